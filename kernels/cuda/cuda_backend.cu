// The CUDA backend. Per token chunk of C rows (chunks of equal size, as large as the workspace
// allows):
//   logits (C x V)  = H_c . W^T                      cublasLt, fp32 accumulation
//   row kernel      : soft-cap, softmax, lse, loss; overwrites the logits with the unscaled
//                     gradient G in the input dtype (the next GEMMs' operand)
//   dH_c  (C x D)   = alpha . G . W                  cublasLt, written in the input dtype
//   dW    (V x D)  += alpha . G^T . H_c              cublasLt, fp32 accumulator, beta = 1
// alpha (grad_scale, / token_count for the mean) is computed on the device by a prologue kernel and
// read by cublasLt in device pointer mode, so nothing in Run waits for the GPU. cublasLt rather
// than cublas_v2: a cublas_v2 handle allocates a 64 MiB workspace pool of its own at creation,
// outside any budget; the cublasLt GEMMs use a slice of our workspace and nothing else.
// The optimizer step and the gradient norm are single memory-bound passes (optimizer_step.cu,
// squared_norm.cu) that share their per-element math with the CPU backend.
// A vocabulary shard's calls (shard_problem.h) are in shard_calls.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/chunk_layout.h"
#include "kernels/cuda/count_targets.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_stream.h"
#include "kernels/cuda/head_gemms.h"
#include "kernels/cuda/loss_reduce.cuh"
#include "kernels/cuda/lt_gemm.h"
#include "kernels/cuda/optimizer_step.cuh"
#include "kernels/cuda/run_types.cuh"
#include "kernels/cuda/scalars.h"
#include "kernels/cuda/shard_calls.h"
#include "kernels/cuda/shard_softmax.cuh"
#include "kernels/cuda/softmax_grad.cuh"
#include "kernels/cuda/squared_norm.cuh"

namespace losshead::kernels {
namespace {

using cuda::AsCudaStream;
using cuda::CudaStream;
using cuda::CudaType;
using cuda::kAlign;
using cuda::Layout;
using cuda::RunScalars;

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& options, std::string description,
              size_t smem_per_sm)
      : device_(device),
        options_(options),
        description_(std::move(description)),
        smem_per_sm_(smem_per_sm) {}

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
    if (2 * cuda::LogitsStride(problem.v) > kIntMax) {
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

  absl::Status Run(const Problem& problem, const Arguments& args, Stream& stream) override {
    if (absl::Status s = CanImplement(problem); !s.ok()) return s;
    CudaStream* cs = AsCudaStream(stream, device_);
    if (cs == nullptr) return cuda::ForeignStreamError();
    if (args.hidden == nullptr || args.weight == nullptr || args.targets == nullptr) {
      return absl::InvalidArgumentError("hidden, weight and targets must not be null");
    }
    if (args.loss_sum == nullptr || args.token_count == nullptr) {
      return absl::InvalidArgumentError("loss_sum and token_count must not be null");
    }
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
    return cuda::WithRunTypes(problem, options_, [&](auto in, auto logits) {
      return this->template RunTyped<typename decltype(in)::type, typename decltype(logits)::type>(
          problem, args, layout, *cs);
    });
  }

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
    return cuda::GradStashLayout(capacity, problem.v, problem.d, DTypeSize(problem.dtype)).total;
  }

  absl::Status FlushGradStash(const Problem& problem, const GradStash& stash, float* grad_weight,
                              void* workspace, size_t workspace_bytes, Stream& stream) override {
    if (absl::Status s = CanImplement(problem); !s.ok()) return s;
    LOSSHEAD_RETURN_IF_ERROR(ValidateGradStash(stash, 0));
    if (problem.dtype == DType::kFP16) {
      return absl::UnimplementedError("the CUDA backend stashes no fp16 gradient");
    }
    if (grad_weight == nullptr) return absl::InvalidArgumentError("grad_weight must not be null");
    CudaStream* cs = AsCudaStream(stream, device_);
    if (cs == nullptr) return cuda::ForeignStreamError();
    if (stash.tokens == 0) return absl::OkStatus();
    // cublasLt's scratch: the front of the caller's memory, as much as a Run's GEMMs use.
    if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % kAlign != 0) {
      workspace_bytes = 0;
    }
    workspace_bytes = std::min(workspace_bytes, options_.cublas_workspace_bytes);
    const cuda::StashLayout layout =
        cuda::GradStashLayout(stash.capacity, problem.v, problem.d, DTypeSize(problem.dtype));
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
    return cuda::RunGradWeightGemm(cs->gemm(), problem.v, stash.tokens, problem.d, type,
                                   cuda::GemmCompute(problem), layout.ldg, &kOne,
                                   base + layout.hidden_off, base, &kOne, grad_weight,
                                   workspace_bytes > 0 ? workspace : nullptr, workspace_bytes,
                                   cs->stream(), /*host_scalars=*/true);
  }

  absl::Status SquaredNorm(const float* data, int64_t count, double* result,
                           Stream& stream) override {
    if (absl::Status s = ValidateSquaredNorm(data, count, result); !s.ok()) return s;
    CudaStream* cs = AsCudaStream(stream, device_);
    if (cs == nullptr) return cuda::ForeignStreamError();
    std::lock_guard<std::mutex> lock(cs->mutex());
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    return cuda::LaunchSquaredNorm(data, count, cs->norm_partials(), result, cs->stream());
  }

  absl::Status OptimizerStep(const OptimizerProblem& problem, const OptimizerTensors& tensors,
                             Stream& stream) override {
    if (absl::Status s = ValidateOptimizerStep(problem, tensors); !s.ok()) return s;
    CudaStream* cs = AsCudaStream(stream, device_);
    if (cs == nullptr) return cuda::ForeignStreamError();
    const OptimizerKind kind = KindOf(problem.options);
    const optim::StepScalars scalars = optim::MakeStepScalars(problem);
    float* state_a = tensors.exp_avg;
    if (kind == OptimizerKind::kSgd) {
      state_a = scalars.sgd_momentum ? tensors.momentum_buffer : nullptr;
    }
    float* state_b = kind == OptimizerKind::kAdamW ? tensors.exp_avg_sq : nullptr;
    std::lock_guard<std::mutex> lock(cs->mutex());
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    switch (problem.dtype) {
      case DType::kFP32:
        return cuda::LaunchOptimizerStep<float>(kind, scalars, static_cast<float*>(tensors.weight),
                                                nullptr, tensors.grad, state_a, state_b,
                                                problem.count, cs->stream());
      case DType::kBF16:
        return cuda::LaunchOptimizerStep(kind, scalars, tensors.master,
                                         static_cast<__nv_bfloat16*>(tensors.weight), tensors.grad,
                                         state_a, state_b, problem.count, cs->stream());
      case DType::kFP16:
        return cuda::LaunchOptimizerStep(kind, scalars, tensors.master,
                                         static_cast<__half*>(tensors.weight), tensors.grad,
                                         state_a, state_b, problem.count, cs->stream());
    }
    return absl::InvalidArgumentError("unknown dtype");
  }

  absl::Status CheckOptimizerStep(const OptimizerProblem& problem, const OptimizerTensors& tensors,
                                  OptimizerCheck* result, Stream& stream) override {
    if (absl::Status s = ValidateOptimizerStep(problem, tensors); !s.ok()) return s;
    if (result == nullptr) return absl::InvalidArgumentError("result must not be null");
    CudaStream* cs = AsCudaStream(stream, device_);
    if (cs == nullptr) return cuda::ForeignStreamError();
    const OptimizerKind kind = KindOf(problem.options);
    const optim::StepScalars scalars = optim::MakeStepScalars(problem);
    // The buffers OptimizerStep would read, chosen the same way.
    const float* state_a = tensors.exp_avg;
    if (kind == OptimizerKind::kSgd) {
      state_a = scalars.sgd_momentum ? tensors.momentum_buffer : nullptr;
    }
    const float* state_b = kind == OptimizerKind::kAdamW ? tensors.exp_avg_sq : nullptr;
    const float* param =
        problem.dtype == DType::kFP32 ? static_cast<const float*>(tensors.weight) : tensors.master;
    std::lock_guard<std::mutex> lock(cs->mutex());
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    switch (problem.dtype) {
      case DType::kFP32:
        return cuda::LaunchOptimizerCheck<float>(kind, scalars, param, tensors.grad, state_a,
                                                 state_b, problem.count, result, cs->stream());
      case DType::kBF16:
        return cuda::LaunchOptimizerCheck<__nv_bfloat16>(kind, scalars, param, tensors.grad,
                                                         state_a, state_b, problem.count, result,
                                                         cs->stream());
      case DType::kFP16:
        return cuda::LaunchOptimizerCheck<__half>(kind, scalars, param, tensors.grad, state_a,
                                                  state_b, problem.count, result, cs->stream());
    }
    return absl::InvalidArgumentError("unknown dtype");
  }

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
    std::unique_ptr<cuda::LtGemm> gemm;
    if (absl::Status st = cuda::LtGemm::Create(&gemm); !st.ok()) {
      cudaStreamDestroy(stream);
      return st;
    }
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

  bool UseBf16Logits(const Problem& problem) const { return cuda::Bf16Logits(problem, options_); }

  // A 16-bit dH over a width that splits (head_gemms.h) adds its parts in fp32 scratch.
  static bool GradHiddenScratch(const Problem& problem) {
    return problem.dtype != DType::kFP32 && cuda::WidthSplits(problem.v);
  }

  Layout MakeLayoutForChunk(const Problem& problem, int64_t chunk) const {
    return cuda::ChunkLayout(chunk, problem.v, UseBf16Logits(problem) ? 2 : 4,
                             options_.cublas_workspace_bytes,
                             GradHiddenScratch(problem) ? problem.d : 0);
  }

  // The largest chunk that fits `bytes`, at most n; rounded down to a multiple of 256 rows when
  // the problem is split, so that the GEMMs' token dimension fills whole tiles.
  Layout MakeLayout(const Problem& problem, size_t bytes) const {
    const Layout one = MakeLayoutForChunk(problem, 1);
    if (bytes < one.total) return Layout{};
    const size_t per_row = static_cast<size_t>(one.ldl) * one.logits_elem +
                           sizeof(float) * (1 + static_cast<size_t>(one.scratch_row_floats));
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

  // TIn: H, W, dH and the gradient operand G; TL: the logits chunk as the first GEMM writes it.
  template <typename TIn, typename TL>
  absl::Status RunTyped(const Problem& problem, const Arguments& args, const Layout& layout,
                        CudaStream& cs) {
    const cudaStream_t stream = cs.stream();
    cuda::LtGemm& gemm = cs.gemm();
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
    const cuda::StashLayout stash_layout =
        stashed ? cuda::GradStashLayout(stash.capacity, v, d, sizeof(TIn)) : cuda::StashLayout{};
    TIn* const stash_grad =
        stashed ? static_cast<TIn*>(stash.data) + stash.tokens * stash_layout.ldg : nullptr;
    const bool need_grad = args.grad_hidden != nullptr || args.grad_weight != nullptr || stashed;
    constexpr cudaDataType_t kIn = CudaType<TIn>();
    const cublasComputeType_t compute = cuda::GemmCompute(problem);
    constexpr cudaDataType_t kLogits = CudaType<TL>();

    LOSSHEAD_RETURN_IF_ERROR(cuda::LaunchCountTargets(
        args.targets, problem.n, problem.v, o.ignore_index, o.reduction == Reduction::kMean,
        o.grad_scale, args.token_count, scalars, stream));

    cuda::SoftmaxGradParams params;
    params.v = problem.v;
    params.ignore_index = o.ignore_index;
    params.label_smoothing = o.label_smoothing;
    params.z_loss = o.z_loss;
    params.softcap = o.softcap;
    if (stashed) params.grad_scale = &scalars->grad_alpha;

    const int chunk = ChunkRows(n, static_cast<int>(layout.chunk));
    const cuda::RowLaunch row_launch{options_.row_threads, options_.row_blocks_per_sm,
                                     smem_per_sm_};
    // Row kernel (and the chunk's loss reduction when `reduce`) over rows [q0, q0 + rows) of the
    // chunk that starts at token r0, on stream `s`.
    auto rows_step = [&](int r0, int q0, int rows, bool reduce, cudaStream_t s) -> absl::Status {
      const int64_t t0 = static_cast<int64_t>(r0) + q0;
      TIn* g = nullptr;
      if (stashed) {
        g = stash_grad + t0 * stash_layout.ldg;
      } else if (need_grad) {
        g = grad + static_cast<int64_t>(q0) * ldg;
      }
      LOSSHEAD_RETURN_IF_ERROR((cuda::LaunchSoftmaxGrad<TL, TIn>(
          logits + static_cast<int64_t>(q0) * ldl, ldl, rows, args.targets + t0, params, g,
          stashed ? stash_layout.ldg : ldg, row_loss + q0,
          args.per_token_loss != nullptr ? args.per_token_loss + t0 : nullptr,
          args.per_token_lse != nullptr ? args.per_token_lse + t0 : nullptr, row_launch, s)));
      if (reduce) {
        // Always over the whole chunk, in one fixed order: bit-identical whatever the schedule.
        const int c = std::min(chunk, n - r0);
        LOSSHEAD_RETURN_IF_ERROR(cuda::LaunchLossReduce(row_loss, c, scalars, args.loss_sum, s));
      }
      return absl::OkStatus();
    };
    void* const gemm_ws = ws + layout.cublas_off;
    const size_t gemm_ws_bytes = layout.cublas_bytes;
    auto logits_gemm = [&](int t0, int rows, int q0) -> absl::Status {
      return cuda::RunLogitsGemm(gemm, v, rows, d, kIn, compute, kLogits, ldl, weight,
                                 hidden + static_cast<int64_t>(t0) * d,
                                 logits + static_cast<int64_t>(q0) * ldl, gemm_ws, gemm_ws_bytes,
                                 stream);
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
      LOSSHEAD_RETURN_IF_ERROR(cuda::RunGradHiddenGemm(
          gemm, v, rows, d, kIn, compute, scratch != nullptr ? CUDA_R_32F : kIn,
          stashed ? stash_layout.ldg : ldg, alpha, weight, g, &scalars->zero, &scalars->one,
          scratch != nullptr ? static_cast<void*>(scratch) : static_cast<void*>(out), gemm_ws,
          gemm_ws_bytes, stream));
      if constexpr (!std::is_same_v<TIn, float>) {
        if (scratch != nullptr) {
          return cuda::LaunchRoundToDType(scratch, out, static_cast<int64_t>(rows) * d, stream);
        }
      }
      return absl::OkStatus();
    };
    auto dw_gemm = [&](int t0, int rows) -> absl::Status {
      if (args.grad_weight == nullptr) return absl::OkStatus();
      return cuda::RunGradWeightGemm(gemm, v, rows, d, kIn, compute, ldg, &scalars->grad_alpha,
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
      LOSSHEAD_RETURN_IF_ERROR(dw_gemm(r0, c));
    }
    return absl::OkStatus();
  }

  const int device_;
  const CudaBackendOptions options_;
  const std::string description_;
  const size_t smem_per_sm_;
  const cuda::ShardCalls shards_{device_, options_};
};

}  // namespace

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // a missing driver is "no device", not a sticky error
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  return CreateCudaBackend(device, CudaBackendOptions{});
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device,
                                                           const CudaBackendOptions& options) {
  const int count = CudaDeviceCount();
  if (device < 0 || device >= count) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " visible)"));
  }
  LOSSHEAD_CUDA_CHECK(cudaSetDevice(device));
  cudaDeviceProp prop;
  LOSSHEAD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (options.row_threads != 512 && options.row_threads != 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("row_threads must be 512 or 1024, got ", options.row_threads));
  }
  return std::unique_ptr<Backend>(
      new CudaBackend(device, options, absl::StrCat("cuda:", device, " (", prop.name, ")"),
                      prop.sharedMemPerMultiprocessor));
}

}  // namespace losshead::kernels
