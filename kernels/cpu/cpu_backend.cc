#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/chunk_plan.h"
#include "kernels/cpu/optimizer_step.h"
#include "kernels/cpu/row_loss.h"
#include "kernels/cpu/shard_rows.h"
#include "kernels/cpu/squared_norm.h"
#include "kernels/cpu/thread_pool.h"
#include "losshead/kernels/dtype_convert.h"

namespace losshead::kernels {
namespace {

// OpenBLAS's thread count is process-wide and its threaded GEMMs are not meant to be entered
// from several threads at once: every Run holds this lock while it computes.
std::mutex& BlasMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

class CpuStream final : public Stream {
 public:
  absl::Status Synchronize() override { return absl::OkStatus(); }
  void* native() const override { return nullptr; }
};

uint64_t MemInfoField(const std::string& field) {
  std::ifstream meminfo("/proc/meminfo");
  std::string name;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> name >> kib >> unit) {
    if (name == field + ":") return kib * 1024;
  }
  return 0;
}

absl::Status CheckTargets(const Problem& problem, const int32_t* targets, int64_t* count) {
  int64_t counted = 0;
  for (int64_t t = 0; t < problem.n; ++t) {
    const int32_t y = targets[t];
    if (y == problem.options.ignore_index) continue;
    if (y < 0 || y >= problem.v) {
      return absl::InvalidArgumentError(absl::StrCat("targets[", t, "] = ", y, " is outside [0, ",
                                                     problem.v, ") and is not ignore_index (",
                                                     problem.options.ignore_index, ")"));
    }
    ++counted;
  }
  *count = counted;
  return absl::OkStatus();
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) : threads_(threads), pool_(threads) {}

  absl::string_view name() const override { return "cpu"; }
  std::string device_description() const override {
    return absl::StrCat("cpu (", threads_, " threads)");
  }
  MemoryInfo memory_info() const override {
    MemoryInfo info;
    info.total_bytes = MemInfoField("MemTotal");
    info.free_bytes = MemInfoField("MemAvailable");
    if (info.total_bytes == 0) {
      const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
      info.total_bytes = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * page;
      info.free_bytes = static_cast<uint64_t>(sysconf(_SC_AVPHYS_PAGES)) * page;
    }
    return info;
  }

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
                                                          int64_t chunk) {
    ShardWorkspace ws;
    ws.layout = LayoutShard(shard, chunk);
    if (args.workspace_bytes < ws.layout.plan.workspace_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shard workspace of ", args.workspace_bytes, " bytes is too small: chunks of ", chunk,
          " tokens need ", ws.layout.plan.workspace_bytes, " (see PlanShard)"));
    }
    const size_t misalignment =
        reinterpret_cast<uintptr_t>(args.workspace) % kCpuWorkspaceAlignment;
    ws.base = static_cast<char*>(args.workspace) +
              (misalignment == 0 ? 0 : kCpuWorkspaceAlignment - misalignment);
    return ws;
  }

  // The fp32 H rows of `chunk` and the shard's fp32 W, converted into the workspace when needed.
  std::pair<const float*, const float*> ShardInputs(const ShardProblem& shard,
                                                    const ShardArguments& args, ShardChunk chunk,
                                                    const ShardWorkspace& ws) {
    const int64_t d = shard.problem.d;
    const DType dtype = shard.problem.dtype;
    const size_t element = DTypeSize(dtype);
    if (!ws.layout.converts_inputs) {
      return {static_cast<const float*>(args.hidden) + chunk.begin * d,
              static_cast<const float*>(args.weight)};
    }
    ConvertRows(dtype, static_cast<const char*>(args.hidden) + chunk.begin * d * element,
                ws.hidden(), chunk.size, d);
    ConvertRows(dtype, args.weight, ws.weight(), shard.rows, d);
    return {ws.hidden(), ws.weight()};
  }

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

absl::Status CpuBackend::Run(const Problem& problem, const Arguments& args, Stream& /*stream*/) {
  if (absl::Status status = CanImplement(problem); !status.ok()) return status;
  if (args.hidden == nullptr || args.weight == nullptr || args.targets == nullptr ||
      args.loss_sum == nullptr || args.token_count == nullptr) {
    return absl::InvalidArgumentError(
        "hidden, weight, targets, loss_sum and token_count must not be null");
  }
  if (args.workspace == nullptr && args.workspace_bytes > 0) {
    return absl::InvalidArgumentError("workspace is null but workspace_bytes > 0");
  }
  const bool stashed = args.grad_stash.data != nullptr;
  if (stashed) {
    if (args.grad_weight != nullptr) {
      return absl::InvalidArgumentError("grad_weight must be null when grad_stash is given");
    }
    if (absl::Status status = ValidateGradStash(args.grad_stash, problem.n); !status.ok()) {
      return status;
    }
  }
  absl::StatusOr<ChunkPlan> plan_or = PlanChunks(problem, args.workspace_bytes);
  if (!plan_or.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace too small: ", plan_or.status().message()));
  }
  const ChunkPlan& plan = *plan_or;
  int64_t token_count = 0;
  if (absl::Status status = CheckTargets(problem, args.targets, &token_count); !status.ok()) {
    return status;
  }

  const int64_t n = problem.n;
  const int64_t d = problem.d;
  const int64_t v = problem.v;
  const DType dtype = problem.dtype;
  const LossOptions& options = problem.options;
  const size_t element = DTypeSize(dtype);
  float grad_scale = options.grad_scale;
  if (options.reduction == Reduction::kMean) {
    grad_scale = token_count > 0 ? static_cast<float>(static_cast<double>(options.grad_scale) /
                                                      static_cast<double>(token_count))
                                 : 0.0f;
  }
  const bool want_grad = args.grad_hidden != nullptr || args.grad_weight != nullptr || stashed;
  float* stash_grad = nullptr;
  float* stash_hidden = nullptr;
  if (stashed) {
    char* stash = static_cast<char*>(args.grad_stash.data);
    stash_grad = reinterpret_cast<float*>(stash) + args.grad_stash.tokens * v;
    stash_hidden =
        reinterpret_cast<float*>(stash + StashHiddenOffset(problem, args.grad_stash.capacity)) +
        args.grad_stash.tokens * d;
  }

  const size_t misalignment = reinterpret_cast<uintptr_t>(args.workspace) % kCpuWorkspaceAlignment;
  char* base = static_cast<char*>(args.workspace) +
               (misalignment == 0 ? 0 : kCpuWorkspaceAlignment - misalignment);
  float* logits = reinterpret_cast<float*>(base + plan.logits_offset);
  double* row_stats = reinterpret_cast<double*>(base + plan.row_stats_offset);
  float* hidden_f32 = reinterpret_cast<float*>(base + plan.hidden_offset);
  float* grad_hidden_f32 = reinterpret_cast<float*>(base + plan.grad_hidden_offset);
  float* weight_f32 = reinterpret_cast<float*>(base + plan.weight_offset);
  const int64_t block_rows = plan.weight_block_rows;
  const bool weight_whole = !plan.converts_inputs || block_rows == v;

  std::lock_guard<std::mutex> blas_lock(BlasMutex());
  openblas_set_num_threads(threads_);

  if (plan.converts_inputs && block_rows == v) ConvertRows(dtype, args.weight, weight_f32, v, d);
  // The fp32 rows [b0, b0 + rows) of W, converting them into the block buffer when needed.
  auto weight_block = [&](int64_t b0, int64_t rows) -> const float* {
    if (!plan.converts_inputs) return static_cast<const float*>(args.weight) + b0 * d;
    if (weight_whole) return weight_f32 + b0 * d;
    ConvertRows(dtype, static_cast<const char*>(args.weight) + b0 * d * element, weight_f32, rows,
                d);
    return weight_f32;
  };

  double loss_sum = 0.0;
  for (int64_t c0 = 0; c0 < n; c0 += plan.chunk_rows) {
    const int64_t rows = std::min(plan.chunk_rows, n - c0);
    const int32_t* targets = args.targets + c0;
    const float* hidden;
    if (plan.converts_inputs) {
      ConvertRows(dtype, static_cast<const char*>(args.hidden) + c0 * d * element, hidden_f32, rows,
                  d);
      hidden = hidden_f32;
    } else {
      hidden = static_cast<const float*>(args.hidden) + c0 * d;
    }

    // Logits chunk: rows x v = H_chunk . W^T, one weight block at a time.
    for (int64_t b0 = 0; b0 < v; b0 += block_rows) {
      const int64_t bn = std::min(block_rows, v - b0);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(rows),
                  static_cast<int>(bn), static_cast<int>(d), 1.0f, hidden, static_cast<int>(d),
                  weight_block(b0, bn), static_cast<int>(d), 0.0f, logits + b0,
                  static_cast<int>(v));
    }

    pool_.ParallelFor(rows, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const bool ignored = targets[r] == options.ignore_index;
        const RowLoss row =
            ComputeRowLoss(logits + r * v, v, targets[r], ignored, options, grad_scale, want_grad);
        row_stats[2 * r] = row.loss;
        row_stats[2 * r + 1] = row.lse;
      }
    });
    int64_t chunk_tokens = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const bool ignored = targets[r] == options.ignore_index;
      chunk_tokens += ignored ? 0 : 1;
      loss_sum += row_stats[2 * r];  // in token order: the sum is the same every run
      if (args.per_token_loss != nullptr) {
        args.per_token_loss[c0 + r] = static_cast<float>(row_stats[2 * r]);
      }
      if (args.per_token_lse != nullptr) {
        args.per_token_lse[c0 + r] = static_cast<float>(row_stats[2 * r + 1]);
      }
    }

    if (stashed) {
      // G is already scaled (ComputeRowLoss applies grad_scale), and zero for ignored rows.
      std::memcpy(stash_grad + c0 * v, logits, static_cast<size_t>(rows * v) * sizeof(float));
      std::memcpy(stash_hidden + c0 * d, hidden, static_cast<size_t>(rows * d) * sizeof(float));
    }
    char* grad_hidden_out = args.grad_hidden == nullptr
                                ? nullptr
                                : static_cast<char*>(args.grad_hidden) + c0 * d * element;
    if (chunk_tokens == 0) {
      // Nothing but ignored tokens: dH is zero (all-zero bits in every dtype), dW is unchanged.
      if (grad_hidden_out != nullptr) std::memset(grad_hidden_out, 0, rows * d * element);
      continue;
    }
    if (args.grad_weight != nullptr) {
      // dW (v x d) += G^T . H_chunk
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(v), static_cast<int>(d),
                  static_cast<int>(rows), 1.0f, logits, static_cast<int>(v), hidden,
                  static_cast<int>(d), 1.0f, args.grad_weight, static_cast<int>(d));
    }
    if (grad_hidden_out != nullptr) {
      // dH chunk (rows x d) = G . W, summed over weight blocks in fp32 before any rounding.
      float* dst =
          plan.converts_inputs ? grad_hidden_f32 : reinterpret_cast<float*>(grad_hidden_out);
      for (int64_t b0 = 0; b0 < v; b0 += block_rows) {
        const int64_t bn = std::min(block_rows, v - b0);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(rows),
                    static_cast<int>(d), static_cast<int>(bn), 1.0f, logits + b0,
                    static_cast<int>(v), weight_block(b0, bn), static_cast<int>(d),
                    b0 == 0 ? 0.0f : 1.0f, dst, static_cast<int>(d));
      }
      if (plan.converts_inputs) {
        pool_.ParallelFor(rows, [&](int64_t begin, int64_t end) {
          FromFloat(dtype, grad_hidden_f32 + begin * d, grad_hidden_out + begin * d * element,
                    static_cast<size_t>((end - begin) * d));
        });
      }
    }
  }

  *args.loss_sum = static_cast<float>(loss_sum);
  *args.token_count = token_count;
  return absl::OkStatus();
}

absl::Status CpuBackend::FlushGradStash(const Problem& problem, const GradStash& stash,
                                        float* grad_weight, void* /*workspace*/,
                                        size_t /*workspace_bytes*/, Stream& /*stream*/) {
  if (absl::Status status = CanImplement(problem); !status.ok()) return status;
  if (absl::Status status = ValidateGradStash(stash, 0); !status.ok()) return status;
  if (grad_weight == nullptr) return absl::InvalidArgumentError("grad_weight must not be null");
  if (stash.tokens == 0) return absl::OkStatus();
  const auto* grad = static_cast<const float*>(stash.data);
  const auto* hidden = reinterpret_cast<const float*>(static_cast<const char*>(stash.data) +
                                                      StashHiddenOffset(problem, stash.capacity));
  std::lock_guard<std::mutex> blas_lock(BlasMutex());
  openblas_set_num_threads(threads_);
  // dW (v x d) += G^T . H over every stashed token.
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(problem.v),
              static_cast<int>(problem.d), static_cast<int>(stash.tokens), 1.0f, grad,
              static_cast<int>(problem.v), hidden, static_cast<int>(problem.d), 1.0f, grad_weight,
              static_cast<int>(problem.d));
  return absl::OkStatus();
}

absl::Status CpuBackend::ShardBegin(const ShardProblem& shard, const ShardArguments& args,
                                    Stream& /*stream*/) {
  if (absl::Status status = CanImplementShard(shard); !status.ok()) return status;
  if (absl::Status status = ValidateShardArguments(shard, args); !status.ok()) return status;
  absl::StatusOr<ShardWorkspace> ws = ShardWorkspaceFor(shard, args, 1);
  if (!ws.ok()) return ws.status();
  int64_t token_count = 0;
  if (absl::Status status = CheckTargets(shard.problem, args.targets, &token_count); !status.ok()) {
    return status;
  }
  const LossOptions& options = shard.problem.options;
  float grad_scale = options.grad_scale;
  if (options.reduction == Reduction::kMean) {
    grad_scale = token_count > 0 ? static_cast<float>(static_cast<double>(options.grad_scale) /
                                                      static_cast<double>(token_count))
                                 : 0.0f;
  }
  *ws->loss_acc() = 0.0;
  *ws->grad_scale() = grad_scale;
  *ws->token_count() = token_count;
  if (args.token_count != nullptr) *args.token_count = token_count;
  if (args.loss_sum != nullptr) *args.loss_sum = 0.0f;
  return absl::OkStatus();
}

absl::Status CpuBackend::ShardForward(const ShardProblem& shard, const ShardArguments& args,
                                      ShardChunk chunk, Stream& /*stream*/) {
  if (absl::Status status = CanImplementShard(shard); !status.ok()) return status;
  if (absl::Status status = ValidateShardChunk(shard, args, chunk); !status.ok()) return status;
  absl::StatusOr<ShardWorkspace> ws = ShardWorkspaceFor(shard, args, chunk.size);
  if (!ws.ok()) return ws.status();
  const int64_t d = shard.problem.d;
  const int64_t rows = shard.rows;
  std::lock_guard<std::mutex> blas_lock(BlasMutex());
  openblas_set_num_threads(threads_);
  const auto [hidden, weight] = ShardInputs(shard, args, chunk, *ws);
  float* logits = ws->logits();
  // z (chunk x rows) = H_chunk . W_rows^T
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(chunk.size),
              static_cast<int>(rows), static_cast<int>(d), 1.0f, hidden, static_cast<int>(d),
              weight, static_cast<int>(d), 0.0f, logits, static_cast<int>(rows));
  const int64_t stride = args.stats_chunk_rows;
  float* slice = args.stats + static_cast<int64_t>(shard.rank) * kShardStats * stride;
  const int32_t ignore = shard.problem.options.ignore_index;
  pool_.ParallelFor(chunk.size, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int32_t y = args.targets[chunk.begin + q];
      const int64_t local = y == ignore ? -1 : y - shard.row_begin;
      const ShardRowStats row =
          ComputeShardRowStats(logits + q * rows, rows, local, shard.problem.options.softcap);
      for (int s = 0; s < kShardStats; ++s) slice[s * stride + q] = row.stats[s];
    }
  });
  return absl::OkStatus();
}

absl::Status CpuBackend::ShardBackward(const ShardProblem& shard, const ShardArguments& args,
                                       ShardChunk chunk, Stream& /*stream*/) {
  if (absl::Status status = CanImplementShard(shard); !status.ok()) return status;
  if (absl::Status status = ValidateShardChunk(shard, args, chunk); !status.ok()) return status;
  absl::StatusOr<ShardWorkspace> ws = ShardWorkspaceFor(shard, args, chunk.size);
  if (!ws.ok()) return ws.status();
  const int64_t d = shard.problem.d;
  const int64_t rows = shard.rows;
  const LossOptions& options = shard.problem.options;
  const float grad_scale = *ws->grad_scale();
  const bool stashed = args.grad_stash.data != nullptr;
  const bool want_grad =
      args.grad_hidden_partial != nullptr || args.grad_weight != nullptr || stashed;
  float* logits = ws->logits();
  double* row_stats = ws->row_stats();
  pool_.ParallelFor(chunk.size, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int32_t y = args.targets[chunk.begin + q];
      const bool ignored = y == options.ignore_index;
      const ShardTokenLoss token = CombineShardStats(
          args.stats, args.stats_chunk_rows, shard.shards, q, ignored, options, shard.problem.v);
      row_stats[2 * q] = token.loss;
      row_stats[2 * q + 1] = token.lse;
      if (want_grad) {
        ComputeShardRowGradient(logits + q * rows, rows, ignored ? -1 : y - shard.row_begin,
                                ignored, token.lse, options, shard.problem.v, grad_scale);
      }
    }
  });
  double& loss_acc = *ws->loss_acc();
  for (int64_t q = 0; q < chunk.size; ++q) {
    loss_acc += row_stats[2 * q];  // in token order: the same sum every run
    if (args.per_token_loss != nullptr) {
      args.per_token_loss[chunk.begin + q] = static_cast<float>(row_stats[2 * q]);
    }
    if (args.per_token_lse != nullptr) {
      args.per_token_lse[chunk.begin + q] = static_cast<float>(row_stats[2 * q + 1]);
    }
  }
  if (args.loss_sum != nullptr) *args.loss_sum = static_cast<float>(loss_acc);
  if (!want_grad) return absl::OkStatus();

  std::lock_guard<std::mutex> blas_lock(BlasMutex());
  openblas_set_num_threads(threads_);
  const auto [hidden, weight] = ShardInputs(shard, args, chunk, *ws);
  if (stashed) {
    // G is already scaled (ComputeShardRowGradient applies grad_scale); laid out as Run's stash
    // of a head of `rows` classes.
    const GradStash& stash = args.grad_stash;
    const int64_t row = stash.tokens + chunk.begin;
    char* base = static_cast<char*>(stash.data);
    std::memcpy(reinterpret_cast<float*>(base) + row * rows, logits,
                static_cast<size_t>(chunk.size * rows) * sizeof(float));
    std::memcpy(
        reinterpret_cast<float*>(base + StashHiddenOffset(ShardStashShape(shard), stash.capacity)) +
            row * d,
        hidden, static_cast<size_t>(chunk.size * d) * sizeof(float));
  }
  if (args.grad_hidden_partial != nullptr) {
    // dH partial (chunk x d) = G . W_rows
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(chunk.size),
                static_cast<int>(d), static_cast<int>(rows), 1.0f, logits, static_cast<int>(rows),
                weight, static_cast<int>(d), 0.0f, args.grad_hidden_partial, static_cast<int>(d));
  }
  if (args.grad_weight != nullptr) {
    // dW_rows (rows x d) += G^T . H_chunk
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(rows),
                static_cast<int>(d), static_cast<int>(chunk.size), 1.0f, logits,
                static_cast<int>(rows), hidden, static_cast<int>(d), 1.0f, args.grad_weight,
                static_cast<int>(d));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::ShardStoreGradHidden(const ShardProblem& shard, const float* partial,
                                              ShardChunk chunk, void* grad_hidden,
                                              Stream& /*stream*/) {
  if (absl::Status status = CanImplementShard(shard); !status.ok()) return status;
  if (partial == nullptr || grad_hidden == nullptr) {
    return absl::InvalidArgumentError(
        "ShardStoreGradHidden: partial and grad_hidden must not be null");
  }
  if (chunk.size < 1 || chunk.begin < 0 || chunk.begin > shard.problem.n - chunk.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard chunk [", chunk.begin, ", ", chunk.begin + chunk.size,
                     ") must be a non-empty part of [0, ", shard.problem.n, ")"));
  }
  const int64_t d = shard.problem.d;
  const DType dtype = shard.problem.dtype;
  const size_t element = DTypeSize(dtype);
  char* out = static_cast<char*>(grad_hidden) + chunk.begin * d * static_cast<int64_t>(element);
  pool_.ParallelFor(chunk.size, [&](int64_t begin, int64_t end) {
    FromFloat(dtype, partial + begin * d, out + begin * d * static_cast<int64_t>(element),
              static_cast<size_t>((end - begin) * d));
  });
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<Backend> CreateCpuBackend(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace losshead::kernels
