#include "tests/kernels/shard_runner.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "losshead/kernels/dtype_convert.h"

namespace losshead::kernels::testing {
namespace {

#define LH_RETURN_IF_ERROR(expr)       \
  {                                    \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  }

constexpr int kPoisonByte = 0x7f;

// One shard's device memory and stream.
struct ShardState {
  Backend* backend = nullptr;
  ShardProblem problem;
  std::unique_ptr<Stream> stream;
  std::vector<DeviceBuffer> keep;
  ShardArguments args;
  float* partial = nullptr;
  void* grad_hidden = nullptr;

  absl::StatusOr<void*> Alloc(size_t bytes) {
    absl::StatusOr<DeviceBuffer> buffer = backend->Allocate(std::max<size_t>(bytes, 1));
    if (!buffer.ok()) return buffer.status();
    void* data = buffer->data();
    keep.push_back(*std::move(buffer));
    return data;
  }
};

// Host-side exchange: every shard's slice of the statistics (`buffer` of its arguments: stats
// or output_stats) into every shard's buffer.
absl::Status GatherThroughHost(std::vector<ShardState>& s, int64_t stats_floats,
                               float* ShardArguments::*buffer = &ShardArguments::stats) {
  const int k = static_cast<int>(s.size());
  const int64_t slice = stats_floats / k;
  std::vector<float> all(stats_floats);
  for (int r = 0; r < k; ++r) {
    LH_RETURN_IF_ERROR(s[r].backend->CopyToHost(all.data() + r * slice,
                                                s[r].args.*buffer + r * slice,
                                                slice * sizeof(float), *s[r].stream));
    LH_RETURN_IF_ERROR(s[r].stream->Synchronize());
  }
  for (int r = 0; r < k; ++r) {
    LH_RETURN_IF_ERROR(s[r].backend->CopyToDevice(s[r].args.*buffer, all.data(),
                                                  stats_floats * sizeof(float), *s[r].stream));
    LH_RETURN_IF_ERROR(s[r].stream->Synchronize());
  }
  return absl::OkStatus();
}

// Host-side exchange: the dH partials summed in rank order in double into every shard's buffer.
absl::Status SumThroughHost(std::vector<ShardState>& s, int64_t floats) {
  std::vector<double> sum(floats, 0.0);
  std::vector<float> part(floats);
  for (ShardState& shard : s) {
    LH_RETURN_IF_ERROR(shard.backend->CopyToHost(part.data(), shard.partial, floats * sizeof(float),
                                                 *shard.stream));
    LH_RETURN_IF_ERROR(shard.stream->Synchronize());
    for (int64_t i = 0; i < floats; ++i) sum[i] += part[i];
  }
  for (int64_t i = 0; i < floats; ++i) part[i] = static_cast<float>(sum[i]);
  for (ShardState& shard : s) {
    LH_RETURN_IF_ERROR(shard.backend->CopyToDevice(shard.partial, part.data(),
                                                   floats * sizeof(float), *shard.stream));
    LH_RETURN_IF_ERROR(shard.stream->Synchronize());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Outputs> RunSharded(std::span<Backend* const> shards, Collective* collective,
                                   const Inputs& in, const RunOptions& options,
                                   ShardStashes* stashes) {
  const Problem& p = in.problem;
  const int k = static_cast<int>(shards.size());
  const size_t element = DTypeSize(p.dtype);
  const size_t n = p.n, d = p.d;
  std::vector<ShardState> s(k);
  int64_t chunk_rows = p.n;
  for (int r = 0; r < k; ++r) {
    const Shard rows = ShardRange(p.v, k, r);
    s[r].backend = shards[r];
    s[r].problem = ShardProblem{
        .problem = p, .row_begin = rows.begin, .rows = rows.size(), .shards = k, .rank = r};
    absl::StatusOr<ShardPlan> plan = shards[r]->PlanShard(s[r].problem, options.workspace_budget);
    if (!plan.ok()) return plan.status();
    chunk_rows = std::min(chunk_rows, plan->chunk_rows);
  }
  chunk_rows = BalancedChunkRows(p.n, chunk_rows);
  const int64_t stats_floats = static_cast<int64_t>(k) * kShardStats * chunk_rows;
  // The distribution outputs (on shard 0) need every shard's output statistics.
  // So does the entropy term (its s travels in them too).
  const bool distribute = options.logprob || options.entropy || options.argmax ||
                          options.correct_count || options.top_k > 0 ||
                          p.options.entropy_coef != 0.0f;
  const int32_t top_k = std::max<int32_t>(options.top_k, 0);
  const int64_t output_rows = ShardOutputStatsRows(top_k);
  const int64_t output_floats = distribute ? k * output_rows * chunk_rows : 0;
  for (int r = 0; r < k; ++r) {
    ShardState& st = s[r];
    Backend& b = *st.backend;
    absl::StatusOr<ShardPlan> plan = b.PlanShard(st.problem, options.workspace_budget);
    absl::StatusOr<std::unique_ptr<Stream>> stream = b.CreateStream();
    if (!stream.ok()) return stream.status();
    st.stream = *std::move(stream);
    ShardArguments& a = st.args;
    const size_t rows = st.problem.rows;
    auto alloc = [&](size_t bytes) { return st.Alloc(bytes); };
    absl::StatusOr<void*> hidden = alloc(n * d * element), weight = alloc(rows * d * element),
                          targets = alloc(n * sizeof(int32_t)),
                          stats = alloc(stats_floats * sizeof(float)),
                          partial = alloc(chunk_rows * d * sizeof(float)),
                          workspace = alloc(plan->workspace_bytes);
    for (const auto* buffer : {&hidden, &weight, &targets, &stats, &partial, &workspace}) {
      if (!buffer->ok()) return buffer->status();
    }
    LH_RETURN_IF_ERROR(
        b.CopyToDevice(*hidden, in.hidden_bytes.data(), n * d * element, *st.stream));
    LH_RETURN_IF_ERROR(b.CopyToDevice(*weight,
                                      in.weight_bytes.data() + st.problem.row_begin * d * element,
                                      rows * d * element, *st.stream));
    LH_RETURN_IF_ERROR(
        b.CopyToDevice(*targets, in.targets.data(), n * sizeof(int32_t), *st.stream));
    a.hidden = *hidden;
    a.weight = *weight;
    a.targets = static_cast<const int32_t*>(*targets);
    a.stats = static_cast<float*>(*stats);
    a.stats_chunk_rows = chunk_rows;
    a.workspace = *workspace;
    a.workspace_bytes = plan->workspace_bytes;
    st.partial = static_cast<float*>(*partial);
    if (distribute) {
      absl::StatusOr<void*> output_stats = alloc(output_floats * sizeof(float));
      if (!output_stats.ok()) return output_stats.status();
      a.output_stats = static_cast<float*>(*output_stats);
      a.top_k = top_k;
    }
    if (options.grad_hidden) a.grad_hidden_partial = st.partial;
    // The terms' inputs: the bias (and its gradient) over the shard's rows, the per-token inputs
    // on every shard (each computes its own columns' G from them).
    auto input = [&](const std::vector<float>& values, int64_t first, int64_t count,
                     const float** out) -> absl::Status {
      if (values.empty()) return absl::OkStatus();
      absl::StatusOr<void*> data = alloc(count * sizeof(float));
      if (!data.ok()) return data.status();
      *out = static_cast<const float*>(*data);
      return b.CopyToDevice(*data, values.data() + first, count * sizeof(float), *st.stream);
    };
    LH_RETURN_IF_ERROR(input(options.bias, st.problem.row_begin, rows, &a.bias));
    LH_RETURN_IF_ERROR(input(options.token_weights, 0, n, &a.token_weights));
    LH_RETURN_IF_ERROR(input(options.old_logprob, 0, n, &a.old_logprob));
    LH_RETURN_IF_ERROR(input(options.advantages, 0, n, &a.advantages));
    LH_RETURN_IF_ERROR(input(options.ref_logprob, 0, n, &a.ref_logprob));
    if (options.grad_bias) {
      absl::StatusOr<void*> grad_bias = alloc(rows * sizeof(float));
      if (!grad_bias.ok()) return grad_bias.status();
      if (options.initial_grad_bias.empty()) {
        LH_RETURN_IF_ERROR(b.Memset(*grad_bias, 0, rows * sizeof(float), *st.stream));
      } else {
        LH_RETURN_IF_ERROR(b.CopyToDevice(*grad_bias,
                                          options.initial_grad_bias.data() + st.problem.row_begin,
                                          rows * sizeof(float), *st.stream));
      }
      a.grad_bias = static_cast<float*>(*grad_bias);
    }
    if (stashes != nullptr) {
      a.grad_stash = GradStash{.data = stashes->stash[r].data(),
                               .capacity = stashes->capacity,
                               .tokens = stashes->tokens};
    } else if (options.grad_weight) {
      absl::StatusOr<void*> grad = alloc(rows * d * sizeof(float));
      if (!grad.ok()) return grad.status();
      if (options.initial_grad_weight.empty()) {
        LH_RETURN_IF_ERROR(b.Memset(*grad, 0, rows * d * sizeof(float), *st.stream));
      } else {
        LH_RETURN_IF_ERROR(
            b.CopyToDevice(*grad, options.initial_grad_weight.data() + st.problem.row_begin * d,
                           rows * d * sizeof(float), *st.stream));
      }
      a.grad_weight = static_cast<float*>(*grad);
    }
    if (r == 0) {  // shard 0 writes the micro-batch's outputs
      absl::StatusOr<void*> loss = alloc(sizeof(float)), count = alloc(sizeof(int64_t));
      if (!loss.ok() || !count.ok()) return absl::ResourceExhaustedError("outputs");
      LH_RETURN_IF_ERROR(b.Memset(*loss, kPoisonByte, sizeof(float), *st.stream));
      LH_RETURN_IF_ERROR(b.Memset(*count, kPoisonByte, sizeof(int64_t), *st.stream));
      a.loss_sum = static_cast<float*>(*loss);
      a.token_count = static_cast<int64_t*>(*count);
      if (options.per_token) {
        absl::StatusOr<void*> loss_t = alloc(n * sizeof(float)), lse_t = alloc(n * sizeof(float));
        if (!loss_t.ok() || !lse_t.ok()) return absl::ResourceExhaustedError("per-token outputs");
        LH_RETURN_IF_ERROR(b.Memset(*loss_t, kPoisonByte, n * sizeof(float), *st.stream));
        LH_RETURN_IF_ERROR(b.Memset(*lse_t, kPoisonByte, n * sizeof(float), *st.stream));
        a.per_token_loss = static_cast<float*>(*loss_t);
        a.per_token_lse = static_cast<float*>(*lse_t);
      }
      auto poisoned = [&](bool asked, size_t bytes, auto** out) -> absl::Status {
        if (!asked) return absl::OkStatus();
        absl::StatusOr<void*> data = alloc(bytes);
        if (!data.ok()) return data.status();
        *out = static_cast<std::remove_reference_t<decltype(*out)>>(*data);
        return b.Memset(*data, kPoisonByte, bytes, *st.stream);
      };
      LH_RETURN_IF_ERROR(poisoned(options.logprob, n * sizeof(float), &a.per_token_logprob));
      LH_RETURN_IF_ERROR(poisoned(options.entropy, n * sizeof(float), &a.per_token_entropy));
      LH_RETURN_IF_ERROR(poisoned(options.argmax, n * sizeof(int32_t), &a.per_token_argmax));
      LH_RETURN_IF_ERROR(poisoned(options.correct_count, sizeof(int64_t), &a.correct_count));
      LH_RETURN_IF_ERROR(poisoned(top_k > 0, n * top_k * sizeof(int32_t), &a.top_k_ids));
      LH_RETURN_IF_ERROR(poisoned(top_k > 0, n * top_k * sizeof(float), &a.top_k_logprobs));
      if (options.grad_hidden) {
        absl::StatusOr<void*> grad_hidden = alloc(n * d * element);
        if (!grad_hidden.ok()) return grad_hidden.status();
        LH_RETURN_IF_ERROR(b.Memset(*grad_hidden, kPoisonByte, n * d * element, *st.stream));
        st.grad_hidden = *grad_hidden;
      }
    }
    LH_RETURN_IF_ERROR(b.ShardBegin(st.problem, a, *st.stream));
  }

  std::vector<void*> stats_buffers, output_buffers, partial_buffers;
  std::vector<Stream*> streams;
  for (ShardState& st : s) {
    stats_buffers.push_back(st.args.stats);
    output_buffers.push_back(st.args.output_stats);
    partial_buffers.push_back(st.partial);
    streams.push_back(st.stream.get());
  }
  const std::vector<int64_t> slices(k, kShardStats * chunk_rows);
  const std::vector<int64_t> output_slices(k, output_rows * chunk_rows);
  for (int64_t t0 = 0; t0 < p.n; t0 += chunk_rows) {
    const ShardChunk chunk{.begin = t0, .size = std::min<int64_t>(chunk_rows, p.n - t0)};
    for (ShardState& st : s) {
      LH_RETURN_IF_ERROR(st.backend->ShardForward(st.problem, st.args, chunk, *st.stream));
    }
    if (collective != nullptr) {
      LH_RETURN_IF_ERROR(collective->AllGather(stats_buffers, slices, DType::kFP32, streams));
    } else {
      LH_RETURN_IF_ERROR(GatherThroughHost(s, stats_floats));
    }
    if (distribute) {
      if (collective != nullptr) {
        LH_RETURN_IF_ERROR(
            collective->AllGather(output_buffers, output_slices, DType::kFP32, streams));
      } else {
        LH_RETURN_IF_ERROR(GatherThroughHost(s, output_floats, &ShardArguments::output_stats));
      }
    }
    for (ShardState& st : s) {
      LH_RETURN_IF_ERROR(st.backend->ShardBackward(st.problem, st.args, chunk, *st.stream));
    }
    if (!options.grad_hidden) continue;
    const int64_t floats = chunk.size * p.d;
    if (collective != nullptr) {
      LH_RETURN_IF_ERROR(
          collective->AllReduce(partial_buffers, floats, DType::kFP32, ReduceOp::kSum, streams));
    } else {
      LH_RETURN_IF_ERROR(SumThroughHost(s, floats));
    }
    LH_RETURN_IF_ERROR(s[0].backend->ShardStoreGradHidden(s[0].problem, s[0].partial, chunk,
                                                          s[0].grad_hidden, *s[0].stream));
  }

  Outputs out;
  ShardState& first = s[0];
  Backend& b0 = *first.backend;
  std::vector<uint8_t> grad_hidden_bytes(n * d * element);
  LH_RETURN_IF_ERROR(
      b0.CopyToHost(&out.loss_sum, first.args.loss_sum, sizeof(float), *first.stream));
  LH_RETURN_IF_ERROR(
      b0.CopyToHost(&out.token_count, first.args.token_count, sizeof(int64_t), *first.stream));
  if (options.grad_hidden) {
    LH_RETURN_IF_ERROR(
        b0.CopyToHost(grad_hidden_bytes.data(), first.grad_hidden, n * d * element, *first.stream));
  }
  if (options.per_token) {
    out.per_token_loss.resize(n);
    out.per_token_lse.resize(n);
    LH_RETURN_IF_ERROR(b0.CopyToHost(out.per_token_loss.data(), first.args.per_token_loss,
                                     n * sizeof(float), *first.stream));
    LH_RETURN_IF_ERROR(b0.CopyToHost(out.per_token_lse.data(), first.args.per_token_lse,
                                     n * sizeof(float), *first.stream));
  }
  auto copy_out = [&](auto& vec, const auto* src, size_t count) -> absl::Status {
    vec.resize(count);
    return b0.CopyToHost(vec.data(), src, count * sizeof(vec[0]), *first.stream);
  };
  if (options.logprob)
    LH_RETURN_IF_ERROR(copy_out(out.per_token_logprob, first.args.per_token_logprob, n));
  if (options.entropy)
    LH_RETURN_IF_ERROR(copy_out(out.per_token_entropy, first.args.per_token_entropy, n));
  if (options.argmax)
    LH_RETURN_IF_ERROR(copy_out(out.per_token_argmax, first.args.per_token_argmax, n));
  if (options.correct_count) {
    LH_RETURN_IF_ERROR(b0.CopyToHost(&out.correct_count, first.args.correct_count, sizeof(int64_t),
                                     *first.stream));
  }
  if (top_k > 0) {
    LH_RETURN_IF_ERROR(copy_out(out.top_k_ids, first.args.top_k_ids, n * top_k));
    LH_RETURN_IF_ERROR(copy_out(out.top_k_logprobs, first.args.top_k_logprobs, n * top_k));
  }
  const bool grad_weight = options.grad_weight && stashes == nullptr;
  if (grad_weight) out.grad_weight.resize(p.v * d);
  if (options.grad_bias) out.grad_bias.resize(p.v);
  for (ShardState& st : s) {
    if (options.grad_bias) {
      LH_RETURN_IF_ERROR(st.backend->CopyToHost(out.grad_bias.data() + st.problem.row_begin,
                                                st.args.grad_bias,
                                                st.problem.rows * sizeof(float), *st.stream));
    }
    if (grad_weight) {
      LH_RETURN_IF_ERROR(st.backend->CopyToHost(out.grad_weight.data() + st.problem.row_begin * d,
                                                st.args.grad_weight,
                                                st.problem.rows * d * sizeof(float), *st.stream));
    }
    LH_RETURN_IF_ERROR(st.stream->Synchronize());
  }
  if (stashes != nullptr) stashes->tokens += p.n;
  if (options.grad_hidden) {
    std::vector<float> f(n * d);
    ToFloat(p.dtype, grad_hidden_bytes.data(), f.data(), n * d);
    out.grad_hidden = ToDouble(f);
  }
  return out;
}

#undef LH_RETURN_IF_ERROR

}  // namespace losshead::kernels::testing
