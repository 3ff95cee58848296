// The reductions of every CUDA kernel, written once: warp shuffles, the warp and block reductions
// built on them, and the online softmax's state with its per-element update and its combine. No
// other kernel file calls __shfl_*.
//
// Invariants:
// - Every reduction has one fixed shape, so a rerun gives the same bits: a warp reduces by
//   shuffling down (or, for WarpAllReduce, by butterfly) with offsets 16, 8, 4, 2, 1, each step
//   op(mine, theirs); a block then folds its warps' results in warp order in one thread.
// - All 32 lanes of every warp that calls a warp or block reduction take part (full mask), and a
//   block reduction is called by all kThreads threads of the block (it holds a barrier).
// - The online softmax state of a thread that saw no element is {m = -inf, s = 0}; Combine skips
//   such a side instead of forming exp(-inf - -inf).
// - Everything here is __forceinline__: a kernel compiles to what it did with the loops written
//   out in it.
#ifndef LOSSHEAD_KERNELS_CUDA_REDUCE_CUH_
#define LOSSHEAD_KERNELS_CUDA_REDUCE_CUH_

#include <cuda_runtime.h>

#include "kernels/common/loss_math.h"

namespace losshead::kernels::cuda {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullWarp = 0xffffffffu;

// The reduction operators: op(mine, theirs).
struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T mine, T theirs) const {
    return mine + theirs;
  }
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float mine, float theirs) const {
    return fmaxf(mine, theirs);
  }
};

// --- Shuffles ------------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ T ShflDown(T x, int offset) {
  return __shfl_down_sync(kFullWarp, x, offset);
}

template <typename T>
__device__ __forceinline__ T ShflXor(T x, int offset) {
  return __shfl_xor_sync(kFullWarp, x, offset);
}

// --- The online softmax --------------------------------------------------------------------------

// A row's (or a thread's part of a row's) running statistics over z: max m, sum of exp(z - m),
// sum of z (label smoothing) and, with kTarget, z of the target (at most one thread holds it, so
// the sum over threads is exact).
template <bool kTarget>
struct SoftmaxState;

// Trivial types (they live in __shared__ arrays): a thread starts from Empty().
template <>
struct SoftmaxState<false> {
  float m, s, sz;
  __device__ __forceinline__ static SoftmaxState Empty() { return {-INFINITY, 0.0f, 0.0f}; }
};

template <>
struct SoftmaxState<true> {
  float m, s, sz, zt;
  __device__ __forceinline__ static SoftmaxState Empty() { return {-INFINITY, 0.0f, 0.0f, 0.0f}; }
};

// Takes in the kVec values of one vector, z_k = to_z(k): the max moves once per vector, then each
// exp is taken against it.
template <int kVec, bool kTarget, typename ToZ>
__device__ __forceinline__ void PushVector(SoftmaxState<kTarget>& st, ToZ to_z) {
  float z[kVec];
  float vmax = -INFINITY;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    z[k] = to_z(k);
    vmax = fmaxf(vmax, z[k]);
  }
  if (vmax > st.m) {
    st.s *= loss::Exp(st.m - vmax);
    st.m = vmax;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    st.s += loss::Exp(z[k] - st.m);
    st.sz += z[k];
  }
}

// Takes in one value z.
template <bool kTarget>
__device__ __forceinline__ void Push(SoftmaxState<kTarget>& st, float z) {
  if (z > st.m) {
    st.s *= loss::Exp(st.m - z);
    st.m = z;
  }
  st.s += loss::Exp(z - st.m);
  st.sz += z;
}

// The state {m, s} with the sums of a and b.
template <bool kTarget>
__device__ __forceinline__ SoftmaxState<kTarget> WithSums(float m, float s, SoftmaxState<kTarget> a,
                                                          SoftmaxState<kTarget> b) {
  if constexpr (kTarget) {
    return {m, s, a.sz + b.sz, a.zt + b.zt};
  } else {
    return {m, s, a.sz + b.sz};
  }
}

template <bool kTarget>
__device__ __forceinline__ SoftmaxState<kTarget> Combine(SoftmaxState<kTarget> a,
                                                         SoftmaxState<kTarget> b) {
  if (a.s == 0.0f) return WithSums(b.m, b.s, a, b);
  if (b.s == 0.0f) return WithSums(a.m, a.s, a, b);
  const float m = fmaxf(a.m, b.m);
  return WithSums(m, loss::Rescaled(a.s, a.m, m) + loss::Rescaled(b.s, b.m, m), a, b);
}

struct CombineOp {
  template <bool kTarget>
  __device__ __forceinline__ SoftmaxState<kTarget> operator()(SoftmaxState<kTarget> mine,
                                                              SoftmaxState<kTarget> theirs) const {
    return Combine(mine, theirs);
  }
};

template <bool kTarget>
__device__ __forceinline__ SoftmaxState<kTarget> ShflDown(SoftmaxState<kTarget> st, int offset) {
  SoftmaxState<kTarget> o;
  o.m = ShflDown(st.m, offset);
  o.s = ShflDown(st.s, offset);
  o.sz = ShflDown(st.sz, offset);
  if constexpr (kTarget) o.zt = ShflDown(st.zt, offset);
  return o;
}

// --- Warp and block reductions -------------------------------------------------------------------

// op over the warp's 32 values; the result is valid in lane 0.
template <typename T, typename Op>
__device__ __forceinline__ T WarpReduce(T x, Op op) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) x = op(x, ShflDown(x, offset));
  return x;
}

// op over the warp's 32 values by butterfly; the result is valid in every lane.
template <typename T, typename Op>
__device__ __forceinline__ T WarpAllReduce(T x, Op op) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) x = op(x, ShflXor(x, offset));
  return x;
}

// The first half of a block reduction: each warp's WarpReduce of x into slots[warp], then a
// barrier, after which any thread may read the kThreads / 32 slots.
template <int kThreads, typename T, typename Op>
__device__ __forceinline__ void ReduceToWarpSlots(T x, Op op, T* slots) {
  static_assert(kThreads % kWarpSize == 0, "whole warps only");
  x = WarpReduce(x, op);
  if (threadIdx.x % kWarpSize == 0) slots[threadIdx.x / kWarpSize] = x;
  __syncthreads();
}

// The second half, in one thread: acc op slots[first] op ... op slots[last warp], in warp order.
template <int kThreads, typename T, typename Op>
__device__ __forceinline__ T FoldWarpSlots(const T* slots, Op op, T acc, int first = 0) {
  for (int w = first; w < kThreads / kWarpSize; ++w) acc = op(acc, slots[w]);
  return acc;
}

// Both halves: init op (every warp's result, in warp order); the result is valid in thread 0 only.
template <int kThreads, typename T, typename Op>
__device__ __forceinline__ T BlockReduce(T x, Op op, T init) {
  __shared__ T slots[kThreads / kWarpSize];
  ReduceToWarpSlots<kThreads>(x, op, slots);
  T total = init;
  if (threadIdx.x == 0) total = FoldWarpSlots<kThreads>(slots, op, init);
  return total;
}

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_REDUCE_CUH_
