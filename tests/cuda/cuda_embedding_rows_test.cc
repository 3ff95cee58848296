// The CUDA backend's GatherRows and IndexAddRows against the CPU backend on fresh random inputs.
// Gathering copies bits; the index-add sums each run of equal ids in the same order on both
// (fp32 additions only, no products to contract), so both must agree bit for bit.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "tests/kernels/embedding_rows_runner.h"

namespace losshead::kernels {
namespace {

using testing::RunGatherRows;
using testing::RunIndexAddRows;

#define SKIP_WITHOUT_GPU() \
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the CUDA suite needs a GPU"

std::unique_ptr<Backend> MakeCuda() {
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(0);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

class CudaGatherRowsTest : public ::testing::TestWithParam<DType> {};

TEST_P(CudaGatherRowsTest, EqualsCpuBitForBit_V1000_D257_N3000) {
  SKIP_WITHOUT_GPU();
  const DType dtype = GetParam();
  std::mt19937 rng(3 + static_cast<int>(dtype));
  const int64_t rows = 1000, d = 257, n = 3000;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(rows * d);
  for (float& v : values) v = normal(rng);
  std::string table(rows * d * DTypeSize(dtype), '\0');
  FromFloat(dtype, values.data(), table.data(), values.size());
  std::uniform_int_distribution<int64_t> id(0, rows - 1);
  std::vector<int64_t> ids(n);
  for (int64_t& i : ids) i = id(rng);
  std::unique_ptr<Backend> cuda = MakeCuda();
  std::unique_ptr<Backend> cpu = CreateCpuBackend();
  absl::StatusOr<std::string> got = RunGatherRows(*cuda, dtype, table, rows, d, ids);
  absl::StatusOr<std::string> want = RunGatherRows(*cpu, dtype, table, rows, d, ids);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_TRUE(*got == *want);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaGatherRowsTest,
                         ::testing::Values(DType::kBF16, DType::kFP16, DType::kFP32));

TEST(CudaIndexAddRowsTest, EqualsCpuBitForBitWithRepeats_V500_D4099_N2048) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  const int64_t rows = 500, d = 4099, n = 2048;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> grad(rows * d), values(n * d);
  for (float& g : grad) g = normal(rng);
  for (float& v : values) v = normal(rng);
  // Few distinct ids: long runs of repeats.
  std::uniform_int_distribution<int64_t> id(0, 63);
  std::vector<int64_t> ids(n);
  for (int64_t& i : ids) i = id(rng);
  std::sort(ids.begin(), ids.end());
  std::unique_ptr<Backend> cuda = MakeCuda();
  std::unique_ptr<Backend> cpu = CreateCpuBackend();
  absl::StatusOr<std::vector<float>> got = RunIndexAddRows(*cuda, grad, rows, d, values, ids);
  absl::StatusOr<std::vector<float>> want = RunIndexAddRows(*cpu, grad, rows, d, values, ids);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(0, std::memcmp(got->data(), want->data(), got->size() * sizeof(float)));
}

TEST(CudaIndexAddRowsTest, BadShapesAreInvalidArgumentBeforeAnyLaunch) {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Backend> cuda = MakeCuda();
  std::unique_ptr<Stream> stream = *cuda->CreateStream();
  EXPECT_EQ(cuda->IndexAddRows(nullptr, nullptr, 2, 4, nullptr, 8, *stream).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cuda->GatherRows(DType::kFP32, nullptr, 8, 0, nullptr, 1, nullptr, *stream).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace losshead::kernels
