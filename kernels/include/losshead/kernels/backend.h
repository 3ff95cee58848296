// A device that can hold a head's tensors and run the fused linear + cross-entropy on them.
#ifndef LOSSHEAD_KERNELS_BACKEND_H_
#define LOSSHEAD_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/kernels/optimizer.h"
#include "losshead/kernels/problem.h"
#include "losshead/kernels/shard_problem.h"

namespace losshead::kernels {

class Backend;

// A point in a Stream (Stream::Mark): the work enqueued before it.
class StreamMark {
 public:
  virtual ~StreamMark() = default;
  // Blocks until the work before the mark has finished, however much was enqueued after it;
  // returns its first error.
  virtual absl::Status Wait() = 0;
};

// An ordered queue of work on a backend (a cudaStream_t on CUDA; on the CPU, work runs inline in
// the calling thread and Synchronize returns at once). Destroying it waits for its work.
class Stream {
 public:
  virtual ~Stream() = default;
  // Blocks until all work enqueued so far has finished; returns its first error.
  virtual absl::Status Synchronize() = 0;
  // The native handle (cudaStream_t) or nullptr.
  virtual void* native() const = 0;
  // A mark after the work enqueued so far, so that a caller can let others enqueue more and still
  // wait for its own work alone. The default, for streams whose work runs inline, is a mark
  // already reached.
  virtual absl::StatusOr<std::unique_ptr<StreamMark>> Mark();
};

// Memory owned by a backend; freed on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend* owner, void* data, size_t bytes) : owner_(owner), data_(data), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  void Reset();

 private:
  Backend* owner_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Host memory that a backend copies to and from at full speed (page-locked on CUDA, where a copy
// from ordinary pageable memory goes through a driver bounce buffer at a fraction of the bus
// rate). Freed on destruction. Move-only.
class HostBuffer {
 public:
  using FreeFn = void (*)(void*);
  HostBuffer() = default;
  HostBuffer(void* data, size_t bytes, FreeFn free) : data_(data), bytes_(bytes), free_(free) {}
  HostBuffer(HostBuffer&& other) noexcept { *this = std::move(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { Reset(); }

  char* data() const { return static_cast<char*>(data_); }
  size_t bytes() const { return bytes_; }
  void Reset();

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  FreeFn free_ = nullptr;
};

struct MemoryInfo {
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;
};

// The backend contract. All methods are thread-safe. Methods taking a Stream enqueue their work
// on it and may return before it finishes (CUDA); host memory passed to such a copy must stay
// valid until the stream is synchronized. Nothing here synchronizes with the host unless named so.
class Backend {
 public:
  virtual ~Backend() = default;

  virtual absl::string_view name() const = 0;  // "cpu" | "cuda"
  virtual std::string device_description() const = 0;
  // The CUDA device ordinal this backend runs on, or -1 where it has none (the CPU backend, the
  // default): CreateCollective gives each device one rank. A wrapper of a CUDA backend forwards it.
  virtual int device_ordinal() const { return -1; }
  virtual MemoryInfo memory_info() const = 0;

  // INVALID_ARGUMENT if this backend cannot run `problem` (ValidateProblem plus its own limits).
  virtual absl::Status CanImplement(const Problem& problem) const = 0;
  // Bytes of workspace that Run needs for `problem`, at most `budget_bytes` and independent of N
  // beyond a per-chunk cap. RESOURCE_EXHAUSTED if no chunk size fits the budget.
  virtual absl::StatusOr<size_t> WorkspaceBytes(const Problem& problem,
                                                size_t budget_bytes) const = 0;
  // Forward and backward in one call: see Arguments. Validates first and launches nothing on error.
  virtual absl::Status Run(const Problem& problem, const Arguments& args, Stream& stream) = 0;

  // Deferred dW (grad_stash.h). Bytes of a stash of `capacity` tokens for `problem`'s shape (its
  // n is not used). INVALID_ARGUMENT for capacity < 1 or a problem CanImplement refuses;
  // UNIMPLEMENTED (the default) where the backend has no stash: Run then adds to dW at once.
  virtual absl::StatusOr<size_t> GradStashBytes(const Problem& problem, int64_t capacity) const;
  // dW (V x D fp32) += G^T H over the stash's rows [0, stash.tokens), in one GEMM; nothing for
  // tokens = 0. `workspace` (optional) is scratch for the GEMM, the memory a Run used will do.
  // Validates first (ValidateGradStash, problem's shape, null grad_weight) and launches nothing on
  // error. The stash is unchanged: the caller starts it again at tokens = 0.
  virtual absl::Status FlushGradStash(const Problem& problem, const GradStash& stash,
                                      float* grad_weight, void* workspace, size_t workspace_bytes,
                                      Stream& stream);

  // Sum of squares of `count` fp32 values at `data`, accumulated in fp64 over a partition of the
  // elements fixed by `count` alone, written to `*result` (one double in this backend's memory).
  // A rerun gives the same bits whatever the thread count or device; the CPU and CUDA backends
  // agree to fp64 rounding. Any NaN or Inf in `data` makes the result non-finite, so one check of
  // it covers the whole gradient. For the clip coefficient of an optimizer step: the norm of the
  // raw dW accumulator, which the caller turns into OptimizerProblem::grad_scale.
  // INVALID_ARGUMENT (nothing launched) for count < 0 or a null pointer where one is needed.
  virtual absl::Status SquaredNorm(const float* data, int64_t count, double* result,
                                   Stream& stream) = 0;
  // One optimizer step in a single pass over the buffers (see OptimizerProblem): reads grad,
  // master (the weights when fp32) and state; writes master, state and the rounded weights, and
  // zeroes grad. Validates first (ValidateOptimizerStep) and launches nothing on error.
  // Elementwise: a rerun on the same inputs gives the same bits, and the CPU and CUDA backends
  // give the same bits too (every fp32 operation rounded separately, in the same order).
  virtual absl::Status OptimizerStep(const OptimizerProblem& problem,
                                     const OptimizerTensors& tensors, Stream& stream) = 0;
  // What OptimizerStep(problem, tensors) would write, without writing it: reads the same
  // buffers, computes every element's new values the same way, and writes only `*result` (one
  // OptimizerCheck in this backend's memory): how many elements would not be finite, and the
  // largest new magnitudes. An apply that would carry a weight past its dtype's range is refused
  // on this before anything changes. Validates first (ValidateOptimizerStep, a null result) and
  // launches nothing on error.
  virtual absl::Status CheckOptimizerStep(const OptimizerProblem& problem,
                                          const OptimizerTensors& tensors, OptimizerCheck* result,
                                          Stream& stream) = 0;

  // A vocabulary shard's halves of Run (see shard_problem.h for the sequence and the exchange
  // between them). Each validates first (ValidateShardProblem, null pointers, a chunk outside
  // [0, n) or larger than the plan's, a workspace smaller than the plan's) and launches nothing
  // on error. RESOURCE_EXHAUSTED from PlanShard when no chunk fits the budget. A backend that
  // cannot run shards (a test double) answers UNIMPLEMENTED, the default.
  virtual absl::StatusOr<ShardPlan> PlanShard(const ShardProblem& shard, size_t budget_bytes) const;
  virtual absl::Status ShardBegin(const ShardProblem& shard, const ShardArguments& args,
                                  Stream& stream);
  virtual absl::Status ShardForward(const ShardProblem& shard, const ShardArguments& args,
                                    ShardChunk chunk, Stream& stream);
  virtual absl::Status ShardBackward(const ShardProblem& shard, const ShardArguments& args,
                                     ShardChunk chunk, Stream& stream);
  // grad_hidden rows [chunk.begin, chunk.begin + chunk.size) (N x D, problem.dtype) = `partial`
  // (chunk.size x D fp32, the dH partials summed over the shards) rounded to the dtype.
  virtual absl::Status ShardStoreGradHidden(const ShardProblem& shard, const float* partial,
                                            ShardChunk chunk, void* grad_hidden, Stream& stream);

  // The rows of a head tied to its model's input embedding (embedding_rows.h has the contract
  // and the checks both calls run first). GatherRows: out (n x d, `dtype`) row i = row ids[i] of
  // `weights` (rows x d, `dtype`), bit for bit. IndexAddRows: for each distinct id, grad (rows x d
  // fp32) row id += the sum of the `values` rows (n x d fp32) that carry it, added in ascending
  // i, then once into grad: a rerun gives the same bits, and the CPU and CUDA backends give the
  // same bits. `ids` (device memory, n int64) must lie in [0, rows), and for IndexAddRows be
  // non-decreasing: the caller checks them on the host (a device backend cannot without a
  // round trip), so that a device never sees an id it would write outside its buffer with.
  // UNIMPLEMENTED (the default) where a backend has no such call (a test double).
  virtual absl::Status GatherRows(DType dtype, const void* weights, int64_t rows, int64_t d,
                                  const int64_t* ids, int64_t n, void* out, Stream& stream);
  virtual absl::Status IndexAddRows(const float* values, const int64_t* ids, int64_t n, int64_t d,
                                    float* grad, int64_t rows, Stream& stream);

  // Memory management.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  virtual absl::StatusOr<std::unique_ptr<Stream>> CreateStream() = 0;
  virtual absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes,
                                    Stream& stream) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes,
                                  Stream& stream) = 0;
  // Copies between two allocations in device memory of this process, on `stream`: `dst` may lie
  // on another device (a peer) or be mapped from another process (a same-node client's region).
  // UNIMPLEMENTED (the default) where a backend has no such copy (a test double).
  virtual absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes, Stream& stream);
  virtual absl::Status Memset(void* dst, int value, size_t bytes, Stream& stream) = 0;
  // Host memory to stage copies through (see HostBuffer). Allocation is slow on CUDA (it pins
  // pages): keep and reuse these buffers. UNIMPLEMENTED where staging buys nothing (the CPU
  // backend copies from any host memory at full speed): copy from the caller's memory directly.
  virtual absl::StatusOr<HostBuffer> AllocateHost(size_t bytes);

 protected:
  friend class DeviceBuffer;
  virtual void Free(void* data) = 0;
};

enum class BackendKind { kCpu, kCuda, kAuto };

// CPU always; CUDA when built with it and a device is present (UNAVAILABLE otherwise);
// kAuto picks CUDA when available, else CPU. `device` selects the CUDA device ordinal.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind, int device = 0);

// True when this build includes the CUDA backend and at least one CUDA device is visible.
bool CudaAvailable();
// Visible CUDA devices (0 in a build without the CUDA backend).
int CudaDevices();

// One backend per entry of `devices` (CUDA ordinals, distinct), as CreateBackend makes them; an
// empty list means every visible CUDA device, or one CPU device. CPU backends take the ordinals
// as names only: a list of k gives k CPU devices, for trying placements without a GPU.
// INVALID_ARGUMENT for a negative or repeated ordinal; CreateBackend's errors otherwise.
absl::StatusOr<std::vector<std::unique_ptr<Backend>>> CreateBackends(
    BackendKind kind, const std::vector<int>& devices);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_BACKEND_H_
