#include "tests/kernels/grad_stash_runner.h"

#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/shard_problem.h"
#include "tests/kernels/shard_runner.h"

namespace losshead::kernels::testing {
namespace {

#define LH_RETURN_IF_ERROR(expr)       \
  {                                    \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  }

absl::StatusOr<DeviceBuffer> Zeroed(Backend& backend, size_t bytes, Stream& stream) {
  absl::StatusOr<DeviceBuffer> buffer = backend.Allocate(bytes);
  if (!buffer.ok()) return buffer.status();
  LH_RETURN_IF_ERROR(backend.Memset(buffer->data(), 0, bytes, stream));
  return buffer;
}

}  // namespace

absl::StatusOr<StashedRun> RunStashed(Backend& backend, const std::vector<Inputs>& batches,
                                      int64_t capacity, size_t workspace_budget) {
  if (batches.empty()) return absl::InvalidArgumentError("no micro-batches");
  const Problem& shape = batches[0].problem;
  const size_t element = DTypeSize(shape.dtype);
  const size_t d = shape.d, v = shape.v;
  absl::StatusOr<std::unique_ptr<Stream>> stream_or = backend.CreateStream();
  if (!stream_or.ok()) return stream_or.status();
  Stream& stream = **stream_or;
  absl::StatusOr<size_t> stash_bytes = backend.GradStashBytes(shape, capacity);
  if (!stash_bytes.ok()) return stash_bytes.status();
  absl::StatusOr<DeviceBuffer> stash = Zeroed(backend, *stash_bytes, stream);
  absl::StatusOr<DeviceBuffer> weight = Zeroed(backend, v * d * element, stream);
  absl::StatusOr<DeviceBuffer> grad_weight = Zeroed(backend, v * d * sizeof(float), stream);
  absl::StatusOr<DeviceBuffer> scalars = Zeroed(backend, 16, stream);
  for (const auto* b : {&stash, &weight, &grad_weight, &scalars}) {
    if (!b->ok()) return b->status();
  }
  LH_RETURN_IF_ERROR(backend.CopyToDevice(weight->data(), batches[0].weight_bytes.data(),
                                          v * d * element, stream));

  StashedRun run;
  GradStash at{.data = stash->data(), .capacity = capacity, .tokens = 0};
  DeviceBuffer workspace;
  auto flush = [&]() -> absl::Status {
    if (at.tokens > 0) ++run.flushes;
    LH_RETURN_IF_ERROR(backend.FlushGradStash(shape, at, grad_weight->as<float>(), workspace.data(),
                                              workspace.bytes(), stream));
    at.tokens = 0;
    return absl::OkStatus();
  };
  for (const Inputs& in : batches) {
    const Problem& p = in.problem;
    const size_t n = p.n;
    if (at.tokens + p.n > capacity) LH_RETURN_IF_ERROR(flush());
    absl::StatusOr<size_t> ws_bytes = backend.WorkspaceBytes(p, workspace_budget);
    if (!ws_bytes.ok()) return ws_bytes.status();
    if (workspace.bytes() < *ws_bytes) {
      LH_RETURN_IF_ERROR(stream.Synchronize());  // the last flush may still use the old one
      absl::StatusOr<DeviceBuffer> fresh = backend.Allocate(*ws_bytes);
      if (!fresh.ok()) return fresh.status();
      workspace = std::move(*fresh);
    }
    absl::StatusOr<DeviceBuffer> hidden = backend.Allocate(n * d * element);
    absl::StatusOr<DeviceBuffer> targets = backend.Allocate(n * sizeof(int32_t));
    absl::StatusOr<DeviceBuffer> grad_hidden = Zeroed(backend, n * d * element, stream);
    for (const auto* b : {&hidden, &targets, &grad_hidden}) {
      if (!b->ok()) return b->status();
    }
    LH_RETURN_IF_ERROR(
        backend.CopyToDevice(hidden->data(), in.hidden_bytes.data(), n * d * element, stream));
    LH_RETURN_IF_ERROR(
        backend.CopyToDevice(targets->data(), in.targets.data(), n * sizeof(int32_t), stream));
    Arguments args;
    args.hidden = hidden->data();
    args.weight = weight->data();
    args.targets = targets->as<int32_t>();
    args.grad_hidden = grad_hidden->data();
    args.token_count = scalars->as<int64_t>();
    args.loss_sum = reinterpret_cast<float*>(scalars->as<char>() + 8);
    args.workspace = workspace.data();
    args.workspace_bytes = *ws_bytes;
    args.grad_stash = at;
    LH_RETURN_IF_ERROR(backend.Run(p, args, stream));
    at.tokens += p.n;

    Outputs out;
    std::vector<uint8_t> dh(n * d * element);
    std::vector<float> dh_f(n * d);
    LH_RETURN_IF_ERROR(backend.CopyToHost(&out.token_count, args.token_count, 8, stream));
    LH_RETURN_IF_ERROR(backend.CopyToHost(&out.loss_sum, args.loss_sum, 4, stream));
    LH_RETURN_IF_ERROR(backend.CopyToHost(dh.data(), grad_hidden->data(), dh.size(), stream));
    LH_RETURN_IF_ERROR(stream.Synchronize());  // the buffers above go at the end of this pass
    ToFloat(p.dtype, dh.data(), dh_f.data(), n * d);
    out.grad_hidden = ToDouble(dh_f);
    run.microbatches.push_back(std::move(out));
  }
  LH_RETURN_IF_ERROR(flush());
  run.grad_weight.resize(v * d);
  LH_RETURN_IF_ERROR(backend.CopyToHost(run.grad_weight.data(), grad_weight->data(),
                                        v * d * sizeof(float), stream));
  LH_RETURN_IF_ERROR(stream.Synchronize());
  return run;
}

absl::StatusOr<StashedRun> RunShardedStashed(std::span<Backend* const> shards,
                                             const std::vector<Inputs>& batches, int64_t capacity,
                                             size_t workspace_budget, const RunOptions* options) {
  if (batches.empty()) return absl::InvalidArgumentError("no micro-batches");
  const Problem& problem = batches[0].problem;
  const int k = static_cast<int>(shards.size());
  const size_t d = problem.d;
  ShardStashes stashes{.capacity = capacity};
  std::vector<ShardProblem> shapes;
  std::vector<std::unique_ptr<Stream>> streams;
  for (int r = 0; r < k; ++r) {
    Backend& backend = *shards[r];
    const Shard rows = ShardRange(problem.v, k, r);
    shapes.push_back(ShardProblem{
        .problem = problem, .row_begin = rows.begin, .rows = rows.size(), .shards = k, .rank = r});
    absl::StatusOr<std::unique_ptr<Stream>> stream = backend.CreateStream();
    if (!stream.ok()) return stream.status();
    streams.push_back(*std::move(stream));
    absl::StatusOr<size_t> bytes = backend.GradStashBytes(ShardStashShape(shapes[r]), capacity);
    if (!bytes.ok()) return bytes.status();
    absl::StatusOr<DeviceBuffer> stash = Zeroed(backend, *bytes, *streams[r]);
    absl::StatusOr<DeviceBuffer> grad =
        Zeroed(backend, rows.size() * d * sizeof(float), *streams[r]);
    if (!stash.ok()) return stash.status();
    if (!grad.ok()) return grad.status();
    LH_RETURN_IF_ERROR(streams[r]->Synchronize());
    stashes.stash.push_back(*std::move(stash));
    stashes.grad_weight.push_back(*std::move(grad));
  }

  StashedRun run;
  auto flush = [&]() -> absl::Status {
    if (stashes.tokens > 0) ++run.flushes;
    for (int r = 0; r < k; ++r) {
      const GradStash at{
          .data = stashes.stash[r].data(), .capacity = capacity, .tokens = stashes.tokens};
      LH_RETURN_IF_ERROR(shards[r]->FlushGradStash(ShardStashShape(shapes[r]), at,
                                                   stashes.grad_weight[r].as<float>(), nullptr, 0,
                                                   *streams[r]));
      LH_RETURN_IF_ERROR(streams[r]->Synchronize());
    }
    stashes.tokens = 0;
    return absl::OkStatus();
  };
  const RunOptions plain{.workspace_budget = workspace_budget, .per_token = false};
  for (const Inputs& in : batches) {
    if (stashes.tokens + in.problem.n > capacity) LH_RETURN_IF_ERROR(flush());
    absl::StatusOr<Outputs> out =
        RunSharded(shards, nullptr, in, options != nullptr ? *options : plain, &stashes);
    if (!out.ok()) return out.status();
    run.microbatches.push_back(*std::move(out));
  }
  LH_RETURN_IF_ERROR(flush());
  run.grad_weight.resize(problem.v * d);
  for (int r = 0; r < k; ++r) {
    LH_RETURN_IF_ERROR(shards[r]->CopyToHost(run.grad_weight.data() + shapes[r].row_begin * d,
                                             stashes.grad_weight[r].data(),
                                             shapes[r].rows * d * sizeof(float), *streams[r]));
    LH_RETURN_IF_ERROR(streams[r]->Synchronize());
  }
  return run;
}

#undef LH_RETURN_IF_ERROR

}  // namespace losshead::kernels::testing
