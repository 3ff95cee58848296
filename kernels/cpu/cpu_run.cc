// The CPU backend's fused call (Run) and the gradient stash's flush: BLAS GEMMs per token chunk
// around the row math of row_loss.cc.
#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/chunk_plan.h"
#include "kernels/cpu/cpu_backend_impl.h"
#include "kernels/cpu/row_loss.h"
#include "kernels/cpu/row_terms.h"
#include "losshead/kernels/dtype_convert.h"

namespace losshead::kernels::cpu {
namespace {

// An ignored token's top-k, as Arguments documents it: ids -1, log-probs 0.
void WriteIgnoredTopK(const RowDistribution& dist) {
  for (int i = 0; i < dist.top_k; ++i) {
    if (dist.top_k_ids != nullptr) dist.top_k_ids[i] = -1;
    if (dist.top_k_logprobs != nullptr) dist.top_k_logprobs[i] = 0.0f;
  }
}

}  // namespace

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
  if (absl::Status status = ValidateTopK(args, problem.v); !status.ok()) return status;
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
  if (absl::Status status = ValidateLossInputs(problem, args); !status.ok()) return status;
  if (absl::Status status = CheckTermInputs(problem, args); !status.ok()) return status;

  const int64_t n = problem.n;
  const int64_t d = problem.d;
  const int64_t v = problem.v;
  const DType dtype = problem.dtype;
  const LossOptions& options = problem.options;
  const size_t element = DTypeSize(dtype);
  const float grad_scale = EffectiveGradScale(options, token_count);
  const bool want_grad = args.grad_hidden != nullptr || args.grad_weight != nullptr || stashed ||
                         args.grad_bias != nullptr;
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

  // The distribution outputs (problem.h): computed per row only when one of them is asked for.
  const bool distribute = AsksDistributionOutputs(args);
  const int top_k = AsksTopK(args) ? args.top_k : 0;
  std::atomic<int64_t> correct_count{0};
  // The model options and loss terms beyond the plain loss (problem.h): decided once per call,
  // one branch per row.
  const bool terms = RowTermsOn(options, args);

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
      int64_t correct = 0;
      for (int64_t r = begin; r < end; ++r) {
        const bool ignored = targets[r] == options.ignore_index;
        // An ignored token keeps RowDistribution's defaults, the values Arguments documents.
        RowDistribution dist;
        const int64_t t = c0 + r;
        if (top_k > 0) {
          dist.top_k = top_k;
          if (args.top_k_ids != nullptr) dist.top_k_ids = args.top_k_ids + t * top_k;
          if (args.top_k_logprobs != nullptr) dist.top_k_logprobs = args.top_k_logprobs + t * top_k;
          if (ignored) WriteIgnoredTopK(dist);
        }
        RowDistribution* dist_out = distribute ? &dist : nullptr;
        const RowLoss row = terms ? ComputeRowLossWithTerms(logits + r * v, v, targets[r], ignored,
                                                            options, args.bias, TokenTermsOf(args, t),
                                                            grad_scale, want_grad, dist_out)
                                  : ComputeRowLoss(logits + r * v, v, targets[r], ignored, options,
                                                   grad_scale, want_grad, dist_out);
        row_stats[2 * r] = row.loss;
        row_stats[2 * r + 1] = row.lse;
        if (!distribute) continue;
        if (args.per_token_logprob != nullptr) {
          args.per_token_logprob[t] = static_cast<float>(dist.logprob);
        }
        if (args.per_token_entropy != nullptr) {
          args.per_token_entropy[t] = static_cast<float>(dist.entropy);
        }
        if (args.per_token_argmax != nullptr) args.per_token_argmax[t] = dist.argmax;
        correct += !ignored && dist.argmax == targets[r] ? 1 : 0;
      }
      // A count: the same total whatever order the threads add in.
      if (correct > 0) correct_count.fetch_add(correct, std::memory_order_relaxed);
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
    if (args.grad_bias != nullptr) {
      // db += the column sums of G over the chunk's rows divided by the logit scale G carries
      // (dloss/db_j = dloss/dx_j, G = logit_scale dloss/dx_j).
      const double inv_scale = 1.0 / static_cast<double>(options.logit_scale);
      pool_.ParallelFor(v, [&](int64_t begin, int64_t end) {
        std::vector<double> column_sums(static_cast<size_t>(end - begin), 0.0);
        for (int64_t r = 0; r < rows; ++r) {
          const float* g = logits + r * v;
          for (int64_t j = begin; j < end; ++j) column_sums[j - begin] += g[j];
        }
        for (int64_t j = begin; j < end; ++j) {
          args.grad_bias[j] += static_cast<float>(column_sums[j - begin] * inv_scale);
        }
      });
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
  if (args.correct_count != nullptr) *args.correct_count = correct_count.load();
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

}  // namespace losshead::kernels::cpu
