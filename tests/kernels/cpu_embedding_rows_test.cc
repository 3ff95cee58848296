// The CPU backend's GatherRows and IndexAddRows against a float64 reference on fresh random
// inputs: rows bit for bit in every dtype, gradient rows as a float64 scatter-add (repeated ids
// included) within fp32 rounding, the same bits on a rerun, and every refusal with its code and
// nothing written.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/step_bound.h"
#include "tests/kernels/embedding_rows_runner.h"

namespace losshead::kernels {
namespace {

using testing::RunGatherRows;
using testing::RunIndexAddRows;

std::string RandomTable(DType dtype, int64_t count, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  std::string bytes(count * DTypeSize(dtype), '\0');
  FromFloat(dtype, values.data(), bytes.data(), count);
  return bytes;
}

// Sorted ids with repeats: about a third of them repeat the one before.
std::vector<int64_t> SortedIdsWithRepeats(int64_t n, int64_t rows, std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> id(0, rows - 1);
  std::vector<int64_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = (i > 0 && rng() % 3 == 0) ? ids[i - 1] : id(rng);
  std::sort(ids.begin(), ids.end());
  return ids;
}

class CpuEmbeddingRowsTest : public ::testing::TestWithParam<DType> {};

TEST_P(CpuEmbeddingRowsTest, GatherEqualsTableRowsBitForBit_V37_D19_N53) {
  const DType dtype = GetParam();
  std::mt19937 rng(11 + static_cast<int>(dtype));
  const int64_t rows = 37, d = 19, n = 53;
  const std::string table = RandomTable(dtype, rows * d, rng);
  std::uniform_int_distribution<int64_t> id(0, rows - 1);
  std::vector<int64_t> ids(n);
  for (int64_t& i : ids) i = id(rng);
  ids[1] = ids[0];  // a repeat: each copy gets the row
  std::unique_ptr<Backend> cpu = CreateCpuBackend(2);
  absl::StatusOr<std::string> got = RunGatherRows(*cpu, dtype, table, rows, d, ids);
  ASSERT_TRUE(got.ok()) << got.status();
  const size_t row_bytes = d * DTypeSize(dtype);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(
        0, std::memcmp(got->data() + i * row_bytes, table.data() + ids[i] * row_bytes, row_bytes))
        << "row " << i << " (id " << ids[i] << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CpuEmbeddingRowsTest,
                         ::testing::Values(DType::kBF16, DType::kFP16, DType::kFP32));

TEST(CpuIndexAddRowsTest, MatchesFloat64ScatterAddWithRepeats_V41_D23_N97) {
  std::mt19937 rng(5);
  const int64_t rows = 41, d = 23, n = 97;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> grad(rows * d), values(n * d);
  for (float& g : grad) g = normal(rng);
  for (float& v : values) v = normal(rng);
  const std::vector<int64_t> ids = SortedIdsWithRepeats(n, rows, rng);
  std::vector<double> want(grad.begin(), grad.end());
  std::vector<double> magnitude(rows * d);
  for (size_t k = 0; k < grad.size(); ++k) magnitude[k] = std::fabs(grad[k]);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < d; ++j) {
      want[ids[i] * d + j] += values[i * d + j];
      magnitude[ids[i] * d + j] += std::fabs(values[i * d + j]);
    }
  }
  std::unique_ptr<Backend> cpu = CreateCpuBackend(3);
  absl::StatusOr<std::vector<float>> got = RunIndexAddRows(*cpu, grad, rows, d, values, ids);
  ASSERT_TRUE(got.ok()) << got.status();
  int max_repeats = 1;
  for (int64_t i = 1, run = 1; i < n; ++i) {
    run = ids[i] == ids[i - 1] ? run + 1 : 1;
    max_repeats = std::max<int>(max_repeats, run);
  }
  ASSERT_GT(max_repeats, 1) << "the case must hold repeated ids";
  for (size_t k = 0; k < want.size(); ++k) {
    // Each fp32 addition rounds by at most half an ulp of the running magnitude.
    const double tolerance = (max_repeats + 1) * magnitude[k] * 6e-8;
    ASSERT_NEAR((*got)[k], want[k], tolerance) << "element " << k;
  }
  // Untouched rows are unchanged bit for bit.
  for (int64_t r = 0; r < rows; ++r) {
    if (std::find(ids.begin(), ids.end(), r) != ids.end()) continue;
    ASSERT_EQ(0, std::memcmp(got->data() + r * d, grad.data() + r * d, d * sizeof(float)));
  }
  // A rerun, with another thread count, gives the same bits.
  std::unique_ptr<Backend> other = CreateCpuBackend(1);
  absl::StatusOr<std::vector<float>> again = RunIndexAddRows(*other, grad, rows, d, values, ids);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(0, std::memcmp(got->data(), again->data(), got->size() * sizeof(float)));
}

TEST(CpuEmbeddingRowsErrorsTest, BadIdsAndShapesAreInvalidArgumentAndWriteNothing) {
  std::unique_ptr<Backend> cpu = CreateCpuBackend(1);
  std::unique_ptr<Stream> stream = *cpu->CreateStream();
  const int64_t rows = 4, d = 3;
  std::vector<float> table(rows * d, 1.0f), out(2 * d, 7.0f), grad(rows * d, 0.5f);
  const std::vector<float> grad_before = grad;
  const std::vector<float> values(2 * d, 1.0f);
  const int64_t outside[] = {1, 4};
  const int64_t negative[] = {-1, 0};
  const int64_t decreasing[] = {2, 1};
  EXPECT_EQ(
      cpu->GatherRows(DType::kFP32, table.data(), rows, d, outside, 2, out.data(), *stream).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cpu->GatherRows(DType::kFP32, table.data(), rows, d, negative, 2, out.data(), *stream).code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      cpu->GatherRows(static_cast<DType>(7), table.data(), rows, d, outside, 1, out.data(), *stream)
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->GatherRows(DType::kFP32, nullptr, rows, d, outside, 1, out.data(), *stream).code(),
            absl::StatusCode::kInvalidArgument);
  for (float v : out) EXPECT_EQ(v, 7.0f);
  EXPECT_EQ(cpu->IndexAddRows(values.data(), outside, 2, d, grad.data(), rows, *stream).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->IndexAddRows(values.data(), decreasing, 2, d, grad.data(), rows, *stream).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->IndexAddRows(values.data(), negative, -1, d, grad.data(), rows, *stream).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->IndexAddRows(values.data(), decreasing, 2, 0, grad.data(), rows, *stream).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(grad, grad_before);
  // No rows is no work.
  EXPECT_TRUE(cpu->IndexAddRows(nullptr, nullptr, 0, d, grad.data(), rows, *stream).ok());
}

}  // namespace
}  // namespace losshead::kernels

namespace losshead::kernels {
namespace {

TEST(EmbeddingGradBoundTest, SumsOfRepeatedRowsStayWithinTheBound) {
  std::mt19937 rng(23);
  const int64_t rows = 13, d = 9, n = 64;
  std::vector<float> values(n * d);
  std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
  for (float& v : values) v = uniform(rng);
  values[5] = 3.0f;  // every element of a row at the extreme, for a tight case
  std::vector<int64_t> ids = SortedIdsWithRepeats(n, rows, rng);
  float max_abs = 0;
  for (float v : values) max_abs = std::max(max_abs, std::fabs(v));
  int64_t repeats = 1;
  for (int64_t i = 1, run = 1; i < n; ++i) {
    run = ids[i] == ids[i - 1] ? run + 1 : 1;
    repeats = std::max(repeats, run);
  }
  std::unique_ptr<Backend> cpu = CreateCpuBackend(1);
  absl::StatusOr<std::vector<float>> got =
      testing::RunIndexAddRows(*cpu, std::vector<float>(rows * d, 0.0f), rows, d, values, ids);
  ASSERT_TRUE(got.ok()) << got.status();
  const double bound = BoundEmbeddingGrad(max_abs, repeats);
  for (float g : *got) EXPECT_LE(std::fabs(g), bound);
  EXPECT_EQ(BoundEmbeddingGrad(std::numeric_limits<double>::infinity(), 2),
            std::numeric_limits<double>::infinity());
}

}  // namespace
}  // namespace losshead::kernels
