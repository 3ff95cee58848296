// A learning LtGemm (lt_gemm.h) against one that always runs the heuristic's first algorithm:
// over the calls in which it tries its candidates and after it has chosen, each of the fused
// call's three GEMMs gives the same bits, and the learning ends.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/random/random.h"
#include "gtest/gtest.h"
#include "kernels/cuda/head_gemms.h"
#include "kernels/cuda/lt_gemm.h"
#include "tests/cuda/cuda_testing.h"

namespace losshead::kernels::cuda {
namespace {

// A device buffer of `count` elements of T, freed with the test.
template <typename T>
struct Device {
  explicit Device(size_t n) : count(n) { EXPECT_EQ(cudaMalloc(&data, n * sizeof(T)), cudaSuccess); }
  ~Device() { cudaFree(data); }
  std::vector<T> Read() const {
    std::vector<T> host(count);
    EXPECT_EQ(cudaMemcpy(host.data(), data, count * sizeof(T), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }
  void Write(const std::vector<T>& host) {
    ASSERT_EQ(host.size(), count);
    ASSERT_EQ(cudaMemcpy(data, host.data(), count * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  T* data = nullptr;
  size_t count;
};

std::vector<__nv_bfloat16> RandomBf16(size_t count, float scale, absl::BitGen& gen) {
  std::vector<__nv_bfloat16> v(count);
  for (auto& x : v) x = __float2bfloat16(absl::Uniform(gen, -scale, scale));
  return v;
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

TEST(LtGemmLearningCudaTest, EveryCallOfEachHeadGemmGivesTheFirstAlgorithmsBits) {
  SKIP_WITHOUT_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  constexpr int64_t kTokens = 512, kV = 8192, kD = 1024;
  absl::BitGen gen;
  Device<__nv_bfloat16> h(kTokens * kD), w(kV * kD), g(kTokens * kV), logits(kTokens * kV),
      dh(kTokens * kD);
  Device<float> dw(kV * kD), scalars(3);
  h.Write(RandomBf16(h.count, 1.0f, gen));
  w.Write(RandomBf16(w.count, 0.125f, gen));
  g.Write(RandomBf16(g.count, 1e-3f, gen));
  std::vector<float> dw_start(dw.count);
  for (float& x : dw_start) x = absl::Uniform(gen, -1e-3f, 1e-3f);
  scalars.Write({1.0f / kTokens, 0.0f, 1.0f});
  void* workspace = nullptr;
  constexpr size_t kWorkspace = size_t{4} << 20;
  ASSERT_EQ(cudaMalloc(&workspace, kWorkspace), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);

  static constexpr float kOne = 1.0f, kZero = 0.0f;
  constexpr cudaDataType_t kBf16 = CUDA_R_16BF;
  struct Case {
    const char* name;
    GemmShape shape;
    const void *alpha, *a, *b, *beta;
    void* out;
    size_t out_count;
    bool weight_grad;  // fp32 dW, added into: reset before every call
  };
  const Case cases[] = {
      {"logits", LogitsGemm(kV, kTokens, kD, kBf16, CUBLAS_COMPUTE_32F, kBf16, kV), &kOne, w.data,
       h.data, &kZero, logits.data, logits.count, false},
      {"dH", GradHiddenGemm(kV, kTokens, kD, kBf16, CUBLAS_COMPUTE_32F, kBf16, kV), scalars.data,
       w.data, g.data, scalars.data + 1, dh.data, dh.count, false},
      {"dW", GradWeightGemm(kV, kTokens, kD, kBf16, CUBLAS_COMPUTE_32F, kV), scalars.data, h.data,
       g.data, scalars.data + 2, dw.data, dw.count, true},
  };
  int shapes_with_choices = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    // Each call from the same start: dW's values, or NaN (all bits set) for the others.
    auto call = [&](LtGemm& gemm) {
      if (c.weight_grad) {
        dw.Write(dw_start);
      } else {
        ASSERT_EQ(cudaMemset(c.out, 0xff, c.out_count * 2), cudaSuccess);
      }
      ASSERT_TRUE(
          gemm.Run(c.shape, c.alpha, c.a, c.b, c.beta, c.out, workspace, kWorkspace, stream).ok());
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    };
    auto result_bits = [&]() -> std::vector<uint32_t> {
      if (c.weight_grad) {
        const std::vector<float> v = dw.Read();
        std::vector<uint32_t> bits(v.size());
        std::memcpy(bits.data(), v.data(), v.size() * 4);
        return bits;
      }
      const std::vector<__nv_bfloat16> v = c.out == logits.data ? logits.Read() : dh.Read();
      std::vector<uint32_t> bits(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        uint16_t x;
        std::memcpy(&x, &v[i], 2);
        bits[i] = x;
      }
      return bits;
    };

    std::unique_ptr<LtGemm> first, learning;
    ASSERT_TRUE(LtGemm::Create(&first, /*learn=*/false).ok());
    ASSERT_TRUE(LtGemm::Create(&learning, /*learn=*/true).ok());
    call(*first);
    const std::vector<uint32_t> want = result_bits();
    EXPECT_EQ(first->LastCandidates(), 1);
    EXPECT_FALSE(first->LastLearning());

    int calls = 0;
    constexpr int kMostCalls = LtGemm::kMaxCandidates * LtGemm::kLearningRounds + 1;
    do {
      call(*learning);
      ++calls;
      ASSERT_TRUE(SameBits(result_bits(), want))
          << "call " << calls << " (" << learning->LastAlgorithm() << ") differs";
    } while (learning->LastLearning() && calls < 2 * kMostCalls);
    EXPECT_FALSE(learning->LastLearning()) << "still learning after " << calls << " calls";
    const int candidates = learning->LastCandidates();
    EXPECT_GE(candidates, 1);
    EXPECT_LE(candidates, LtGemm::kMaxCandidates);
    // Synchronised calls: every timed call is read before the next, so the learning ends with the
    // call that follows the last candidate's last round.
    EXPECT_EQ(calls, candidates > 1 ? candidates * LtGemm::kLearningRounds + 1 : 1);
    if (candidates > 1) ++shapes_with_choices;
    for (int i = 0; i < 3; ++i) {  // the choice made, it stays
      const std::string chosen = learning->LastAlgorithm();
      call(*learning);
      EXPECT_EQ(learning->LastAlgorithm(), chosen);
      ASSERT_TRUE(SameBits(result_bits(), want));
    }
  }
  // On Hopper the heuristic offers several such algorithms for these shapes: the test compared
  // real alternatives, not the first algorithm with itself.
  EXPECT_GE(shapes_with_choices, 1);
  cudaStreamDestroy(stream);
  cudaFree(workspace);
}

TEST(LtGemmLearningCudaTest, Fp32InputsKeepTheHeuristicsFirst) {
  SKIP_WITHOUT_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  constexpr int64_t kTokens = 256, kV = 4096, kD = 512;
  absl::BitGen gen;
  Device<float> h(kTokens * kD), w(kV * kD), logits(kTokens * kV);
  for (Device<float>* t : {&h, &w}) {
    std::vector<float> v(t->count);
    for (float& x : v) x = absl::Uniform(gen, -1.0f, 1.0f);
    t->Write(v);
  }
  std::unique_ptr<LtGemm> gemm;
  ASSERT_TRUE(LtGemm::Create(&gemm, /*learn=*/true).ok());
  static constexpr float kOne = 1.0f, kZero = 0.0f;
  for (cublasComputeType_t compute : {CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32}) {
    const GemmShape shape = LogitsGemm(kV, kTokens, kD, CUDA_R_32F, compute, CUDA_R_32F, kV);
    ASSERT_TRUE(
        gemm->Run(shape, &kOne, w.data, h.data, &kZero, logits.data, nullptr, 0, nullptr).ok());
    EXPECT_EQ(gemm->LastCandidates(), 1);
    EXPECT_FALSE(gemm->LastLearning());
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace losshead::kernels::cuda
