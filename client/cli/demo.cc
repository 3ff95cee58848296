// `losshead demo`: trains a head end to end through the server. A fixed random teacher head labels
// random hidden states by sampling from its softmax; a student head on the server learns it: stream
// micro-batches, then one ApplyOptimizer steps the server-side optimizer over them (the
// hyper-parameters, a cosine learning-rate schedule included, come from here). With
// --client_optimizer the optimizer runs here instead, as a custom one would: pull dW with reset,
// update a host copy of W, push it back. The loss falls toward the teacher's entropy, the lowest
// mean cross-entropy reachable on samples of the teacher.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/cli/command_line.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "client/cli/host_math.h"

namespace losshead::cli {
namespace {

using Clock = std::chrono::steady_clock;

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "demo: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The window must hold exactly what this step sent.
absl::Status CheckWindow(const v1::GradientSummary& window, int64_t tokens, int64_t sent) {
  if (window.token_count() == static_cast<uint64_t>(tokens) &&
      window.microbatch_count() == static_cast<uint64_t>(sent)) {
    return absl::OkStatus();
  }
  return absl::InternalError(absl::StrCat("the step covers ", window.token_count(), " tokens in ",
                                          window.microbatch_count(), " micro-batches, sent ",
                                          tokens, " in ", sent));
}

// One server-side optimizer step (torch's AdamW without weight decay, or plain SGD), keyed by the
// step number so that a retry never steps twice. Returns the new weights version.
absl::StatusOr<uint64_t> ServerStep(client::Client& client, const std::string& head,
                                    const std::string& client_id, int step, bool adam, double lr,
                                    uint64_t version, int64_t tokens, int64_t sent) {
  v1::ApplyOptimizerRequest request;
  request.set_head(head);
  request.set_client_id(client_id);
  request.set_step_key(static_cast<uint64_t>(step));
  request.set_expected_weights_version(version);
  v1::OptimizerHyperParams& p = *request.mutable_params();
  p.set_lr(lr);
  if (adam) {
    p.set_beta1(0.9);
    p.set_beta2(0.999);
    p.set_eps(1e-8);
  }
  absl::StatusOr<v1::ApplyOptimizerResponse> applied = client.ApplyOptimizer(request);
  if (!applied.ok()) return applied.status();
  if (absl::Status s = CheckWindow(applied->window(), tokens, sent); !s.ok()) return s;
  return applied->weights_version();
}

// The client-side path: pull dW with reset, step the host copy of W, push it back.
absl::StatusOr<uint64_t> ClientStep(client::Client& client, const std::string& head, double lr,
                                    uint64_t version, int64_t tokens, int64_t sent,
                                    Optimizer& optimizer, std::vector<float>& weights) {
  auto grad = client.PullGradient(head, v1::DTYPE_FP32, /*reset=*/true);
  if (!grad.ok()) return grad.status();
  if (absl::Status s = CheckWindow(grad->summary, tokens, sent); !s.ok()) return s;
  optimizer.set_lr(static_cast<float>(lr));
  optimizer.Apply(reinterpret_cast<const float*>(grad->data.data()), weights.data());
  client::PushRequest push;
  push.head = head;
  push.dtype = v1::DTYPE_FP32;
  push.data = client::AsBytes(weights);
  push.expected_weights_version = version;
  return client.PushWeights(push);
}

}  // namespace

int RunDemo() {
  const int64_t v = SizeFlag(FLAGS_vocab_size, "demo");
  const int64_t d = SizeFlag(FLAGS_hidden_size, "demo");
  const int64_t tokens = absl::GetFlag(FLAGS_tokens_per_step);
  const int64_t micro = std::min(SizeFlag(FLAGS_chunk_tokens, "demo"), tokens);
  const int steps = absl::GetFlag(FLAGS_steps);
  const std::string optimizer_name = absl::GetFlag(FLAGS_optimizer);
  if (v < 2 || d < 1 || tokens < 1 || micro < 1 || steps < 1 ||
      (optimizer_name != "adam" && optimizer_name != "sgd")) {
    return Fail("flags",
                absl::InvalidArgumentError(
                    "need --vocab_size >= 2, --hidden_size, --tokens_per_step, --chunk_tokens, "
                    "--steps >= 1 and --optimizer adam|sgd"));
  }
  auto connected = ConnectFromFlags();
  if (!connected.ok()) return Fail("connect", connected.status());
  client::Client& client = **connected;

  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  const float gain = static_cast<float>(absl::GetFlag(FLAGS_teacher_gain));
  const std::vector<float> teacher =
      RandomNormal(static_cast<size_t>(v * d), gain / std::sqrt(static_cast<float>(d)), rng);

  // The student starts at zero (loss = log V) in fp32 so that the host and server copies of W
  // are the same numbers.
  std::string head = absl::GetFlag(FLAGS_head);
  if (head.empty()) head = absl::StrCat("demo-", getpid());
  v1::HeadSpec spec;
  spec.set_name(head);
  spec.set_vocab_size(v);
  spec.set_hidden_size(d);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->set_zeros(true);
  const bool on_server = !absl::GetFlag(FLAGS_client_optimizer);
  if (on_server) {
    spec.mutable_optimizer()->set_kind(optimizer_name == "adam" ? v1::OPTIMIZER_ADAMW
                                                                : v1::OPTIMIZER_SGD);
  }
  auto created = client.CreateHead(spec);
  if (!created.ok()) return Fail("create head " + head, created.status());
  uint64_t version = created->weights_version();
  // The client-side path's host copy of W and optimizer state.
  std::vector<float> weights(on_server ? 0 : static_cast<size_t>(v * d), 0.0f);
  Optimizer optimizer(weights.size(), optimizer_name == "adam",
                      static_cast<float>(absl::GetFlag(FLAGS_lr)));
  const std::string client_id = absl::StrCat("demo-", getpid());

  std::printf(
      "demo: head %s V=%lld D=%lld on %s, %lld tokens/step in micro-batches of %lld, "
      "%s lr=%g (cosine decay) on the %s\n",
      head.c_str(), static_cast<long long>(v), static_cast<long long>(d), created->device().c_str(),
      static_cast<long long>(tokens), static_cast<long long>(micro), optimizer_name.c_str(),
      absl::GetFlag(FLAGS_lr), on_server ? "server" : "client");
  std::printf("%6s %10s %16s %10s\n", "step", "loss", "teacher_entropy", "gap");

  // One stream for the whole run: the micro-batches of a step are pipelined on it.
  auto stream = client.OpenStepStream();
  if (!stream.ok()) return Fail("open step stream", stream.status());

  int exit_code = 0;
  double server_seconds = 0;
  int64_t server_tokens = 0;
  uint64_t sequence = 0;
  double first_loss = NAN, last_loss = NAN, last_entropy = NAN;
  std::vector<int32_t> targets;
  for (int step = 1; step <= steps && exit_code == 0; ++step) {
    const std::vector<float> hidden = RandomNormal(static_cast<size_t>(tokens * d), 1.0f, rng);
    const double entropy = SampleFromTeacher(teacher, hidden, tokens, d, v, rng, &targets);

    const Clock::time_point start = Clock::now();
    int64_t sent = 0;
    for (int64_t begin = 0; begin < tokens; begin += micro) {
      const int64_t n = std::min(micro, tokens - begin);
      client::Microbatch mb;
      mb.head = head;
      mb.client_id = client_id;
      mb.sequence = ++sequence;
      mb.num_tokens = n;
      mb.hidden_dtype = v1::DTYPE_FP32;
      mb.hidden = std::as_bytes(std::span<const float>(hidden.data() + begin * d, n * d));
      mb.target_dtype = v1::DTYPE_INT32;
      mb.targets = std::as_bytes(std::span<const int32_t>(targets.data() + begin, n));
      // dW of the whole step's mean loss: sum over tokens, scaled once by 1 / tokens (the
      // server-side apply divides by the window's tokens itself).
      mb.options.set_reduction(v1::REDUCTION_SUM);
      if (!on_server) mb.options.set_grad_scale(1.0f / static_cast<float>(tokens));
      mb.options.set_expected_weights_version(version);
      if (absl::Status s = (*stream)->Send(mb); !s.ok()) {
        exit_code = Fail("send", s);
        break;
      }
      ++sent;
    }
    double loss_sum = 0;
    int64_t token_count = 0;
    for (int64_t i = 0; i < sent; ++i) {
      auto result = (*stream)->Receive();
      if (!result.ok()) {
        exit_code = Fail("step", result.status());
        continue;
      }
      loss_sum += result->loss_sum;
      token_count += result->token_count;
    }
    if (exit_code != 0) break;

    // Cosine decay to a tenth of --lr: late steps average out the sampling noise of small batches.
    const double progress = static_cast<double>(step - 1) / std::max(1, steps - 1);
    const double lr = absl::GetFlag(FLAGS_lr) * (0.1 + 0.45 * (1 + std::cos(M_PI * progress)));
    absl::StatusOr<uint64_t> stepped =
        on_server ? ServerStep(client, head, client_id, step, optimizer_name == "adam", lr, version,
                               tokens, sent)
                  : ClientStep(client, head, lr, version, tokens, sent, optimizer, weights);
    if (!stepped.ok()) {
      exit_code = Fail("optimizer step", stepped.status());
      break;
    }
    version = *stepped;
    server_seconds += Seconds(Clock::now() - start);
    server_tokens += token_count;

    const double loss = loss_sum / static_cast<double>(token_count);
    if (step == 1) first_loss = loss;
    last_loss = loss;
    last_entropy = entropy;
    if (step == 1 || step % absl::GetFlag(FLAGS_print_every) == 0 || step == steps) {
      std::printf("%6d %10.4f %16.4f %10.4f\n", step, loss, entropy, loss - entropy);
      std::fflush(stdout);
    }
  }

  absl::Status finished = (*stream)->Finish();
  if (exit_code == 0 && !finished.ok()) exit_code = Fail("step stream", finished);
  if (exit_code == 0) {
    std::printf(
        "demo: loss %.4f -> %.4f (log V = %.4f, teacher entropy %.4f); %lld tokens, "
        "%.0f tokens/s through steps and optimizer steps\n",
        first_loss, last_loss, std::log(static_cast<double>(v)), last_entropy,
        static_cast<long long>(server_tokens), static_cast<double>(server_tokens) / server_seconds);
  }
  if (absl::GetFlag(FLAGS_keep_head)) return exit_code;  // trained for an export or a restart
  if (absl::Status deleted = client.DeleteHead(head); !deleted.ok() && exit_code == 0) {
    exit_code = Fail("delete head", deleted);
  }
  return exit_code;
}

}  // namespace losshead::cli
