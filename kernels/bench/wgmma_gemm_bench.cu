// losshead_wgmma_bench: a GEMM of our own on Hopper's bulk tensor copies (TMA) and warpgroup
// matrix instructions (wgmma), against cuBLASLt on the fused call's logits shape. The first piece
// of a fused kernel (docs/benchmarks/kernels.md, "The GEMMs at the power limit": the logits' trips
// through memory are what is left), measured alone before anything is built on it.
//
// C (M x N, row-major, bf16) = A (M x K, row-major) . B (N x K, row-major)^T, bf16 inputs, fp32
// sums: the logits GEMM with A = H (tokens x D) and B = W (V x D). One persistent block per SM
// walks 128 x 256 tiles of C, M fastest (the blocks in flight share a slice of B, and A stays in
// L2). In a block, one warpgroup's one thread loads 128 x 64 and 256 x 64 slices of A and B into a
// ring of shared memory (128-byte swizzle, completion on the stage's "full" barrier); two
// warpgroups of consumers each multiply 64 rows of the A slice by the B slice (m64n256k16, fp32
// accumulators in registers), release the stage on its "empty" barrier once their instructions
// have read it, and after the last k slice write their rows of C. Two epilogues (Epilogue): each
// thread storing its accumulators to global memory (a four-stage ring), or the rows staged in
// shared memory and written by bulk tensor stores that the warpgroup does not wait for (a
// three-stage ring, to make room): the second keeps the tensor cores' idle time per tile to the
// staging, and is what matched cuBLASLt (docs/benchmarks/kernels.md, "Our own GEMM"). On the
// second, each row's softmax statistics per 256 columns (its largest logit and the sum of exp
// over the rest), what a row kernel's first read of the logits computes: by the consumers
// before they move on (the tensor cores wait), or by the producer warpgroup's three idle warps
// from the staged tile while the consumers multiply the next one; checked against one read of
// C that computes them, timed beside it.
//
// Requires sm_90a (wgmma, setmaxnreg, bulk tensor copies); K and the row strides a multiple of 8
// elements (the tensor maps' 16-byte strides). Each shape is checked against cuBLASLt on the same
// inputs (relative L2 difference and the count of elements whose bits differ; the outputs
// poisoned with NaN before), then all three are timed in rounds (RoundsMedianMs, median of
// --runs).
//
//   losshead_wgmma_bench --shapes=4096:128256:4096,8192:8192:8192,1000:1032:520 --runs=20
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "kernels/bench/bench_util.h"
#include "kernels/bench/random_fill.cuh"
#include "kernels/bench/tensor_diff.cuh"
#include "kernels/cuda/head_gemms.h"
#include "kernels/cuda/lt_gemm.h"

namespace losshead::bench {
namespace {

constexpr int kBlockM = 128, kBlockN = 256, kBlockK = 64;
constexpr int kConsumers = 2;  // warpgroups of 64 rows each
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kStageABytes = kBlockM * kBlockK * 2;  // 16 KiB
constexpr int kStageBBytes = kBlockN * kBlockK * 2;  // 32 KiB
// How a tile of C leaves the block.
enum class Epilogue {
  kDirect,    // each thread stores its accumulators to global memory; the tensor cores wait
  kTmaStore,  // into shared memory, then one bulk tensor store per 64 x 64 box, not waited for:
              // the warpgroup starts its next tile while the copy engine writes this one
  kTmaStoreStats,  // kTmaStore, and each row's softmax statistics over the tile's 256 columns
                   // (RowTileStats): what a row kernel's first read of the logits computes
  kTmaStoreStatsAside,  // the same statistics, read from the staged tile by the producer
                        // warpgroup's three idle warps (StatsWarps) while the consumers
                        // multiply the next tile
};
__host__ __device__ constexpr bool Staged(Epilogue e) { return e != Epilogue::kDirect; }
// A consumer's staging of its 64 x 256 rows of C: four 64 x 64 boxes in the 128-byte swizzle.
constexpr int kStagingBytes = 64 * kBlockN * 2;  // 32 KiB
// The staging takes a stage of the ring: 3 x 48 + 2 x 32 KiB fit the 227 KiB a block may have.
template <Epilogue kEpilogue>
constexpr int kStages = Staged(kEpilogue) ? 3 : 4;
// The ring, the staging, the barriers, and room to align the ring to the 1024 bytes of a swizzle
// pattern.
template <Epilogue kEpilogue>
constexpr int kSmemBytes = kStages<kEpilogue> * (kStageABytes + kStageBBytes) +
                           (Staged(kEpilogue) ? kConsumers * kStagingBytes : 0) +
                           2 * kStages<kEpilogue> * 8 + 2 * kConsumers * 8 + 1024;

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void BarrierInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(SmemAddress(bar)), "r"(count));
}

__device__ __forceinline__ void BarrierExpectBytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SmemAddress(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void BarrierArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(SmemAddress(bar)) : "memory");
}

// Until the barrier's phase of this parity has completed.
__device__ __forceinline__ void BarrierWait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(SmemAddress(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
}

// The box of the 2-D tensor `map` whose first element is (inner, outer) into `dst`, its bytes
// counted on `bar`.
__device__ __forceinline__ void TmaLoad(void* dst, const CUtensorMap* map, uint64_t* bar, int inner,
                                        int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%3, %4}], [%2];" ::"r"(SmemAddress(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(SmemAddress(bar)), "r"(inner), "r"(outer)
      : "memory");
}

// The box of `map` whose first element is (inner, outer) from `src`, in this thread's bulk group.
__device__ __forceinline__ void TmaStore(const CUtensorMap* map, const void* src, int inner,
                                         int outer) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(SmemAddress(src)), "r"(inner), "r"(outer)
      : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until this thread's bulk stores have read their shared memory (kReadOnly), or are complete.
template <bool kReadOnly>
__device__ __forceinline__ void TmaStoreWait() {
  if constexpr (kReadOnly) {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

// Makes this thread's ordinary writes to shared memory visible to the bulk copies.
__device__ __forceinline__ void FenceToAsyncProxy() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The 128 threads of one warpgroup (named barrier `id`, 1 or more: 0 is __syncthreads').
__device__ __forceinline__ void WarpgroupSync(int id) {
  asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

// A wgmma operand in shared memory: K-major rows of 128 bytes in the 128-byte swizzle the tensor
// maps write, 8-row groups 1024 bytes apart. Stepping k by 16 elements moves the start by 32
// bytes; the hardware applies the swizzle to the address.
__device__ __forceinline__ uint64_t SmemDescriptor(const void* p) {
  const uint64_t address = SmemAddress(p);
  return ((address & 0x3FFFF) >> 4) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

__device__ __forceinline__ void WgmmaFence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving reads or writes of the accumulators across an asynchronous
// wgmma's issue or wait.
__device__ __forceinline__ void FenceAccumulators(float (&d)[128]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (64 x 256 fp32 per warpgroup) += A (smem, desc_a) . B^T (smem, desc_b), both K-major bf16;
// d is overwritten instead where scale_d is 0.
__device__ __forceinline__ void Wgmma64x256(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                            int scale_d) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
      "%127},"
      " %128, %129, p, 1, 1, 0, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// One consumer's 64 x 256 rows of C (its accumulators, `row0` the first row of this thread)
// written into its staging in the bulk copies' 128-byte swizzle: element (r, c) is in box c / 64,
// row r, 16-byte chunk (c % 64 / 8) ^ (r % 8). The four threads of a row fill one chunk and the
// eight rows of a store go to eight different chunks: no bank conflicts.
__device__ __forceinline__ void StageTile(const float (&d)[128], uint8_t* staging, int row0,
                                          int lane) {
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + half * 8;
      const int offset = j / 8 * (64 * 128) + r * 128 + ((j % 8) ^ (r % 8)) * 16 + lane % 4 * 4;
      *reinterpret_cast<__nv_bfloat162*>(staging + offset) =
          __floats2bfloat162_rn(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
    }
  }
}

// The statistics a row of logits x takes for its softmax, over one tile of 256 columns: the
// largest x and sum(exp(x - largest)), from x as stored (rounded to bf16), exp as exp2 of x log2 e.
constexpr int kStatsColumns = kBlockN;
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float AsStored(float x) {
  return __bfloat162float(__float2bfloat16_rn(x));
}

// A consumer's rows of one tile: this thread holds 64 of a row's 256 columns (its quad the rest)
// for rows row0 and row0 + 8; columns past n do not count. stats is M x tiles_n.
__device__ __forceinline__ void RowTileStats(const float (&d)[128], float2* stats, int m, int n,
                                             int row0, int n0, int tiles_n, int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float largest = -INFINITY;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      const int col = n0 + j * 8 + lane % 4 * 2;
      if (col < n) largest = fmaxf(largest, AsStored(d[4 * j + 2 * half]));
      if (col + 1 < n) largest = fmaxf(largest, AsStored(d[4 * j + 2 * half + 1]));
    }
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 1));
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, 2));
    const float shift = largest * kLog2e;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      const int col = n0 + j * 8 + lane % 4 * 2;
      if (col < n) sum += exp2f(fmaf(AsStored(d[4 * j + 2 * half]), kLog2e, -shift));
      if (col + 1 < n) sum += exp2f(fmaf(AsStored(d[4 * j + 2 * half + 1]), kLog2e, -shift));
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row0 + half * 8;
    if (lane % 4 == 0 && row < m) {
      stats[static_cast<int64_t>(row) * tiles_n + n0 / kStatsColumns] = make_float2(largest, sum);
    }
  }
}

// The same statistics by one read of C (M x n, row-major): a block per row, a warp per tile of
// 256 columns at a time, 16 bytes per lane. The reference the epilogue's are checked against,
// and the read of the logits they would save a row kernel (timed beside the GEMMs).
__global__ void __launch_bounds__(256) ReadRowTileStats(const __nv_bfloat16* c, int n,
                                                        int tiles_n, float2* stats) {
  const int row = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const __nv_bfloat16* x = c + static_cast<int64_t>(row) * n;
  for (int tile = warp; tile < tiles_n; tile += 8) {
    const int col = tile * kStatsColumns + lane * 8;
    float v[8];
    if (col + 8 <= n) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + col);
      const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = col + i < n ? __bfloat162float(x[col + i]) : -INFINITY;
    }
    float largest = -INFINITY;
#pragma unroll
    for (int i = 0; i < 8; ++i) largest = fmaxf(largest, v[i]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, o));
    const float shift = largest * kLog2e;
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += v[i] == -INFINITY ? 0.0f : exp2f(fmaf(v[i], kLog2e, -shift));
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) stats[static_cast<int64_t>(row) * tiles_n + tile] = make_float2(largest, sum);
  }
}

// One staged row of 256 columns (row r of a consumer's staging, first column n0) into its
// statistics, by one warp: lane l reads the 16-byte chunk of columns 8l to 8l + 7, as
// ReadRowTileStats does from global memory, so both sum in the same order.
__device__ __forceinline__ float2 StagedRowStats(const uint8_t* staging, int r, int n0, int n,
                                                 int lane) {
  const int box = lane / 8, chunk = lane % 8;
  const uint4 raw = *reinterpret_cast<const uint4*>(staging + box * (64 * 128) + r * 128 +
                                                    ((chunk ^ (r % 8)) * 16));
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  const int col = n0 + lane * 8;
  float v[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    v[2 * i] = col + 2 * i < n ? f.x : -INFINITY;
    v[2 * i + 1] = col + 2 * i + 1 < n ? f.y : -INFINITY;
  }
  float largest = -INFINITY;
#pragma unroll
  for (int i = 0; i < 8; ++i) largest = fmaxf(largest, v[i]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, o));
  const float shift = largest * kLog2e;
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) sum += v[i] == -INFINITY ? 0.0f : exp2f(fmaf(v[i], kLog2e, -shift));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  return make_float2(largest, sum);
}

// Largest |a.x - b.x| and largest |a.y - b.y| / b.y over `count` pairs, into out[0], out[1]
// (zeroed first; non-negative floats compare as their bits).
__global__ void StatsDiff(const float2* a, const float2* b, int64_t count, float* out) {
  float largest = 0.0f, rel = 0.0f;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    largest = fmaxf(largest, fabsf(a[i].x - b[i].x));
    rel = fmaxf(rel, fabsf(a[i].y - b[i].y) / b[i].y);
    if (a[i].x != a[i].x || a[i].y != a[i].y) rel = INFINITY;  // NaN: never written
  }
  atomicMax(reinterpret_cast<unsigned*>(&out[0]), __float_as_uint(largest));
  atomicMax(reinterpret_cast<unsigned*>(&out[1]), __float_as_uint(rel));
}

template <Epilogue kEpilogue>
__global__ void __launch_bounds__(kThreads, 1)
    GemmKernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
               const __grid_constant__ CUtensorMap map_c, __nv_bfloat16* c, float2* stats, int m,
               int n, int k, int64_t ldc) {
  constexpr int kRing = kStages<kEpilogue>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  auto* a_ring = reinterpret_cast<__nv_bfloat16*>(smem);
  auto* b_ring = reinterpret_cast<__nv_bfloat16*>(smem + kRing * kStageABytes);
  uint8_t* staging = smem + kRing * (kStageABytes + kStageBBytes);
  auto* full = reinterpret_cast<uint64_t*>(
      staging + (Staged(kEpilogue) ? kConsumers * kStagingBytes : 0));
  uint64_t* empty = full + kRing;
  // Per consumer: its tile is staged (its thread 0 arrives); the stats warps are done reading it
  // (each of the three arrives). kTmaStoreStatsAside only.
  uint64_t* staged = empty + kRing;
  uint64_t* released = staged + kConsumers;
  constexpr int kStatsWarps = 3;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRing; ++s) {
      BarrierInit(&full[s], 1);
      BarrierInit(&empty[s], kConsumers);
    }
    for (int c = 0; c < kConsumers; ++c) {
      BarrierInit(&staged[c], 1);
      BarrierInit(&released[c], kStatsWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int tiles_m = (m + kBlockM - 1) / kBlockM;
  const int tiles = tiles_m * ((n + kBlockN - 1) / kBlockN);
  const int k_blocks = (k + kBlockK - 1) / kBlockK;
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {  // the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (kEpilogue == Epilogue::kTmaStoreStatsAside && threadIdx.x >= 32) {  // the stats warps
      const int stats_warp = threadIdx.x / 32 - 1, lane = threadIdx.x % 32;
      const int tiles_n = (n + kStatsColumns - 1) / kStatsColumns;
      for (int tile = blockIdx.x, iteration = 0; tile < tiles; tile += gridDim.x, ++iteration) {
        const int m0 = tile % tiles_m * kBlockM, n0 = tile / tiles_m * kBlockN;
        for (int c = 0; c < kConsumers; ++c) {
          BarrierWait(&staged[c], iteration & 1);
          for (int r = stats_warp; r < 64 && m0 + c * 64 + r < m; r += kStatsWarps) {
            const float2 rs = StagedRowStats(staging + c * kStagingBytes, r, n0, n, lane);
            if (lane == 0) {
              stats[static_cast<int64_t>(m0 + c * 64 + r) * tiles_n + n0 / kStatsColumns] = rs;
            }
          }
          __syncwarp();
          if (lane == 0) BarrierArrive(&released[c]);
        }
      }
      return;
    }
    if (threadIdx.x != 0) return;
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      const int m0 = tile % tiles_m * kBlockM, n0 = tile / tiles_m * kBlockN;
      for (int kb = 0; kb < k_blocks; ++kb) {
        BarrierWait(&empty[stage], phase ^ 1);  // a fresh barrier passes parity 1 at once
        // Boxes past the tensor's edge are filled with zeros and count in full.
        BarrierExpectBytes(&full[stage], kStageABytes + kStageBBytes);
        TmaLoad(a_ring + stage * kBlockM * kBlockK, &map_a, &full[stage], kb * kBlockK, m0);
        TmaLoad(b_ring + stage * kBlockN * kBlockK, &map_b, &full[stage], kb * kBlockK, n0);
        if (++stage == kRing) {
          stage = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int consumer = warpgroup - 1;
  const int t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
  int stage = 0;
  uint32_t phase = 0;
  float d[128];
  for (int tile = blockIdx.x, iteration = 0; tile < tiles; tile += gridDim.x, ++iteration) {
    const int m0 = tile % tiles_m * kBlockM, n0 = tile / tiles_m * kBlockN;
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0.0f;
    FenceAccumulators(d);
    int held = -1;  // the stage whose instructions may still be reading it
    for (int kb = 0; kb < k_blocks; ++kb) {
      BarrierWait(&full[stage], phase);
      WgmmaFence();
      const __nv_bfloat16* a = a_ring + stage * kBlockM * kBlockK + consumer * 64 * kBlockK;
      const __nv_bfloat16* b = b_ring + stage * kBlockN * kBlockK;
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        Wgmma64x256(d, SmemDescriptor(a + kk * 16), SmemDescriptor(b + kk * 16), 1);
      }
      WgmmaCommit();
      WgmmaWait<1>();  // the previous slice's instructions are done with its stage
      FenceAccumulators(d);
      if (held >= 0 && t == 0) BarrierArrive(&empty[held]);
      held = stage;
      if (++stage == kRing) {
        stage = 0;
        phase ^= 1;
      }
    }
    WgmmaWait<0>();
    FenceAccumulators(d);
    if (held >= 0 && t == 0) BarrierArrive(&empty[held]);

    // The accumulators' layout: row warp * 16 + lane / 4 (+ 8), columns j * 8 + lane % 4 * 2
    // (+ 1) for j in [0, 32): d[4j], d[4j + 1] on the first row, d[4j + 2], d[4j + 3] on the
    // second.
    if constexpr (Staged(kEpilogue)) {
      uint8_t* mine = staging + consumer * kStagingBytes;
      // The last tile's stores, and its statistics, must have read the staging before it is
      // written again.
      if (t == 0) {
        TmaStoreWait<true>();
        if (kEpilogue == Epilogue::kTmaStoreStatsAside && iteration > 0) {
          BarrierWait(&released[consumer], (iteration - 1) & 1);
        }
      }
      WarpgroupSync(1 + consumer);
      StageTile(d, mine, warp * 16 + lane / 4, lane);
      if constexpr (kEpilogue == Epilogue::kTmaStoreStats) {
        RowTileStats(d, stats, m, n, m0 + consumer * 64 + warp * 16 + lane / 4, n0,
                     (n + kStatsColumns - 1) / kStatsColumns, lane);
      }
      FenceToAsyncProxy();
      WarpgroupSync(1 + consumer);
      // Boxes past the tensor's edge are clipped by the copy.
      if (t == 0) {
        for (int box = 0; box < kBlockN / 64; ++box) {
          TmaStore(&map_c, mine + box * 64 * 128, n0 + box * 64, m0 + consumer * 64);
        }
        if (kEpilogue == Epilogue::kTmaStoreStatsAside) BarrierArrive(&staged[consumer]);
      }
      continue;
    }
    const int row0 = m0 + consumer * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      const int col = n0 + j * 8 + lane % 4 * 2;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + half * 8;
        if (row >= m || col >= n) continue;
        __nv_bfloat16* out = c + static_cast<int64_t>(row) * ldc + col;
        const float x = d[4 * j + 2 * half], y = d[4 * j + 2 * half + 1];
        if (col + 1 < n) {
          *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(x, y);
        } else {
          *out = __float2bfloat16_rn(x);
        }
      }
    }
  }
  if (Staged(kEpilogue) && t == 0) TmaStoreWait<false>();
}

// cuTensorMapEncodeTiled, from the driver the runtime found (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 EncodeTiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    BENCH_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
      std::fprintf(stderr, "the driver has no cuTensorMapEncodeTiled\n");
      std::exit(1);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A row-major bf16 matrix (rows x cols, row stride ld elements) read in boxes of box_rows x 64.
CUtensorMap MakeMap(const void* base, int64_t rows, int64_t cols, int64_t ld, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  const cuuint32_t box[2] = {kBlockK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = EncodeTiled()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed (%d) for %lld x %lld, ld %lld\n",
                 static_cast<int>(r), (long long)rows, (long long)cols, (long long)ld);
    std::exit(1);
  }
  return map;
}

struct Shape {
  int64_t m, n, k;
};

template <Epilogue kEpilogue>
void LaunchGemm(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c,
                __nv_bfloat16* c, float2* stats, const Shape& s, int sms, cudaStream_t stream) {
  const int64_t tiles = (s.m + kBlockM - 1) / kBlockM * ((s.n + kBlockN - 1) / kBlockN);
  const int grid = static_cast<int>(std::min<int64_t>(tiles, sms));
  GemmKernel<kEpilogue><<<grid, kThreads, kSmemBytes<kEpilogue>, stream>>>(
      map_a, map_b, map_c, c, stats, static_cast<int>(s.m), static_cast<int>(s.n),
      static_cast<int>(s.k), s.n);
  BENCH_CUDA(cudaGetLastError());
}

int Main(int argc, char** argv) {
  std::vector<Shape> shapes = {{4096, 128256, 4096}, {8192, 8192, 8192}, {1000, 1032, 520}};
  int runs = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--runs=", 0) == 0) runs = std::max(1, std::atoi(a.c_str() + 7));
    if (a.rfind("--shapes=", 0) == 0) {
      shapes.clear();
      for (size_t start = 9; start < a.size();) {
        size_t end = a.find(',', start);
        if (end == std::string::npos) end = a.size();
        long long m = 0, n = 0, k = 0;
        if (std::sscanf(a.substr(start, end - start).c_str(), "%lld:%lld:%lld", &m, &n, &k) != 3 ||
            m < 1 || n < 8 || k < 8 || n % 8 != 0 || k % 8 != 0) {
          std::fprintf(stderr, "--shapes=M:N:K,... with N and K multiples of 8\n");
          return 1;
        }
        shapes.push_back({m, n, k});
        start = end + 1;
      }
    }
  }
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major != 9) {
    std::fprintf(stderr, "needs a Hopper GPU (sm_90a); this is sm_%d%d\n", prop.major, prop.minor);
    return 1;
  }
  BENCH_CUDA(cudaFuncSetAttribute(GemmKernel<Epilogue::kDirect>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kSmemBytes<Epilogue::kDirect>));
  BENCH_CUDA(cudaFuncSetAttribute(GemmKernel<Epilogue::kTmaStore>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kSmemBytes<Epilogue::kTmaStore>));
  BENCH_CUDA(cudaFuncSetAttribute(GemmKernel<Epilogue::kTmaStoreStats>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kSmemBytes<Epilogue::kTmaStoreStats>));
  BENCH_CUDA(cudaFuncSetAttribute(GemmKernel<Epilogue::kTmaStoreStatsAside>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kSmemBytes<Epilogue::kTmaStoreStatsAside>));
  std::printf(
      "device: %s, %d SMs; C = A . B^T in bf16, fp32 sums; ours with each epilogue (direct: "
      "stores from registers, 4 stages; TMA: through shared memory, 3 stages; + stats: and each "
      "row's softmax statistics per 256 columns, by the consumers / aside, by the producer's idle "
      "warps), cuBLASLt, and one read of C for the same statistics, timed in rounds, median of "
      "%d\n",
      prop.name, prop.multiProcessorCount, runs);
  std::printf(
      "| M | N | K | direct ms | TMA ms | + stats ms | + stats aside ms | TFLOP/s (TMA) | "
      "cuBLASLt ms | TFLOP/s | cuBLASLt / direct | cuBLASLt / TMA | cuBLASLt / aside | read for "
      "stats ms | rel. diff direct / TMA / + stats / aside | bits differ direct / TMA / + stats / "
      "aside | stats vs the read, + stats / aside: max abs diff of largest, max rel diff of sum "
      "|\n");
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::unique_ptr<kernels::cuda::LtGemm> lt;
  BENCH_OK(kernels::cuda::LtGemm::Create(&lt));
  constexpr size_t kWorkspace = size_t{4} << 20;
  void* workspace = nullptr;
  BENCH_CUDA(cudaMalloc(&workspace, kWorkspace));
  bool all_close = true;
  for (const Shape& s : shapes) {
    __nv_bfloat16 *a, *b, *ours, *theirs;
    BENCH_CUDA(cudaMalloc(&a, s.m * s.k * 2));
    BENCH_CUDA(cudaMalloc(&b, s.n * s.k * 2));
    BENCH_CUDA(cudaMalloc(&ours, s.m * s.n * 2));
    BENCH_CUDA(cudaMalloc(&theirs, s.m * s.n * 2));
    __nv_bfloat16* staged;  // the TMA epilogues' output
    BENCH_CUDA(cudaMalloc(&staged, s.m * s.n * 2));
    const int64_t tiles_n = (s.n + kStatsColumns - 1) / kStatsColumns;
    float2 *stats, *read_stats;  // the epilogue's and the read's
    float* stats_diff;
    BENCH_CUDA(cudaMalloc(&stats, s.m * tiles_n * sizeof(float2)));
    BENCH_CUDA(cudaMalloc(&read_stats, s.m * tiles_n * sizeof(float2)));
    BENCH_CUDA(cudaMalloc(&stats_diff, 2 * sizeof(float)));
    BENCH_CUDA(cudaMemsetAsync(stats, 0xff, s.m * tiles_n * sizeof(float2), stream));
    // As kernel_bench's: h ~ U(-1, 1), w ~ U(-4 / sqrt(K), 4 / sqrt(K)).
    BENCH_CUDA(FillUniformBf16(a, s.m * s.k, 1.0f, 11, stream));
    BENCH_CUDA(FillUniformBf16(b, s.n * s.k, 4.0f / std::sqrt(float(s.k)), 12, stream));
    BENCH_CUDA(cudaMemsetAsync(ours, 0xff, s.m * s.n * 2, stream));  // NaN where unwritten
    BENCH_CUDA(cudaMemsetAsync(staged, 0xff, s.m * s.n * 2, stream));
    const CUtensorMap map_a = MakeMap(a, s.m, s.k, s.k, kBlockM);
    const CUtensorMap map_b = MakeMap(b, s.n, s.k, s.k, kBlockN);
    const CUtensorMap map_c = MakeMap(staged, s.m, s.n, s.n, 64);
    static constexpr float kOne = 1.0f, kZero = 0.0f;
    // The fused call's logits GEMM: logits (tokens x width) = H . W^T with H = A, W = B.
    const kernels::cuda::GemmShape shape =
        kernels::cuda::LogitsGemm(s.n, s.m, s.k, CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_16BF, s.n);
    auto run_ours = [&] {
      LaunchGemm<Epilogue::kDirect>(map_a, map_b, map_c, ours, nullptr, s,
                                    prop.multiProcessorCount, stream);
    };
    auto run_staged = [&] {
      LaunchGemm<Epilogue::kTmaStore>(map_a, map_b, map_c, staged, nullptr, s,
                                      prop.multiProcessorCount, stream);
    };
    auto run_stats = [&] {
      LaunchGemm<Epilogue::kTmaStoreStats>(map_a, map_b, map_c, staged, stats, s,
                                           prop.multiProcessorCount, stream);
    };
    auto run_aside = [&] {
      LaunchGemm<Epilogue::kTmaStoreStatsAside>(map_a, map_b, map_c, staged, stats, s,
                                                prop.multiProcessorCount, stream);
    };
    auto run_read = [&] {
      ReadRowTileStats<<<static_cast<unsigned>(s.m), 256, 0, stream>>>(
          theirs, static_cast<int>(s.n), static_cast<int>(tiles_n), read_stats);
      BENCH_CUDA(cudaGetLastError());
    };
    auto run_theirs = [&] {
      BENCH_OK(lt->Run(shape, &kOne, b, a, &kZero, theirs, workspace, kWorkspace, stream));
    };
    run_ours();
    run_staged();
    run_theirs();
    TensorDiff diff, diff_staged, diff_stats, diff_aside;
    BENCH_CUDA(DiffTensors(ours, theirs, s.m * s.n, /*fp32=*/false, stream, &diff));
    BENCH_CUDA(DiffTensors(staged, theirs, s.m * s.n, /*fp32=*/false, stream, &diff_staged));
    run_read();
    // Each statistics variant from outputs poisoned with NaN, its C and statistics checked.
    auto check_stats = [&](auto run, TensorDiff* c_diff, float* error) {
      BENCH_CUDA(cudaMemsetAsync(staged, 0xff, s.m * s.n * 2, stream));
      BENCH_CUDA(cudaMemsetAsync(stats, 0xff, s.m * tiles_n * sizeof(float2), stream));
      run();
      BENCH_CUDA(DiffTensors(staged, theirs, s.m * s.n, /*fp32=*/false, stream, c_diff));
      BENCH_CUDA(cudaMemsetAsync(stats_diff, 0, 2 * sizeof(float), stream));
      StatsDiff<<<264, 256, 0, stream>>>(stats, read_stats, s.m * tiles_n, stats_diff);
      BENCH_CUDA(cudaMemcpyAsync(error, stats_diff, 2 * sizeof(float), cudaMemcpyDeviceToHost,
                                 stream));
      BENCH_CUDA(cudaStreamSynchronize(stream));
    };
    float stats_error[2], aside_error[2];
    check_stats(run_stats, &diff_stats, stats_error);
    check_stats(run_aside, &diff_aside, aside_error);
    // bf16 outputs: a rounding step is 2^-8. The statistics: the same largest value, and sums
    // of the same exp2 values, in another order in the consumers.
    const bool close = diff.relative <= 1e-2 && diff_staged.relative <= 1e-2 &&
                       diff_stats.relative <= 1e-2 && diff_aside.relative <= 1e-2 &&
                       stats_error[0] == 0.0f && stats_error[1] <= 1e-5f &&
                       aside_error[0] == 0.0f && aside_error[1] <= 1e-5f;
    all_close &= close;
    const std::vector<float> ms = RoundsMedianMs(
        stream, 2, runs, {run_ours, run_staged, run_stats, run_aside, run_theirs, run_read});
    const double flop = 2.0 * s.m * s.n * s.k;
    std::printf(
        "| %lld | %lld | %lld | %.3f | %.3f | %.3f | %.3f | %.1f | %.3f | %.1f | %.3f | %.3f | "
        "%.3f | %.3f | %.1e / %.1e / %.1e / %.1e | %lld / %lld / %lld / %lld | %.1e, %.1e / "
        "%.1e, %.1e%s |\n",
        (long long)s.m, (long long)s.n, (long long)s.k, ms[0], ms[1], ms[2], ms[3],
        flop / ms[1] / 1e9, ms[4], flop / ms[4] / 1e9, ms[4] / ms[0], ms[4] / ms[1],
        ms[4] / ms[3], ms[5], diff.relative, diff_staged.relative, diff_stats.relative,
        diff_aside.relative, (long long)diff.differing, (long long)diff_staged.differing,
        (long long)diff_stats.differing, (long long)diff_aside.differing, stats_error[0],
        stats_error[1], aside_error[0], aside_error[1], close ? "" : " FAIL");
    std::fflush(stdout);
    for (void* p : {(void*)a, (void*)b, (void*)ours, (void*)theirs, (void*)staged, (void*)stats,
                    (void*)read_stats, (void*)stats_diff}) {
      cudaFree(p);
    }
  }
  cudaFree(workspace);
  BENCH_CUDA(cudaStreamDestroy(stream));
  return all_close ? 0 : 2;
}

}  // namespace
}  // namespace losshead::bench

int main(int argc, char** argv) { return losshead::bench::Main(argc, argv); }
