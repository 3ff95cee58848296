// LaunchLogitsTail (kernels/cuda/logits_tail.cuh), the logits of a width's last few rows, against
// a float64 host reference: every type pair the backend runs, 1 to 7 rows, the vector and scalar
// paths, and the refusals.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/logits_tail.cuh"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/problem.h"
#include "tests/kernels/backend_runner.h"

namespace losshead::kernels {
namespace {

#define SKIP_WITHOUT_GPU() \
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device visible: the CUDA suite needs a GPU"

DType DTypeOf(cudaDataType_t t) {
  return t == CUDA_R_16BF ? DType::kBF16 : t == CUDA_R_16F ? DType::kFP16 : DType::kFP32;
}

struct TailCase {
  cudaDataType_t in, out;
  int rows;
  int64_t d, tokens;
  int64_t offset;  // elements: a hidden pointer off 16 bytes takes the scalar path
};

// Fresh random W rows and H on the device, the kernel's logits back on the host; the columns
// past `rows` of every logits row must keep the sentinel they were filled with.
class LogitsTail {
 public:
  explicit LogitsTail(const TailCase& c) : c_(c) {
    backend_ = *CreateCudaBackend(0);
    stream_ = *backend_->CreateStream();
    ldl_ = c.rows + 5;
  }

  // W's rows and H from the suites' generator: bytes in the input dtype and the same values in
  // float64 for the reference.
  void Fill(uint64_t seed) {
    const Problem shape{.n = c_.tokens, .d = c_.d, .v = c_.rows, .dtype = DTypeOf(c_.in)};
    inputs_ = testing::MakeRandomInputs(shape, seed, {.weight_scale = 0.05});
  }

  absl::Status Launch(int rows, cudaDataType_t in, cudaDataType_t out) {
    const size_t esize = DTypeSize(DTypeOf(c_.in));
    const size_t osize = DTypeSize(DTypeOf(c_.out));
    const std::vector<uint8_t>& w = inputs_.weight_bytes;
    const std::vector<uint8_t>& h = inputs_.hidden_bytes;
    weight_ = *backend_->Allocate(w.size());
    hidden_ = *backend_->Allocate(h.size() + c_.offset * esize);
    logits_ = *backend_->Allocate(c_.tokens * ldl_ * osize);
    char* hidden = static_cast<char*>(hidden_.data()) + c_.offset * esize;
    EXPECT_TRUE(backend_->CopyToDevice(weight_.data(), w.data(), w.size(), *stream_).ok());
    EXPECT_TRUE(backend_->CopyToDevice(hidden, h.data(), h.size(), *stream_).ok());
    EXPECT_TRUE(backend_->Memset(logits_.data(), 0x7f, logits_.bytes(), *stream_).ok());
    const absl::Status s =
        cuda::LaunchLogitsTail(in, out, weight_.data(), hidden, c_.d, c_.tokens, rows,
                               logits_.data(), ldl_, static_cast<cudaStream_t>(stream_->native()));
    std::vector<char> raw(logits_.bytes());
    EXPECT_TRUE(backend_->CopyToHost(raw.data(), logits_.data(), raw.size(), *stream_).ok());
    EXPECT_TRUE(stream_->Synchronize().ok());
    got_.resize(c_.tokens * ldl_);
    ToFloat(DTypeOf(c_.out), raw.data(), got_.data(), got_.size());
    const std::vector<char> fill(osize, 0x7f);
    ToFloat(DTypeOf(c_.out), fill.data(), &sentinel_, 1);
    return s;
  }

  // Every column from `columns` on, in every token's row, still holds the fill.
  void ExpectUntouchedBeyond(int columns) const {
    for (int64_t t = 0; t < c_.tokens; ++t) {
      for (int64_t j = columns; j < ldl_; ++j) {
        ASSERT_EQ(got_[t * ldl_ + j], sentinel_) << "token " << t << " column " << j;
      }
    }
  }

  void ExpectMatchesReference() const {
    const bool bf16_out = c_.out == CUDA_R_16BF;
    for (int64_t t = 0; t < c_.tokens; ++t) {
      for (int j = 0; j < c_.rows; ++j) {
        double want = 0, magnitude = 0;
        for (int64_t k = 0; k < c_.d; ++k) {
          const double p = inputs_.hidden[t * c_.d + k] * inputs_.weight[j * c_.d + k];
          want += p;
          magnitude += std::fabs(p);
        }
        // fp32 accumulation over d terms, then one rounding to the output type.
        const double tol = 1e-5 * magnitude + (bf16_out ? std::ldexp(std::fabs(want), -8) : 0.0);
        ASSERT_NEAR(got_[t * ldl_ + j], want, tol) << "token " << t << " row " << j;
      }
    }
  }

 private:
  TailCase c_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Stream> stream_;
  int64_t ldl_ = 0;
  testing::Inputs inputs_;
  DeviceBuffer weight_, hidden_, logits_;
  std::vector<float> got_;
  float sentinel_ = 0.0f;
};

class LogitsTailTest : public ::testing::TestWithParam<TailCase> {};

TEST_P(LogitsTailTest, MatchesFloat64Reference) {
  SKIP_WITHOUT_GPU();
  const TailCase& c = GetParam();
  LogitsTail tail(c);
  tail.Fill(0x7a11u + static_cast<uint64_t>(c.rows * 131 + c.d + c.in * 7 + c.out));
  ASSERT_TRUE(tail.Launch(c.rows, c.in, c.out).ok());
  tail.ExpectUntouchedBeyond(c.rows);
  tail.ExpectMatchesReference();
}

std::vector<TailCase> TailCases() {
  std::vector<TailCase> cases;
  const std::pair<cudaDataType_t, cudaDataType_t> pairs[] = {{CUDA_R_16BF, CUDA_R_16BF},
                                                             {CUDA_R_16BF, CUDA_R_32F},
                                                             {CUDA_R_16F, CUDA_R_32F},
                                                             {CUDA_R_32F, CUDA_R_32F}};
  for (const auto& [in, out] : pairs) {
    for (int rows : {1, 3, 7}) {
      cases.push_back({in, out, rows, 4096, 37, 0});  // 16-byte loads
      cases.push_back({in, out, rows, 1001, 37, 0});  // d off the vector width: scalar loads
      cases.push_back({in, out, rows, 512, 19, 1});   // H off 16 bytes: scalar loads
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Pairs, LogitsTailTest, ::testing::ValuesIn(TailCases()),
                         [](const ::testing::TestParamInfo<TailCase>& info) {
                           const TailCase& c = info.param;
                           return absl::StrCat(DTypeName(DTypeOf(c.in)), "_to_",
                                               DTypeName(DTypeOf(c.out)), "_rows", c.rows, "_d",
                                               c.d, c.offset > 0 ? "_unaligned" : "");
                         });

TEST(LogitsTailRefusalTest, RowsOutsideOneToSevenOrAnotherTypePairLaunchNothing) {
  SKIP_WITHOUT_GPU();
  const TailCase c{CUDA_R_16BF, CUDA_R_16BF, 7, 256, 9, 0};
  LogitsTail tail(c);
  tail.Fill(0x5eed);
  for (int rows : {0, 8, -1}) {
    const absl::Status s = tail.Launch(rows, CUDA_R_16BF, CUDA_R_16BF);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << rows << ": " << s;
    tail.ExpectUntouchedBeyond(0);
  }
  for (const auto& [in, out] :
       {std::pair{CUDA_R_16F, CUDA_R_16BF}, std::pair{CUDA_R_32F, CUDA_R_16BF},
        std::pair{CUDA_R_8I, CUDA_R_32F}}) {
    const absl::Status s = tail.Launch(3, in, out);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    tail.ExpectUntouchedBeyond(0);
  }
}

}  // namespace
}  // namespace losshead::kernels
