// A backend wrapper for the engine's fault tests (device_fault_test.cc, deferred_grad_test.cc).
#ifndef LOSSHEAD_TESTS_SERVER_FAULTY_BACKEND_H_
#define LOSSHEAD_TESTS_SERVER_FAULTY_BACKEND_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"

namespace losshead::server::testing {

// The CPU backend, with faults to order: the next copy of results to the host (anything larger
// than the 16 bytes of scalars read under the compute lock), the next run (after it has added to
// dW, as a device that fails midway would), the next copy to the device, or the next flush of a
// gradient stash (before it adds anything, so that dW's content is known). It counts runs and the
// flushes that add tokens.
class FaultyBackend : public kernels::Backend {
 public:
  explicit FaultyBackend(std::unique_ptr<kernels::Backend> inner) : inner_(std::move(inner)) {}

  std::atomic<bool> fail_copy_out{false};
  std::atomic<bool> fail_run{false};
  std::atomic<bool> fail_copy_in{false};
  std::atomic<bool> fail_flush{false};
  std::atomic<int> runs{0};
  std::atomic<int> flushes{0};

  absl::string_view name() const override { return inner_->name(); }
  std::string device_description() const override { return inner_->device_description(); }
  kernels::MemoryInfo memory_info() const override { return inner_->memory_info(); }
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
    if (stash.tokens > 0) ++flushes;
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
  absl::StatusOr<kernels::DeviceBuffer> Allocate(size_t bytes) override {
    return inner_->Allocate(bytes);  // owned (and freed) by the inner backend
  }
  absl::StatusOr<std::unique_ptr<kernels::Stream>> CreateStream() override {
    return inner_->CreateStream();
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
    if (bytes > 16 && fail_copy_out.exchange(false)) {
      return absl::InternalError("injected: the copy of results to the host failed");
    }
    return inner_->CopyToHost(dst, src, bytes, stream);
  }
  absl::Status Memset(void* dst, int value, size_t bytes, kernels::Stream& stream) override {
    return inner_->Memset(dst, value, bytes, stream);
  }
  absl::StatusOr<kernels::HostBuffer> AllocateHost(size_t bytes) override {
    return inner_->AllocateHost(bytes);
  }

 protected:
  void Free(void*) override {}  // every buffer belongs to the inner backend

 private:
  std::unique_ptr<kernels::Backend> inner_;
};

}  // namespace losshead::server::testing

#endif  // LOSSHEAD_TESTS_SERVER_FAULTY_BACKEND_H_
