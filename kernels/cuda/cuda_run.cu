// The CUDA backend's fused call (Run) and the gradient stash's flush: per token chunk the logits
// GEMM, the row kernel (softmax_grad.cu) and the two gradient GEMMs, on one stream or, with
// overlap, on two (see cuda_backend.cu's file comment).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/chunk_layout.h"
#include "kernels/cuda/column_sums.cuh"
#include "kernels/cuda/count_targets.cuh"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/cuda/head_gemms.h"
#include "kernels/cuda/loss_reduce.cuh"
#include "kernels/cuda/lt_gemm.h"
#include "kernels/cuda/run_types.cuh"
#include "kernels/cuda/scalars.h"
#include "kernels/cuda/shard_softmax.cuh"
#include "kernels/cuda/softmax_grad.cuh"

namespace losshead::kernels::cuda {

absl::Status CudaBackend::Run(const Problem& problem, const Arguments& args, Stream& stream) {
  if (absl::Status s = CanImplement(problem); !s.ok()) return s;
  CudaStream* cs = AsCudaStream(stream, device_);
  if (cs == nullptr) return ForeignStreamError();
  if (args.hidden == nullptr || args.weight == nullptr || args.targets == nullptr) {
    return absl::InvalidArgumentError("hidden, weight and targets must not be null");
  }
  if (args.loss_sum == nullptr || args.token_count == nullptr) {
    return absl::InvalidArgumentError("loss_sum and token_count must not be null");
  }
  LOSSHEAD_RETURN_IF_ERROR(ValidateTopK(args, problem.v));
  LOSSHEAD_RETURN_IF_ERROR(ValidateLossInputs(problem, args));
  if (args.workspace == nullptr || reinterpret_cast<uintptr_t>(args.workspace) % kAlign != 0) {
    return absl::InvalidArgumentError("workspace must be a 256-byte aligned device pointer");
  }
  if (args.grad_stash.data != nullptr) {
    if (args.grad_weight != nullptr) {
      return absl::InvalidArgumentError("grad_weight must be null when grad_stash is given");
    }
    LOSSHEAD_RETURN_IF_ERROR(ValidateGradStash(args.grad_stash, problem.n));
    if (problem.dtype == DType::kFP16) {
      return absl::UnimplementedError("the CUDA backend stashes no fp16 gradient");
    }
    if (reinterpret_cast<uintptr_t>(args.grad_stash.data) % kAlign != 0) {
      return absl::InvalidArgumentError("grad_stash must be a 256-byte aligned device pointer");
    }
  }
  const Layout layout = MakeLayout(problem, args.workspace_bytes);
  if (layout.chunk < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "workspace of ", args.workspace_bytes, " bytes is too small: at least ",
        MakeLayoutForChunk(problem, 1).total, " bytes are needed (see WorkspaceBytes)"));
  }

  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  return WithRunTypes(problem, options_, [&](auto in, auto logits) {
    return this->template RunTyped<typename decltype(in)::type, typename decltype(logits)::type>(
        problem, args, layout, *cs);
  });
}

absl::Status CudaBackend::FlushGradStash(const Problem& problem, const GradStash& stash,
                                         float* grad_weight, void* workspace,
                                         size_t workspace_bytes, Stream& stream) {
  if (absl::Status s = CanImplement(problem); !s.ok()) return s;
  LOSSHEAD_RETURN_IF_ERROR(ValidateGradStash(stash, 0));
  if (problem.dtype == DType::kFP16) {
    return absl::UnimplementedError("the CUDA backend stashes no fp16 gradient");
  }
  if (grad_weight == nullptr) return absl::InvalidArgumentError("grad_weight must not be null");
  CudaStream* cs = AsCudaStream(stream, device_);
  if (cs == nullptr) return ForeignStreamError();
  if (stash.tokens == 0) return absl::OkStatus();
  // cublasLt's scratch: the front of the caller's memory, as much as a Run's GEMMs use.
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % kAlign != 0) {
    workspace_bytes = 0;
  }
  workspace_bytes = std::min(workspace_bytes, options_.cublas_workspace_bytes);
  const StashLayout layout =
      GradStashLayout(stash.capacity, problem.v, problem.d, DTypeSize(problem.dtype));
  cudaDataType_t type = CUDA_R_32F;
  switch (problem.dtype) {
    case DType::kFP32:
      type = CUDA_R_32F;
      break;
    case DType::kBF16:
      type = CUDA_R_16BF;
      break;
    case DType::kFP16:
      type = CUDA_R_16F;
      break;
  }
  // dW_cm += H_cm . G_cm^T over every stashed token: G is already scaled, so alpha = beta = 1,
  // both on the host.
  static constexpr float kOne = 1.0f;
  const char* base = static_cast<const char*>(stash.data);
  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  return RunGradWeightGemm(cs->gemm(), problem.v, stash.tokens, problem.d, type,
                           GemmCompute(problem), layout.ldg, &kOne, base + layout.hidden_off, base,
                           &kOne, grad_weight, workspace_bytes > 0 ? workspace : nullptr,
                           workspace_bytes, cs->stream(), /*host_scalars=*/true);
}

// TIn: H, W, dH and the gradient operand G; TL: the logits chunk as the first GEMM writes it.
template <typename TIn, typename TL>
absl::Status CudaBackend::RunTyped(const Problem& problem, const Arguments& args,
                                   const Layout& layout, CudaStream& cs) {
  const cudaStream_t stream = cs.stream();
  LtGemm& gemm = cs.gemm();
  char* ws = static_cast<char*>(args.workspace);
  auto* scalars = reinterpret_cast<RunScalars*>(ws + layout.scalars_off);
  auto* row_loss = reinterpret_cast<float*>(ws + layout.row_loss_off);
  auto* logits = reinterpret_cast<TL*>(ws + layout.logits_off);
  auto* grad = reinterpret_cast<TIn*>(logits);  // G overwrites the logits in place
  const int64_t ldl = layout.ldl;
  const int64_t ldg = ldl * static_cast<int64_t>(sizeof(TL) / sizeof(TIn));
  const LossOptions& o = problem.options;
  const int n = static_cast<int>(problem.n);
  const int d = static_cast<int>(problem.d);
  const int v = static_cast<int>(problem.v);
  const auto* hidden = static_cast<const TIn*>(args.hidden);
  const auto* weight = static_cast<const TIn*>(args.weight);
  auto* grad_hidden = static_cast<TIn*>(args.grad_hidden);
  // Deferred dW: G goes, scaled, to the stash's rows (from which dH is then computed), and H
  // beside it; dW is left to FlushGradStash.
  const GradStash& stash = args.grad_stash;
  const bool stashed = stash.data != nullptr;
  const StashLayout stash_layout =
      stashed ? GradStashLayout(stash.capacity, v, d, sizeof(TIn)) : StashLayout{};
  TIn* const stash_grad =
      stashed ? static_cast<TIn*>(stash.data) + stash.tokens * stash_layout.ldg : nullptr;
  const bool need_grad = args.grad_hidden != nullptr || args.grad_weight != nullptr || stashed ||
                         args.grad_bias != nullptr;
  constexpr cudaDataType_t kIn = CudaType<TIn>();
  const cublasComputeType_t compute = GemmCompute(problem);
  constexpr cudaDataType_t kLogits = CudaType<TL>();

  LOSSHEAD_RETURN_IF_ERROR(LaunchCountTargets(args.targets, problem.n, problem.v, o.ignore_index,
                                              o.reduction == Reduction::kMean, o.grad_scale,
                                              args.token_count, scalars, stream));
  // The row kernels add each chunk's correct tokens to it (RowOutputs).
  if (args.correct_count != nullptr) {
    LOSSHEAD_CUDA_CHECK(cudaMemsetAsync(args.correct_count, 0, sizeof(int64_t), stream));
  }
  const int top_k = AsksTopK(args) ? args.top_k : 0;
  // The distribution outputs of the rows from token t0 on (none asked: the plain row kernel).
  auto row_outputs = [&](int64_t t0) {
    RowOutputs out;
    if (!AsksDistributionOutputs(args)) return out;
    auto at = [t0](auto* p, int64_t width = 1) { return p != nullptr ? p + t0 * width : nullptr; };
    out.logprob = at(args.per_token_logprob);
    out.entropy = at(args.per_token_entropy);
    out.argmax = at(args.per_token_argmax);
    out.correct_count = reinterpret_cast<unsigned long long*>(args.correct_count);
    out.top_k = top_k;
    out.top_k_ids = at(args.top_k_ids, top_k);
    out.top_k_logprobs = at(args.top_k_logprobs, top_k);
    return out;
  };

  // The model options and terms of the rows from token t0 on (none: the plain row kernel).
  const loss::TermOptions term_options = loss::TermOptionsOf(o);
  auto row_terms = [&](int64_t t0) {
    RowTerms terms;
    terms.terms = term_options;
    terms.bias = args.bias;
    auto at = [t0](const float* p) { return p != nullptr ? p + t0 : nullptr; };
    terms.token_weights = at(args.token_weights);
    terms.old_logprob = at(args.old_logprob);
    terms.advantages = at(args.advantages);
    terms.ref_logprob = at(args.ref_logprob);
    return terms;
  };

  SoftmaxGradParams params;
  params.v = problem.v;
  params.ignore_index = o.ignore_index;
  params.loss = loss::OptionsOf(o);
  if (stashed) params.grad_scale = &scalars->grad_alpha;

  // Our own logits GEMM where the layout made room for its statistics (UseSm90LogitsGemm) and H
  // and W are aligned for its tensor maps; its statistics spare the row kernel its first read of
  // the logits where the loss takes them as they are (SoftmaxGradParams::tile_stats), whatever
  // distribution outputs are asked for.
  constexpr bool kBf16 = std::is_same_v<TIn, __nv_bfloat16> && std::is_same_v<TL, __nv_bfloat16>;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool sm90_gemm =
      kBf16 && layout.stats_row_floats > 0 && aligned(args.hidden) && aligned(args.weight);
  const bool plain_logits = !row_terms(0).Any() && o.softcap == 0.0f && o.label_smoothing == 0.0f;
  float* const tile_stats =
      sm90_gemm && plain_logits ? reinterpret_cast<float*>(ws + layout.stats_off) : nullptr;
  const int64_t stats_ld = Sm90StatsPerRow(v);
  if (tile_stats != nullptr) {
    params.stats_width = WidthBulk(v);
    params.stats_ld = stats_ld;
  }

  const int chunk = ChunkRows(n, static_cast<int>(layout.chunk));
  const RowLaunch row_launch{options_.row_threads, options_.row_blocks_per_sm, smem_per_sm_};
  // Row kernel (and the chunk's loss reduction when `reduce`) over rows [q0, q0 + rows) of the
  // chunk that starts at token r0, on stream `s`.
  auto rows_step = [&](int r0, int q0, int rows, bool reduce, cudaStream_t s) -> absl::Status {
    const int64_t t0 = static_cast<int64_t>(r0) + q0;
    SoftmaxGradParams rows_params = params;
    if (tile_stats != nullptr) rows_params.tile_stats = tile_stats + q0 * stats_ld;
    TIn* g = nullptr;
    if (stashed) {
      g = stash_grad + t0 * stash_layout.ldg;
    } else if (need_grad) {
      g = grad + static_cast<int64_t>(q0) * ldg;
    }
    LOSSHEAD_RETURN_IF_ERROR((LaunchSoftmaxGrad<TL, TIn>(
        logits + static_cast<int64_t>(q0) * ldl, ldl, rows, args.targets + t0, rows_params, g,
        stashed ? stash_layout.ldg : ldg, row_loss + q0,
        args.per_token_loss != nullptr ? args.per_token_loss + t0 : nullptr,
        args.per_token_lse != nullptr ? args.per_token_lse + t0 : nullptr, row_launch, s,
        row_outputs(t0), row_terms(t0))));
    if (reduce) {
      // Always over the whole chunk, in one fixed order: bit-identical whatever the schedule.
      const int c = std::min(chunk, n - r0);
      LOSSHEAD_RETURN_IF_ERROR(LaunchLossReduce(row_loss, c, scalars, args.loss_sum, s));
    }
    return absl::OkStatus();
  };
  void* const gemm_ws = ws + layout.cublas_off;
  const size_t gemm_ws_bytes = layout.cublas_bytes;
  auto logits_gemm = [&](int t0, int rows, int q0) -> absl::Status {
    if constexpr (kBf16) {
      if (sm90_gemm) {
        return RunLogitsGemmSm90(v, rows, d, ldl, weight, hidden + static_cast<int64_t>(t0) * d,
                                 logits + static_cast<int64_t>(q0) * ldl,
                                 tile_stats != nullptr ? tile_stats + q0 * stats_ld : nullptr,
                                 stream);
      }
    }
    return RunLogitsGemm(gemm, v, rows, d, kIn, compute, kLogits, ldl, weight,
                         hidden + static_cast<int64_t>(t0) * d,
                         logits + static_cast<int64_t>(q0) * ldl, gemm_ws, gemm_ws_bytes, stream);
  };
  // Where the width splits, a 16-bit dH is summed in the layout's fp32 scratch (rows of the
  // chunk from q0) and then rounded into place.
  float* const dh_scratch =
      layout.scratch_row_floats > 0 ? reinterpret_cast<float*>(ws + layout.scratch_off) : nullptr;
  auto dh_gemm = [&](int t0, int rows, int q0) -> absl::Status {
    if (grad_hidden == nullptr) return absl::OkStatus();
    TIn* const out = grad_hidden + static_cast<int64_t>(t0) * d;
    float* const scratch =
        dh_scratch != nullptr ? dh_scratch + static_cast<int64_t>(q0) * d : nullptr;
    const float* alpha = stashed ? &scalars->one : &scalars->grad_alpha;
    const TIn* g =
        stashed ? stash_grad + t0 * stash_layout.ldg : grad + static_cast<int64_t>(q0) * ldg;
    LOSSHEAD_RETURN_IF_ERROR(RunGradHiddenGemm(
        gemm, v, rows, d, kIn, compute, scratch != nullptr ? CUDA_R_32F : kIn,
        stashed ? stash_layout.ldg : ldg, alpha, weight, g, &scalars->zero, &scalars->one,
        scratch != nullptr ? static_cast<void*>(scratch) : static_cast<void*>(out), gemm_ws,
        gemm_ws_bytes, stream));
    if constexpr (!std::is_same_v<TIn, float>) {
      if (scratch != nullptr) {
        return LaunchRoundToDType(scratch, out, static_cast<int64_t>(rows) * d, stream);
      }
    }
    return absl::OkStatus();
  };
  // grad_bias += the column sums of the chunk's G (whole chunk, after its rows), scaled as dW is
  // and divided by the logit scale G carries.
  auto bias_sums = [&](int t0, int rows) -> absl::Status {
    if (args.grad_bias == nullptr) return absl::OkStatus();
    return LaunchAddColumnSums(stashed ? stash_grad + t0 * stash_layout.ldg : grad,
                               stashed ? stash_layout.ldg : ldg, rows, problem.v,
                               stashed ? &scalars->one : &scalars->grad_alpha, o.logit_scale,
                               args.grad_bias, stream);
  };
  auto dw_gemm = [&](int t0, int rows) -> absl::Status {
    if (args.grad_weight == nullptr) return absl::OkStatus();
    return RunGradWeightGemm(gemm, v, rows, d, kIn, compute, ldg, &scalars->grad_alpha,
                             hidden + static_cast<int64_t>(t0) * d, grad, &scalars->one,
                             args.grad_weight, gemm_ws, gemm_ws_bytes, stream);
  };

  if (stashed) {
    char* stash_hidden = static_cast<char*>(stash.data) + stash_layout.hidden_off;
    LOSSHEAD_CUDA_CHECK(cudaMemcpyAsync(
        stash_hidden + static_cast<size_t>(stash.tokens) * d * sizeof(TIn), hidden,
        static_cast<size_t>(n) * d * sizeof(TIn), cudaMemcpyDeviceToDevice, stream));
  }
  for (int r0 = 0; r0 < n; r0 += chunk) {
    const int c = std::min(chunk, n - r0);
    // Halves of at least 256 rows keep the GEMMs' token dimension in whole tiles.
    const int half = options_.overlap && c >= 512 ? (c / 2 + 127) / 128 * 128 : 0;
    if (half == 0) {
      LOSSHEAD_RETURN_IF_ERROR(logits_gemm(r0, c, 0));
      LOSSHEAD_RETURN_IF_ERROR(rows_step(r0, 0, c, /*reduce=*/true, stream));
      LOSSHEAD_RETURN_IF_ERROR(dh_gemm(r0, c, 0));
      LOSSHEAD_RETURN_IF_ERROR(bias_sums(r0, c));
      LOSSHEAD_RETURN_IF_ERROR(dw_gemm(r0, c));
      continue;
    }
    // main: logits(A) logits(B) | dH(A) after row(A) | dH(B), dW after row(B)
    // side:      row(A) after logits(A), row(B) + loss after logits(B)
    // so row(A) runs beside logits(B) and row(B) beside dH(A). dW covers the whole chunk: one
    // read-modify-write of the fp32 accumulator per chunk, as without the split.
    const cudaStream_t side = cs.side();
    const cudaEvent_t logits_a = cs.event(0), logits_b = cs.event(1), rows_a = cs.event(2),
                      rows_b = cs.event(3);
    LOSSHEAD_RETURN_IF_ERROR(logits_gemm(r0, half, 0));
    LOSSHEAD_CUDA_CHECK(cudaEventRecord(logits_a, stream));
    LOSSHEAD_RETURN_IF_ERROR(logits_gemm(r0 + half, c - half, half));
    LOSSHEAD_CUDA_CHECK(cudaEventRecord(logits_b, stream));
    LOSSHEAD_CUDA_CHECK(cudaStreamWaitEvent(side, logits_a, 0));
    LOSSHEAD_RETURN_IF_ERROR(rows_step(r0, 0, half, /*reduce=*/false, side));
    LOSSHEAD_CUDA_CHECK(cudaEventRecord(rows_a, side));
    LOSSHEAD_CUDA_CHECK(cudaStreamWaitEvent(side, logits_b, 0));
    LOSSHEAD_RETURN_IF_ERROR(rows_step(r0, half, c - half, /*reduce=*/true, side));
    LOSSHEAD_CUDA_CHECK(cudaEventRecord(rows_b, side));
    LOSSHEAD_CUDA_CHECK(cudaStreamWaitEvent(stream, rows_a, 0));
    LOSSHEAD_RETURN_IF_ERROR(dh_gemm(r0, half, 0));
    // Also keeps the next chunk's logits GEMM off the buffer until this chunk's rows are done.
    LOSSHEAD_CUDA_CHECK(cudaStreamWaitEvent(stream, rows_b, 0));
    LOSSHEAD_RETURN_IF_ERROR(dh_gemm(r0 + half, c - half, half));
    LOSSHEAD_RETURN_IF_ERROR(bias_sums(r0, c));
    LOSSHEAD_RETURN_IF_ERROR(dw_gemm(r0, c));
  }
  return absl::OkStatus();
}

}  // namespace losshead::kernels::cuda
