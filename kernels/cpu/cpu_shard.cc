// A vocabulary shard's calls on the CPU backend (shard_problem.h): the shard's logits and
// per-token statistics, their combination into the loss and G, and the rounding of the summed dH,
// around the row math of shard_rows.cc.
#include <cblas.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/chunk_plan.h"
#include "kernels/cpu/cpu_backend_impl.h"
#include "kernels/cpu/row_math.h"
#include "kernels/cpu/row_terms.h"
#include "kernels/cpu/shard_rows.h"
#include "losshead/kernels/dtype_convert.h"
#include "losshead/kernels/shard_problem.h"

namespace losshead::kernels::cpu {
namespace {

// Whether a shard call computes the model options and terms (row_terms.h's RowTermsOn).
bool ShardTermsOn(const LossOptions& options, const ShardArguments& args) {
  return loss::AnyTerm(loss::TermOptionsOf(options)) || args.bias != nullptr ||
         args.token_weights != nullptr;
}

// The terms' inputs of a shard call as Arguments carries them: bias over the shard's rows, the
// per-token inputs over the micro-batch.
Arguments TermInputsOf(const ShardArguments& args) {
  Arguments view;
  view.targets = args.targets;
  view.bias = args.bias;
  view.grad_bias = args.grad_bias;
  view.token_weights = args.token_weights;
  view.old_logprob = args.old_logprob;
  view.advantages = args.advantages;
  view.ref_logprob = args.ref_logprob;
  return view;
}

}  // namespace

absl::StatusOr<CpuBackend::ShardWorkspace> CpuBackend::ShardWorkspaceFor(const ShardProblem& shard,
                                                                         const ShardArguments& args,
                                                                         int64_t chunk) {
  ShardWorkspace ws;
  ws.layout = LayoutShard(shard, chunk);
  if (args.workspace_bytes < ws.layout.plan.workspace_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shard workspace of ", args.workspace_bytes, " bytes is too small: chunks of ",
                     chunk, " tokens need ", ws.layout.plan.workspace_bytes, " (see PlanShard)"));
  }
  const size_t misalignment = reinterpret_cast<uintptr_t>(args.workspace) % kCpuWorkspaceAlignment;
  ws.base = static_cast<char*>(args.workspace) +
            (misalignment == 0 ? 0 : kCpuWorkspaceAlignment - misalignment);
  return ws;
}

// The fp32 H rows of `chunk` and the shard's fp32 W, converted into the workspace when needed.
std::pair<const float*, const float*> CpuBackend::ShardInputs(const ShardProblem& shard,
                                                              const ShardArguments& args,
                                                              ShardChunk chunk,
                                                              const ShardWorkspace& ws) {
  const int64_t d = shard.problem.d;
  const DType dtype = shard.problem.dtype;
  const size_t element = DTypeSize(dtype);
  if (!ws.layout.converts_inputs) {
    return {static_cast<const float*>(args.hidden) + chunk.begin * d,
            static_cast<const float*>(args.weight)};
  }
  ConvertRows(dtype, static_cast<const char*>(args.hidden) + chunk.begin * d * element, ws.hidden(),
              chunk.size, d);
  ConvertRows(dtype, args.weight, ws.weight(), shard.rows, d);
  return {ws.hidden(), ws.weight()};
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
  // Every value the terms will read, once per micro-batch: the bias over the shard's rows.
  if (AsksLossInputs(args)) {
    if (absl::Status status = CheckTermInputs(ShardStashShape(shard), TermInputsOf(args));
        !status.ok()) {
      return status;
    }
  }
  const LossOptions& options = shard.problem.options;
  const float grad_scale = EffectiveGradScale(options, token_count);
  *ws->loss_acc() = 0.0;
  *ws->grad_scale() = grad_scale;
  *ws->token_count() = token_count;
  if (args.token_count != nullptr) *args.token_count = token_count;
  if (args.loss_sum != nullptr) *args.loss_sum = 0.0f;
  // Like loss_sum, a count over the chunks: ShardBackward adds each chunk's.
  if (args.correct_count != nullptr) *args.correct_count = 0;
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
  // The distribution outputs' statistics, only when one is asked for (shard_problem.h).
  const int top_k = args.top_k;
  float* output_slice = args.output_stats != nullptr
                            ? args.output_stats + static_cast<int64_t>(shard.rank) *
                                                      ShardOutputStatsRows(top_k) * stride
                            : nullptr;
  const float logit_scale = shard.problem.options.logit_scale;
  pool_.ParallelFor(chunk.size, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int32_t y = args.targets[chunk.begin + q];
      const int64_t local = y == ignore ? -1 : y - shard.row_begin;
      // x = logit_scale u + b before the soft-cap (a no-op without them).
      ScaleBiasRow(logits + q * rows, rows, logit_scale, args.bias);
      const ShardRowStats row =
          ComputeShardRowStats(logits + q * rows, rows, local, shard.problem.options.softcap);
      for (int s = 0; s < kShardStats; ++s) slice[s * stride + q] = row.stats[s];
      if (output_slice != nullptr) {
        ComputeShardOutputStats(logits + q * rows, rows, shard.row_begin, top_k, output_slice + q,
                                stride);
      }
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
  const bool want_grad = args.grad_hidden_partial != nullptr || args.grad_weight != nullptr ||
                         stashed || args.grad_bias != nullptr;
  const bool terms_on = ShardTermsOn(options, args);
  const bool entropy_term = options.entropy_coef != 0.0f;
  float* logits = ws->logits();
  double* row_stats = ws->row_stats();
  const bool distribute = AsksDistributionOutputs(args);
  // The candidates exchanged (every shard's top_k); those written only where asked for.
  const int top_k = args.top_k;
  std::atomic<int64_t> correct_count{0};
  pool_.ParallelFor(chunk.size, [&](int64_t begin, int64_t end) {
    int64_t correct = 0;
    for (int64_t q = begin; q < end; ++q) {
      const int32_t y = args.targets[chunk.begin + q];
      const bool ignored = y == options.ignore_index;
      const int64_t t = chunk.begin + q;
      ShardTokenLoss token = CombineShardStats(args.stats, args.stats_chunk_rows, shard.shards, q,
                                               ignored, options, shard.problem.v);
      // The entropy term's entropy, combined as the output's is (without the top-k).
      double entropy = 0.0;
      if (entropy_term && !ignored) {
        entropy = CombineShardOutputStats(args.stats, args.output_stats, args.stats_chunk_rows,
                                          shard.shards, q, token.lse, top_k, nullptr, nullptr)
                      .entropy;
      }
      TokenTerms inputs;
      if (terms_on) {
        if (args.token_weights != nullptr) inputs.weight = args.token_weights[t];
        if (args.old_logprob != nullptr) inputs.old_logprob = args.old_logprob[t];
        if (args.advantages != nullptr) inputs.advantage = args.advantages[t];
        if (args.ref_logprob != nullptr) inputs.ref_logprob = args.ref_logprob[t];
        if (!ignored) token.loss = ShardTermsLoss(options, token, shard.problem.v, entropy, inputs);
      }
      row_stats[2 * q] = token.loss;
      row_stats[2 * q + 1] = token.lse;
      if (distribute) {
        int32_t* top_ids = args.top_k_ids != nullptr ? args.top_k_ids + t * top_k : nullptr;
        float* top_logprobs =
            args.top_k_logprobs != nullptr ? args.top_k_logprobs + t * top_k : nullptr;
        // An ignored token gets the values Arguments names: its statistics are not combined.
        ShardTokenOutputs out;
        if (ignored) {
          for (int i = 0; i < top_k; ++i) {
            if (top_ids != nullptr) top_ids[i] = -1;
            if (top_logprobs != nullptr) top_logprobs[i] = 0.0f;
          }
        } else {
          out = CombineShardOutputStats(args.stats, args.output_stats, args.stats_chunk_rows,
                                        shard.shards, q, token.lse, top_k, top_ids, top_logprobs);
        }
        if (args.per_token_logprob != nullptr) {
          args.per_token_logprob[t] = static_cast<float>(out.logprob);
        }
        if (args.per_token_entropy != nullptr) {
          args.per_token_entropy[t] = static_cast<float>(out.entropy);
        }
        if (args.per_token_argmax != nullptr) args.per_token_argmax[t] = out.argmax;
        correct += !ignored && out.argmax == y ? 1 : 0;
      }
      if (want_grad && terms_on) {
        ComputeShardRowGradientWithTerms(logits + q * rows, rows,
                                         ignored ? -1 : y - shard.row_begin, ignored, token,
                                         options, shard.problem.v, entropy, inputs, grad_scale);
      } else if (want_grad) {
        ComputeShardRowGradient(logits + q * rows, rows, ignored ? -1 : y - shard.row_begin,
                                ignored, token.lse, options, shard.problem.v, grad_scale);
      }
    }
    // A count: the same total whatever order the threads add in.
    if (correct > 0) correct_count.fetch_add(correct, std::memory_order_relaxed);
  });
  if (args.correct_count != nullptr) *args.correct_count += correct_count.load();
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
  if (args.grad_bias != nullptr) {
    // db_rows += the column sums of G over the chunk's tokens, in token order, divided by the
    // logit scale G carries (as Run's, cpu_run.cc).
    const double inv_scale = 1.0 / static_cast<double>(options.logit_scale);
    pool_.ParallelFor(rows, [&](int64_t begin, int64_t end) {
      std::vector<double> column_sums(static_cast<size_t>(end - begin), 0.0);
      for (int64_t q = 0; q < chunk.size; ++q) {
        const float* g = logits + q * rows;
        for (int64_t j = begin; j < end; ++j) column_sums[j - begin] += g[j];
      }
      for (int64_t j = begin; j < end; ++j) {
        args.grad_bias[j] += static_cast<float>(column_sums[j - begin] * inv_scale);
      }
    });
  }

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

}  // namespace losshead::kernels::cpu
