// The CUDA backend's class, shared by the files that implement it: cuda_backend.cu (device,
// memory, streams, workspace layout and the factory), cuda_run.cu (Run and the gradient stash's
// flush), cuda_update.cu (the optimizer step and the gradient norm); a vocabulary shard's calls
// are forwarded to ShardCalls (shard_calls.cu). Internal to kernels/cuda: CreateCudaBackend
// (cuda_backend.h) is the only way in.
#ifndef LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_IMPL_H_
#define LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_IMPL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/chunk_layout.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/cuda/head_gemms.h"
#include "kernels/cuda/lt_gemm.h"
#include "kernels/cuda/shard_calls.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels::cuda {

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& options, std::string description,
              size_t smem_per_sm)
      : device_(device),
        options_(options),
        description_(std::move(description)),
        smem_per_sm_(smem_per_sm),
        sm90_gemm_runs_(LogitsGemmSm90Runs(device)) {}

  absl::string_view name() const override { return "cuda"; }
  std::string device_description() const override { return description_; }
  int device_ordinal() const override { return device_; }

  MemoryInfo memory_info() const override {
    MemoryInfo info;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(device_) == cudaSuccess &&
        cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      info.free_bytes = free_bytes;
      info.total_bytes = total_bytes;
    }
    return info;
  }

  absl::Status CanImplement(const Problem& problem) const override {
    if (absl::Status s = ValidateProblem(problem); !s.ok()) return s;
    // cublasLt takes int sizes and strides; the narrowed gradient's stride is up to 2 * ldl.
    constexpr int64_t kIntMax = 2147483647;
    if (problem.d > kIntMax) {
      return absl::InvalidArgumentError(absl::StrCat("d must fit in int32, got ", problem.d));
    }
    if (2 * LogitsStride(problem.v) > kIntMax) {
      return absl::InvalidArgumentError(
          absl::StrCat("v too large for the CUDA backend (max ~1e9), got ", problem.v));
    }
    if (problem.n > kIntMax) {
      return absl::InvalidArgumentError(absl::StrCat("n must fit in int32, got ", problem.n));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<size_t> WorkspaceBytes(const Problem& problem,
                                        size_t budget_bytes) const override {
    if (absl::Status s = CanImplement(problem); !s.ok()) return s;
    // The stream holds a little memory of its own: the workspace gets the rest.
    const size_t reserve = options_.handle_reserve_bytes;
    const Layout layout = MakeLayout(problem, budget_bytes > reserve ? budget_bytes - reserve : 0);
    if (layout.chunk < 1) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "workspace budget of ", budget_bytes, " bytes holds no chunk: at least ",
          MakeLayoutForChunk(problem, 1).total + reserve, " bytes are needed for v = ", problem.v));
    }
    return layout.total;
  }

  absl::Status Run(const Problem& problem, const Arguments& args, Stream& stream) override;

  absl::StatusOr<size_t> GradStashBytes(const Problem& problem, int64_t capacity) const override {
    if (absl::Status s = CanImplement(problem); !s.ok()) return s;
    if (capacity < 1 || capacity > 2147483647) {
      return absl::InvalidArgumentError(
          absl::StrCat("grad stash capacity must be in [1, 2^31), got ", capacity));
    }
    // The stash keeps G scaled in the head's dtype: fp16's range would flush a mean's small
    // gradients (p_j / N) to zero, where bf16 and fp32 keep them.
    if (problem.dtype == DType::kFP16) {
      return absl::UnimplementedError("the CUDA backend stashes no fp16 gradient");
    }
    return GradStashLayout(capacity, problem.v, problem.d, DTypeSize(problem.dtype)).total;
  }

  absl::Status FlushGradStash(const Problem& problem, const GradStash& stash, float* grad_weight,
                              void* workspace, size_t workspace_bytes, Stream& stream) override;

  absl::Status SquaredNorm(const float* data, int64_t count, double* result,
                           Stream& stream) override;
  // The tied input embedding's rows (embedding_calls.cu).
  absl::Status GatherRows(DType dtype, const void* weights, int64_t rows, int64_t d,
                          const int64_t* ids, int64_t n, void* out, Stream& stream) override;
  absl::Status IndexAddRows(const float* values, const int64_t* ids, int64_t n, int64_t d,
                            float* grad, int64_t rows, Stream& stream) override;
  absl::Status OptimizerStep(const OptimizerProblem& problem, const OptimizerTensors& tensors,
                             Stream& stream) override;
  absl::Status CheckOptimizerStep(const OptimizerProblem& problem, const OptimizerTensors& tensors,
                                  OptimizerCheck* result, Stream& stream) override;

  absl::StatusOr<ShardPlan> PlanShard(const ShardProblem& shard,
                                      size_t budget_bytes) const override {
    return shards_.Plan(shard, budget_bytes);
  }
  absl::Status ShardBegin(const ShardProblem& shard, const ShardArguments& args,
                          Stream& stream) override {
    return shards_.Begin(shard, args, AsCudaStream(stream, device_));
  }
  absl::Status ShardForward(const ShardProblem& shard, const ShardArguments& args, ShardChunk chunk,
                            Stream& stream) override {
    return shards_.Forward(shard, args, chunk, AsCudaStream(stream, device_));
  }
  absl::Status ShardBackward(const ShardProblem& shard, const ShardArguments& args,
                             ShardChunk chunk, Stream& stream) override {
    return shards_.Backward(shard, args, chunk, AsCudaStream(stream, device_));
  }
  absl::Status ShardStoreGradHidden(const ShardProblem& shard, const float* partial,
                                    ShardChunk chunk, void* grad_hidden, Stream& stream) override {
    return shards_.StoreGradHidden(shard, partial, chunk, grad_hidden,
                                   AsCudaStream(stream, device_));
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    void* data = nullptr;
    if (bytes > 0) LOSSHEAD_CUDA_CHECK(cudaMalloc(&data, bytes));
    return DeviceBuffer(this, data, bytes);
  }

  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    cudaStream_t stream = nullptr;
    LOSSHEAD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::unique_ptr<LtGemm> gemm;
    if (absl::Status st = LtGemm::Create(&gemm); !st.ok()) {
      cudaStreamDestroy(stream);
      return st;
    }
    gemm->set_role_ranks(options_.gemm_ranks);
    auto result = std::make_unique<CudaStream>(device_, stream, std::move(gemm));
    LOSSHEAD_RETURN_IF_ERROR(result->InitSide());
    return std::unique_ptr<Stream>(std::move(result));
  }

  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes,
                            Stream& stream) override {
    return Copy(dst, host_src, bytes, stream);
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes, Stream& stream) override {
    return Copy(host_dst, src, bytes, stream);
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes, Stream& stream) override {
    // cudaMemcpyDefault: unified addressing finds each side's device, a peer's or an IPC
    // mapping's included.
    return Copy(dst, src, bytes, stream);
  }
  absl::StatusOr<HostBuffer> AllocateHost(size_t bytes) override {
    if (bytes == 0) return HostBuffer();
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    void* data = nullptr;
    // Portable: the pages stay pinned for every device of the process, whichever is current.
    LOSSHEAD_CUDA_CHECK(cudaHostAlloc(&data, bytes, cudaHostAllocPortable));
    return HostBuffer(
        data, bytes, +[](void* p) { cudaFreeHost(p); });
  }
  absl::Status Memset(void* dst, int value, size_t bytes, Stream& stream) override {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    LOSSHEAD_CUDA_CHECK(
        cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(stream.native())));
    return absl::OkStatus();
  }

 protected:
  void Free(void* data) override {
    // Free cannot report: an error here means the context is already broken.
    cudaSetDevice(device_);
    cudaFree(data);
  }

 private:
  // Rows per chunk for n tokens when the workspace holds up to `max_rows`: with balancing, the
  // fewest chunks, all of one size (a multiple of 128 rows where that still fits), so that no
  // small tail chunk pays a full pass over the fp32 dW accumulator for a few rows of work.
  int ChunkRows(int n, int max_rows) const {
    if (!options_.balance_chunks || n <= max_rows) return std::min(n, max_rows);
    const int chunks = (n + max_rows - 1) / max_rows;
    const int even = (n + chunks - 1) / chunks;
    const int rounded = (even + 127) / 128 * 128;
    return rounded <= max_rows ? rounded : even;
  }

  bool UseBf16Logits(const Problem& problem) const { return Bf16Logits(problem, options_); }

  // A 16-bit dH over a width that splits (head_gemms.h) adds its parts in fp32 scratch.
  static bool GradHiddenScratch(const Problem& problem) {
    return problem.dtype != DType::kFP32 && WidthSplits(problem.v);
  }

  // Whether the problem's logits GEMM may be our own (CudaBackendOptions::sm90_logits_gemm): its
  // statistics then have room in the layout, and Run takes it where H and W are aligned.
  bool UseSm90LogitsGemm(const Problem& problem) const {
    return options_.sm90_logits_gemm && sm90_gemm_runs_ && UseBf16Logits(problem) &&
           Sm90LogitsGemmFits(problem.v, problem.d);
  }

  Layout MakeLayoutForChunk(const Problem& problem, int64_t chunk) const {
    return ChunkLayout(chunk, problem.v, UseBf16Logits(problem) ? 2 : 4,
                       options_.cublas_workspace_bytes, GradHiddenScratch(problem) ? problem.d : 0,
                       UseSm90LogitsGemm(problem) ? Sm90StatsPerRow(problem.v) : 0);
  }

  // The largest chunk that fits `bytes`, at most n; rounded down to a multiple of 256 rows when
  // the problem is split, so that the GEMMs' token dimension fills whole tiles.
  Layout MakeLayout(const Problem& problem, size_t bytes) const {
    const Layout one = MakeLayoutForChunk(problem, 1);
    if (bytes < one.total) return Layout{};
    const size_t per_row = static_cast<size_t>(one.ldl) * one.logits_elem +
                           sizeof(float) * (1 + static_cast<size_t>(one.scratch_row_floats) +
                                            static_cast<size_t>(one.stats_row_floats));
    // Estimate, then settle on the exact largest chunk (alignment padding makes the estimate off
    // by a row or two either way).
    int64_t chunk = std::clamp<int64_t>((bytes - one.logits_off) / per_row, 1, problem.n);
    while (chunk > 1 && MakeLayoutForChunk(problem, chunk).total > bytes) --chunk;
    while (chunk < problem.n && MakeLayoutForChunk(problem, chunk + 1).total <= bytes) ++chunk;
    if (chunk < problem.n && chunk >= 256) chunk = chunk / 256 * 256;
    return MakeLayoutForChunk(problem, chunk);
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes, Stream& stream) {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    LOSSHEAD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault,
                                        static_cast<cudaStream_t>(stream.native())));
    return absl::OkStatus();
  }

  // Run for the problem's types (run_types.cuh), in cuda_run.cu. TIn: H, W, dH and the gradient
  // operand G; TL: the logits chunk as the first GEMM writes it.
  template <typename TIn, typename TL>
  absl::Status RunTyped(const Problem& problem, const Arguments& args, const Layout& layout,
                        CudaStream& cs);

  const int device_;
  const CudaBackendOptions options_;
  const std::string description_;
  const size_t smem_per_sm_;
  const bool sm90_gemm_runs_;  // LogitsGemmSm90Runs(device_)
  const ShardCalls shards_{device_, options_};
};

}  // namespace losshead::kernels::cuda

#endif  // LOSSHEAD_KERNELS_CUDA_CUDA_BACKEND_IMPL_H_
