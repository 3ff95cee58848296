// A backend wrapper for the engine's fault tests (device_fault_test.cc, deferred_grad_test.cc).
#ifndef LOSSHEAD_TESTS_SERVER_FAULTY_BACKEND_H_
#define LOSSHEAD_TESTS_SERVER_FAULTY_BACKEND_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "losshead/kernels/backend.h"
#include "server/engine/replica_group.h"

namespace losshead::server::testing {

// The order of calls across several devices, as "flush <tag>" (a flush that adds tokens) and
// "sync <tag>" (a wait for one of the device's streams).
class CallLog {
 public:
  void Add(std::string call) {
    absl::MutexLock lock(&mu_);
    calls_.push_back(std::move(call));
  }
  // The calls so far, and a fresh log.
  std::vector<std::string> Take() {
    absl::MutexLock lock(&mu_);
    return std::exchange(calls_, {});
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> calls_ ABSL_GUARDED_BY(mu_);
};

// Holds the marks of a device's streams (a run in flight: StepDevices::Launched) unreached until
// released: a device still at work on a run that was launched.
class MarkGate {
 public:
  void Hold() {
    absl::MutexLock lock(&mu_);
    held_ = true;
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }
  // Blocks while held; counted meanwhile in `waiting`.
  void Pass() {
    absl::MutexLock lock(&mu_);
    ++waiting_;
    mu_.Await(absl::Condition(+[](bool* held) { return !*held; }, &held_));
    --waiting_;
  }
  // Blocks until `n` waits are held at once; false after 10 s.
  bool AwaitWaiting(int n) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return waiting_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
  }

 private:
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
};

// A stream whose waits are logged (where `log` is set) and whose marks pass `gate`.
class LoggedStream : public kernels::Stream {
 public:
  LoggedStream(std::unique_ptr<kernels::Stream> inner, CallLog* log, std::string tag,
               MarkGate* gate)
      : inner_(std::move(inner)), log_(log), tag_(std::move(tag)), gate_(gate) {}
  absl::Status Synchronize() override {
    if (log_ != nullptr) log_->Add("sync " + tag_);
    return inner_->Synchronize();
  }
  void* native() const override { return inner_->native(); }
  absl::StatusOr<std::unique_ptr<kernels::StreamMark>> Mark() override {
    absl::StatusOr<std::unique_ptr<kernels::StreamMark>> inner = inner_->Mark();
    if (!inner.ok()) return inner.status();
    return std::unique_ptr<kernels::StreamMark>(
        std::make_unique<GatedMark>(*std::move(inner), gate_));
  }

 private:
  class GatedMark final : public kernels::StreamMark {
   public:
    GatedMark(std::unique_ptr<kernels::StreamMark> inner, MarkGate* gate)
        : inner_(std::move(inner)), gate_(gate) {}
    absl::Status Wait() override {
      gate_->Pass();
      return inner_->Wait();
    }

   private:
    std::unique_ptr<kernels::StreamMark> inner_;
    MarkGate* gate_;
  };

  std::unique_ptr<kernels::Stream> inner_;
  CallLog* log_;
  std::string tag_;
  MarkGate* gate_;
};

// The CPU backend, with faults to order: the next copy of results to the host (anything larger
// than the kStepScalarBytes of scalars read under the compute lock), the next run (after it has added to
// dW, as a device that fails midway would), the next copy to the device, or the next flush of a
// gradient stash (before it adds anything, so that dW's content is known). It counts runs, the
// flushes that add tokens and the optimizer steps' checks, and can log its flushes and stream
// waits (CallLog). With a memory limit it is a device of
// that size: allocations beyond it fail (RESOURCE_EXHAUSTED) and memory_info reports what is left.
class FaultyBackend : public kernels::Backend {
 public:
  explicit FaultyBackend(std::unique_ptr<kernels::Backend> inner) : inner_(std::move(inner)) {}

  std::atomic<bool> fail_copy_out{false};
  std::atomic<bool> fail_run{false};
  std::atomic<bool> fail_copy_in{false};
  std::atomic<bool> fail_flush{false};
  std::atomic<bool> fail_copy_on_device{false};
  std::atomic<int> runs{0};
  std::atomic<int> flushes{0};
  std::atomic<int> optimizer_checks{0};
  // Where set (before the head that uses it is created), flushes and the waits for this device's
  // streams are logged, tagged `tag`.
  CallLog* call_log = nullptr;
  std::string tag;
  // The marks of this device's streams: held, a run launched on it stays in flight until released.
  MarkGate marks;

  // Device memory of `bytes` from now on; buffers allocated before do not count.
  void LimitMemory(size_t bytes) {
    absl::MutexLock lock(&memory_mu_);
    limit_ = bytes;
  }
  // Bytes allocated under the limit and not yet freed.
  size_t allocated() const {
    absl::MutexLock lock(&memory_mu_);
    return allocated_;
  }

  absl::string_view name() const override { return inner_->name(); }
  std::string device_description() const override { return inner_->device_description(); }
  kernels::MemoryInfo memory_info() const override {
    absl::MutexLock lock(&memory_mu_);
    if (limit_ == 0) return inner_->memory_info();
    return {.total_bytes = limit_, .free_bytes = limit_ - allocated_};
  }
  absl::Status CanImplement(const kernels::Problem& p) const override {
    return inner_->CanImplement(p);
  }
  absl::StatusOr<size_t> WorkspaceBytes(const kernels::Problem& p, size_t budget) const override {
    return inner_->WorkspaceBytes(p, budget);
  }
  absl::Status Run(const kernels::Problem& p, const kernels::Arguments& args,
                   kernels::Stream& stream) override {
    ++runs;
    absl::Status status = inner_->Run(p, args, stream);
    if (status.ok() && fail_run.exchange(false)) {
      return absl::InternalError("injected: the device failed during the run");
    }
    return status;
  }
  absl::StatusOr<size_t> GradStashBytes(const kernels::Problem& p,
                                        int64_t capacity) const override {
    return inner_->GradStashBytes(p, capacity);
  }
  absl::Status FlushGradStash(const kernels::Problem& p, const kernels::GradStash& stash,
                              float* grad_weight, void* workspace, size_t workspace_bytes,
                              kernels::Stream& stream) override {
    if (stash.tokens > 0) {
      ++flushes;
      if (call_log != nullptr) call_log->Add("flush " + tag);
    }
    if (fail_flush.exchange(false)) {
      return absl::InternalError("injected: the device failed before adding the stash to dW");
    }
    return inner_->FlushGradStash(p, stash, grad_weight, workspace, workspace_bytes, stream);
  }
  // A shard's halves: `fail_run` strikes after its backward half has added to dW.
  absl::StatusOr<kernels::ShardPlan> PlanShard(const kernels::ShardProblem& shard,
                                               size_t budget) const override {
    return inner_->PlanShard(shard, budget);
  }
  absl::Status ShardBegin(const kernels::ShardProblem& shard, const kernels::ShardArguments& args,
                          kernels::Stream& stream) override {
    ++runs;
    return inner_->ShardBegin(shard, args, stream);
  }
  absl::Status ShardForward(const kernels::ShardProblem& shard, const kernels::ShardArguments& args,
                            kernels::ShardChunk chunk, kernels::Stream& stream) override {
    return inner_->ShardForward(shard, args, chunk, stream);
  }
  absl::Status ShardBackward(const kernels::ShardProblem& shard,
                             const kernels::ShardArguments& args, kernels::ShardChunk chunk,
                             kernels::Stream& stream) override {
    absl::Status status = inner_->ShardBackward(shard, args, chunk, stream);
    if (status.ok() && fail_run.exchange(false)) {
      return absl::InternalError("injected: the device failed during the run");
    }
    return status;
  }
  absl::Status ShardStoreGradHidden(const kernels::ShardProblem& shard, const float* partial,
                                    kernels::ShardChunk chunk, void* grad_hidden,
                                    kernels::Stream& stream) override {
    return inner_->ShardStoreGradHidden(shard, partial, chunk, grad_hidden, stream);
  }
  absl::Status SquaredNorm(const float* data, int64_t count, double* result,
                           kernels::Stream& stream) override {
    return inner_->SquaredNorm(data, count, result, stream);
  }
  absl::Status OptimizerStep(const kernels::OptimizerProblem& problem,
                             const kernels::OptimizerTensors& tensors,
                             kernels::Stream& stream) override {
    return inner_->OptimizerStep(problem, tensors, stream);
  }
  absl::Status CheckOptimizerStep(const kernels::OptimizerProblem& problem,
                                  const kernels::OptimizerTensors& tensors,
                                  kernels::OptimizerCheck* result,
                                  kernels::Stream& stream) override {
    ++optimizer_checks;
    return inner_->CheckOptimizerStep(problem, tensors, result, stream);
  }
  absl::StatusOr<kernels::DeviceBuffer> Allocate(size_t bytes) override {
    absl::MutexLock lock(&memory_mu_);
    // Without a limit the inner backend owns (and frees) the buffer.
    if (limit_ == 0 || bytes == 0) return inner_->Allocate(bytes);
    if (bytes > limit_ - allocated_) {
      return absl::ResourceExhaustedError(absl::StrCat("injected: ", bytes,
                                                       " bytes do not fit: ", limit_ - allocated_,
                                                       " of ", limit_, " are free"));
    }
    absl::StatusOr<kernels::DeviceBuffer> inner = inner_->Allocate(bytes);
    if (!inner.ok()) return inner.status();
    void* data = inner->data();
    allocated_ += bytes;
    held_.emplace(data, std::move(*inner));
    return kernels::DeviceBuffer(this, data, bytes);
  }
  absl::StatusOr<std::unique_ptr<kernels::Stream>> CreateStream() override {
    absl::StatusOr<std::unique_ptr<kernels::Stream>> stream = inner_->CreateStream();
    if (!stream.ok()) return stream;
    return std::make_unique<LoggedStream>(*std::move(stream), call_log, tag, &marks);
  }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes,
                            kernels::Stream& stream) override {
    if (fail_copy_in.exchange(false)) {
      return absl::InternalError("injected: the copy to the device failed");
    }
    return inner_->CopyToDevice(dst, src, bytes, stream);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes,
                          kernels::Stream& stream) override {
    if (bytes > server::kStepScalarBytes && fail_copy_out.exchange(false)) {
      return absl::InternalError("injected: the copy of results to the host failed");
    }
    return inner_->CopyToHost(dst, src, bytes, stream);
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes,
                            kernels::Stream& stream) override {
    if (fail_copy_on_device.exchange(false)) {
      return absl::InternalError("injected: the copy between devices failed");
    }
    return inner_->CopyOnDevice(dst, src, bytes, stream);
  }
  absl::Status Memset(void* dst, int value, size_t bytes, kernels::Stream& stream) override {
    return inner_->Memset(dst, value, bytes, stream);
  }
  absl::StatusOr<kernels::HostBuffer> AllocateHost(size_t bytes) override {
    return inner_->AllocateHost(bytes);
  }

 protected:
  // Buffers allocated under a limit: the inner one goes with it.
  void Free(void* data) override {
    absl::MutexLock lock(&memory_mu_);
    auto it = held_.find(data);
    if (it == held_.end()) return;
    allocated_ -= it->second.bytes();
    held_.erase(it);
  }

 private:
  std::unique_ptr<kernels::Backend> inner_;
  mutable absl::Mutex memory_mu_;
  size_t limit_ ABSL_GUARDED_BY(memory_mu_) = 0;
  size_t allocated_ ABSL_GUARDED_BY(memory_mu_) = 0;
  absl::flat_hash_map<void*, kernels::DeviceBuffer> held_ ABSL_GUARDED_BY(memory_mu_);
};

}  // namespace losshead::server::testing

#endif  // LOSSHEAD_TESTS_SERVER_FAULTY_BACKEND_H_
