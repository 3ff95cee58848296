#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/cuda_check.h"
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

struct RowStats {
  float m;   // running max of z
  float s;   // sum of exp(z - m)
  float sz;  // sum of z
  float zt;  // z of the target: at most one thread holds it, so the sum over threads is exact
};

__device__ __forceinline__ RowStats Combine(RowStats a, RowStats b) {
  // A thread that saw no element has m = -inf and s = 0; exp(-inf - -inf) would be NaN.
  if (a.s == 0.0f) return {b.m, b.s, a.sz + b.sz, a.zt + b.zt};
  if (b.s == 0.0f) return {a.m, a.s, a.sz + b.sz, a.zt + b.zt};
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m), a.sz + b.sz, a.zt + b.zt};
}

template <typename TL>
__global__ void __launch_bounds__(kThreads)
    ShardStatsKernel(const TL* logits, int64_t ldl, const int32_t* __restrict__ targets,
                     ShardRowParams p, float* __restrict__ stats, int64_t stride) {
  constexpr int kVec = Vec<TL>::kSize;
  __shared__ RowStats warp_states[kThreads / 32];
  const int64_t q = blockIdx.x;
  const int tid = threadIdx.x;
  const TL* x = logits + q * ldl;
  const int64_t t = targets[q];
  // The target's local column, or -1 when it is another shard's row or the token is ignored
  // (ignore_index may be a real class id).
  const int64_t local =
      t != p.ignore_index && t >= p.row_begin && t < p.row_begin + p.rows ? t - p.row_begin : -1;
  const Cap cap{p.softcap, p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f};
  const int64_t nvec = p.rows / kVec;
  const Vec<TL>* xv = reinterpret_cast<const Vec<TL>*>(x);

  RowStats st{-INFINITY, 0.0f, 0.0f, 0.0f};
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
        float z[kVec];
        float vmax = -INFINITY;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          z[k] = cap(ToF(in[u].v[k]));
          vmax = fmaxf(vmax, z[k]);
          if (i * kVec + k == local) st.zt = z[k];
        }
        if (vmax > st.m) {
          st.s *= __expf(st.m - vmax);
          st.m = vmax;
        }
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          st.s += __expf(z[k] - st.m);
          st.sz += z[k];
        }
      }
    }
  }
  for (int64_t j = nvec * kVec + tid; j < p.rows; j += kThreads) {
    const float z = cap(ToF(x[j]));
    if (j == local) st.zt = z;
    if (z > st.m) {
      st.s *= __expf(st.m - z);
      st.m = z;
    }
    st.s += __expf(z - st.m);
    st.sz += z;
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    RowStats o;
    o.m = __shfl_down_sync(0xffffffffu, st.m, offset);
    o.s = __shfl_down_sync(0xffffffffu, st.s, offset);
    o.sz = __shfl_down_sync(0xffffffffu, st.sz, offset);
    o.zt = __shfl_down_sync(0xffffffffu, st.zt, offset);
    st = Combine(st, o);
  }
  if (tid % 32 == 0) warp_states[tid / 32] = st;
  __syncthreads();
  if (tid == 0) {
    RowStats total = warp_states[0];
    for (int w = 1; w < kThreads / 32; ++w) total = Combine(total, warp_states[w]);
    stats[q] = total.m;
    stats[stride + q] = total.s;
    stats[2 * stride + q] = total.sz;
    stats[3 * stride + q] = total.zt;
  }
}

template <typename TL, typename TG>
__global__ void __launch_bounds__(kThreads)
    ShardGradKernel(const TL* logits, int64_t ldl, const int32_t* __restrict__ targets,
                    ShardRowParams p, const float* __restrict__ stats, int64_t stride, int shards,
                    TG* grad, int64_t ldg, float* __restrict__ row_loss,
                    float* __restrict__ per_token_loss, float* __restrict__ per_token_lse) {
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
      if (s > 0.0f) sum_exp += static_cast<double>(s) * exp(static_cast<double>(slice[q]) - max_z);
      sum_z += slice[2 * stride + q];
      z_target += slice[3 * stride + q];
    }
    const double lse = max_z + log(sum_exp);
    double loss = 0.0;
    if (valid) {
      const double eps = p.label_smoothing;
      loss = (1.0 - eps) * (lse - z_target) + eps * (lse - sum_z / static_cast<double>(p.v)) +
             static_cast<double>(p.z_loss) * lse * lse;
    }
    row_loss[q] = static_cast<float>(loss);
    if (per_token_loss != nullptr) per_token_loss[q] = static_cast<float>(loss);
    if (per_token_lse != nullptr) per_token_lse[q] = static_cast<float>(lse);
    shared_lse = static_cast<float>(lse);
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
  const Cap cap{p.softcap, p.softcap > 0.0f ? 1.0f / p.softcap : 0.0f};
  const int64_t local =
      valid && t >= p.row_begin && t < p.row_begin + p.rows ? t - p.row_begin : -1;
  // g_j = p_j (1 + 2 z_loss lse) - eps / V - (1 - eps) [j == y], times dz/dx = 1 - (z/cap)^2,
  // with the whole vocabulary's lse and V. z is recomputed from x exactly as the statistics
  // pass computed it.
  const float coef = 1.0f + 2.0f * p.z_loss * lse;
  const float eps_v = p.label_smoothing / static_cast<float>(p.v);
  const float hit = 1.0f - p.label_smoothing;
  const float scale = p.grad_scale != nullptr ? *p.grad_scale : 1.0f;
  auto grad_of = [&](float xval, int64_t j) -> float {
    const float z = cap(xval);
    float gj = __expf(z - lse) * coef - eps_v - (j == local ? hit : 0.0f);
    if (cap.cap > 0.0f) {
      const float r = z * cap.inv_cap;
      gj *= 1.0f - r * r;
    }
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

}  // namespace

template <typename TL>
absl::Status LaunchShardStats(const TL* logits, int64_t ldl, int64_t tokens, const int32_t* targets,
                              const ShardRowParams& p, float* stats, int64_t stride,
                              cudaStream_t stream) {
  if (tokens <= 0) return absl::OkStatus();
  ShardStatsKernel<TL><<<static_cast<unsigned>(tokens), kThreads, 0, stream>>>(logits, ldl, targets,
                                                                               p, stats, stride);
  LOSSHEAD_CUDA_CHECK_LAUNCH();
  return absl::OkStatus();
}

template <typename TL, typename TG>
absl::Status LaunchShardGrad(const TL* logits, int64_t ldl, int64_t tokens, const int32_t* targets,
                             const ShardRowParams& p, const float* stats, int64_t stride,
                             int shards, TG* grad, int64_t ldg, float* row_loss,
                             float* per_token_loss, float* per_token_lse, cudaStream_t stream) {
  if (tokens <= 0) return absl::OkStatus();
  ShardGradKernel<TL, TG><<<static_cast<unsigned>(tokens), kThreads, 0, stream>>>(
      logits, ldl, targets, p, stats, stride, shards, grad, ldg, row_loss, per_token_loss,
      per_token_lse);
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
                                              const ShardRowParams&, float*, int64_t, cudaStream_t);
template absl::Status LaunchShardStats<__nv_bfloat16>(const __nv_bfloat16*, int64_t, int64_t,
                                                      const int32_t*, const ShardRowParams&, float*,
                                                      int64_t, cudaStream_t);

#define LOSSHEAD_INSTANTIATE_GRAD(TL, TG)                                                        \
  template absl::Status LaunchShardGrad<TL, TG>(                                                 \
      const TL*, int64_t, int64_t, const int32_t*, const ShardRowParams&, const float*, int64_t, \
      int, TG*, int64_t, float*, float*, float*, cudaStream_t);
LOSSHEAD_INSTANTIATE_GRAD(float, float)
LOSSHEAD_INSTANTIATE_GRAD(float, __nv_bfloat16)
LOSSHEAD_INSTANTIATE_GRAD(float, __half)
LOSSHEAD_INSTANTIATE_GRAD(__nv_bfloat16, __nv_bfloat16)
#undef LOSSHEAD_INSTANTIATE_GRAD

template absl::Status LaunchRoundToDType<__nv_bfloat16>(const float*, __nv_bfloat16*, int64_t,
                                                        cudaStream_t);
template absl::Status LaunchRoundToDType<__half>(const float*, __half*, int64_t, cudaStream_t);

}  // namespace losshead::kernels::cuda
