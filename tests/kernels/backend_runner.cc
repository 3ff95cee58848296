#include "tests/kernels/backend_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "losshead/kernels/dtype_convert.h"

namespace losshead::kernels::testing {
namespace {

constexpr int kPoisonByte = 0x7f;

std::vector<double> Decode(DType dtype, const std::vector<uint8_t>& bytes, size_t count) {
  std::vector<float> f(count);
  ToFloat(dtype, bytes.data(), f.data(), count);
  return ToDouble(f);
}

}  // namespace

Inputs MakeRandomInputs(const Problem& problem, uint64_t seed, const InputSpec& spec) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  Inputs in;
  in.problem = problem;
  const size_t hidden_count = problem.n * problem.d;
  const size_t weight_count = problem.v * problem.d;
  const size_t element = DTypeSize(problem.dtype);
  std::vector<float> f(std::max(hidden_count, weight_count));

  for (size_t i = 0; i < hidden_count; ++i)
    f[i] = unit(rng) * static_cast<float>(spec.hidden_scale);
  in.hidden_bytes.resize(hidden_count * element);
  FromFloat(problem.dtype, f.data(), in.hidden_bytes.data(), hidden_count);
  in.hidden = Decode(problem.dtype, in.hidden_bytes, hidden_count);

  for (size_t i = 0; i < weight_count; ++i)
    f[i] = unit(rng) * static_cast<float>(spec.weight_scale);
  in.weight_bytes.resize(weight_count * element);
  FromFloat(problem.dtype, f.data(), in.weight_bytes.data(), weight_count);
  in.weight = Decode(problem.dtype, in.weight_bytes, weight_count);

  std::uniform_int_distribution<int32_t> target(0, static_cast<int32_t>(problem.v - 1));
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  in.targets.resize(problem.n);
  for (int32_t& t : in.targets) {
    t = coin(rng) < spec.ignore_fraction ? static_cast<int32_t>(problem.options.ignore_index)
                                         : target(rng);
  }
  return in;
}

absl::StatusOr<Outputs> RunOnBackend(Backend& backend, const Inputs& in,
                                     const RunOptions& options) {
  const Problem& p = in.problem;
  const size_t element = DTypeSize(p.dtype);
  const size_t n = p.n, d = p.d, v = p.v;
  absl::StatusOr<size_t> workspace_bytes = backend.WorkspaceBytes(p, options.workspace_budget);
  if (!workspace_bytes.ok()) return workspace_bytes.status();
  absl::StatusOr<std::unique_ptr<Stream>> stream_or = backend.CreateStream();
  if (!stream_or.ok()) return stream_or.status();
  Stream& stream = **stream_or;

  std::vector<DeviceBuffer> keep;
  auto alloc = [&](size_t bytes) -> absl::StatusOr<void*> {
    absl::StatusOr<DeviceBuffer> buffer = backend.Allocate(bytes);
    if (!buffer.ok()) return buffer.status();
    void* data = buffer->data();
    keep.push_back(*std::move(buffer));
    return data;
  };
#define LH_ASSIGN_OR_RETURN(lhs, expr)          \
  {                                             \
    auto result_ = (expr);                      \
    if (!result_.ok()) return result_.status(); \
    lhs = *result_;                             \
  }
#define LH_RETURN_IF_ERROR(expr)       \
  {                                    \
    absl::Status status_ = (expr);     \
    if (!status_.ok()) return status_; \
  }
  Arguments args;
  void *hidden, *weight, *targets, *grad_hidden = nullptr, *grad_weight = nullptr;
  void *loss_sum, *token_count, *per_token_loss = nullptr, *per_token_lse = nullptr, *workspace;
  LH_ASSIGN_OR_RETURN(hidden, alloc(n * d * element));
  LH_ASSIGN_OR_RETURN(weight, alloc(v * d * element));
  LH_ASSIGN_OR_RETURN(targets, alloc(n * sizeof(int32_t)));
  LH_ASSIGN_OR_RETURN(loss_sum, alloc(sizeof(float)));
  LH_ASSIGN_OR_RETURN(token_count, alloc(sizeof(int64_t)));
  LH_ASSIGN_OR_RETURN(workspace, alloc(*workspace_bytes));
  LH_RETURN_IF_ERROR(backend.CopyToDevice(hidden, in.hidden_bytes.data(), n * d * element, stream));
  LH_RETURN_IF_ERROR(backend.CopyToDevice(weight, in.weight_bytes.data(), v * d * element, stream));
  LH_RETURN_IF_ERROR(backend.CopyToDevice(targets, in.targets.data(), n * sizeof(int32_t), stream));
  LH_RETURN_IF_ERROR(backend.Memset(loss_sum, kPoisonByte, sizeof(float), stream));
  LH_RETURN_IF_ERROR(backend.Memset(token_count, kPoisonByte, sizeof(int64_t), stream));
  if (options.grad_hidden) {
    LH_ASSIGN_OR_RETURN(grad_hidden, alloc(n * d * element));
    LH_RETURN_IF_ERROR(backend.Memset(grad_hidden, kPoisonByte, n * d * element, stream));
  }
  if (options.grad_weight) {
    LH_ASSIGN_OR_RETURN(grad_weight, alloc(v * d * sizeof(float)));
    if (options.initial_grad_weight.empty()) {
      LH_RETURN_IF_ERROR(backend.Memset(grad_weight, 0, v * d * sizeof(float), stream));
    } else {
      LH_RETURN_IF_ERROR(backend.CopyToDevice(grad_weight, options.initial_grad_weight.data(),
                                              v * d * sizeof(float), stream));
    }
  }
  if (options.per_token) {
    LH_ASSIGN_OR_RETURN(per_token_loss, alloc(n * sizeof(float)));
    LH_ASSIGN_OR_RETURN(per_token_lse, alloc(n * sizeof(float)));
    LH_RETURN_IF_ERROR(backend.Memset(per_token_loss, kPoisonByte, n * sizeof(float), stream));
    LH_RETURN_IF_ERROR(backend.Memset(per_token_lse, kPoisonByte, n * sizeof(float), stream));
  }
  void *logprob = nullptr, *entropy = nullptr, *argmax = nullptr, *correct_count = nullptr;
  auto poisoned = [&](bool asked, size_t bytes, void** out) -> absl::Status {
    if (!asked) return absl::OkStatus();
    absl::StatusOr<void*> data = alloc(bytes);
    if (!data.ok()) return data.status();
    *out = *data;
    return backend.Memset(*out, kPoisonByte, bytes, stream);
  };
  LH_RETURN_IF_ERROR(poisoned(options.logprob, n * sizeof(float), &logprob));
  LH_RETURN_IF_ERROR(poisoned(options.entropy, n * sizeof(float), &entropy));
  LH_RETURN_IF_ERROR(poisoned(options.argmax, n * sizeof(int32_t), &argmax));
  LH_RETURN_IF_ERROR(poisoned(options.correct_count, sizeof(int64_t), &correct_count));
  args.per_token_logprob = static_cast<float*>(logprob);
  args.per_token_entropy = static_cast<float*>(entropy);
  args.per_token_argmax = static_cast<int32_t*>(argmax);
  args.correct_count = static_cast<int64_t*>(correct_count);
  // The loss terms' inputs, copied in where given.
  auto input = [&](const std::vector<float>& values, const float** out) -> absl::Status {
    if (values.empty()) return absl::OkStatus();
    absl::StatusOr<void*> data = alloc(values.size() * sizeof(float));
    if (!data.ok()) return data.status();
    *out = static_cast<const float*>(*data);
    return backend.CopyToDevice(*data, values.data(), values.size() * sizeof(float), stream);
  };
  LH_RETURN_IF_ERROR(input(options.bias, &args.bias));
  LH_RETURN_IF_ERROR(input(options.token_weights, &args.token_weights));
  LH_RETURN_IF_ERROR(input(options.old_logprob, &args.old_logprob));
  LH_RETURN_IF_ERROR(input(options.advantages, &args.advantages));
  LH_RETURN_IF_ERROR(input(options.ref_logprob, &args.ref_logprob));
  if (options.grad_bias) {
    void* grad_bias;
    LH_ASSIGN_OR_RETURN(grad_bias, alloc(v * sizeof(float)));
    if (options.initial_grad_bias.empty()) {
      LH_RETURN_IF_ERROR(backend.Memset(grad_bias, 0, v * sizeof(float), stream));
    } else {
      LH_RETURN_IF_ERROR(backend.CopyToDevice(grad_bias, options.initial_grad_bias.data(),
                                              v * sizeof(float), stream));
    }
    args.grad_bias = static_cast<float*>(grad_bias);
  }
  const size_t top_k = options.top_k > 0 ? static_cast<size_t>(options.top_k) : 0;
  void *top_ids = nullptr, *top_logprobs = nullptr;
  LH_RETURN_IF_ERROR(poisoned(top_k > 0, n * top_k * sizeof(int32_t), &top_ids));
  LH_RETURN_IF_ERROR(poisoned(top_k > 0, n * top_k * sizeof(float), &top_logprobs));
  args.top_k = options.top_k;
  args.top_k_ids = static_cast<int32_t*>(top_ids);
  args.top_k_logprobs = static_cast<float*>(top_logprobs);
  args.hidden = hidden;
  args.weight = weight;
  args.targets = static_cast<const int32_t*>(targets);
  args.grad_hidden = grad_hidden;
  args.grad_weight = static_cast<float*>(grad_weight);
  args.loss_sum = static_cast<float*>(loss_sum);
  args.token_count = static_cast<int64_t*>(token_count);
  args.per_token_loss = static_cast<float*>(per_token_loss);
  args.per_token_lse = static_cast<float*>(per_token_lse);
  args.workspace = workspace;
  args.workspace_bytes = *workspace_bytes;
  const bool stashed = options.stash && options.grad_weight;
  if (stashed) {
    absl::StatusOr<size_t> stash_bytes = backend.GradStashBytes(p, p.n);
    if (!stash_bytes.ok()) return stash_bytes.status();
    void* stash;
    LH_ASSIGN_OR_RETURN(stash, alloc(*stash_bytes));
    args.grad_stash = GradStash{.data = stash, .capacity = p.n, .tokens = 0};
    args.grad_weight = nullptr;
  }
  LH_RETURN_IF_ERROR(backend.Run(p, args, stream));
  if (stashed) {
    GradStash flush = args.grad_stash;
    flush.tokens = p.n;
    LH_RETURN_IF_ERROR(backend.FlushGradStash(p, flush, static_cast<float*>(grad_weight), workspace,
                                              *workspace_bytes, stream));
  }

  Outputs out;
  std::vector<uint8_t> grad_hidden_bytes(n * d * element);
  LH_RETURN_IF_ERROR(backend.CopyToHost(&out.loss_sum, loss_sum, sizeof(float), stream));
  LH_RETURN_IF_ERROR(backend.CopyToHost(&out.token_count, token_count, sizeof(int64_t), stream));
  if (options.grad_hidden) {
    LH_RETURN_IF_ERROR(
        backend.CopyToHost(grad_hidden_bytes.data(), grad_hidden, n * d * element, stream));
  }
  if (options.grad_weight) {
    out.grad_weight.resize(v * d);
    LH_RETURN_IF_ERROR(
        backend.CopyToHost(out.grad_weight.data(), grad_weight, v * d * sizeof(float), stream));
  }
  if (options.grad_bias) {
    out.grad_bias.resize(v);
    LH_RETURN_IF_ERROR(
        backend.CopyToHost(out.grad_bias.data(), args.grad_bias, v * sizeof(float), stream));
  }
  if (options.per_token) {
    out.per_token_loss.resize(n);
    out.per_token_lse.resize(n);
    LH_RETURN_IF_ERROR(
        backend.CopyToHost(out.per_token_loss.data(), per_token_loss, n * sizeof(float), stream));
    LH_RETURN_IF_ERROR(
        backend.CopyToHost(out.per_token_lse.data(), per_token_lse, n * sizeof(float), stream));
  }
  if (options.logprob) {
    out.per_token_logprob.resize(n);
    LH_RETURN_IF_ERROR(
        backend.CopyToHost(out.per_token_logprob.data(), logprob, n * sizeof(float), stream));
  }
  if (options.entropy) {
    out.per_token_entropy.resize(n);
    LH_RETURN_IF_ERROR(
        backend.CopyToHost(out.per_token_entropy.data(), entropy, n * sizeof(float), stream));
  }
  if (options.argmax) {
    out.per_token_argmax.resize(n);
    LH_RETURN_IF_ERROR(
        backend.CopyToHost(out.per_token_argmax.data(), argmax, n * sizeof(int32_t), stream));
  }
  if (options.correct_count) {
    LH_RETURN_IF_ERROR(
        backend.CopyToHost(&out.correct_count, correct_count, sizeof(int64_t), stream));
  }
  if (top_k > 0) {
    out.top_k_ids.resize(n * top_k);
    out.top_k_logprobs.resize(n * top_k);
    LH_RETURN_IF_ERROR(
        backend.CopyToHost(out.top_k_ids.data(), top_ids, n * top_k * sizeof(int32_t), stream));
    LH_RETURN_IF_ERROR(backend.CopyToHost(out.top_k_logprobs.data(), top_logprobs,
                                          n * top_k * sizeof(float), stream));
  }
  LH_RETURN_IF_ERROR(stream.Synchronize());
#undef LH_ASSIGN_OR_RETURN
#undef LH_RETURN_IF_ERROR
  if (options.grad_hidden) out.grad_hidden = Decode(p.dtype, grad_hidden_bytes, n * d);
  return out;
}

double WorstToleranceRatio(const std::vector<double>& actual, const std::vector<double>& expected,
                           double rel, double abs) {
  if (actual.size() != expected.size()) return INFINITY;
  double worst = 0.0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double err = std::fabs(actual[i] - expected[i]);
    if (err == 0.0) continue;
    const double ratio = err / (rel * std::fabs(expected[i]) + abs);
    if (!(ratio <= worst)) worst = ratio;  // NaN sticks
    if (std::isnan(worst)) return worst;
  }
  return worst;
}

double MaxAbs(const std::vector<double>& values) {
  double m = 0.0;
  for (double x : values) m = std::max(m, std::fabs(x));
  return m;
}

}  // namespace losshead::kernels::testing
