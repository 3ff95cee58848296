#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/common/loss_math.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/logits_gemm_sm90.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/row_terms.cuh"
#include "kernels/cuda/row_vec.cuh"
#include "kernels/cuda/softmax_grad.cuh"

namespace losshead::kernels::cuda {
namespace {

// One block per row, kThreads x kUnroll 16-byte loads in flight per block (32 KiB): enough to
// saturate HBM with a few blocks per SM. A row's second read (pass 2) hits L2 only when few rows
// are live at once, hence the 1024-thread variant (about one row per SM).

// What a launch computes beyond the loss (RowOutputs): each its own instantiation, so that the
// plain kernel is the code it was without them.
enum class RowExtras { kNone, kDistribution, kTopK };

// Thread 0's part of a counted row with the terms: its weighted loss, and its factors into
// SharedTermFactors(). z_target after scale, bias and soft-cap; lse, the sum of z and the entropy
// from the reduction.
__device__ __forceinline__ float RowTermsLoss(const loss::Options& o, const RowTerms& rt,
                                              int64_t row, float lse, float z_target, float sum_z,
                                              float v, float entropy) {
  const loss::TermOptions& t = rt.terms;
  const loss::BasicTokenInputs<float> in = TokenInputsAt<float>(rt, row);
  const loss::BasicTermsLoss<float> r = loss::TermsLossOf(o, t, lse, z_target, v, entropy, in, [&] {
    return loss::TokenLossSmoothingLast(o, lse, z_target, sum_z, v);
  });
  // The chain rule's last links, into u_j = h . w_j: the weight and the scale.
  const float scale = in.weight * t.logit_scale;
  TermFactors& out = SharedTermFactors();
  const loss::GradFactors& f = r.factors;
  out.factors = loss::GradFactors{f.p_scale * scale, f.uniform * scale, f.target * scale};
  // Against lse rather than the max (pass 2 has lse): with e_j = p_j and shifted z_j - lse,
  // z_j - sum_k p_k z_k = (z_j - lse) + entropy.
  out.entropy = loss::EntropyGrad{-t.entropy_coef * scale, -entropy};
  out.entropy_on = t.entropy_coef != 0.0f;
  return in.weight * r.loss;
}

// Blocks each SM must hold at once: two of 512 threads, one of 1024 (at most 64 registers), so
// that they keep the rows in flight that the row's bandwidth needs. Left to itself the compiler
// gave the top-k 95 registers (110 with the terms): one block of 512 per SM, and the row kernel
// took about twice as long; the plain bf16 kernel 94 (ncu: 25 % occupancy, 2.2 TB/s from DRAM)
// and the distribution outputs' 90 (held to 64: 4 bytes spilled, the call with logprob, entropy
// and argmax 0.7 ms faster at 8192 tokens). Only the distribution outputs with the terms keep
// one block: 113 registers would spill too much.
template <int kThreads, RowExtras kExtras, bool kTerms>
inline constexpr int kMinBlocksPerSm =
    kExtras == RowExtras::kDistribution && kTerms ? 1 : 2048 / 2 / kThreads;

// kStats: the lse comes from the logits GEMM's statistics per tile (SoftmaxGradParams::
// tile_stats), so pass 1 reads the row only for the distribution's other statistics (kDist), not
// at all in the plain kernel. The lse is then the same bits whatever else is asked. Never with
// the terms, whose z is not the logit.
template <typename TL, typename TG, int kThreads, RowExtras kExtras, bool kTerms, bool kStats>
__global__ void __launch_bounds__(kThreads, (kMinBlocksPerSm<kThreads, kExtras, kTerms>))
    SoftmaxGradKernel(const TL* logits, int64_t ldl, const int32_t* __restrict__ targets,
                      SoftmaxGradParams p, TG* grad, int64_t ldg, float* __restrict__ row_loss,
                      float* __restrict__ per_token_loss, float* __restrict__ per_token_lse,
                      RowOutputs outputs, RowTerms terms) {
  constexpr int kVec = Vec<TL>::kSize;
  constexpr int kUnroll = kThreads >= 1024 ? 2 : 4;
  // The terms need s for the entropy term: they carry the distribution's state.
  constexpr bool kDist = kExtras != RowExtras::kNone || kTerms;
  constexpr bool kTop = kExtras == RowExtras::kTopK;
  using State = SoftmaxState<false, kDist>;
  static_assert(!kStats || !kTerms, "the statistics are those of the logits, not of the terms' z");
  using Plain = SoftmaxState<false>;
  [[maybe_unused]] __shared__ Plain tile_slots[kThreads / kWarpSize];
  // The row's own read in pass 1: for its lse, or for the distribution's other statistics.
  constexpr bool kRead = !kStats || kDist;
  __shared__ State warp_states[kThreads / kWarpSize];
  __shared__ float shared_lse;

  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const TL* x = logits + row * ldl;
  const int64_t t = targets[row];
  const bool valid = t != p.ignore_index && t >= 0 && t < p.v;
  const loss::Softcap cap = loss::Softcap::Of(p.loss.softcap);
  const int64_t nvec = p.v / kVec;
  const int64_t tail_start = nvec * kVec;
  const Vec<TL>* xv = reinterpret_cast<const Vec<TL>*>(x);
  // z of logit x of class j: the scale and bias first with the terms (ScaleBiasRow's order).
  [[maybe_unused]] auto z_of = [&](float xval, int64_t j) -> float {
    if constexpr (kTerms) {
      return TermsZ(cap, xval, terms.terms.logit_scale, terms.bias, j);
    } else {
      return cap(xval);
    }
  };

  // The top-k, of a counted row only (k = 0 offers none): pass 1 finds a bound below which none
  // of the row's k best lies (BlockKthBest), and the row's next read offers this thread's list
  // only the values at or above it, about k of the row's V for random logits.
  [[maybe_unused]] const int top_k = kTop && valid ? outputs.top_k : 0;
  [[maybe_unused]] float top_bound = INFINITY;
  [[maybe_unused]] TopKList top;
  [[maybe_unused]] Candidate last;
  if constexpr (kTop) last = TopKList::Empty(top);
  [[maybe_unused]] auto offer_top = [&](float z, int64_t j) {
    if (z >= top_bound) OfferTopK(top, last, z, static_cast<int>(j), top_k);
  };

  // An ignored row still needs its lse when the caller asks for it; otherwise only zeros.
  const bool need_stats = valid || per_token_lse != nullptr;
  float lse = 0.0f;
  if (need_stats) {
    State st = State::Empty();
    // kStats: a tile's log-sum-exp is a state of its own (largest lse, sum 1); the columns past
    // the tiles are pushed one by one. sz stays 0: no label smoothing with the statistics.
    [[maybe_unused]] Plain tiles = Plain::Empty();
    if constexpr (kStats) {
      const float* lse_of_tile = p.tile_stats + row * p.stats_ld;
      const int64_t count = LogitsTileCount(p.stats_width);
      for (int64_t i = tid; i < count; i += kThreads) {
        tiles = Combine(tiles, Plain{__ldcs(&lse_of_tile[i]), 1.0f, 0.0f});
      }
      for (int64_t j = p.stats_width + tid; j < p.v; j += kThreads) Push(tiles, ToF(x[j]));
      if constexpr (!kDist) st = tiles;
    }
    for (int64_t base = tid; kRead && base < nvec; base += kThreads * kUnroll) {
      Vec<TL> in[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * kThreads;
        if (i < nvec) in[u].raw = __ldcg(&xv[i].raw);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * kThreads;
        if (i < nvec) {
          if constexpr (kDist) {
            float z[kVec];
#pragma unroll
            for (int k = 0; k < kVec; ++k) z[k] = z_of(ToF(in[u].v[k]), i * kVec + k);
            PushVector<kVec>(
                st, [&](int k) { return z[k]; }, i * kVec);
          } else {
            PushVector<kVec>(st, [&](int k) { return cap(ToF(in[u].v[k])); });
          }
        }
      }
    }
    for (int64_t j = tail_start + tid; kRead && j < p.v; j += kThreads) {
      if constexpr (kDist) {
        const float z = z_of(ToF(x[j]), j);
        Push(st, z, j);
      } else {
        Push(st, cap(ToF(x[j])));
      }
    }
    ReduceToWarpSlots<kThreads>(st, CombineOp{}, warp_states);
    if constexpr (kStats && kDist) ReduceToWarpSlots<kThreads>(tiles, CombineOp{}, tile_slots);
    if (tid == 0) {
      const State total = FoldWarpSlots<kThreads>(warp_states, CombineOp{}, warp_states[0], 1);
      float l = loss::Lse(total.m, total.s);
      if constexpr (kStats && kDist) {
        const Plain t = FoldWarpSlots<kThreads>(tile_slots, CombineOp{}, tile_slots[0], 1);
        l = loss::Lse(t.m, t.s);
      }
      float loss = 0.0f;
      if constexpr (kTerms) {
        if (valid) {
          loss = RowTermsLoss(p.loss, terms, row, l, z_of(ToF(x[t]), t), total.sz,
                              static_cast<float>(p.v), loss::Entropy(total.s, total.h));
        }
      } else if (valid) {
        loss = loss::TokenLossSmoothingLast(p.loss, l, cap(ToF(x[t])), total.sz,
                                            static_cast<float>(p.v));
      }
      row_loss[row] = loss;
      if (per_token_loss != nullptr) per_token_loss[row] = loss;
      if (per_token_lse != nullptr) per_token_lse[row] = l;
      shared_lse = l;
      if constexpr (kDist) {
        if (valid) {
          if (outputs.logprob != nullptr) {
            outputs.logprob[row] = loss::TargetLogProb(l, z_of(ToF(x[t]), t));
          }
          if (outputs.entropy != nullptr) outputs.entropy[row] = loss::Entropy(total.s, total.h);
          // A row of NaN has no candidate: its argmax is its first id, as where a NaN leads.
          const int argmax = total.ai == kNoId ? 0 : total.ai;
          if (outputs.argmax != nullptr) outputs.argmax[row] = argmax;
          if (outputs.correct_count != nullptr && argmax == t) {
            atomicAdd(outputs.correct_count, 1ull);
          }
        } else {
          WriteIgnoredOutputs(outputs, row);
        }
      }
    }
    // Also orders thread 0's read of x[t] before pass 2 overwrites the row.
    __syncthreads();
    lse = shared_lse;
    if constexpr (kTop) {
      // top_k is the same in every thread of the block: the barriers are reached by all.
      if (top_k > 0) top_bound = BlockKthBest<kThreads>(Candidate{st.am, st.ai}, top_k).z;
    }
  } else if (tid == 0) {
    row_loss[row] = 0.0f;
    if (per_token_loss != nullptr) per_token_loss[row] = 0.0f;
    if constexpr (kDist) WriteIgnoredOutputs(outputs, row);
  }

  // The block's top-k from the threads' lists, once the row's next read has offered them.
  [[maybe_unused]] auto write_top_k = [&] {
    __shared__ Candidate best[kMaxTopK];
    BlockTopK<kThreads>(top, top_k, best);
    if (tid < top_k) {
      const Candidate c = best[tid];
      if (outputs.top_k_ids != nullptr) {
        outputs.top_k_ids[row * top_k + tid] = c.id == kNoId ? -1 : c.id;
      }
      if (outputs.top_k_logprobs != nullptr) {
        outputs.top_k_logprobs[row * top_k + tid] = loss::TargetLogProb(lse, c.z);
      }
    }
  };

  if (grad == nullptr) {
    // No pass 2 to offer the top-k its values: a read of the row of its own.
    if constexpr (kTop) {
      if (top_k > 0) {
        for (int64_t i = tid; i < nvec; i += kThreads) {
          Vec<TL> in;
          in.raw = __ldcg(&xv[i].raw);
#pragma unroll
          for (int k = 0; k < kVec; ++k) offer_top(z_of(ToF(in.v[k]), i * kVec + k), i * kVec + k);
        }
        for (int64_t j = tail_start + tid; j < p.v; j += kThreads) offer_top(z_of(ToF(x[j]), j), j);
        write_top_k();
      }
    }
    return;
  }
  TG* g = grad + row * ldg;
  using Out = OutVec<TG, kVec>;
  Out* gv = reinterpret_cast<Out*>(g);
  // g_j = p_j (1 + 2 z_loss lse) - (1 - eps) [j == y] - eps / V, times dz/dx = 1 - (z/cap)^2.
  const loss::GradFactors factors = loss::GradFactorsOf(p.loss, lse, static_cast<float>(p.v));
  const float scale = p.grad_scale != nullptr ? *p.grad_scale : 1.0f;
  auto grad_of = [&](float xval, int64_t j) -> float {
    if (!valid) return 0.0f;
    if constexpr (kTerms) {
      return TermsLogitGrad(SharedTermFactors(), cap, z_of(xval, j), lse, j == t) * scale;
    }
    const float z = cap(xval);
    float gj = loss::LogitGrad(factors, loss::Exp(z - lse), j == t);
    if (cap.cap > 0.0f) gj *= loss::SoftcapSlope(z * cap.inv_cap);
    return gj * scale;
  };
  // When TG is narrower than TL the gradient of element j lands on bytes of an element <= j that
  // another thread may not have read yet in this tile: read the tile, barrier, then write.
  constexpr bool kNarrowing = sizeof(TG) < sizeof(TL);
  // Pass 1 ended at the row's end, so its last tiles are the likeliest still in L2: without
  // narrowing (each thread overwrites exactly what it read) walk the row backwards. Narrowing
  // writes land on lower addresses, which must not have been read yet: forwards only.
  constexpr bool kReverse = !kNarrowing;
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * kUnroll;
  const int64_t ntiles = (nvec + kTile - 1) / kTile;
  for (int64_t k = 0; k < ntiles; ++k) {
    const int64_t base = (kReverse ? ntiles - 1 - k : k) * kTile;
    Vec<TL> in[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + tid + static_cast<int64_t>(u) * kThreads;
      in[u].raw = make_uint4(0, 0, 0, 0);
      if (i < nvec && valid) in[u].raw = __ldcs(&xv[i].raw);
    }
    Out out[kUnroll];
    // Whether a value of the tile reaches the top-k's bound: a compare per value here, and the
    // rare offers (a call) in a loop of their own, off this one's schedule.
    [[maybe_unused]] bool top_hit = false;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + tid + static_cast<int64_t>(u) * kThreads;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float xval = ToF(in[u].v[k]);
        if constexpr (kTop) top_hit |= i < nvec && z_of(xval, i * kVec + k) >= top_bound;
        out[u].v[k] = FromF<TG>(valid ? grad_of(xval, i * kVec + k) : 0.0f);
      }
    }
    if constexpr (kTop) {
      // Before this tile's stores: G may overwrite the logits in place.
      if (top_hit && top_k > 0) {
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = base + tid + static_cast<int64_t>(u) * kThreads;
          if (i >= nvec) break;
          for (int k = 0; k < kVec; ++k)
            offer_top(z_of(ToF(x[i * kVec + k]), i * kVec + k), i * kVec + k);
        }
      }
    }
    if constexpr (kNarrowing) __syncthreads();
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + tid + static_cast<int64_t>(u) * kThreads;
      if (i < nvec) StoreStreaming(&gv[i], out[u]);
    }
  }
  // Tail (v % kVec < kThreads elements): same read-barrier-write discipline.
  const int64_t j = tail_start + tid;
  float gt = 0.0f;
  if (j < p.v && valid) {
    gt = grad_of(ToF(x[j]), j);
    if constexpr (kTop) {
      if (top_k > 0) offer_top(z_of(ToF(x[j]), j), j);
    }
  }
  if constexpr (kNarrowing) __syncthreads();
  if (j < p.v) g[j] = FromF<TG>(gt);
  if constexpr (kTop) {
    if (top_k > 0) write_top_k();
  }
}

template <typename TL, typename TG, int kThreads, RowExtras kExtras, bool kTerms,
          bool kStats = false>
absl::Status LaunchWithThreads(const TL* logits, int64_t ldl, int64_t rows, const int32_t* targets,
                               const SoftmaxGradParams& params, TG* grad, int64_t ldg,
                               float* row_loss, float* per_token_loss, float* per_token_lse,
                               const RowLaunch& launch, cudaStream_t stream,
                               const RowOutputs& outputs, const RowTerms& terms) {
  auto* kernel = &SoftmaxGradKernel<TL, TG, kThreads, kExtras, kTerms, kStats>;
  // The kernel needs no dynamic shared memory: asking for some only caps how many rows an SM
  // holds at once, so that the rows in flight fit in L2 for the second pass.
  size_t smem = 0;
  if (launch.blocks_per_sm > 0 && launch.smem_per_sm > 0) {
    smem = launch.smem_per_sm / (launch.blocks_per_sm + 1) + 1024;
    LOSSHEAD_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem)));
  }
  kernel<<<static_cast<unsigned>(rows), kThreads, smem, stream>>>(
      logits, ldl, targets, params, grad, ldg, row_loss, per_token_loss, per_token_lse, outputs,
      terms);
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

// The instantiation for the outputs asked for (RowOutputs) and the terms (RowTerms). The terms
// carry the distribution's state already, so with them the outputs short of the top-k share it.
template <typename TL, typename TG, int kThreads, bool kTerms, bool kStats>
absl::Status LaunchForOutputs(const TL* logits, int64_t ldl, int64_t rows, const int32_t* targets,
                              const SoftmaxGradParams& params, TG* grad, int64_t ldg,
                              float* row_loss, float* per_token_loss, float* per_token_lse,
                              const RowLaunch& launch, cudaStream_t stream,
                              const RowOutputs& outputs, const RowTerms& terms) {
  if (outputs.TopK()) {
    return LaunchWithThreads<TL, TG, kThreads, RowExtras::kTopK, kTerms, kStats>(
        logits, ldl, rows, targets, params, grad, ldg, row_loss, per_token_loss, per_token_lse,
        launch, stream, outputs, terms);
  }
  if (outputs.Any() || kTerms) {
    return LaunchWithThreads<TL, TG, kThreads, RowExtras::kDistribution, kTerms, kStats>(
        logits, ldl, rows, targets, params, grad, ldg, row_loss, per_token_loss, per_token_lse,
        launch, stream, outputs, terms);
  }
  return LaunchWithThreads<TL, TG, kThreads, RowExtras::kNone, false, kStats>(
      logits, ldl, rows, targets, params, grad, ldg, row_loss, per_token_loss, per_token_lse,
      launch, stream, {}, {});
}

template <typename TL, typename TG, int kThreads>
absl::Status LaunchForTerms(const TL* logits, int64_t ldl, int64_t rows, const int32_t* targets,
                            const SoftmaxGradParams& params, TG* grad, int64_t ldg, float* row_loss,
                            float* per_token_loss, float* per_token_lse, const RowLaunch& launch,
                            cudaStream_t stream, const RowOutputs& outputs, const RowTerms& terms) {
  if (terms.Any()) {
    return LaunchForOutputs<TL, TG, kThreads, true, false>(
        logits, ldl, rows, targets, params, grad, ldg, row_loss, per_token_loss, per_token_lse,
        launch, stream, outputs, terms);
  }
  // The statistics come from bf16 logits only (CheckTileStats): no other instantiation needs them.
  if constexpr (std::is_same_v<TL, __nv_bfloat16>) {
    if (params.tile_stats != nullptr) {
      return LaunchForOutputs<TL, TG, kThreads, false, true>(
          logits, ldl, rows, targets, params, grad, ldg, row_loss, per_token_loss, per_token_lse,
          launch, stream, outputs, {});
    }
  }
  return LaunchForOutputs<TL, TG, kThreads, false, false>(
      logits, ldl, rows, targets, params, grad, ldg, row_loss, per_token_loss, per_token_lse,
      launch, stream, outputs, {});
}

// The statistics stand for bf16 logits as they are: only a loss that takes them so may use them.
template <typename TL>
absl::Status CheckTileStats(const SoftmaxGradParams& params, const RowTerms& terms) {
  if (params.tile_stats == nullptr) return absl::OkStatus();
  if (!std::is_same_v<TL, __nv_bfloat16>) {
    return absl::InvalidArgumentError("tile statistics come with bf16 logits only");
  }
  if (terms.Any() || params.loss.softcap != 0.0f || params.loss.label_smoothing != 0.0f) {
    return absl::InvalidArgumentError(
        "tile statistics serve only a loss of the logits as they are: no soft-cap, label "
        "smoothing or terms");
  }
  if (params.stats_width < 0 || params.stats_width > params.v ||
      params.stats_ld < LogitsTileCount(params.stats_width)) {
    return absl::InvalidArgumentError(absl::StrCat("tile statistics of width ", params.stats_width,
                                                   " and stride ", params.stats_ld,
                                                   " do not fit rows of ", params.v, " logits"));
  }
  return absl::OkStatus();
}

}  // namespace

template <typename TL, typename TG>
absl::Status LaunchSoftmaxGrad(const TL* logits, int64_t ldl, int64_t rows, const int32_t* targets,
                               const SoftmaxGradParams& params, TG* grad, int64_t ldg,
                               float* row_loss, float* per_token_loss, float* per_token_lse,
                               const RowLaunch& launch, cudaStream_t stream,
                               const RowOutputs& outputs, const RowTerms& terms) {
  if (rows <= 0) return absl::OkStatus();
  LOSSHEAD_RETURN_IF_ERROR(CheckTileStats<TL>(params, terms));
  if (launch.threads == 512) {
    return LaunchForTerms<TL, TG, 512>(logits, ldl, rows, targets, params, grad, ldg, row_loss,
                                       per_token_loss, per_token_lse, launch, stream, outputs,
                                       terms);
  }
  if (launch.threads == 1024) {
    return LaunchForTerms<TL, TG, 1024>(logits, ldl, rows, targets, params, grad, ldg, row_loss,
                                        per_token_loss, per_token_lse, launch, stream, outputs,
                                        terms);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("row kernel threads must be 512 or 1024, got ", launch.threads));
}

#define LOSSHEAD_INSTANTIATE(TL, TG)                                                               \
  template absl::Status LaunchSoftmaxGrad<TL, TG>(                                                 \
      const TL*, int64_t, int64_t, const int32_t*, const SoftmaxGradParams&, TG*, int64_t, float*, \
      float*, float*, const RowLaunch&, cudaStream_t, const RowOutputs&, const RowTerms&);
LOSSHEAD_INSTANTIATE(float, float)
LOSSHEAD_INSTANTIATE(float, __nv_bfloat16)
LOSSHEAD_INSTANTIATE(float, __half)
LOSSHEAD_INSTANTIATE(__nv_bfloat16, __nv_bfloat16)
#undef LOSSHEAD_INSTANTIATE

}  // namespace losshead::kernels::cuda
