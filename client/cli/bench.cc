// `losshead bench`: synthetic micro-batches over several concurrent Step streams; reports tokens/s
// and the latency of each micro-batch from its first byte sent to its answer received. The head it
// creates has --dtype weights (and --matmul_precision) drawn from N(0, 0.02) (GEMMs on zeros run
// ~15 % faster than on real weights; --zero_head keeps the old zero head for comparison). The
// hidden states go up and dH comes back in bf16 whatever the head's dtype: the server converts, as
// it would for a bf16 trainer. The result is checked before anything is timed: the first tokens'
// losses and dH rows against a float64 computation on the host from the downloaded W.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "client/cli/host_math.h"
#include "losshead/kernels/dtype_convert.h"

namespace losshead::cli {
namespace {

using Clock = std::chrono::steady_clock;

// Tokens whose loss and dH rows the check recomputes on the host (each costs 2·V·D multiply-adds).
constexpr int64_t kCheckedTokens = 4;

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "bench: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

struct Batch {
  std::vector<uint16_t> hidden;
  std::vector<int32_t> targets;
};

client::Microbatch MakeMicrobatch(const std::string& head, const std::string& client_id,
                                  uint64_t sequence, int64_t n, const Batch& batch) {
  client::Microbatch mb;
  mb.head = head;
  mb.client_id = client_id;
  mb.sequence = sequence;
  mb.num_tokens = n;
  mb.hidden_dtype = v1::DTYPE_BF16;
  mb.hidden = client::AsBytes(batch.hidden);
  mb.target_dtype = v1::DTYPE_INT32;
  mb.targets = client::AsBytes(batch.targets);
  return mb;
}

// One answer: when it arrived and the tokens it counted.
struct Answered {
  Clock::time_point at;
  int64_t tokens = 0;
};

// One stream's loop: keeps `depth` micro-batches in flight until `done` says stop.
absl::Status RunStream(client::Client& client, const std::string& head, int index, int64_t n,
                       const Batch& batch, int depth, int64_t iterations, Clock::time_point stop,
                       std::vector<double>* latencies, std::vector<Answered>* answers) {
  auto stream = client.OpenStepStream();
  if (!stream.ok()) return stream.status();
  const std::string client_id = absl::StrCat("bench-", getpid(), "-", index);
  std::deque<Clock::time_point> started;
  // Micro-batch s writes its dH into grad[s % depth] as it arrives: at most `depth` are in flight
  // and answers come in order, so the buffer's previous micro-batch has been received. Written
  // once here, so that the timed run maps no pages (a fresh 64 MiB result costs 16,384 faults).
  std::vector<std::vector<std::byte>> grad(absl::GetFlag(FLAGS_fresh_results) ? 0 : depth);
  for (std::vector<std::byte>& g : grad) g.assign(batch.hidden.size() * sizeof(uint16_t), {});
  uint64_t sequence = 0;
  auto more = [&] {
    return iterations > 0 ? static_cast<int64_t>(sequence) < iterations : Clock::now() < stop;
  };
  absl::Status status;
  while (status.ok() && (more() || !started.empty())) {
    while (status.ok() && static_cast<int>(started.size()) < depth && more()) {
      started.push_back(Clock::now());
      client::Microbatch mb = MakeMicrobatch(head, client_id, ++sequence, n, batch);
      if (!grad.empty()) mb.grad_hidden_out = std::span<std::byte>(grad[sequence % depth]);
      status = (*stream)->Send(mb);
    }
    if (started.empty()) break;
    auto result = (*stream)->Receive();
    if (!result.ok()) {
      status = result.status();
      break;
    }
    const Clock::time_point now = Clock::now();
    latencies->push_back(std::chrono::duration<double>(now - started.front()).count());
    started.pop_front();
    answers->push_back({now, result->token_count});
  }
  absl::Status finished = (*stream)->Finish();
  return status.ok() ? finished : status;
}

// Compares the first tokens of `result` (a sum-reduced step with per-token losses) with the same
// tokens computed in float64 from W as the server holds it.
absl::Status CheckAgainstHost(client::Client& admin, const std::string& head, int64_t d, int64_t v,
                              const Batch& batch, const client::StepResult& result) {
  // In fp32, which holds every weight dtype exactly: a bf16 copy of an fp32 head would differ
  // from what the server multiplies by about as much as the check tolerates.
  auto w = admin.DownloadWeights(head, v1::DTYPE_FP32);
  if (!w.ok()) return w.status();
  if (w->data.size() != static_cast<size_t>(v) * d * sizeof(float)) {
    return absl::InternalError(
        absl::StrCat("downloaded W holds ", w->data.size(), " bytes, not V x D in fp32"));
  }
  const auto* weights = reinterpret_cast<const float*>(w->data.data());
  const auto* grad = reinterpret_cast<const uint16_t*>(result.grad_hidden.data());
  const int64_t checked = std::min<int64_t>(kCheckedTokens, result.token_count);
  if (static_cast<int64_t>(result.per_token_loss.size()) < checked ||
      result.grad_hidden.size() < static_cast<size_t>(checked * d) * sizeof(uint16_t)) {
    return absl::InternalError("check step returned no per-token losses or dH");
  }
  std::vector<double> logits(v);
  std::vector<double> dh(d);
  for (int64_t t = 0; t < checked; ++t) {
    const uint16_t* h = batch.hidden.data() + t * d;
    double max_logit = -INFINITY;
    for (int64_t j = 0; j < v; ++j) {
      const float* wj = weights + j * d;
      double dot = 0;
      for (int64_t k = 0; k < d; ++k) dot += double{wj[k]} * kernels::Bf16ToFloat(h[k]);
      logits[j] = dot;
      max_logit = std::max(max_logit, dot);
    }
    double z = 0;
    for (int64_t j = 0; j < v; ++j) z += std::exp(logits[j] - max_logit);
    const int32_t target = batch.targets[t];
    const double loss = max_logit + std::log(z) - logits[target];
    std::fill(dh.begin(), dh.end(), 0.0);
    double dh_scale = 0;
    for (int64_t j = 0; j < v; ++j) {
      const double g = std::exp(logits[j] - max_logit) / z - (j == target ? 1.0 : 0.0);
      const float* wj = weights + j * d;
      for (int64_t k = 0; k < d; ++k) dh[k] += g * wj[k];
    }
    for (double x : dh) dh_scale = std::max(dh_scale, std::fabs(x));
    // fp32 accumulation over D and V on the device, dH rounded to bf16 (2^-8 relative); an fp32
    // head's TF32 (high) or bf16 (medium) GEMM inputs err by no more than that.
    if (std::fabs(result.per_token_loss[t] - loss) > 1e-3 * std::max(1.0, loss)) {
      return absl::InternalError(absl::StrCat("token ", t, ": loss ", result.per_token_loss[t],
                                              ", float64 reference ", loss));
    }
    for (int64_t k = 0; k < d; ++k) {
      const double got = kernels::Bf16ToFloat(grad[t * d + k]);
      if (std::fabs(got - dh[k]) > 1e-2 * dh_scale + 1e-6) {
        return absl::InternalError(
            absl::StrCat("token ", t, ": dH[", k, "] ", got, ", float64 reference ", dh[k]));
      }
    }
  }
  return absl::OkStatus();
}

double Percentile(std::vector<double>& sorted, double p) {
  if (sorted.empty()) return NAN;
  const size_t i = std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()));
  return sorted[i];
}

}  // namespace

int RunBench() {
  const int64_t n = absl::GetFlag(FLAGS_n);
  const int64_t d = absl::GetFlag(FLAGS_d);
  const int64_t v = absl::GetFlag(FLAGS_v);
  const int streams = absl::GetFlag(FLAGS_streams);
  const int depth = absl::GetFlag(FLAGS_pipeline);
  const int64_t iterations = absl::GetFlag(FLAGS_iterations);
  if (n < 1 || d < 1 || v < 1 || streams < 1 || depth < 1) {
    return Fail("flags",
                absl::InvalidArgumentError("--n --d --v --streams --pipeline must be >= 1"));
  }
  const double seconds = absl::GetFlag(FLAGS_seconds);
  if (iterations < 0 || (iterations == 0 && !(seconds > 0 && std::isfinite(seconds)))) {
    return Fail("flags", absl::InvalidArgumentError(absl::StrCat(
                             "--iterations must be >= 0 and, when it is 0, --seconds finite and "
                             "> 0; got ",
                             iterations, " and ", seconds)));
  }
  // Checked before anything connects; they apply to the bench's own head.
  const absl::StatusOr<v1::Placement> placement = PlacementFromFlags();
  if (!placement.ok()) return Fail("flags", placement.status());
  const absl::StatusOr<v1::DType> dtype = WeightDTypeFromFlags();
  if (!dtype.ok()) return Fail("flags", dtype.status());
  const absl::StatusOr<v1::MatmulPrecision> precision = MatmulPrecisionFromFlags();
  if (!precision.ok()) return Fail("flags", precision.status());
  const bool dedicated = absl::GetFlag(FLAGS_dedicated_connections);
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int i = 0; i < (dedicated ? streams : 1); ++i) {
    auto c = ConnectFromFlags(dedicated);
    if (!c.ok()) return Fail("connect", c.status());
    clients.push_back(std::move(*c));
  }
  // Every connection up before anything is timed: a stream opened on a channel whose attempt
  // failed would fail at once rather than wait for the next one (the timed streams do not retry).
  for (const auto& c : clients) {
    if (!c->channel()->WaitForConnected(std::chrono::system_clock::now() +
                                        std::chrono::seconds(30))) {
      return Fail("connect", absl::UnavailableError(absl::StrCat(
                                 "no connection to ", absl::GetFlag(FLAGS_server), " in 30 s")));
    }
  }
  client::Client& admin = *clients[0];

  std::string head = absl::GetFlag(FLAGS_head);
  const bool own_head = head.empty();
  v1::HeadInfo info;  // as the server reports it: the dtype and precision the steps run with
  if (own_head) {
    head = absl::StrCat("bench-", getpid());
    v1::HeadSpec spec;
    spec.set_name(head);
    spec.set_vocab_size(v);
    spec.set_hidden_size(d);
    spec.set_weight_dtype(*dtype);
    spec.set_matmul_precision(*precision);
    *spec.mutable_placement() = *placement;
    if (absl::GetFlag(FLAGS_zero_head)) {
      spec.mutable_init()->set_zeros(true);
    } else {
      spec.mutable_init()->mutable_normal()->set_std(0.02f);
      // Not --seed itself, which draws the hidden states: W stays unrelated to them whatever
      // generator the server's init uses.
      spec.mutable_init()->mutable_normal()->set_seed(absl::GetFlag(FLAGS_seed) ^
                                                      0x9e3779b97f4a7c15ull);
    }
    auto created = admin.CreateHead(spec);
    if (!created.ok()) return Fail("create head", created.status());
    info = *std::move(created);
  } else {
    auto got = admin.GetHead(head);
    if (!got.ok()) return Fail("get head", got.status());
    info = *std::move(got);
  }
  const std::string numerics = DescribeNumerics(info.spec());
  std::printf("bench: %s head %s V=%lld D=%lld %s on %s; hidden bf16 on the wire\n",
              own_head ? "created" : "given", head.c_str(),
              static_cast<long long>(info.spec().vocab_size()),
              static_cast<long long>(info.spec().hidden_size()), numerics.c_str(),
              absl::StrJoin(info.devices(), ", ").c_str());

  std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
  Batch batch;
  batch.hidden = ToBf16(RandomNormal(static_cast<size_t>(n * d), 1.0f, rng));
  batch.targets.resize(n);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(v - 1));
  for (int32_t& t : batch.targets) t = pick(rng);

  // Check first: a finite loss over every token always; on a head of our own, the first tokens'
  // losses and dH rows against the host (a head given by --head may be trained or shared).
  int exit_code = 0;
  {
    client::Microbatch check =
        MakeMicrobatch(head, absl::StrCat("bench-check-", getpid()), 1, n, batch);
    check.options.set_reduction(v1::REDUCTION_SUM);
    check.options.set_return_per_token_loss(true);
    check.options.set_forward_only(true);
    auto result = admin.Step(check);
    absl::Status status = result.status();
    if (status.ok() && (!std::isfinite(result->loss) || result->token_count != n)) {
      status = absl::InternalError(
          absl::StrCat("loss ", result->loss, " over ", result->token_count, " tokens"));
    }
    if (status.ok() && own_head) status = CheckAgainstHost(admin, head, d, v, batch, *result);
    if (!status.ok()) {
      exit_code = Fail("check step", status);
    } else {
      std::printf("bench: check ok (mean loss %.5f; %s)\n", result->loss_sum / n,
                  own_head ? "first tokens' loss and dH match float64 on the host"
                           : "finite over every token");
      std::fflush(stdout);  // a progress line: seen before the timed run, also through a pipe
    }
  }

  if (exit_code == 0) {
    std::vector<std::vector<double>> latencies(streams);
    std::vector<std::vector<Answered>> answers(streams);
    std::vector<absl::Status> statuses(streams);
    const Clock::time_point start = Clock::now();
    const Clock::time_point stop =
        start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    std::vector<std::thread> threads;
    for (int i = 0; i < streams; ++i) {
      threads.emplace_back([&, i] {
        statuses[i] = RunStream(*clients[dedicated ? i : 0], head, i, n, batch, depth, iterations,
                                stop, &latencies[i], &answers[i]);
      });
    }
    for (std::thread& t : threads) t.join();
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    for (const absl::Status& s : statuses) {
      if (!s.ok() && exit_code == 0) exit_code = Fail("stream", s);
    }
    std::vector<double> all;
    int64_t total_tokens = 0;
    // Steady state: from the moment every stream has had its first `depth + 1` answers back (its
    // pipeline has filled and turned over once; answers computed while the streams were still
    // filling have been delivered) to the end of sending (after which they drain). The whole-run
    // figure counts the filling and the draining too, about one step latency of each.
    Clock::time_point steady_from = start;
    bool every_stream_steady = true;
    for (int i = 0; i < streams; ++i) {
      all.insert(all.end(), latencies[i].begin(), latencies[i].end());
      for (const Answered& a : answers[i]) total_tokens += a.tokens;
      if (answers[i].size() <= static_cast<size_t>(depth)) {
        every_stream_steady = false;
      } else {
        steady_from = std::max(steady_from, answers[i][depth].at);
      }
    }
    int64_t steady_tokens = 0;
    for (const std::vector<Answered>& stream_answers : answers) {
      for (const Answered& a : stream_answers) {
        if (a.at > steady_from && a.at <= stop) steady_tokens += a.tokens;
      }
    }
    const double steady_seconds = std::chrono::duration<double>(stop - steady_from).count();
    std::sort(all.begin(), all.end());
    const double flops =
        6.0 * static_cast<double>(total_tokens) * static_cast<double>(v) * static_cast<double>(d);
    std::printf(
        "bench: N=%lld D=%lld V=%lld, head %s, hidden bf16 on the wire, %d streams x %d in "
        "flight: %zu micro-batches, %lld tokens in %.2f s\n",
        static_cast<long long>(n), static_cast<long long>(d), static_cast<long long>(v),
        numerics.c_str(), streams, depth, all.size(), static_cast<long long>(total_tokens),
        elapsed);
    std::printf("bench: %.0f tokens/s, %.2f GFLOP/s, %.1f MB/s on the wire (hidden up + dH down)\n",
                static_cast<double>(total_tokens) / elapsed, flops / elapsed * 1e-9,
                4.0 * static_cast<double>(total_tokens) * static_cast<double>(d) / elapsed * 1e-6);
    // Without --iterations, and only when the window is long enough to mean something.
    if (iterations == 0 && every_stream_steady && steady_seconds >= 1.0) {
      std::printf(
          "bench: steady state %.0f tokens/s (answers from every stream's turned-over pipeline to "
          "the end of sending, %.2f s)\n",
          static_cast<double>(steady_tokens) / steady_seconds, steady_seconds);
    } else if (iterations == 0) {
      std::printf("bench: no steady-state figure: %s\n",
                  every_stream_steady
                      ? absl::StrCat("the last pipeline turned over ",
                                     std::chrono::duration<double>(steady_from - start).count(),
                                     " s into the run, under 1 s before its end")
                            .c_str()
                      : "a stream had no more answers than micro-batches in flight");
    }
    std::printf("bench: step latency p50 %.2f ms, p95 %.2f ms, p99 %.2f ms\n",
                Percentile(all, 0.50) * 1e3, Percentile(all, 0.95) * 1e3,
                Percentile(all, 0.99) * 1e3);
  }
  if (own_head) {
    if (absl::Status s = admin.DeleteHead(head); !s.ok() && exit_code == 0) {
      exit_code = Fail("delete head", s);
    }
  }
  return exit_code;
}

}  // namespace losshead::cli
