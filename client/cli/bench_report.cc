// `losshead bench`: what the timed streams measured, printed.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "client/cli/bench.h"

namespace losshead::cli::bench {
namespace {

double Percentile(std::vector<double>& sorted, double p) {
  if (sorted.empty()) return NAN;
  const size_t i = std::min(sorted.size() - 1, static_cast<size_t>(p * sorted.size()));
  return sorted[i];
}

// Steady state: from the moment every stream has had its first `depth + 1` answers back (its
// pipeline has filled and turned over once; answers computed while the streams were still
// filling have been delivered) to the end of sending (after which they drain). The whole-run
// figure counts the filling and the draining too, about one step latency of each.
struct SteadyState {
  Clock::time_point from;
  bool every_stream = true;  // every stream had more answers than micro-batches in flight
  int64_t tokens = 0;
  double seconds = 0;
};

SteadyState SteadyStateOf(const TimedRun& run, int depth) {
  SteadyState steady{.from = run.start};
  for (const StreamRecord& stream : run.streams) {
    if (stream.answers.size() <= static_cast<size_t>(depth)) {
      steady.every_stream = false;
    } else {
      steady.from = std::max(steady.from, stream.answers[depth].at);
    }
  }
  for (const StreamRecord& stream : run.streams) {
    for (const Answered& a : stream.answers) {
      if (a.at > steady.from && a.at <= run.stop) steady.tokens += a.tokens;
    }
  }
  steady.seconds = std::chrono::duration<double>(run.stop - steady.from).count();
  return steady;
}

}  // namespace

void Report(const TimedRun& run, const Settings& settings, const std::string& numerics) {
  std::vector<double> all;
  int64_t total_tokens = 0;
  for (const StreamRecord& stream : run.streams) {
    all.insert(all.end(), stream.latencies.begin(), stream.latencies.end());
    for (const Answered& a : stream.answers) total_tokens += a.tokens;
  }
  const SteadyState steady = SteadyStateOf(run, settings.depth);
  std::sort(all.begin(), all.end());
  const double elapsed = run.elapsed;
  const double d = static_cast<double>(settings.hidden_size);
  const double flops =
      6.0 * static_cast<double>(total_tokens) * static_cast<double>(settings.vocab_size) * d;
  std::printf(
      "bench: N=%lld D=%lld V=%lld, head %s, hidden bf16 on the wire, %d streams x %d in "
      "flight: %zu micro-batches, %lld tokens in %.2f s\n",
      static_cast<long long>(settings.tokens), static_cast<long long>(settings.hidden_size),
      static_cast<long long>(settings.vocab_size), numerics.c_str(), settings.streams,
      settings.depth, all.size(), static_cast<long long>(total_tokens), elapsed);
  std::printf("bench: %.0f tokens/s, %.2f GFLOP/s, %.1f MB/s on the wire (hidden up + dH down)\n",
              static_cast<double>(total_tokens) / elapsed, flops / elapsed * 1e-9,
              4.0 * static_cast<double>(total_tokens) * d / elapsed * 1e-6);
  // Without --iterations, and only when the window is long enough to mean something.
  if (settings.iterations == 0 && steady.every_stream && steady.seconds >= 1.0) {
    std::printf(
        "bench: steady state %.0f tokens/s (answers from every stream's turned-over pipeline to "
        "the end of sending, %.2f s)\n",
        static_cast<double>(steady.tokens) / steady.seconds, steady.seconds);
  } else if (settings.iterations == 0) {
    std::printf("bench: no steady-state figure: %s\n",
                steady.every_stream
                    ? absl::StrCat("the last pipeline turned over ",
                                   std::chrono::duration<double>(steady.from - run.start).count(),
                                   " s into the run, under 1 s before its end")
                          .c_str()
                    : "a stream had no more answers than micro-batches in flight");
  }
  std::printf("bench: step latency p50 %.2f ms, p95 %.2f ms, p99 %.2f ms\n",
              Percentile(all, 0.50) * 1e3, Percentile(all, 0.95) * 1e3,
              Percentile(all, 0.99) * 1e3);
}

}  // namespace losshead::cli::bench
