// `losshead demo`: trains a head end to end through the server. A fixed random teacher head labels
// random hidden states by sampling from its softmax; a student head on the server learns it while
// the optimizer runs here, as a trainer's would: stream micro-batches, pull dW with reset, update
// a host copy of W, push it back. The loss falls toward the teacher's entropy, the lowest mean
// cross-entropy reachable on samples of the teacher.
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

}  // namespace

int RunDemo() {
  const int64_t v = absl::GetFlag(FLAGS_vocab);
  const int64_t d = absl::GetFlag(FLAGS_hidden);
  const int64_t tokens = absl::GetFlag(FLAGS_tokens_per_step);
  const int64_t micro = std::min(absl::GetFlag(FLAGS_microbatch), tokens);
  const int steps = absl::GetFlag(FLAGS_steps);
  const std::string optimizer_name = absl::GetFlag(FLAGS_optimizer);
  if (v < 2 || d < 1 || tokens < 1 || micro < 1 || steps < 1 ||
      (optimizer_name != "adam" && optimizer_name != "sgd")) {
    return Fail("flags", absl::InvalidArgumentError(
                             "need --vocab >= 2, --hidden, --tokens_per_step, --microbatch, "
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
  auto created = client.CreateHead(spec);
  if (!created.ok()) return Fail("create head " + head, created.status());
  uint64_t version = created->weights_version();
  std::vector<float> weights(static_cast<size_t>(v * d), 0.0f);
  Optimizer optimizer(weights.size(), optimizer_name == "adam",
                      static_cast<float>(absl::GetFlag(FLAGS_lr)));

  std::printf(
      "demo: head %s V=%lld D=%lld on %s, %lld tokens/step in micro-batches of %lld, "
      "%s lr=%g (cosine decay)\n",
      head.c_str(), static_cast<long long>(v), static_cast<long long>(d), created->device().c_str(),
      static_cast<long long>(tokens), static_cast<long long>(micro), optimizer_name.c_str(),
      absl::GetFlag(FLAGS_lr));
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
      mb.client_id = "demo";
      mb.sequence = ++sequence;
      mb.num_tokens = n;
      mb.hidden_dtype = v1::DTYPE_FP32;
      mb.hidden = std::as_bytes(std::span<const float>(hidden.data() + begin * d, n * d));
      mb.target_dtype = v1::DTYPE_INT32;
      mb.targets = std::as_bytes(std::span<const int32_t>(targets.data() + begin, n));
      // dW of the whole step's mean loss: sum over tokens, scaled once by 1 / tokens.
      mb.options.set_reduction(v1::REDUCTION_SUM);
      mb.options.set_grad_scale(1.0f / static_cast<float>(tokens));
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

    auto grad = client.PullGradient(head, v1::DTYPE_FP32, /*reset=*/true);
    if (!grad.ok()) {
      exit_code = Fail("pull", grad.status());
      break;
    }
    if (grad->summary.token_count() != static_cast<uint64_t>(tokens) ||
        grad->summary.microbatch_count() != static_cast<uint64_t>(sent)) {
      exit_code = Fail(
          "pull", absl::InternalError(absl::StrCat("gradient covers ", grad->summary.token_count(),
                                                   " tokens in ", grad->summary.microbatch_count(),
                                                   " micro-batches, sent ", tokens, " in ", sent)));
      break;
    }
    // Cosine decay to a tenth of --lr: late steps average out the sampling noise of small batches.
    const double progress = static_cast<double>(step - 1) / std::max(1, steps - 1);
    optimizer.set_lr(static_cast<float>(absl::GetFlag(FLAGS_lr) *
                                        (0.1 + 0.45 * (1 + std::cos(M_PI * progress)))));
    optimizer.Apply(reinterpret_cast<const float*>(grad->data.data()), weights.data());
    client::PushRequest push;
    push.head = head;
    push.dtype = v1::DTYPE_FP32;
    push.data = client::AsBytes(weights);
    push.expected_weights_version = version;
    auto pushed = client.PushWeights(push);
    if (!pushed.ok()) {
      exit_code = Fail("push", pushed.status());
      break;
    }
    version = *pushed;
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
        "%.0f tokens/s through step + pull + push\n",
        first_loss, last_loss, std::log(static_cast<double>(v)), last_entropy,
        static_cast<long long>(server_tokens), static_cast<double>(server_tokens) / server_seconds);
  }
  if (absl::Status deleted = client.DeleteHead(head); !deleted.ok() && exit_code == 0) {
    exit_code = Fail("delete head", deleted);
  }
  return exit_code;
}

}  // namespace losshead::cli
