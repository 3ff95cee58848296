#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "kernels/common/loss_math.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/row_terms.cuh"
#include "kernels/cuda/row_vec.cuh"
#include "kernels/cuda/shard_softmax.cuh"
#include "losshead/kernels/shard_problem.h"

namespace losshead::kernels::cuda {
namespace {

// One block per token. A shard's row is V / k columns, often a few thousand: 256 threads with
// kUnroll 16-byte loads each in flight (16 KiB per block) and several blocks per SM keep HBM busy.
// A chunk's logits are far larger than L2 and each pass reads them once: streaming loads.
constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// What a launch computes beyond the plain statistics: each its own instantiation.
enum class ShardExtras { kNone, kDistribution, kTopK };

// A shard's statistics of a token carry z of the target (kShardStats: m, s, sz, zt). kTerms: z of
// the scaled and biased logit (RowTerms), an instantiation of its own.
template <typename TL, ShardExtras kExtras, bool kTerms>
__global__ void __launch_bounds__(kThreads)
    ShardStatsKernel(const TL* logits, int64_t ldl, const int32_t* __restrict__ targets,
                     ShardRowParams p, float* __restrict__ stats, int64_t stride,
                     float* __restrict__ output_stats, int top_k, RowTerms terms) {
  constexpr int kVec = Vec<TL>::kSize;
  constexpr bool kDist = kExtras != ShardExtras::kNone;
  constexpr bool kTop = kExtras == ShardExtras::kTopK;
  using RowStats = SoftmaxState<true, kDist>;
  __shared__ RowStats warp_states[kThreads / kWarpSize];
  const int64_t q = blockIdx.x;
  const int tid = threadIdx.x;
  const TL* x = logits + q * ldl;
  const int64_t t = targets[q];
  // The target's local column, or -1 when it is another shard's row or the token is ignored
  // (ignore_index may be a real class id).
  const int64_t local =
      t != p.ignore_index && t >= p.row_begin && t < p.row_begin + p.rows ? t - p.row_begin : -1;
  const loss::Softcap cap = loss::Softcap::Of(p.loss.softcap);
  const int64_t nvec = p.rows / kVec;
  const Vec<TL>* xv = reinterpret_cast<const Vec<TL>*>(x);
  // z of the logit x of local column j: the scale and bias first with the terms.
  auto z_of = [&](float xval, int64_t j) -> float {
    if constexpr (kTerms) {
      return TermsZ(cap, xval, terms.terms.logit_scale, terms.bias, j);
    } else {
      return cap(xval);
    }
  };

  RowStats st = RowStats::Empty();
  // The top-k's candidates of this thread, in local ids (the shard's columns).
  [[maybe_unused]] TopKList top;
  [[maybe_unused]] Candidate last;
  if constexpr (kTop) last = TopKList::Empty(top);
  for (int64_t base = tid; base < nvec; base += kThreads * kUnroll) {
    Vec<TL> in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kThreads;
      if (i < nvec) in[u].raw = __ldcs(&xv[i].raw);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kThreads;
      if (i < nvec) {
        PushVector<kVec>(
            st,
            [&](int k) {
              const float z = z_of(ToF(in[u].v[k]), i * kVec + k);
              if (i * kVec + k == local) st.zt = z;
              if constexpr (kTop) OfferTopK(top, last, z, static_cast<int>(i * kVec) + k, top_k);
              return z;
            },
            i * kVec);
      }
    }
  }
  for (int64_t j = nvec * kVec + tid; j < p.rows; j += kThreads) {
    const float z = z_of(ToF(x[j]), j);
    if (j == local) st.zt = z;
    if constexpr (kTop) OfferTopK(top, last, z, static_cast<int>(j), top_k);
    Push(st, z, j);
  }
  ReduceToWarpSlots<kThreads>(st, CombineOp{}, warp_states);
  if (tid == 0) {
    const RowStats total = FoldWarpSlots<kThreads>(warp_states, CombineOp{}, warp_states[0], 1);
    stats[q] = total.m;
    stats[stride + q] = total.s;
    stats[2 * stride + q] = total.sz;
    stats[3 * stride + q] = total.zt;
    if constexpr (kDist) {
      // shard_problem.h's output_stats: s, then the argmax's global id as the float of its bits.
      output_stats[q] = total.h;
      // (A row of NaN has no candidate: its first id stands in, as where a NaN leads.)
      const int argmax = total.ai == kNoId ? 0 : total.ai;
      output_stats[stride + q] = __int_as_float(static_cast<int>(p.row_begin) + argmax);
    }
  }
  if constexpr (kTop) {
    __shared__ Candidate best[kMaxTopK];
    BlockTopK<kThreads>(top, top_k, best);
    if (tid < top_k) {
      // A shard of fewer than top_k columns pads with id -1 (z -inf).
      const Candidate c = best[tid];
      const int id = c.id == kNoId ? -1 : static_cast<int>(p.row_begin) + c.id;
      output_stats[(kShardOutputStats + tid) * stride + q] = c.z;
      output_stats[(kShardOutputStats + top_k + tid) * stride + q] = __int_as_float(id);
    }
  }
}

// Token q's s (sum_j ShiftedZTerm(e_j, z_j - max)) over every shard, each shard's moved to the
// global max, in rank order, in double, by one thread: the entropy term's statistic, summed as
// CombineOutputStats sums it for the outputs (that loop keeps its own copy: fused with the
// argmax's, it is what the distribution outputs' kernel was tuned with).
__device__ __forceinline__ double CombineShiftedZ(const float* stats, const float* output_stats,
                                                  int64_t stride, int shards, int64_t q, int top_k,
                                                  float max_z) {
  const int64_t per_shard = ShardOutputStatsRows(top_k);
  double sum_shifted_z = 0.0;
  for (int r = 0; r < shards; ++r) {
    const float* slice = stats + r * kShardStats * stride;
    const float s = slice[stride + q];
    if (s > 0.0f) {
      sum_shifted_z += loss::RescaledShiftedZ<double>(output_stats[r * per_shard * stride + q], s,
                                                      slice[q], max_z);
    }
  }
  return sum_shifted_z;
}

// One token's distribution outputs from every shard's statistics and output statistics, in rank
// order, in double (as the CPU backend's CombineShardOutputStats), by one thread; `lse` and
// `sum_exp` as the caller combined them.
__device__ __forceinline__ void CombineOutputStats(const float* stats, const float* output_stats,
                                                   int64_t stride, int shards, int64_t q,
                                                   int64_t target, int top_k, double lse,
                                                   double sum_exp, double z_target, float max_z,
                                                   const RowOutputs& out) {
  const int64_t per_shard = ShardOutputStatsRows(top_k);
  double sum_shifted_z = 0.0;
  Candidate best{-INFINITY, kNoId};
  for (int r = 0; r < shards; ++r) {
    const float* slice = stats + r * kShardStats * stride;
    const float* extra = output_stats + r * per_shard * stride;
    const float m = slice[q];
    const float s = slice[stride + q];
    if (s > 0.0f) {
      sum_shifted_z += loss::RescaledShiftedZ<double>(extra[q], s, m, max_z);
    }
    const int id = __float_as_int(extra[stride + q]);
    if (loss::ArgmaxBeats(m, id, best.z, best.id)) best = {m, id};
  }
  // Every shard's max NaN: shard 0's stands, as where a NaN leads.
  if (best.id == kNoId) best.id = __float_as_int(output_stats[stride + q]);
  if (out.logprob != nullptr) {
    out.logprob[q] = static_cast<float>(loss::TargetLogProb(lse, z_target));
  }
  if (out.entropy != nullptr) {
    out.entropy[q] = static_cast<float>(loss::Entropy(sum_exp, sum_shifted_z));
  }
  if (out.argmax != nullptr) out.argmax[q] = best.id;
  if (out.correct_count != nullptr && best.id == target) atomicAdd(out.correct_count, 1ull);
  if (!out.TopK()) return;
  TopKList list;
  Candidate last = TopKList::Empty(list);
  for (int r = 0; r < shards; ++r) {
    const float* extra = output_stats + r * per_shard * stride;
    for (int i = 0; i < top_k; ++i) {
      const int id = __float_as_int(extra[(kShardOutputStats + top_k + i) * stride + q]);
      if (id >= 0) OfferTopK(list, last, extra[(kShardOutputStats + i) * stride + q], id, top_k);
    }
  }
  for (int i = 0; i < top_k; ++i) {
    const bool filled = list.id[i] != kNoId;
    if (out.top_k_ids != nullptr) out.top_k_ids[q * top_k + i] = filled ? list.id[i] : -1;
    if (out.top_k_logprobs != nullptr) {
      out.top_k_logprobs[q * top_k + i] =
          filled ? static_cast<float>(loss::TargetLogProb<double>(lse, list.z[i])) : 0.0f;
    }
  }
}

// Thread 0's part of counted token q with the terms, from the combined statistics: its weighted
// loss, and its factors into SharedTermFactors() (the weight and the logit scale folded in, in
// double, each rounded once), as the CPU backend's ShardTermsLoss and
// ComputeShardRowGradientWithTerms form them.
__device__ __forceinline__ double ShardRowTermsLoss(const ShardRowParams& p, const RowTerms& rt,
                                                    int64_t q, double lse, double z_target,
                                                    double sum_z, double entropy) {
  const loss::BasicTokenInputs<double> in = TokenInputsAt<double>(rt, q);
  const double v = static_cast<double>(p.v);
  const loss::BasicTermsLoss<double> r =
      loss::TermsLossOf(p.loss, rt.terms, lse, z_target, v, entropy, in,
                        [&] { return loss::TokenLoss<double>(p.loss, lse, z_target, sum_z, v); });
  const double scale = in.weight * static_cast<double>(rt.terms.logit_scale);
  TermFactors& out = SharedTermFactors();
  out.factors = loss::FoldedGradFactors(r.factors, /*p_divisor=*/1.0, scale);
  // Against lse (e_j = p_j): z_j - sum_k p_k z_k = (z_j - lse) + entropy.
  out.entropy =
      loss::EntropyGrad{static_cast<float>(-static_cast<double>(rt.terms.entropy_coef) * scale),
                        static_cast<float>(-entropy)};
  out.entropy_on = rt.terms.entropy_coef != 0.0f;
  return in.weight * r.loss;
}

template <typename TL, typename TG, bool kOutputs, bool kTerms>
__global__ void __launch_bounds__(kThreads)
    ShardGradKernel(const TL* logits, int64_t ldl, const int32_t* __restrict__ targets,
                    ShardRowParams p, const float* __restrict__ stats, int64_t stride, int shards,
                    TG* grad, int64_t ldg, float* __restrict__ row_loss,
                    float* __restrict__ per_token_loss, float* __restrict__ per_token_lse,
                    const float* __restrict__ output_stats, int top_k, RowOutputs outputs,
                    RowTerms terms) {
  __shared__ float shared_lse;
  const int64_t q = blockIdx.x;
  const int tid = threadIdx.x;
  const int64_t t = targets[q];
  const bool valid = t != p.ignore_index && t >= 0 && t < p.v;

  if (tid == 0) {
    // k terms per token: combined in double, in rank order, so that every shard derives the same
    // lse and loss bits from the same gathered statistics.
    float max_z = -INFINITY;
    for (int r = 0; r < shards; ++r) max_z = fmaxf(max_z, stats[r * kShardStats * stride + q]);
    double sum_exp = 0.0, sum_z = 0.0, z_target = 0.0;
    for (int r = 0; r < shards; ++r) {
      const float* slice = stats + r * kShardStats * stride;
      const float s = slice[stride + q];
      // An empty slice (s = 0) adds nothing, and no exp(-inf - -inf).
      if (s > 0.0f) {
        sum_exp += loss::Rescaled<double>(s, slice[q], max_z);
      }
      sum_z += slice[2 * stride + q];
      z_target += slice[3 * stride + q];
    }
    const double lse = loss::Lse<double>(max_z, sum_exp);
    double loss = 0.0;
    if (valid) {
      if constexpr (kTerms) {
        // The entropy term's entropy, combined as the output's is.
        const double entropy =
            terms.terms.entropy_coef != 0.0f
                ? loss::Entropy(sum_exp, CombineShiftedZ(stats, output_stats, stride, shards, q,
                                                         top_k, max_z))
                : 0.0;
        loss = ShardRowTermsLoss(p, terms, q, lse, z_target, sum_z, entropy);
      } else {
        loss = loss::TokenLoss<double>(p.loss, lse, z_target, sum_z, static_cast<double>(p.v));
      }
    }
    row_loss[q] = static_cast<float>(loss);
    if (per_token_loss != nullptr) per_token_loss[q] = static_cast<float>(loss);
    if (per_token_lse != nullptr) per_token_lse[q] = static_cast<float>(lse);
    shared_lse = static_cast<float>(lse);
    if constexpr (kOutputs) {
      if (valid) {
        CombineOutputStats(stats, output_stats, stride, shards, q, t, top_k, lse, sum_exp, z_target,
                           max_z, outputs);
      } else {
        WriteIgnoredOutputs(outputs, q);
      }
    }
  }
  if (grad == nullptr) return;  // uniform over the block: no thread is left at the barrier
  __syncthreads();
  const float lse = shared_lse;

  constexpr int kVec = Vec<TL>::kSize;
  const TL* x = logits + q * ldl;
  const Vec<TL>* xv = reinterpret_cast<const Vec<TL>*>(x);
  TG* g = grad + q * ldg;
  using Out = OutVec<TG, kVec>;
  Out* gv = reinterpret_cast<Out*>(g);
  const loss::Softcap cap = loss::Softcap::Of(p.loss.softcap);
  const int64_t local =
      valid && t >= p.row_begin && t < p.row_begin + p.rows ? t - p.row_begin : -1;
  // g_j = p_j (1 + 2 z_loss lse) - eps / V - (1 - eps) [j == y], times dz/dx = 1 - (z/cap)^2,
  // with the whole vocabulary's lse and V. z is recomputed from x exactly as the statistics
  // pass computed it.
  const loss::GradFactors factors = loss::GradFactorsOf(p.loss, lse, static_cast<float>(p.v));
  const float scale = p.grad_scale != nullptr ? *p.grad_scale : 1.0f;
  auto grad_of = [&](float xval, int64_t j) -> float {
    if constexpr (kTerms) {
      const float z = TermsZ(cap, xval, terms.terms.logit_scale, terms.bias, j);
      return TermsLogitGrad(SharedTermFactors(), cap, z, lse, j == local) * scale;
    }
    const float z = cap(xval);
    float gj = loss::LogitGrad(factors, loss::Exp(z - lse), j == local);
    if (cap.cap > 0.0f) gj *= loss::SoftcapSlope(z * cap.inv_cap);
    return gj * scale;
  };

  // Narrowing in place (TG smaller than TL): the gradient of element j lands on bytes of an
  // element <= j that another thread may not have read yet in this tile: read the tile, barrier,
  // then write; tiles go forwards, so no write reaches a later tile. Without narrowing each
  // thread overwrites exactly what it read.
  constexpr bool kNarrowing = sizeof(TG) < sizeof(TL);
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * kUnroll;
  const int64_t nvec = p.rows / kVec;
  const int64_t ntiles = (nvec + kTile - 1) / kTile;
  for (int64_t k = 0; k < ntiles; ++k) {
    const int64_t base = k * kTile;
    Vec<TL> in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + tid + static_cast<int64_t>(u) * kThreads;
      in[u].raw = make_uint4(0, 0, 0, 0);
      if (i < nvec && valid) in[u].raw = __ldcs(&xv[i].raw);
    }
    // A tile's gradients: all of them before the barrier when narrowing, else each vector as
    // soon as it is computed.
    Out out[kNarrowing ? kUnroll : 1];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + tid + static_cast<int64_t>(u) * kThreads;
      Out& o = out[kNarrowing ? u : 0];
#pragma unroll
      for (int c = 0; c < kVec; ++c) {
        o.v[c] = FromF<TG>(valid ? grad_of(ToF(in[u].v[c]), i * kVec + c) : 0.0f);
      }
      if (!kNarrowing && i < nvec) StoreStreaming(&gv[i], o);
    }
    if constexpr (kNarrowing) {
      __syncthreads();
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + tid + static_cast<int64_t>(u) * kThreads;
        if (i < nvec) StoreStreaming(&gv[i], out[u]);
      }
    }
  }
  // Tail (rows % kVec < kThreads elements): same read-barrier-write discipline.
  const int64_t j = nvec * kVec + tid;
  float gt = 0.0f;
  if (j < p.rows && valid) gt = grad_of(ToF(x[j]), j);
  if constexpr (kNarrowing) __syncthreads();
  if (j < p.rows) g[j] = FromF<TG>(gt);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    RoundKernel(const float* __restrict__ src, T* __restrict__ dst, int64_t count) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += step) {
    dst[i] = FromF<T>(src[i]);
  }
}

template <typename TL, bool kTerms>
void LaunchStatsKernel(const TL* logits, int64_t ldl, int64_t tokens, const int32_t* targets,
                       const ShardRowParams& p, float* stats, int64_t stride, cudaStream_t stream,
                       float* output_stats, int top_k, const RowTerms& terms) {
  const auto blocks = static_cast<unsigned>(tokens);
  if (output_stats == nullptr) {
    ShardStatsKernel<TL, ShardExtras::kNone, kTerms><<<blocks, kThreads, 0, stream>>>(
        logits, ldl, targets, p, stats, stride, nullptr, 0, terms);
  } else if (top_k > 0) {
    ShardStatsKernel<TL, ShardExtras::kTopK, kTerms><<<blocks, kThreads, 0, stream>>>(
        logits, ldl, targets, p, stats, stride, output_stats, top_k, terms);
  } else {
    ShardStatsKernel<TL, ShardExtras::kDistribution, kTerms><<<blocks, kThreads, 0, stream>>>(
        logits, ldl, targets, p, stats, stride, output_stats, 0, terms);
  }
}

}  // namespace

template <typename TL>
absl::Status LaunchShardStats(const TL* logits, int64_t ldl, int64_t tokens, const int32_t* targets,
                              const ShardRowParams& p, float* stats, int64_t stride,
                              cudaStream_t stream, float* output_stats, int top_k,
                              const RowTerms& terms) {
  if (tokens <= 0) return absl::OkStatus();
  if (terms.Any()) {
    LaunchStatsKernel<TL, true>(logits, ldl, tokens, targets, p, stats, stride, stream,
                                output_stats, top_k, terms);
  } else {
    LaunchStatsKernel<TL, false>(logits, ldl, tokens, targets, p, stats, stride, stream,
                                 output_stats, top_k, {});
  }
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

template <typename TL, typename TG>
absl::Status LaunchShardGrad(const TL* logits, int64_t ldl, int64_t tokens, const int32_t* targets,
                             const ShardRowParams& p, const float* stats, int64_t stride,
                             int shards, TG* grad, int64_t ldg, float* row_loss,
                             float* per_token_loss, float* per_token_lse, cudaStream_t stream,
                             const float* output_stats, int top_k, const RowOutputs& outputs,
                             const RowTerms& terms) {
  if (tokens <= 0) return absl::OkStatus();
  const auto blocks = static_cast<unsigned>(tokens);
  const bool with_outputs = outputs.Any() && output_stats != nullptr;
  if (terms.Any()) {
    // The entropy term reads output_stats whether or not an output is asked for.
    if (with_outputs) {
      ShardGradKernel<TL, TG, true, true><<<blocks, kThreads, 0, stream>>>(
          logits, ldl, targets, p, stats, stride, shards, grad, ldg, row_loss, per_token_loss,
          per_token_lse, output_stats, top_k, outputs, terms);
    } else {
      ShardGradKernel<TL, TG, false, true><<<blocks, kThreads, 0, stream>>>(
          logits, ldl, targets, p, stats, stride, shards, grad, ldg, row_loss, per_token_loss,
          per_token_lse, output_stats, top_k, {}, terms);
    }
  } else if (with_outputs) {
    ShardGradKernel<TL, TG, true, false><<<blocks, kThreads, 0, stream>>>(
        logits, ldl, targets, p, stats, stride, shards, grad, ldg, row_loss, per_token_loss,
        per_token_lse, output_stats, top_k, outputs, {});
  } else {
    ShardGradKernel<TL, TG, false, false><<<blocks, kThreads, 0, stream>>>(
        logits, ldl, targets, p, stats, stride, shards, grad, ldg, row_loss, per_token_loss,
        per_token_lse, nullptr, 0, {}, {});
  }
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

template <typename T>
absl::Status LaunchRoundToDType(const float* src, T* dst, int64_t count, cudaStream_t stream) {
  if (count <= 0) return absl::OkStatus();
  // A grid-stride loop: a few waves of blocks cover any count.
  const int64_t blocks = std::min<int64_t>((count + kThreads - 1) / kThreads, int64_t{1} << 16);
  RoundKernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(src, dst, count);
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

template absl::Status LaunchShardStats<float>(const float*, int64_t, int64_t, const int32_t*,
                                              const ShardRowParams&, float*, int64_t, cudaStream_t,
                                              float*, int, const RowTerms&);
template absl::Status LaunchShardStats<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int64_t,
                                                      const int32_t*, const ShardRowParams&, float*,
                                                      int64_t, cudaStream_t, float*, int,
                                                      const RowTerms&);

#define LOSSHEAD_INSTANTIATE_GRAD(TL, TG)                                                        \
  template absl::Status LaunchShardGrad<TL, TG>(                                                 \
      const TL*, int64_t, int64_t, const int32_t*, const ShardRowParams&, const float*, int64_t, \
      int, TG*, int64_t, float*, float*, float*, cudaStream_t, const float*, int,                \
      const RowOutputs&, const RowTerms&);
LOSSHEAD_INSTANTIATE_GRAD(float, float)
LOSSHEAD_INSTANTIATE_GRAD(float, __nv_bfloat16)
LOSSHEAD_INSTANTIATE_GRAD(float, __half)
LOSSHEAD_INSTANTIATE_GRAD(__nv_bfloat16, __nv_bfloat16)
#undef LOSSHEAD_INSTANTIATE_GRAD

template absl::Status LaunchRoundToDType<__nv_bfloat16>(const float*, __nv_bfloat16*, int64_t,
                                                        cudaStream_t);
template absl::Status LaunchRoundToDType<__half>(const float*, __half*, int64_t, cudaStream_t);

}  // namespace losshead::kernels::cuda
