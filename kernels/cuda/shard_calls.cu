#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/column_sums.cuh"
#include "kernels/cuda/count_targets.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/head_gemms.h"
#include "kernels/cuda/loss_reduce.cuh"
#include "kernels/cuda/lt_gemm.h"
#include "kernels/cuda/run_types.cuh"
#include "kernels/cuda/scalars.h"
#include "kernels/cuda/shard_calls.h"
#include "kernels/cuda/shard_softmax.cuh"

namespace losshead::kernels::cuda {
namespace {

// CanImplement's int32 limits, with the shard's rows as the logits' width.
absl::Status CanImplementShard(const ShardProblem& shard) {
  if (absl::Status s = ValidateShardProblem(shard); !s.ok()) return s;
  constexpr int64_t kIntMax = 2147483647;
  const Problem& problem = shard.problem;
  if (problem.d > kIntMax) {
    return absl::InvalidArgumentError(absl::StrCat("d must fit in int32, got ", problem.d));
  }
  if (2 * LogitsStride(shard.rows) > kIntMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard rows too many for the CUDA backend (max ~1e9), got ", shard.rows));
  }
  if (problem.n > kIntMax) {
    return absl::InvalidArgumentError(absl::StrCat("n must fit in int32, got ", problem.n));
  }
  return absl::OkStatus();
}

// ShardStoreGradHidden's chunk, which has no ShardArguments to check it against.
absl::Status CheckChunkInTokens(const ShardProblem& shard, ShardChunk chunk) {
  if (chunk.size < 1 || chunk.begin < 0 || chunk.begin > shard.problem.n - chunk.size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chunk [", chunk.begin, ", ", chunk.begin + chunk.size,
        ") must be a non-empty part of the micro-batch's tokens [0, ", shard.problem.n, ")"));
  }
  return absl::OkStatus();
}

RunScalars* ShardScalars(const ShardArguments& args) {
  return reinterpret_cast<RunScalars*>(args.workspace);
}

ShardRowParams ShardRowParamsOf(const ShardProblem& shard) {
  const LossOptions& o = shard.problem.options;
  ShardRowParams p;
  p.v = shard.problem.v;
  p.row_begin = shard.row_begin;
  p.rows = shard.rows;
  p.ignore_index = o.ignore_index;
  p.loss = loss::OptionsOf(o);
  return p;
}

// The distribution outputs asked for, from token t0 on (none: the plain kernels).
RowOutputs ShardRowOutputs(const ShardArguments& args, int64_t t0) {
  RowOutputs out;
  if (!AsksDistributionOutputs(args)) return out;
  const int64_t top_k = AsksTopK(args) ? args.top_k : 0;
  auto at = [t0](auto* p, int64_t width = 1) { return p != nullptr ? p + t0 * width : nullptr; };
  out.logprob = at(args.per_token_logprob);
  out.entropy = at(args.per_token_entropy);
  out.argmax = at(args.per_token_argmax);
  out.correct_count = reinterpret_cast<unsigned long long*>(args.correct_count);
  out.top_k = static_cast<int>(top_k);
  out.top_k_ids = at(args.top_k_ids, top_k);
  out.top_k_logprobs = at(args.top_k_logprobs, top_k);
  return out;
}

// The model options and terms of the chunk from token t0 on (none: the plain kernels): the bias
// over the shard's rows, the per-token inputs over the micro-batch (every shard reads them).
RowTerms ShardRowTermsOf(const ShardProblem& shard, const ShardArguments& args, int64_t t0) {
  RowTerms terms;
  terms.terms = loss::TermOptionsOf(shard.problem.options);
  terms.bias = args.bias;
  auto at = [t0](const float* p) { return p != nullptr ? p + t0 : nullptr; };
  terms.token_weights = at(args.token_weights);
  terms.old_logprob = at(args.old_logprob);
  terms.advantages = at(args.advantages);
  terms.ref_logprob = at(args.ref_logprob);
  return terms;
}

}  // namespace

absl::StatusOr<ShardPlan> ShardCalls::Plan(const ShardProblem& shard, size_t budget_bytes) const {
  if (absl::Status s = CanImplementShard(shard); !s.ok()) return s;
  // As in WorkspaceBytes: the stream's own memory comes out of the budget first.
  const size_t reserve = options_.handle_reserve_bytes;
  const size_t bytes = budget_bytes > reserve ? budget_bytes - reserve : 0;
  const int64_t chunk = ChunkRows(shard, bytes);
  if (chunk < 1) {
    return absl::ResourceExhaustedError(
        absl::StrCat("workspace budget of ", budget_bytes,
                     " bytes holds no chunk of the vocabulary shard: at least ",
                     PlanBytes(shard, 1) + reserve, " bytes are needed for ", shard.rows,
                     " rows, d = ", shard.problem.d, " and ", shard.shards, " shards"));
  }
  ShardPlan plan;
  plan.chunk_rows = chunk;
  plan.workspace_bytes = LayoutFor(shard, chunk).total;
  plan.stats_floats = static_cast<int64_t>(shard.shards) * kShardStats * chunk;
  plan.partial_floats = chunk * shard.problem.d;
  return plan;
}

absl::Status ShardCalls::Begin(const ShardProblem& shard, const ShardArguments& args,
                               CudaStream* cs) const {
  if (absl::Status s = Validate(shard, args, nullptr, cs); !s.ok()) return s;
  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  // The count covers all N tokens of the micro-batch (every shard gets the same alpha); the
  // loss accumulator (and loss_sum, as on the CPU backend) starts at 0 and lives in the
  // workspace until the last chunk.
  const Problem& problem = shard.problem;
  const LossOptions& o = problem.options;
  if (args.loss_sum != nullptr) {
    LOSSHEAD_CUDA_CHECK(cudaMemsetAsync(args.loss_sum, 0, sizeof(float), cs->stream()));
  }
  // Like loss_sum, a count over the chunks: ShardBackward's row kernel adds each chunk's.
  if (args.correct_count != nullptr) {
    LOSSHEAD_CUDA_CHECK(cudaMemsetAsync(args.correct_count, 0, sizeof(int64_t), cs->stream()));
  }
  return LaunchCountTargets(args.targets, problem.n, problem.v, o.ignore_index,
                            o.reduction == Reduction::kMean, o.grad_scale, args.token_count,
                            ShardScalars(args), cs->stream());
}

absl::Status ShardCalls::Forward(const ShardProblem& shard, const ShardArguments& args,
                                 ShardChunk chunk, CudaStream* cs) const {
  if (absl::Status s = Validate(shard, args, &chunk, cs); !s.ok()) return s;
  const Layout layout = LayoutFor(shard, chunk.size);
  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  return WithRunTypes(shard.problem, options_, [&](auto in, auto logits) {
    return this
        ->template ForwardTyped<typename decltype(in)::type, typename decltype(logits)::type>(
            shard, args, chunk, layout, *cs);
  });
}

absl::Status ShardCalls::Backward(const ShardProblem& shard, const ShardArguments& args,
                                  ShardChunk chunk, CudaStream* cs) const {
  if (absl::Status s = Validate(shard, args, &chunk, cs); !s.ok()) return s;
  const Layout layout = LayoutFor(shard, chunk.size);
  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  return WithRunTypes(shard.problem, options_, [&](auto in, auto logits) {
    return this
        ->template BackwardTyped<typename decltype(in)::type, typename decltype(logits)::type>(
            shard, args, chunk, layout, *cs);
  });
}

absl::Status ShardCalls::StoreGradHidden(const ShardProblem& shard, const float* partial,
                                         ShardChunk chunk, void* grad_hidden,
                                         CudaStream* cs) const {
  if (absl::Status s = CanImplementShard(shard); !s.ok()) return s;
  if (cs == nullptr) return ForeignStreamError();
  if (partial == nullptr || grad_hidden == nullptr) {
    return absl::InvalidArgumentError("partial and grad_hidden must not be null");
  }
  if (absl::Status s = CheckChunkInTokens(shard, chunk); !s.ok()) return s;
  const int64_t offset = chunk.begin * shard.problem.d;
  const int64_t count = chunk.size * shard.problem.d;
  std::lock_guard<std::mutex> lock(cs->mutex());
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
  switch (shard.problem.dtype) {
    case DType::kFP32:
      LOSSHEAD_CUDA_CHECK(cudaMemcpyAsync(static_cast<float*>(grad_hidden) + offset, partial,
                                          static_cast<size_t>(count) * sizeof(float),
                                          cudaMemcpyDeviceToDevice, cs->stream()));
      return absl::OkStatus();
    case DType::kFP16:
      return LaunchRoundToDType(partial, static_cast<__half*>(grad_hidden) + offset, count,
                                cs->stream());
    case DType::kBF16:
      return LaunchRoundToDType(partial, static_cast<__nv_bfloat16*>(grad_hidden) + offset, count,
                                cs->stream());
  }
  return absl::InvalidArgumentError("unknown dtype");
}

// What ShardBegin (chunk null), ShardForward and ShardBackward check before launching anything:
// the checks every backend makes (shard_problem.h), then this backend's stream and workspace.
absl::Status ShardCalls::Validate(const ShardProblem& shard, const ShardArguments& args,
                                  const ShardChunk* chunk, const CudaStream* cs) const {
  if (absl::Status s = CanImplementShard(shard); !s.ok()) return s;
  if (absl::Status s = chunk != nullptr ? ValidateShardChunk(shard, args, *chunk)
                                        : ValidateShardArguments(shard, args);
      !s.ok()) {
    return s;
  }
  if (cs == nullptr) return ForeignStreamError();
  if (args.workspace == nullptr || reinterpret_cast<uintptr_t>(args.workspace) % kAlign != 0) {
    return absl::InvalidArgumentError("workspace must be a 256-byte aligned device pointer");
  }
  if (args.grad_stash.data != nullptr) {
    // As for Run: fp16 would flush a mean's small scaled gradients to zero.
    if (shard.problem.dtype == DType::kFP16) {
      return absl::UnimplementedError("the CUDA backend stashes no fp16 gradient");
    }
    if (reinterpret_cast<uintptr_t>(args.grad_stash.data) % kAlign != 0) {
      return absl::InvalidArgumentError("grad_stash must be a 256-byte aligned device pointer");
    }
  }
  const size_t needed = LayoutFor(shard, chunk != nullptr ? chunk->size : 1).total;
  if (args.workspace_bytes < needed) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace of ", args.workspace_bytes, " bytes is too small: ", needed,
                     " bytes are needed for a chunk of ", chunk != nullptr ? chunk->size : 1,
                     " tokens (see PlanShard)"));
  }
  return absl::OkStatus();
}

// The workspace of a shard's chunk: Run's layout with the shard's rows as the logits' width,
// in bf16 or fp32 as for Run (the logits stay there from ShardForward to ShardBackward). The
// scalars sit at offset 0 whatever the chunk, so ShardBegin's count and the loss accumulator
// carry over.
Layout ShardCalls::LayoutFor(const ShardProblem& shard, int64_t chunk) const {
  return ChunkLayout(chunk, shard.rows, Bf16Logits(shard.problem, options_) ? 2 : 4,
                     options_.cublas_workspace_bytes);
}

// Workspace plus the caller's stats and dH-partial buffers for a chunk of `chunk` tokens.
size_t ShardCalls::PlanBytes(const ShardProblem& shard, int64_t chunk) const {
  const size_t floats = static_cast<size_t>(chunk) *
                        (static_cast<size_t>(shard.shards) * kShardStats + shard.problem.d);
  return LayoutFor(shard, chunk).total + floats * sizeof(float);
}

// The largest chunk whose PlanBytes fit `bytes`, at most n (0 when none does); rounded
// down to a multiple of 256 tokens when the micro-batch is split, as MakeLayout does. Depends
// on the shard's rows but not on its rank or first row.
int64_t ShardCalls::ChunkRows(const ShardProblem& shard, size_t bytes) const {
  if (PlanBytes(shard, 1) > bytes) return 0;
  const int64_t n = shard.problem.n;
  const size_t fixed = PlanBytes(shard, 0);
  // Logits row, row loss, stats and partial: alignment padding makes the estimate below off by
  // a row or two either way.
  const size_t per_row =
      static_cast<size_t>(LogitsStride(shard.rows)) * LayoutFor(shard, 1).logits_elem +
      sizeof(float) * (1 + static_cast<size_t>(shard.shards) * kShardStats + shard.problem.d);
  // Estimate, then settle on the exact largest chunk.
  int64_t chunk =
      static_cast<int64_t>(std::min<size_t>((bytes - fixed) / per_row, static_cast<size_t>(n)));
  chunk = std::max<int64_t>(chunk, 1);
  while (chunk > 1 && PlanBytes(shard, chunk) > bytes) --chunk;
  while (chunk < n && PlanBytes(shard, chunk + 1) <= bytes) ++chunk;
  if (chunk < n && chunk >= 256) chunk = chunk / 256 * 256;
  return chunk;
}

// TIn: H, W and the gradient operand G; TL: the logits chunk as the first GEMM writes it.
template <typename TIn, typename TL>
absl::Status ShardCalls::ForwardTyped(const ShardProblem& shard, const ShardArguments& args,
                                      ShardChunk chunk, const Layout& layout,
                                      CudaStream& cs) const {
  const cudaStream_t stream = cs.stream();
  char* ws = static_cast<char*>(args.workspace);
  auto* logits = reinterpret_cast<TL*>(ws + layout.logits_off);
  const auto* hidden = static_cast<const TIn*>(args.hidden);
  const int64_t d = shard.problem.d;
  // Host alpha/beta: nothing here depends on the token count.
  LOSSHEAD_RETURN_IF_ERROR(RunLogitsGemm(cs.gemm(), shard.rows, chunk.size, d, CudaType<TIn>(),
                                         GemmCompute(shard.problem), CudaType<TL>(), layout.ldl,
                                         args.weight, hidden + chunk.begin * d, logits,
                                         ws + layout.cublas_off, layout.cublas_bytes, stream));
  float* slice =
      args.stats + static_cast<int64_t>(shard.rank) * kShardStats * args.stats_chunk_rows;
  // The distribution outputs' statistics only when the caller exchanges them (shard_problem.h).
  float* output_slice = args.output_stats != nullptr
                            ? args.output_stats + static_cast<int64_t>(shard.rank) *
                                                      ShardOutputStatsRows(args.top_k) *
                                                      args.stats_chunk_rows
                            : nullptr;
  return LaunchShardStats(logits, layout.ldl, chunk.size, args.targets + chunk.begin,
                          ShardRowParamsOf(shard), slice, args.stats_chunk_rows, stream,
                          output_slice, args.top_k, ShardRowTermsOf(shard, args, chunk.begin));
}

template <typename TIn, typename TL>
absl::Status ShardCalls::BackwardTyped(const ShardProblem& shard, const ShardArguments& args,
                                       ShardChunk chunk, const Layout& layout,
                                       CudaStream& cs) const {
  const cudaStream_t stream = cs.stream();
  LtGemm& gemm = cs.gemm();
  char* ws = static_cast<char*>(args.workspace);
  RunScalars* scalars = ShardScalars(args);
  auto* row_loss = reinterpret_cast<float*>(ws + layout.row_loss_off);
  auto* logits = reinterpret_cast<TL*>(ws + layout.logits_off);
  auto* grad = reinterpret_cast<TIn*>(logits);  // G overwrites the logits in place, as in Run
  const int64_t ldl = layout.ldl;
  const int64_t ldg = ldl * static_cast<int64_t>(sizeof(TL) / sizeof(TIn));
  const int64_t t0 = chunk.begin;
  const int c = static_cast<int>(chunk.size);
  const int d = static_cast<int>(shard.problem.d);
  const int rows = static_cast<int>(shard.rows);
  void* const gemm_ws = ws + layout.cublas_off;
  const size_t gemm_ws_bytes = layout.cublas_bytes;
  constexpr cudaDataType_t kIn = CudaType<TIn>();
  const cublasComputeType_t compute = GemmCompute(shard.problem);
  // Deferred dW: G goes, scaled, to the stash's rows (dH's GEMM then reads it there with
  // alpha = 1), and the chunk's H beside it; dW is left to FlushGradStash.
  const GradStash& stash = args.grad_stash;
  const bool stashed = stash.data != nullptr;
  const bool need_grad = args.grad_hidden_partial != nullptr || args.grad_weight != nullptr ||
                         stashed || args.grad_bias != nullptr;
  ShardRowParams params = ShardRowParamsOf(shard);
  const float* grad_alpha = &scalars->grad_alpha;
  int64_t g_ld = ldg;
  if (stashed) {
    const StashLayout stash_layout = GradStashLayout(stash.capacity, rows, d, sizeof(TIn));
    const int64_t row = stash.tokens + t0;
    char* base = static_cast<char*>(stash.data);
    grad = reinterpret_cast<TIn*>(base) + row * stash_layout.ldg;
    g_ld = stash_layout.ldg;
    params.grad_scale = &scalars->grad_alpha;
    grad_alpha = &scalars->one;
    LOSSHEAD_CUDA_CHECK(cudaMemcpyAsync(
        base + stash_layout.hidden_off + static_cast<size_t>(row) * d * sizeof(TIn),
        static_cast<const TIn*>(args.hidden) + t0 * d, static_cast<size_t>(c) * d * sizeof(TIn),
        cudaMemcpyDeviceToDevice, stream));
  }

  LOSSHEAD_RETURN_IF_ERROR((LaunchShardGrad<TL, TIn>(
      logits, ldl, c, args.targets + t0, params, args.stats, args.stats_chunk_rows, shard.shards,
      need_grad ? grad : nullptr, g_ld, row_loss,
      args.per_token_loss != nullptr ? args.per_token_loss + t0 : nullptr,
      args.per_token_lse != nullptr ? args.per_token_lse + t0 : nullptr, stream, args.output_stats,
      args.top_k, ShardRowOutputs(args, t0), ShardRowTermsOf(shard, args, t0))));
  // One block over the chunk, after the previous chunks: the same bits on every rerun.
  LOSSHEAD_RETURN_IF_ERROR(LaunchLossReduce(row_loss, c, scalars, args.loss_sum, stream));

  if (args.grad_hidden_partial != nullptr) {
    // partial_cm (D x c) = W_rows_cm (D x rows) . G_cm (rows x c, ld g_ld), fp32 out: the shards'
    // partials are summed before anything rounds them.
    LOSSHEAD_RETURN_IF_ERROR(RunGradHiddenGemm(
        gemm, rows, c, d, kIn, compute, CUDA_R_32F, g_ld, grad_alpha, args.weight, grad,
        &scalars->zero, &scalars->one, args.grad_hidden_partial, gemm_ws, gemm_ws_bytes, stream));
  }
  if (args.grad_bias != nullptr) {
    // db_rows += the column sums of the chunk's G, scaled as dW is (G in a stash carries the scale
    // already) and divided by the logit scale G carries, as Run's (cuda_run.cu).
    LOSSHEAD_RETURN_IF_ERROR(
        LaunchAddColumnSums(grad, g_ld, c, rows, stashed ? &scalars->one : &scalars->grad_alpha,
                            shard.problem.options.logit_scale, args.grad_bias, stream));
  }
  if (args.grad_weight != nullptr) {
    // dW_rows_cm (D x rows) += H_cm (D x c) . G_cm^T (c x rows).
    LOSSHEAD_RETURN_IF_ERROR(
        RunGradWeightGemm(gemm, rows, c, d, kIn, compute, ldg, &scalars->grad_alpha,
                          static_cast<const TIn*>(args.hidden) + t0 * d, grad, &scalars->one,
                          args.grad_weight, gemm_ws, gemm_ws_bytes, stream));
  }
  return absl::OkStatus();
}

}  // namespace losshead::kernels::cuda
