// The CPU backend's class, shared by the files that implement it: cpu_backend.cc (memory,
// copies, the optimizer and the factory), cpu_run.cc (Run and the gradient stash's flush) and
// cpu_shard.cc (a vocabulary shard's calls). Internal to kernels/cpu: CreateCpuBackend
// (cpu_backend.h) is the only way in.
#ifndef LOSSHEAD_KERNELS_CPU_CPU_BACKEND_IMPL_H_
#define LOSSHEAD_KERNELS_CPU_CPU_BACKEND_IMPL_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cpu/chunk_plan.h"
#include "kernels/cpu/embedding_rows.h"
#include "kernels/cpu/optimizer_step.h"
#include "kernels/cpu/squared_norm.h"
#include "kernels/cpu/thread_pool.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/embedding_rows.h"

namespace losshead::kernels::cpu {

// OpenBLAS's thread count is process-wide and its threaded GEMMs are not meant to be entered
// from several threads at once: every call that runs a GEMM holds this lock while it computes.
std::mutex& BlasMutex();

// Counts the targets that are not ignore_index into *count; INVALID_ARGUMENT for a target outside
// [0, v) that is not ignore_index.
absl::Status CheckTargets(const Problem& problem, const int32_t* targets, int64_t* count);

// The factor every gradient is multiplied by: grad_scale, divided by the counted tokens for kMean
// (0 when none is counted).
float EffectiveGradScale(const LossOptions& options, int64_t token_count);

// Total and available host memory, from /proc/meminfo where it can be read.
MemoryInfo HostMemoryInfo();

class CpuStream final : public Stream {
 public:
  absl::Status Synchronize() override { return absl::OkStatus(); }
  void* native() const override { return nullptr; }
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) : threads_(threads), pool_(threads) {}

  absl::string_view name() const override { return "cpu"; }
  std::string device_description() const override {
    return absl::StrCat("cpu (", threads_, " threads)");
  }
  MemoryInfo memory_info() const override { return HostMemoryInfo(); }

  absl::Status CanImplement(const Problem& problem) const override {
    if (absl::Status status = ValidateProblem(problem); !status.ok()) return status;
    // BLAS leading dimensions are 32-bit.
    if (problem.d > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cpu backend needs d to fit in int32, got ", problem.d));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<size_t> WorkspaceBytes(const Problem& problem,
                                        size_t budget_bytes) const override {
    if (absl::Status status = CanImplement(problem); !status.ok()) return status;
    absl::StatusOr<ChunkPlan> plan = PlanChunks(problem, budget_bytes);
    if (!plan.ok()) return plan.status();
    return plan->bytes;
  }

  absl::Status Run(const Problem& problem, const Arguments& args, Stream& stream) override;

  absl::StatusOr<size_t> GradStashBytes(const Problem& problem, int64_t capacity) const override {
    if (absl::Status status = CanImplement(problem); !status.ok()) return status;
    if (capacity < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("grad stash capacity must be >= 1, got ", capacity));
    }
    return StashHiddenOffset(problem, capacity) +
           static_cast<size_t>(capacity) * problem.d * sizeof(float);
  }
  absl::Status FlushGradStash(const Problem& problem, const GradStash& stash, float* grad_weight,
                              void* workspace, size_t workspace_bytes, Stream& stream) override;

  absl::StatusOr<ShardPlan> PlanShard(const ShardProblem& shard,
                                      size_t budget_bytes) const override {
    if (absl::Status status = CanImplementShard(shard); !status.ok()) return status;
    absl::StatusOr<ShardChunkPlan> plan = PlanShardChunks(shard, budget_bytes);
    if (!plan.ok()) return plan.status();
    return plan->plan;
  }
  absl::Status ShardBegin(const ShardProblem& shard, const ShardArguments& args,
                          Stream& stream) override;
  absl::Status ShardForward(const ShardProblem& shard, const ShardArguments& args, ShardChunk chunk,
                            Stream& stream) override;
  absl::Status ShardBackward(const ShardProblem& shard, const ShardArguments& args,
                             ShardChunk chunk, Stream& stream) override;
  absl::Status ShardStoreGradHidden(const ShardProblem& shard, const float* partial,
                                    ShardChunk chunk, void* grad_hidden, Stream& stream) override;

  absl::Status SquaredNorm(const float* data, int64_t count, double* result, Stream&) override {
    if (absl::Status status = ValidateSquaredNorm(data, count, result); !status.ok()) return status;
    *result = CpuSquaredNorm(data, count, pool_);
    return absl::OkStatus();
  }

  absl::Status OptimizerStep(const OptimizerProblem& problem, const OptimizerTensors& tensors,
                             Stream&) override {
    if (absl::Status status = ValidateOptimizerStep(problem, tensors); !status.ok()) return status;
    CpuOptimizerStep(problem, tensors, pool_);
    return absl::OkStatus();
  }

  absl::Status CheckOptimizerStep(const OptimizerProblem& problem, const OptimizerTensors& tensors,
                                  OptimizerCheck* result, Stream&) override {
    if (absl::Status status = ValidateOptimizerStep(problem, tensors); !status.ok()) return status;
    if (result == nullptr) return absl::InvalidArgumentError("result must not be null");
    *result = CpuCheckOptimizerStep(problem, tensors, pool_);
    return absl::OkStatus();
  }

  absl::Status GatherRows(DType dtype, const void* weights, int64_t rows, int64_t d,
                          const int64_t* ids, int64_t n, void* out, Stream&) override {
    if (absl::Status s = ValidateGatherRows(dtype, weights, rows, d, ids, n, out); !s.ok()) {
      return s;
    }
    // Host memory: the ids can be checked here, so a bad one never reads outside the table.
    if (absl::Status s = CheckRowIds(ids, n, rows, false); !s.ok()) {
      return s;
    }
    CpuGatherRows(dtype, weights, d, ids, n, out, pool_);
    return absl::OkStatus();
  }
  absl::Status IndexAddRows(const float* values, const int64_t* ids, int64_t n, int64_t d,
                            float* grad, int64_t rows, Stream&) override {
    if (absl::Status s = ValidateIndexAddRows(values, ids, n, d, grad, rows); !s.ok()) return s;
    if (absl::Status s = CheckRowIds(ids, n, rows, true); !s.ok()) {
      return s;
    }
    CpuIndexAddRows(values, ids, n, d, grad, pool_);
    return absl::OkStatus();
  }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    if (bytes == 0) return DeviceBuffer(this, nullptr, 0);
    const size_t rounded =
        (bytes + kCpuWorkspaceAlignment - 1) / kCpuWorkspaceAlignment * kCpuWorkspaceAlignment;
    void* data = std::aligned_alloc(kCpuWorkspaceAlignment, rounded);
    if (data == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " host bytes"));
    }
    return DeviceBuffer(this, data, bytes);
  }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override {
    return std::unique_ptr<Stream>(new CpuStream());
  }
  absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes, Stream&) override {
    return Copy(dst, host_src, bytes);
  }
  absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes, Stream&) override {
    return Copy(host_dst, src, bytes);
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes, Stream&) override {
    return Copy(dst, src, bytes);
  }
  absl::Status Memset(void* dst, int value, size_t bytes, Stream&) override {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr) return absl::InvalidArgumentError("Memset to a null pointer");
    std::memset(dst, value, bytes);
    return absl::OkStatus();
  }

 protected:
  void Free(void* data) override { std::free(data); }

 private:
  static absl::Status Copy(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return absl::OkStatus();
    if (dst == nullptr || src == nullptr)
      return absl::InvalidArgumentError("copy with a null pointer");
    std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }

  absl::Status CanImplementShard(const ShardProblem& shard) const {
    if (absl::Status status = ValidateShardProblem(shard); !status.ok()) return status;
    return CanImplement(shard.problem);
  }

  // The workspace of a shard call as laid out for chunks of up to `chunk` tokens, checked against
  // the bytes given; `base` is the aligned start.
  struct ShardWorkspace {
    ShardChunkPlan layout;
    char* base = nullptr;
    double* loss_acc() const { return reinterpret_cast<double*>(base + layout.scalars_offset); }
    float* grad_scale() const {
      return reinterpret_cast<float*>(base + layout.scalars_offset + sizeof(double));
    }
    int64_t* token_count() const {
      return reinterpret_cast<int64_t*>(base + layout.scalars_offset + 2 * sizeof(double));
    }
    float* logits() const { return reinterpret_cast<float*>(base + layout.logits_offset); }
    double* row_stats() const { return reinterpret_cast<double*>(base + layout.row_stats_offset); }
    float* hidden() const { return reinterpret_cast<float*>(base + layout.hidden_offset); }
    float* weight() const { return reinterpret_cast<float*>(base + layout.weight_offset); }
  };
  static absl::StatusOr<ShardWorkspace> ShardWorkspaceFor(const ShardProblem& shard,
                                                          const ShardArguments& args,
                                                          int64_t chunk);

  // The fp32 H rows of `chunk` and the shard's fp32 W, converted into the workspace when needed.
  std::pair<const float*, const float*> ShardInputs(const ShardProblem& shard,
                                                    const ShardArguments& args, ShardChunk chunk,
                                                    const ShardWorkspace& ws);

  // Converts `rows` rows of `d` elements from `dtype` to fp32, split over the pool.
  void ConvertRows(DType dtype, const void* src, float* dst, int64_t rows, int64_t d) {
    const size_t element = DTypeSize(dtype);
    pool_.ParallelFor(rows, [&](int64_t begin, int64_t end) {
      ToFloat(dtype, static_cast<const char*>(src) + begin * d * element, dst + begin * d,
              static_cast<size_t>((end - begin) * d));
    });
  }

  // The stash holds G (capacity x v) and then H (capacity x d), both fp32: the CPU backend's G
  // is never rounded to the input dtype, and H is the fp32 image Run computes with.
  static size_t StashHiddenOffset(const Problem& problem, int64_t capacity) {
    const size_t g = static_cast<size_t>(capacity) * problem.v * sizeof(float);
    return (g + kCpuWorkspaceAlignment - 1) / kCpuWorkspaceAlignment * kCpuWorkspaceAlignment;
  }

  const int threads_;
  ThreadPool pool_;
};

}  // namespace losshead::kernels::cpu

#endif  // LOSSHEAD_KERNELS_CPU_CPU_BACKEND_IMPL_H_
