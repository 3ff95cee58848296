// The logits GEMM of our own for Hopper (logits_gemm_sm90.cuh). Built for sm_90a only (its own
// library target): wgmma, setmaxnreg and the bulk tensor copies have no other target.
//
// One persistent block per SM walks 128 x 256 tiles of the logits, rows fastest (the blocks in
// flight share a slice of W, and the chunk's H stays in L2). Warpgroup 0 is the producer: its
// first thread issues the bulk tensor copies of 128 x 64 slices of H and 256 x 64 of W into a
// three-stage ring (128-byte swizzle; each stage's "full" mbarrier counts the bytes, its "empty"
// one the two consumers); its other three warps compute the statistics. Warpgroups 1 and 2 are
// the consumers: 64 rows each, m64n256k16 wgmma into 128 fp32 accumulators per thread. After a
// tile's last k slice a consumer stages its 64 x 256 rows in shared memory (bf16, the 128-byte
// swizzle), issues four bulk tensor stores of 64 x 64 boxes that it does not wait for, and
// starts its next tile; it waits for them, and for the statistics warps, only when it stages
// again. The statistics warps read each staged row (a warp per row) while the consumers
// multiply the next tile: the statistics cost 2 % of the GEMM so, 23 % when the consumers
// computed them and the tensor cores waited (docs/benchmarks/kernels.md, "Our own GEMM").
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/logits_gemm_sm90.cuh"
#include "kernels/cuda/reduce.cuh"

namespace losshead::kernels::cuda {
namespace {

constexpr int kBlockM = 128, kBlockN = 256, kBlockK = 64;
static_assert(kBlockN == kLogitsStatsColumns, "a tile's columns are a statistics tile");
constexpr int kConsumers = 2;  // warpgroups of 64 rows each
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kStatsWarps = 3;  // warpgroup 0's warps besides the producer's
constexpr int kStages = 3;
constexpr int kStageABytes = kBlockM * kBlockK * 2;  // 16 KiB
constexpr int kStageBBytes = kBlockN * kBlockK * 2;  // 32 KiB
// A consumer's staging of its 64 x 256 rows: four 64 x 64 boxes in the 128-byte swizzle.
constexpr int kStagingBytes = 64 * kBlockN * 2;  // 32 KiB
// The ring, the staging, the barriers (full and empty per stage, staged and released per
// consumer), and room to align the ring to the 1024 bytes of a swizzle pattern: 3 x 48 + 2 x 32
// KiB of the 227 a block may have.
constexpr int kSmemBytes = kStages * (kStageABytes + kStageBBytes) + kConsumers * kStagingBytes +
                           (2 * kStages + 2 * kConsumers) * 8 + 1024;

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
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
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

// One staged row of 256 columns (row r of a consumer's staging, first column n0) into its
// log-sum-exp, by one warp: lane l reads the 16-byte chunk of columns 8l to 8l + 7, largest over
// the lane's eight then across the warp by xor shuffles, then the sum the same way.
__device__ __forceinline__ float StagedRowLse(const uint8_t* staging, int r, int n0, int n,
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
    v[2 * i] = col + 2 * i < n ? f.x : -INFINITY;  // past the width: no part
    v[2 * i + 1] = col + 2 * i + 1 < n ? f.y : -INFINITY;
  }
  return WarpTileLse(v);
}

template <bool kStats>
__global__ void __launch_bounds__(kThreads, 1)
    LogitsGemmKernel(const __grid_constant__ CUtensorMap map_h,
                     const __grid_constant__ CUtensorMap map_w,
                     const __grid_constant__ CUtensorMap map_logits, float* stats, int m, int n,
                     int k) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  auto* a_ring = reinterpret_cast<__nv_bfloat16*>(smem);
  auto* b_ring = reinterpret_cast<__nv_bfloat16*>(smem + kStages * kStageABytes);
  uint8_t* staging = smem + kStages * (kStageABytes + kStageBBytes);
  auto* full = reinterpret_cast<uint64_t*>(staging + kConsumers * kStagingBytes);
  uint64_t* empty = full + kStages;
  // Per consumer: its tile is staged (its thread 0 arrives); the statistics warps are done
  // reading it (each of the three arrives).
  uint64_t* staged = empty + kStages;
  uint64_t* released = staged + kConsumers;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
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
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (kStats && threadIdx.x >= 32) {  // the statistics warps
      const int stats_warp = threadIdx.x / 32 - 1, lane = threadIdx.x % 32;
      const int tiles_n = (n + kBlockN - 1) / kBlockN;
      for (int tile = blockIdx.x, iteration = 0; tile < tiles; tile += gridDim.x, ++iteration) {
        const int m0 = tile % tiles_m * kBlockM, n0 = tile / tiles_m * kBlockN;
        for (int c = 0; c < kConsumers; ++c) {
          BarrierWait(&staged[c], iteration & 1);
          for (int r = stats_warp; r < 64 && m0 + c * 64 + r < m; r += kStatsWarps) {
            const float lse = StagedRowLse(staging + c * kStagingBytes, r, n0, n, lane);
            if (lane == 0)
              stats[static_cast<int64_t>(m0 + c * 64 + r) * tiles_n + n0 / kBlockN] = lse;
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
        TmaLoad(a_ring + stage * kBlockM * kBlockK, &map_h, &full[stage], kb * kBlockK, m0);
        TmaLoad(b_ring + stage * kBlockN * kBlockK, &map_w, &full[stage], kb * kBlockK, n0);
        if (++stage == kStages) {
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
  uint8_t* mine = staging + consumer * kStagingBytes;
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
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    WgmmaWait<0>();
    FenceAccumulators(d);
    if (held >= 0 && t == 0) BarrierArrive(&empty[held]);

    // The last tile's stores, and its statistics, must have read the staging before it is
    // written again.
    if (t == 0) {
      TmaStoreWait<true>();
      if (kStats && iteration > 0) BarrierWait(&released[consumer], (iteration - 1) & 1);
    }
    WarpgroupSync(1 + consumer);
    // The accumulators' layout: row warp * 16 + lane / 4 (+ 8), columns j * 8 + lane % 4 * 2
    // (+ 1) for j in [0, 32).
    StageTile(d, mine, warp * 16 + lane / 4, lane);
    FenceToAsyncProxy();
    WarpgroupSync(1 + consumer);
    if (t == 0) {
      // Boxes past the tensor's edge are clipped by the copy.
      for (int box = 0; box < kBlockN / 64; ++box) {
        TmaStore(&map_logits, mine + box * 64 * 128, n0 + box * 64, m0 + consumer * 64);
      }
      if (kStats) BarrierArrive(&staged[consumer]);
    }
  }
  if (t == 0) TmaStoreWait<false>();
}

// cuTensorMapEncodeTiled, from the driver the runtime found (no link against libcuda); null
// where the driver has none.
PFN_cuTensorMapEncodeTiled_v12000 EncodeTiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A row-major bf16 matrix (rows x cols, row stride ld elements) in boxes of box_rows x 64, the
// 128-byte swizzle.
absl::Status MakeMap(const void* base, int64_t rows, int64_t cols, int64_t ld, int box_rows,
                     CUtensorMap* map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = EncodeTiled();
  if (encode == nullptr) return absl::InternalError("the driver has no cuTensorMapEncodeTiled");
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld) * 2};
  const cuuint32_t box[2] = {kBlockK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat("cuTensorMapEncodeTiled failed (", static_cast<int>(r),
                                            ") for ", rows, " x ", cols, ", ld ", ld));
  }
  return absl::OkStatus();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool LogitsGemmSm90Runs(int device) {
  int major = 0, minor = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
         major == 9 && minor == 0;
}

absl::Status LaunchLogitsGemmSm90(const __nv_bfloat16* hidden, const __nv_bfloat16* weight,
                                  int64_t rows, int64_t v, int64_t d, __nv_bfloat16* logits,
                                  int64_t ldl, float* tile_stats, cudaStream_t stream) {
  constexpr int64_t kMax = kLogitsGemmSm90MaxSize;
  if (rows < 1 || v < 1 || d < 1 || rows > kMax || v > kMax || d > kMax) {
    return absl::InvalidArgumentError(absl::StrCat(
        "logits GEMM: rows, v and d must be in [1, 2^30], got ", rows, ", ", v, ", ", d));
  }
  if (v % 8 != 0 || d % 8 != 0 || ldl % 8 != 0 || ldl < v) {
    return absl::InvalidArgumentError(
        absl::StrCat("logits GEMM: v, d and ldl must be multiples of 8 and ldl >= v, got v ", v,
                     ", d ", d, ", ldl ", ldl));
  }
  if (!Aligned16(hidden) || !Aligned16(weight) || !Aligned16(logits)) {
    return absl::InvalidArgumentError(
        "logits GEMM: hidden, weight and logits must be 16-byte aligned");
  }
  int device = 0;
  LOSSHEAD_CUDA_CHECK(cudaGetDevice(&device));
  if (!LogitsGemmSm90Runs(device)) {
    return absl::FailedPreconditionError("logits GEMM: needs a device of compute capability 9.0");
  }
  CUtensorMap map_h, map_w, map_logits;
  LOSSHEAD_RETURN_IF_ERROR(MakeMap(hidden, rows, d, d, kBlockM, &map_h));
  LOSSHEAD_RETURN_IF_ERROR(MakeMap(weight, v, d, d, kBlockN, &map_w));
  LOSSHEAD_RETURN_IF_ERROR(MakeMap(logits, rows, v, ldl, 64, &map_logits));
  int sms = 0;
  LOSSHEAD_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t tiles = (rows + kBlockM - 1) / kBlockM * ((v + kBlockN - 1) / kBlockN);
  const int grid = static_cast<int>(std::min<int64_t>(tiles, sms));
  auto launch = [&](auto kernel) -> absl::Status {
    LOSSHEAD_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    kernel<<<grid, kThreads, kSmemBytes, stream>>>(map_h, map_w, map_logits, tile_stats,
                                                   static_cast<int>(rows), static_cast<int>(v),
                                                   static_cast<int>(d));
    LOSSHEAD_CUDA_CHECK(cudaGetLastError());
    return absl::OkStatus();
  };
  return tile_stats != nullptr ? launch(LogitsGemmKernel<true>) : launch(LogitsGemmKernel<false>);
}

}  // namespace losshead::kernels::cuda
