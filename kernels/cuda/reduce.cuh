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
// - Everything here is __forceinline__ (but TopKList::Insert, the top-k's rare slow path): a
//   kernel compiles to what it did with the loops written out in it.
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
// the sum over threads is exact). With kDist (only for a call that asks for the distribution
// outputs, problem.h; the plain state and its code are unchanged by it) also
//   h        sum of ShiftedZTerm(exp(z - m), z - m), moved with m by RescaledShiftedZ, so that the
//            entropy is loss::Entropy(s, h)
//   am, ai   the argmax so far, its z and class id, in ArgmaxBeats' order (ai = kNoId if none)
template <bool kTarget, bool kDist = false>
struct SoftmaxState;

// The id of no class: larger than any, so that every real candidate beats it in a tie.
inline constexpr int kNoId = 0x7fffffff;

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

template <>
struct SoftmaxState<false, true> {
  float m, s, sz, h, am;
  int ai;
  __device__ __forceinline__ static SoftmaxState Empty() {
    return {-INFINITY, 0.0f, 0.0f, 0.0f, -INFINITY, kNoId};
  }
};

template <>
struct SoftmaxState<true, true> {
  float m, s, sz, zt, h, am;
  int ai;
  __device__ __forceinline__ static SoftmaxState Empty() {
    return {-INFINITY, 0.0f, 0.0f, 0.0f, 0.0f, -INFINITY, kNoId};
  }
};

// kDist's part of a push, before the max moves from st.m to max: the argmax takes in z (id), and
// h is re-expressed against the new max (an empty state's h stays 0: no exp(-inf) * -inf).
template <bool kTarget>
__device__ __forceinline__ void MoveShiftedZ(SoftmaxState<kTarget, true>& st, float max) {
  st.h = st.s > 0.0f ? loss::RescaledShiftedZ(st.h, st.s, st.m, max) : 0.0f;
}

template <bool kTarget>
__device__ __forceinline__ void PushArgmax(SoftmaxState<kTarget, true>& st, float z, int id) {
  if (loss::ArgmaxBeats(z, id, st.am, st.ai)) {
    st.am = z;
    st.ai = id;
  }
}

// Takes in the kVec values of one vector, z_k = to_z(k): the max moves once per vector, then each
// exp is taken against it. With kDist, value k is class first_id + k.
template <int kVec, bool kTarget, bool kDist, typename ToZ>
__device__ __forceinline__ void PushVector(SoftmaxState<kTarget, kDist>& st, ToZ to_z,
                                           int64_t first_id = 0) {
  float z[kVec];
  float vmax = -INFINITY;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    z[k] = to_z(k);
    vmax = fmaxf(vmax, z[k]);
    if constexpr (kDist) PushArgmax(st, z[k], static_cast<int>(first_id) + k);
  }
  if (vmax > st.m) {
    if constexpr (kDist) MoveShiftedZ(st, vmax);
    st.s *= loss::Exp(st.m - vmax);
    st.m = vmax;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    if constexpr (kDist) {
      const float shifted = z[k] - st.m;
      const float e = loss::Exp(shifted);
      st.s += e;
      st.h += loss::ShiftedZTerm(e, shifted);
    } else {
      st.s += loss::Exp(z[k] - st.m);
    }
    st.sz += z[k];
  }
}

// Takes in one value z (with kDist, of class id).
template <bool kTarget, bool kDist>
__device__ __forceinline__ void Push(SoftmaxState<kTarget, kDist>& st, float z, int64_t id = 0) {
  if constexpr (kDist) PushArgmax(st, z, static_cast<int>(id));
  if (z > st.m) {
    if constexpr (kDist) MoveShiftedZ(st, z);
    st.s *= loss::Exp(st.m - z);
    st.m = z;
  }
  if constexpr (kDist) {
    const float shifted = z - st.m;
    const float e = loss::Exp(shifted);
    st.s += e;
    st.h += loss::ShiftedZTerm(e, shifted);
  } else {
    st.s += loss::Exp(z - st.m);
  }
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

// kDist's combine: the plain statistics as above, h as s is (each side moved to the common max),
// the argmax by ArgmaxBeats.
template <bool kTarget>
__device__ __forceinline__ SoftmaxState<kTarget, true> Combine(SoftmaxState<kTarget, true> a,
                                                               SoftmaxState<kTarget, true> b) {
  SoftmaxState<kTarget, true> r;
  if (a.s == 0.0f) {
    r.m = b.m;
    r.s = b.s;
    r.h = b.h;
  } else if (b.s == 0.0f) {
    r.m = a.m;
    r.s = a.s;
    r.h = a.h;
  } else {
    r.m = fmaxf(a.m, b.m);
    r.s = loss::Rescaled(a.s, a.m, r.m) + loss::Rescaled(b.s, b.m, r.m);
    r.h = loss::RescaledShiftedZ(a.h, a.s, a.m, r.m) + loss::RescaledShiftedZ(b.h, b.s, b.m, r.m);
  }
  r.sz = a.sz + b.sz;
  if constexpr (kTarget) r.zt = a.zt + b.zt;
  const bool b_wins = loss::ArgmaxBeats(b.am, b.ai, a.am, a.ai);
  r.am = b_wins ? b.am : a.am;
  r.ai = b_wins ? b.ai : a.ai;
  return r;
}

struct CombineOp {
  template <bool kTarget, bool kDist>
  __device__ __forceinline__ SoftmaxState<kTarget, kDist> operator()(
      SoftmaxState<kTarget, kDist> mine, SoftmaxState<kTarget, kDist> theirs) const {
    return Combine(mine, theirs);
  }
};

template <bool kTarget, bool kDist>
__device__ __forceinline__ SoftmaxState<kTarget, kDist> ShflDown(SoftmaxState<kTarget, kDist> st,
                                                                 int offset) {
  SoftmaxState<kTarget, kDist> o;
  o.m = ShflDown(st.m, offset);
  o.s = ShflDown(st.s, offset);
  o.sz = ShflDown(st.sz, offset);
  if constexpr (kTarget) o.zt = ShflDown(st.zt, offset);
  if constexpr (kDist) {
    o.h = ShflDown(st.h, offset);
    o.am = ShflDown(st.am, offset);
    o.ai = ShflDown(st.ai, offset);
  }
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

// The log-sum-exp of 256 values held 8 per lane (-inf: no value), the same in every lane: the
// largest, plus the log of the sum of exp(v - largest) taken as exp2f(v log2 e - largest log2 e).
// A row's statistics per 256 columns of the logits (logits_gemm_sm90.cuh) are this of each tile:
// one float, where the largest and the sum apart would take two.
__device__ __forceinline__ float WarpTileLse(const float (&v)[8]) {
  constexpr float kLog2e = 1.4426950408889634f;
  float largest = -INFINITY;
#pragma unroll
  for (int i = 0; i < 8; ++i) largest = fmaxf(largest, v[i]);
  largest = WarpAllReduce(largest, MaxOp{});
  const float shift = largest * kLog2e;
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += v[i] == -INFINITY ? 0.0f : exp2f(fmaf(v[i], kLog2e, -shift));
  return largest + logf(WarpAllReduce(sum, SumOp{}));
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

// --- Top-k ---------------------------------------------------------------------------------------

// A candidate of the top-k (and argmax) order: z and class id, compared by ArgmaxBeats.
struct Candidate {
  float z;
  int id;
};

struct BestOp {
  __device__ __forceinline__ Candidate operator()(Candidate mine, Candidate theirs) const {
    return loss::ArgmaxBeats(theirs.z, theirs.id, mine.z, mine.id) ? theirs : mine;
  }
};

__device__ __forceinline__ Candidate ShflDown(Candidate c, int offset) {
  return {ShflDown(c.z, offset), ShflDown(c.id, offset)};
}

__device__ __forceinline__ Candidate ShflXor(Candidate c, int offset) {
  return {ShflXor(c.z, offset), ShflXor(c.id, offset)};
}

// A thread's best k candidates (k <= kMaxTopK, given at run time), best first. The caller keeps
// the k-th (`last`, from Empty and Insert) in a register and calls Insert only for a candidate
// that beats it: the list itself lives in local memory (L1), written only there. Offered every
// value of a row, a thread inserts about k (1 + ln(values / k)) times, each a divergent branch of
// its warp: the row kernel offers only the values at or above a bound (BlockKthBest), about k. The
// order is total (ArgmaxBeats), so the list does not depend on the order of the offers.
struct TopKList {
  float z[kMaxTopK];
  int id[kMaxTopK];

  __device__ __forceinline__ static Candidate Empty(TopKList& list) {
    for (int i = 0; i < kMaxTopK; ++i) {
      list.z[i] = -INFINITY;
      list.id[i] = kNoId;
    }
    return {-INFINITY, kNoId};
  }

  // Inserts c into the first k entries (c beats the k-th); returns the new k-th. Not inlined:
  // unrolled at every offer of a row kernel's loads it would take the registers of its loop.
  __device__ __noinline__ Candidate Insert(Candidate c, int k) {
    for (int i = 0; i < k; ++i) {
      if (loss::ArgmaxBeats(c.z, c.id, z[i], id[i])) {
        const Candidate displaced{z[i], id[i]};
        z[i] = c.z;
        id[i] = c.id;
        c = displaced;
      }
    }
    return {z[k - 1], id[k - 1]};
  }

  // Drops the best candidate.
  __device__ __forceinline__ void Pop() {
    for (int i = 0; i + 1 < kMaxTopK; ++i) {
      z[i] = z[i + 1];
      id[i] = id[i + 1];
    }
    z[kMaxTopK - 1] = -INFINITY;
    id[kMaxTopK - 1] = kNoId;
  }
};

// Offers (z, id) to `list`, whose k-th is `last`.
__device__ __forceinline__ void OfferTopK(TopKList& list, Candidate& last, float z, int id, int k) {
  if (loss::ArgmaxBeats(z, id, last.z, last.id)) last = list.Insert({z, id}, k);
}

// The block's best k (k <= kMaxTopK) of every thread's candidates, best first, into best[0, k)
// (shared memory, valid in every thread on return; {-inf, kNoId} past the last candidate).
// head() is the thread's best remaining candidate and pop() drops it; ids are unique over the
// block. Each warp first finds its own best k by k rounds of a warp all-reduce over its lanes'
// heads, with no barrier; then warp 0 merges the warps' sorted lists, k rounds over their heads:
// two barriers in all, where k rounds of a block reduction would take 2k. The order is total
// (BestOp), so the result does not depend on the order of the candidates. Called by all kThreads
// threads.
template <int kThreads, typename Head, typename Pop>
__device__ __forceinline__ void BlockBestK(Head head, Pop pop, int k, Candidate* best) {
  constexpr int kWarps = kThreads / kWarpSize;
  static_assert(kWarps <= kWarpSize, "warp 0 merges one list per lane");
  __shared__ Candidate warp_best[kWarps][kMaxTopK];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  constexpr Candidate kNone{-INFINITY, kNoId};
  for (int r = 0; r < k; ++r) {
    const Candidate mine = head();
    const Candidate w = WarpAllReduce(mine, BestOp{});
    if (lane == 0) warp_best[warp][r] = w;
    if (w.id != kNoId && mine.id == w.id) pop();
  }
  __syncthreads();
  if (warp == 0) {
    int at = 0;  // lane l < kWarps: the head of warp l's list
    for (int r = 0; r < k; ++r) {
      const Candidate mine = lane < kWarps && at < k ? warp_best[lane][at] : kNone;
      const Candidate w = WarpAllReduce(mine, BestOp{});
      if (lane == 0) best[r] = w;
      if (w.id != kNoId && mine.id == w.id) ++at;
    }
  }
  __syncthreads();
}

// The block's best k of every thread's list, into best[0, k) as BlockBestK says. Empties the
// lists.
template <int kThreads>
__device__ __forceinline__ void BlockTopK(TopKList& list, int k, Candidate* best) {
  BlockBestK<kThreads>(
      [&] {
        return Candidate{list.z[0], list.id[0]};
      },
      [&] { list.Pop(); }, k, best);
}

// The k-th best of the block's candidates, one per thread (`mine`: ids unique over the block, or
// kNoId for none), valid in every thread on return. With each thread's own best as `mine` it
// bounds a row's top-k from below: the k candidates at or above it are k elements of the row, so
// each of the row's k best is at or above it too. {-inf, kNoId} where fewer than k threads have
// one. Called by all kThreads threads.
template <int kThreads>
__device__ __forceinline__ Candidate BlockKthBest(Candidate mine, int k) {
  __shared__ Candidate best[kMaxTopK];
  BlockBestK<kThreads>([&] { return mine; }, [&] { mine = Candidate{-INFINITY, kNoId}; }, k, best);
  return best[k - 1];
}

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_REDUCE_CUH_
