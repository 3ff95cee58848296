#include "kernels/cuda/lt_gemm.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"

namespace losshead::kernels::cuda {
namespace {

// Largest power of two (at most 256) that divides the address: the heuristic may only pick
// kernels whose vector loads the operand's alignment allows.
int AlignmentOf(const void* p) {
  const auto x = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && x % a != 0) a /= 2;
  return a;
}

// An algorithm's configuration attribute, read with its own width T (cublasLt refuses any
// other); -1 where it cannot be read.
template <typename T>
int64_t ConfigOf(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute) {
  T value{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value), &written) !=
      CUBLAS_STATUS_SUCCESS) {
    return -1;
  }
  return static_cast<int64_t>(value);
}

// Whether `other` sums over k in the order `first` does: the same kernel family, neither split.
bool SameSums(const cublasLtMatmulAlgo_t& first, const cublasLtMatmulAlgo_t& other) {
  return ConfigOf<int32_t>(first, CUBLASLT_ALGO_CONFIG_ID) ==
             ConfigOf<int32_t>(other, CUBLASLT_ALGO_CONFIG_ID) &&
         ConfigOf<int32_t>(first, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == 1 &&
         ConfigOf<int32_t>(other, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == 1;
}

}  // namespace

struct LtGemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

absl::Status LtGemm::Create(std::unique_ptr<LtGemm>* out) {
  cublasLtHandle_t handle = nullptr;
  LOSSHEAD_CUBLAS_CHECK(cublasLtCreate(&handle));
  out->reset(new LtGemm(handle));
  return absl::OkStatus();
}

LtGemm::LtGemm(cublasLtHandle_t handle) : handle_(handle) {}

LtGemm::~LtGemm() {
  plans_.clear();
  cublasLtDestroy(handle_);
}

absl::Status LtGemm::MakePlan(const GemmShape& s, int align_a, int align_b, int align_c,
                              size_t workspace_bytes, Plan* plan) {
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, s.compute, CUDA_R_32F));
  const int32_t ta = s.trans_a, tb = s.trans_b;
  LOSSHEAD_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LOSSHEAD_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const int32_t mode = s.device_scalars ? CUBLASLT_POINTER_MODE_DEVICE : CUBLASLT_POINTER_MODE_HOST;
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
      plan->desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof(mode)));
  const bool ta_t = s.trans_a != CUBLAS_OP_N, tb_t = s.trans_b != CUBLAS_OP_N;
  LOSSHEAD_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->a, s.type_a, ta_t ? s.k : s.m, ta_t ? s.m : s.k, s.lda));
  LOSSHEAD_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&plan->b, s.type_b, tb_t ? s.n : s.k, tb_t ? s.k : s.n, s.ldb));
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, s.type_c, s.m, s.n, s.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  struct PrefGuard {
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { cublasLtMatmulPreferenceDestroy(p); }
  } guard{pref};
  const uint64_t ws = workspace_bytes;
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // Split-K partial sums are added in fp32, never in the 16-bit output type (what
  // CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION asks of cublas_v2).
  const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
  const uint32_t al_a = align_a, al_b = align_b, al_c = align_c;
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));

  const int role_rank = s.role == GemmRole::kOther ? 0 : role_ranks_[static_cast<int>(s.role)];
  const int wanted = std::max(rank_, role_rank) + 1;
  std::vector<cublasLtMatmulHeuristicResult_t> results(wanted);
  int found = 0;
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->a, plan->b,
                                                       plan->c, plan->c, pref, wanted,
                                                       results.data(), &found));
  if (found < 1 || results[0].state != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError(absl::StrCat("cublasLt found no algorithm for m=", s.m, " n=", s.n,
                                            " k=", s.k, " within ", workspace_bytes,
                                            " bytes of workspace"));
  }
  if (rank_ > 0) {
    if (found <= rank_ || results[rank_].state != CUBLAS_STATUS_SUCCESS) {
      return absl::NotFoundError(absl::StrCat("cublasLt offers ", found, " algorithms for m=", s.m,
                                              " n=", s.n, " k=", s.k, ", none of rank ", rank_));
    }
    plan->algo = results[rank_].algo;
    return absl::OkStatus();
  }
  plan->algo = results[0].algo;
  if (role_rank > 0 && found > role_rank && results[role_rank].state == CUBLAS_STATUS_SUCCESS &&
      SameSums(results[0].algo, results[role_rank].algo)) {
    plan->algo = results[role_rank].algo;
  }
  return absl::OkStatus();
}

absl::Status LtGemm::Run(const GemmShape& s, const void* alpha, const void* a, const void* b,
                         const void* beta, void* c, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream) {
  const int align_a = AlignmentOf(a), align_b = AlignmentOf(b), align_c = AlignmentOf(c);
  const Key key{s.trans_a,
                s.trans_b,
                s.m,
                s.n,
                s.k,
                s.type_a,
                s.type_b,
                s.type_c,
                s.lda,
                s.ldb,
                s.ldc,
                s.device_scalars ? 1 : 0,
                static_cast<int>(s.compute),
                static_cast<int>(s.role),
                align_a,
                align_b * 512 + align_c,
                workspace_bytes};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    LOSSHEAD_RETURN_IF_ERROR(MakePlan(s, align_a, align_b, align_c, workspace_bytes, plan.get()));
    it = plans_.emplace(key, std::move(plan)).first;
  }
  const Plan& p = *it->second;
  last_ = &p;
  LOSSHEAD_CUBLAS_CHECK(cublasLtMatmul(handle_, p.desc, alpha, a, p.a, b, p.b, beta, c, p.c, c, p.c,
                                       &p.algo, workspace, workspace_bytes, stream));
  return absl::OkStatus();
}

std::string LtGemm::LastAlgorithm() const {
  if (last_ == nullptr) return "";
  const cublasLtMatmulAlgo_t& a = last_->algo;
  return absl::StrCat("algo ", ConfigOf<int32_t>(a, CUBLASLT_ALGO_CONFIG_ID), " tile ",
                      ConfigOf<uint32_t>(a, CUBLASLT_ALGO_CONFIG_TILE_ID), " stages ",
                      ConfigOf<uint32_t>(a, CUBLASLT_ALGO_CONFIG_STAGES_ID), " splitk ",
                      ConfigOf<int32_t>(a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), " swizzle ",
                      ConfigOf<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), " cluster ",
                      ConfigOf<uint16_t>(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), " inner ",
                      ConfigOf<uint16_t>(a, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID), " custom ",
                      ConfigOf<uint32_t>(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION));
}

}  // namespace losshead::kernels::cuda
