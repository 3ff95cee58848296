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
// A vocabulary shard (shard_problem.h) splits the row kernel around the statistics exchange:
//   ShardForward    logits (C x rows) = H_c . W_rows^T (bf16 or fp32 as in Run, kept in the
//                   workspace), then per token the shard's statistics (shard_softmax.cu)
//   ShardBackward   combine the gathered statistics; G over the shard's columns (written over the
//                   logits as in Run); partial_c (C x D, fp32) = alpha . G . W_rows;
//                   dW_rows += alpha . G^T . H_c
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/count_targets.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/loss_reduce.cuh"
#include "kernels/cuda/lt_gemm.h"
#include "kernels/cuda/optimizer_step.cuh"
#include "kernels/cuda/scalars.h"
#include "kernels/cuda/shard_softmax.cuh"
#include "kernels/cuda/softmax_grad.cuh"
#include "kernels/cuda/squared_norm.cuh"

namespace losshead::kernels {
namespace {

using cuda::RunScalars;

constexpr size_t kAlign = 256;
constexpr size_t AlignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// A CUDA stream with its own cublasLt handle and GEMM plans: Run on different streams never
// shares them, and the mutex serialises two threads that enqueue on the same stream.
// The second stream and events serve the overlapped schedule (row kernel of one half of a chunk
// beside the GEMMs of the other): only Run, under the mutex, uses them.
class CudaStream final : public Stream {
 public:
  static constexpr int kEvents = 4;
  CudaStream(int device, cudaStream_t stream, std::unique_ptr<cuda::LtGemm> gemm)
      : device_(device), stream_(stream), gemm_(std::move(gemm)) {}
  ~CudaStream() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    if (side_ != nullptr) cudaStreamSynchronize(side_);
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (side_ != nullptr) cudaStreamDestroy(side_);
    if (norm_partials_ != nullptr) cudaFree(norm_partials_);
    gemm_.reset();
    cudaStreamDestroy(stream_);
  }

  absl::Status InitSide() {
    LOSSHEAD_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    for (cudaEvent_t& e : events_) {
      LOSSHEAD_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    // Allocated here rather than per call: cudaMalloc would synchronise the device.
    LOSSHEAD_CUDA_CHECK(cudaMalloc(&norm_partials_, sizeof(double) * cuda::kSquaredNormPartials));
    return absl::OkStatus();
  }
  // SquaredNorm's per-block partial sums; only used under the mutex.
  double* norm_partials() const { return norm_partials_; }
  cudaStream_t side() const { return side_; }
  cudaEvent_t event(int i) const { return events_[i]; }

  absl::Status Synchronize() override {
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    LOSSHEAD_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  void* native() const override { return stream_; }

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  cuda::LtGemm& gemm() { return *gemm_; }
  std::mutex& mutex() { return mu_; }

 private:
  const int device_;
  const cudaStream_t stream_;
  std::unique_ptr<cuda::LtGemm> gemm_;
  cudaStream_t side_ = nullptr;
  cudaEvent_t events_[kEvents] = {};
  double* norm_partials_ = nullptr;
  std::mutex mu_;
};

template <typename T>
constexpr cudaDataType_t CudaType();
template <>
constexpr cudaDataType_t CudaType<float>() {
  return CUDA_R_32F;
}
template <>
constexpr cudaDataType_t CudaType<__nv_bfloat16>() {
  return CUDA_R_16BF;
}
template <>
constexpr cudaDataType_t CudaType<__half>() {
  return CUDA_R_16F;
}

// Where each part of the workspace lives for a chunk of `chunk` rows.
struct Layout {
  int64_t chunk = 0;
  int64_t ldl = 0;         // logits row stride in elements (V rounded up to 16: aligned vectors)
  size_t logits_elem = 0;  // bytes per logits element
  size_t scalars_off = 0;
  size_t row_loss_off = 0;
  size_t cublas_off = 0;
  size_t cublas_bytes = 0;
  size_t logits_off = 0;
  size_t total = 0;
};

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

  absl::Status Run(const Problem& problem, const Arguments& args, Stream& stream) override {
    if (absl::Status s = CanImplement(problem); !s.ok()) return s;
    CudaStream* cs = OwnStream(stream);
    if (cs == nullptr) return ForeignStream();
    if (args.hidden == nullptr || args.weight == nullptr || args.targets == nullptr) {
      return absl::InvalidArgumentError("hidden, weight and targets must not be null");
    }
    if (args.loss_sum == nullptr || args.token_count == nullptr) {
      return absl::InvalidArgumentError("loss_sum and token_count must not be null");
    }
    if (args.workspace == nullptr || reinterpret_cast<uintptr_t>(args.workspace) % kAlign != 0) {
      return absl::InvalidArgumentError("workspace must be a 256-byte aligned device pointer");
    }
    const Layout layout = MakeLayout(problem, args.workspace_bytes);
    if (layout.chunk < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "workspace of ", args.workspace_bytes, " bytes is too small: at least ",
          MakeLayoutForChunk(problem, 1).total, " bytes are needed (see WorkspaceBytes)"));
    }

    std::lock_guard<std::mutex> lock(cs->mutex());
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    switch (problem.dtype) {
      case DType::kFP32:
        return RunTyped<float, float>(problem, args, layout, *cs);
      case DType::kFP16:
        return RunTyped<__half, float>(problem, args, layout, *cs);
      case DType::kBF16:
        if (UseBf16Logits(problem)) {
          return RunTyped<__nv_bfloat16, __nv_bfloat16>(problem, args, layout, *cs);
        }
        return RunTyped<__nv_bfloat16, float>(problem, args, layout, *cs);
    }
    return absl::InvalidArgumentError("unknown dtype");
  }

  absl::Status SquaredNorm(const float* data, int64_t count, double* result,
                           Stream& stream) override {
    if (absl::Status s = ValidateSquaredNorm(data, count, result); !s.ok()) return s;
    CudaStream* cs = OwnStream(stream);
    if (cs == nullptr) return ForeignStream();
    std::lock_guard<std::mutex> lock(cs->mutex());
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    return cuda::LaunchSquaredNorm(data, count, cs->norm_partials(), result, cs->stream());
  }

  absl::Status OptimizerStep(const OptimizerProblem& problem, const OptimizerTensors& tensors,
                             Stream& stream) override {
    if (absl::Status s = ValidateOptimizerStep(problem, tensors); !s.ok()) return s;
    CudaStream* cs = OwnStream(stream);
    if (cs == nullptr) return ForeignStream();
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

  absl::StatusOr<ShardPlan> PlanShard(const ShardProblem& shard,
                                      size_t budget_bytes) const override {
    if (absl::Status s = CanImplementShard(shard); !s.ok()) return s;
    // As in WorkspaceBytes: the stream's own memory comes out of the budget first.
    const size_t reserve = options_.handle_reserve_bytes;
    const size_t bytes = budget_bytes > reserve ? budget_bytes - reserve : 0;
    const int64_t chunk = ShardChunkRows(shard, bytes);
    if (chunk < 1) {
      return absl::ResourceExhaustedError(
          absl::StrCat("workspace budget of ", budget_bytes,
                       " bytes holds no chunk of the vocabulary shard: at least ",
                       ShardPlanBytes(shard, 1) + reserve, " bytes are needed for ", shard.rows,
                       " rows, d = ", shard.problem.d, " and ", shard.shards, " shards"));
    }
    ShardPlan plan;
    plan.chunk_rows = chunk;
    plan.workspace_bytes = ShardLayoutForChunk(shard, chunk).total;
    plan.stats_floats = static_cast<int64_t>(shard.shards) * kShardStats * chunk;
    plan.partial_floats = chunk * shard.problem.d;
    return plan;
  }

  absl::Status ShardBegin(const ShardProblem& shard, const ShardArguments& args,
                          Stream& stream) override {
    CudaStream* cs = nullptr;
    if (absl::Status s = ValidateShardCall(shard, args, nullptr, stream, &cs); !s.ok()) return s;
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
    return cuda::LaunchCountTargets(args.targets, problem.n, problem.v, o.ignore_index,
                                    o.reduction == Reduction::kMean, o.grad_scale, args.token_count,
                                    ShardScalars(args), cs->stream());
  }

  absl::Status ShardForward(const ShardProblem& shard, const ShardArguments& args, ShardChunk chunk,
                            Stream& stream) override {
    CudaStream* cs = nullptr;
    if (absl::Status s = ValidateShardCall(shard, args, &chunk, stream, &cs); !s.ok()) return s;
    const Layout layout = ShardLayoutForChunk(shard, chunk.size);
    std::lock_guard<std::mutex> lock(cs->mutex());
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    switch (shard.problem.dtype) {
      case DType::kFP32:
        return ShardForwardTyped<float, float>(shard, args, chunk, layout, *cs);
      case DType::kFP16:
        return ShardForwardTyped<__half, float>(shard, args, chunk, layout, *cs);
      case DType::kBF16:
        if (UseBf16Logits(shard.problem)) {
          return ShardForwardTyped<__nv_bfloat16, __nv_bfloat16>(shard, args, chunk, layout, *cs);
        }
        return ShardForwardTyped<__nv_bfloat16, float>(shard, args, chunk, layout, *cs);
    }
    return absl::InvalidArgumentError("unknown dtype");
  }

  absl::Status ShardBackward(const ShardProblem& shard, const ShardArguments& args,
                             ShardChunk chunk, Stream& stream) override {
    CudaStream* cs = nullptr;
    if (absl::Status s = ValidateShardCall(shard, args, &chunk, stream, &cs); !s.ok()) return s;
    const Layout layout = ShardLayoutForChunk(shard, chunk.size);
    std::lock_guard<std::mutex> lock(cs->mutex());
    LOSSHEAD_CUDA_CHECK(cudaSetDevice(device_));
    switch (shard.problem.dtype) {
      case DType::kFP32:
        return ShardBackwardTyped<float, float>(shard, args, chunk, layout, *cs);
      case DType::kFP16:
        return ShardBackwardTyped<__half, float>(shard, args, chunk, layout, *cs);
      case DType::kBF16:
        if (UseBf16Logits(shard.problem)) {
          return ShardBackwardTyped<__nv_bfloat16, __nv_bfloat16>(shard, args, chunk, layout, *cs);
        }
        return ShardBackwardTyped<__nv_bfloat16, float>(shard, args, chunk, layout, *cs);
    }
    return absl::InvalidArgumentError("unknown dtype");
  }

  absl::Status ShardStoreGradHidden(const ShardProblem& shard, const float* partial,
                                    ShardChunk chunk, void* grad_hidden, Stream& stream) override {
    if (absl::Status s = CanImplementShard(shard); !s.ok()) return s;
    CudaStream* cs = OwnStream(stream);
    if (cs == nullptr) return ForeignStream();
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
        return cuda::LaunchRoundToDType(partial, static_cast<__half*>(grad_hidden) + offset, count,
                                        cs->stream());
      case DType::kBF16:
        return cuda::LaunchRoundToDType(partial, static_cast<__nv_bfloat16*>(grad_hidden) + offset,
                                        count, cs->stream());
    }
    return absl::InvalidArgumentError("unknown dtype");
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
    return HostBuffer(data, bytes, +[](void* p) { cudaFreeHost(p); });
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
  static int64_t LogitsStride(int64_t v) { return (v + 15) / 16 * 16; }

  // `stream` as one of this backend's streams, or null when another backend made it.
  CudaStream* OwnStream(Stream& stream) const {
    auto* cs = dynamic_cast<CudaStream*>(&stream);
    return cs != nullptr && cs->device() == device_ ? cs : nullptr;
  }
  static absl::Status ForeignStream() {
    return absl::InvalidArgumentError("stream was not created by this CUDA backend");
  }

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

  bool UseBf16Logits(const Problem& problem) const {
    return problem.dtype == DType::kBF16 && options_.bf16_logits;
  }

  Layout MakeLayoutForChunk(const Problem& problem, int64_t chunk) const {
    Layout l;
    l.chunk = chunk;
    l.ldl = LogitsStride(problem.v);
    l.logits_elem = UseBf16Logits(problem) ? 2 : 4;
    l.scalars_off = 0;
    l.row_loss_off = AlignUp(sizeof(RunScalars));
    l.cublas_off = l.row_loss_off + AlignUp(static_cast<size_t>(chunk) * sizeof(float));
    l.cublas_bytes = AlignUp(options_.cublas_workspace_bytes);
    l.logits_off = l.cublas_off + l.cublas_bytes;
    l.total = l.logits_off + static_cast<size_t>(chunk) * l.ldl * l.logits_elem;
    return l;
  }

  // The largest chunk that fits `bytes`, at most n; rounded down to a multiple of 256 rows when
  // the problem is split, so that the GEMMs' token dimension fills whole tiles.
  Layout MakeLayout(const Problem& problem, size_t bytes) const {
    const Layout one = MakeLayoutForChunk(problem, 1);
    if (bytes < one.total) return Layout{};
    const size_t per_row = static_cast<size_t>(one.ldl) * one.logits_elem + sizeof(float);
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
    const bool need_grad = args.grad_hidden != nullptr || args.grad_weight != nullptr;
    constexpr cudaDataType_t kIn = CudaType<TIn>();
    constexpr cudaDataType_t kLogits = CudaType<TL>();
    static constexpr float kOne = 1.0f, kZero = 0.0f;

    LOSSHEAD_RETURN_IF_ERROR(cuda::LaunchCountTargets(
        args.targets, problem.n, problem.v, o.ignore_index, o.reduction == Reduction::kMean,
        o.grad_scale, args.token_count, scalars, stream));

    cuda::SoftmaxGradParams params;
    params.v = problem.v;
    params.ignore_index = o.ignore_index;
    params.label_smoothing = o.label_smoothing;
    params.z_loss = o.z_loss;
    params.softcap = o.softcap;

    const int chunk = ChunkRows(n, static_cast<int>(layout.chunk));
    const cuda::RowLaunch row_launch{options_.row_threads, options_.row_blocks_per_sm,
                                     smem_per_sm_};
    // Row kernel (and the chunk's loss reduction when `reduce`) over rows [q0, q0 + rows) of the
    // chunk that starts at token r0, on stream `s`.
    auto rows_step = [&](int r0, int q0, int rows, bool reduce, cudaStream_t s) -> absl::Status {
      const int64_t t0 = static_cast<int64_t>(r0) + q0;
      LOSSHEAD_RETURN_IF_ERROR((cuda::LaunchSoftmaxGrad<TL, TIn>(
          logits + static_cast<int64_t>(q0) * ldl, ldl, rows, args.targets + t0, params,
          need_grad ? grad + static_cast<int64_t>(q0) * ldg : nullptr, ldg, row_loss + q0,
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
      // Column-major view: logits^T (V x rows, ld ldl) = W^T_cm(V x D) . H_cm (D x rows).
      // Host alpha/beta here: with a device beta cublasLt cannot know it is 0 and reads the whole
      // logits chunk back in its epilogue. Only the gradient GEMMs need the device alpha.
      cuda::GemmShape g;
      g.trans_a = CUBLAS_OP_T;
      g.m = v;
      g.n = rows;
      g.k = d;
      g.type_a = g.type_b = kIn;
      g.type_c = kLogits;
      g.lda = d;
      g.ldb = d;
      g.ldc = static_cast<int>(ldl);
      return gemm.Run(g, &kOne, weight, hidden + static_cast<int64_t>(t0) * d, &kZero,
                      logits + static_cast<int64_t>(q0) * ldl, gemm_ws, gemm_ws_bytes, stream);
    };
    auto dh_gemm = [&](int t0, int rows, int q0) -> absl::Status {
      if (grad_hidden == nullptr) return absl::OkStatus();
      // dH_cm (D x rows) = W_cm (D x V) . G_cm (V x rows, ld ldg).
      cuda::GemmShape g;
      g.m = d;
      g.n = rows;
      g.k = v;
      g.type_a = g.type_b = g.type_c = kIn;
      g.lda = d;
      g.ldb = static_cast<int>(ldg);
      g.ldc = d;
      g.device_scalars = true;
      return gemm.Run(g, &scalars->grad_alpha, weight, grad + static_cast<int64_t>(q0) * ldg,
                      &scalars->zero, grad_hidden + static_cast<int64_t>(t0) * d, gemm_ws,
                      gemm_ws_bytes, stream);
    };
    auto dw_gemm = [&](int t0, int rows) -> absl::Status {
      if (args.grad_weight == nullptr) return absl::OkStatus();
      // dW_cm (D x V) += H_cm (D x rows) . G_cm^T (rows x V).
      cuda::GemmShape g;
      g.trans_b = CUBLAS_OP_T;
      g.m = d;
      g.n = v;
      g.k = rows;
      g.type_a = g.type_b = kIn;
      g.type_c = CUDA_R_32F;
      g.lda = d;
      g.ldb = static_cast<int>(ldg);
      g.ldc = d;
      g.device_scalars = true;
      return gemm.Run(g, &scalars->grad_alpha, hidden + static_cast<int64_t>(t0) * d, grad,
                      &scalars->one, args.grad_weight, gemm_ws, gemm_ws_bytes, stream);
    };

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

  // ---- Vocabulary shards ----

  // CanImplement's int32 limits, with the shard's rows as the logits' width.
  static absl::Status CanImplementShard(const ShardProblem& shard) {
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
  static absl::Status CheckChunkInTokens(const ShardProblem& shard, ShardChunk chunk) {
    if (chunk.size < 1 || chunk.begin < 0 || chunk.begin > shard.problem.n - chunk.size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "chunk [", chunk.begin, ", ", chunk.begin + chunk.size,
          ") must be a non-empty part of the micro-batch's tokens [0, ", shard.problem.n, ")"));
    }
    return absl::OkStatus();
  }

  // What ShardBegin (chunk null), ShardForward and ShardBackward check before launching anything:
  // the checks every backend makes (shard_problem.h), then this backend's stream and workspace.
  absl::Status ValidateShardCall(const ShardProblem& shard, const ShardArguments& args,
                                 const ShardChunk* chunk, Stream& stream, CudaStream** cs) const {
    if (absl::Status s = CanImplementShard(shard); !s.ok()) return s;
    if (absl::Status s = chunk != nullptr ? ValidateShardChunk(shard, args, *chunk)
                                          : ValidateShardArguments(shard, args);
        !s.ok()) {
      return s;
    }
    *cs = OwnStream(stream);
    if (*cs == nullptr) return ForeignStream();
    if (args.workspace == nullptr || reinterpret_cast<uintptr_t>(args.workspace) % kAlign != 0) {
      return absl::InvalidArgumentError("workspace must be a 256-byte aligned device pointer");
    }
    const size_t needed = ShardLayoutForChunk(shard, chunk != nullptr ? chunk->size : 1).total;
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
  Layout ShardLayoutForChunk(const ShardProblem& shard, int64_t chunk) const {
    Layout l;
    l.chunk = chunk;
    l.ldl = LogitsStride(shard.rows);
    l.logits_elem = UseBf16Logits(shard.problem) ? 2 : 4;
    l.scalars_off = 0;
    l.row_loss_off = AlignUp(sizeof(RunScalars));
    l.cublas_off = l.row_loss_off + AlignUp(static_cast<size_t>(chunk) * sizeof(float));
    l.cublas_bytes = AlignUp(options_.cublas_workspace_bytes);
    l.logits_off = l.cublas_off + l.cublas_bytes;
    l.total = l.logits_off + static_cast<size_t>(chunk) * l.ldl * l.logits_elem;
    return l;
  }

  // Workspace plus the caller's stats and dH-partial buffers for a chunk of `chunk` tokens.
  size_t ShardPlanBytes(const ShardProblem& shard, int64_t chunk) const {
    const size_t floats = static_cast<size_t>(chunk) *
                          (static_cast<size_t>(shard.shards) * kShardStats + shard.problem.d);
    return ShardLayoutForChunk(shard, chunk).total + floats * sizeof(float);
  }

  // The largest chunk whose ShardPlanBytes fit `bytes`, at most n (0 when none does); rounded
  // down to a multiple of 256 tokens when the micro-batch is split, as MakeLayout does. Depends
  // on the shard's rows but not on its rank or first row.
  int64_t ShardChunkRows(const ShardProblem& shard, size_t bytes) const {
    if (ShardPlanBytes(shard, 1) > bytes) return 0;
    const int64_t n = shard.problem.n;
    const size_t fixed = ShardPlanBytes(shard, 0);
    // Logits row, row loss, stats and partial: alignment padding makes the estimate below off by
    // a row or two either way.
    const size_t per_row =
        static_cast<size_t>(LogitsStride(shard.rows)) * ShardLayoutForChunk(shard, 1).logits_elem +
        sizeof(float) * (1 + static_cast<size_t>(shard.shards) * kShardStats + shard.problem.d);
    // Estimate, then settle on the exact largest chunk.
    int64_t chunk =
        static_cast<int64_t>(std::min<size_t>((bytes - fixed) / per_row, static_cast<size_t>(n)));
    chunk = std::max<int64_t>(chunk, 1);
    while (chunk > 1 && ShardPlanBytes(shard, chunk) > bytes) --chunk;
    while (chunk < n && ShardPlanBytes(shard, chunk + 1) <= bytes) ++chunk;
    if (chunk < n && chunk >= 256) chunk = chunk / 256 * 256;
    return chunk;
  }

  static RunScalars* ShardScalars(const ShardArguments& args) {
    return reinterpret_cast<RunScalars*>(args.workspace);
  }

  static cuda::ShardRowParams ShardRowParamsOf(const ShardProblem& shard) {
    const LossOptions& o = shard.problem.options;
    cuda::ShardRowParams p;
    p.v = shard.problem.v;
    p.row_begin = shard.row_begin;
    p.rows = shard.rows;
    p.ignore_index = o.ignore_index;
    p.label_smoothing = o.label_smoothing;
    p.z_loss = o.z_loss;
    p.softcap = o.softcap;
    return p;
  }

  // TIn: H, W and the gradient operand G; TL: the logits chunk as the first GEMM writes it.
  template <typename TIn, typename TL>
  absl::Status ShardForwardTyped(const ShardProblem& shard, const ShardArguments& args,
                                 ShardChunk chunk, const Layout& layout, CudaStream& cs) {
    const cudaStream_t stream = cs.stream();
    char* ws = static_cast<char*>(args.workspace);
    auto* logits = reinterpret_cast<TL*>(ws + layout.logits_off);
    const auto* hidden = static_cast<const TIn*>(args.hidden);
    const int64_t d = shard.problem.d;
    static constexpr float kOne = 1.0f, kZero = 0.0f;
    // Column-major view: logits^T (rows x c, ld ldl) = W_rows^T_cm (rows x D) . H_cm (D x c).
    // Host alpha/beta: nothing here depends on the token count.
    cuda::GemmShape g;
    g.trans_a = CUBLAS_OP_T;
    g.m = static_cast<int>(shard.rows);
    g.n = static_cast<int>(chunk.size);
    g.k = static_cast<int>(d);
    g.type_a = g.type_b = CudaType<TIn>();
    g.type_c = CudaType<TL>();
    g.lda = static_cast<int>(d);
    g.ldb = static_cast<int>(d);
    g.ldc = static_cast<int>(layout.ldl);
    LOSSHEAD_RETURN_IF_ERROR(cs.gemm().Run(g, &kOne, args.weight, hidden + chunk.begin * d, &kZero,
                                           logits, ws + layout.cublas_off, layout.cublas_bytes,
                                           stream));
    float* slice =
        args.stats + static_cast<int64_t>(shard.rank) * kShardStats * args.stats_chunk_rows;
    return cuda::LaunchShardStats(logits, layout.ldl, chunk.size, args.targets + chunk.begin,
                                  ShardRowParamsOf(shard), slice, args.stats_chunk_rows, stream);
  }

  template <typename TIn, typename TL>
  absl::Status ShardBackwardTyped(const ShardProblem& shard, const ShardArguments& args,
                                  ShardChunk chunk, const Layout& layout, CudaStream& cs) {
    const cudaStream_t stream = cs.stream();
    cuda::LtGemm& gemm = cs.gemm();
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
    const bool need_grad = args.grad_hidden_partial != nullptr || args.grad_weight != nullptr;
    void* const gemm_ws = ws + layout.cublas_off;
    const size_t gemm_ws_bytes = layout.cublas_bytes;
    constexpr cudaDataType_t kIn = CudaType<TIn>();

    LOSSHEAD_RETURN_IF_ERROR((cuda::LaunchShardGrad<TL, TIn>(
        logits, ldl, c, args.targets + t0, ShardRowParamsOf(shard), args.stats,
        args.stats_chunk_rows, shard.shards, need_grad ? grad : nullptr, ldg, row_loss,
        args.per_token_loss != nullptr ? args.per_token_loss + t0 : nullptr,
        args.per_token_lse != nullptr ? args.per_token_lse + t0 : nullptr, stream)));
    // One block over the chunk, after the previous chunks: the same bits on every rerun.
    LOSSHEAD_RETURN_IF_ERROR(cuda::LaunchLossReduce(row_loss, c, scalars, args.loss_sum, stream));

    if (args.grad_hidden_partial != nullptr) {
      // partial_cm (D x c) = W_rows_cm (D x rows) . G_cm (rows x c, ld ldg), fp32 out: the shards'
      // partials are summed before anything rounds them.
      cuda::GemmShape g;
      g.m = d;
      g.n = c;
      g.k = rows;
      g.type_a = g.type_b = kIn;
      g.type_c = CUDA_R_32F;
      g.lda = d;
      g.ldb = static_cast<int>(ldg);
      g.ldc = d;
      g.device_scalars = true;
      LOSSHEAD_RETURN_IF_ERROR(gemm.Run(g, &scalars->grad_alpha, args.weight, grad, &scalars->zero,
                                        args.grad_hidden_partial, gemm_ws, gemm_ws_bytes, stream));
    }
    if (args.grad_weight != nullptr) {
      // dW_rows_cm (D x rows) += H_cm (D x c) . G_cm^T (c x rows).
      cuda::GemmShape g;
      g.trans_b = CUBLAS_OP_T;
      g.m = d;
      g.n = rows;
      g.k = c;
      g.type_a = g.type_b = kIn;
      g.type_c = CUDA_R_32F;
      g.lda = d;
      g.ldb = static_cast<int>(ldg);
      g.ldc = d;
      g.device_scalars = true;
      LOSSHEAD_RETURN_IF_ERROR(
          gemm.Run(g, &scalars->grad_alpha, static_cast<const TIn*>(args.hidden) + t0 * d, grad,
                   &scalars->one, args.grad_weight, gemm_ws, gemm_ws_bytes, stream));
    }
    return absl::OkStatus();
  }

  const int device_;
  const CudaBackendOptions options_;
  const std::string description_;
  const size_t smem_per_sm_;
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
