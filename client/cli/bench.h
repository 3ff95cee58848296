// The parts of `losshead bench` (bench.cc runs them in order): its checked settings
// (bench_args.cc), the check of one step against the host (bench_check.cc), the timed streams
// (bench_loop.cc) and the report of what they measured (bench_report.cc).
#ifndef LOSSHEAD_CLIENT_CLI_BENCH_H_
#define LOSSHEAD_CLIENT_CLI_BENCH_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/client/client.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::cli::bench {

using Clock = std::chrono::steady_clock;

// The flags of `losshead bench`, each within its range.
struct Settings {
  int64_t tokens = 0;  // per micro-batch (--chunk_tokens)
  int64_t hidden_size = 0;
  int64_t vocab_size = 0;
  int streams = 0;
  int depth = 0;           // micro-batches in flight per stream
  int64_t iterations = 0;  // per stream; 0: run for `seconds`
  double seconds = 0;
  bool dedicated_connections = true;
  bool same_node = true;  // the same-node path where the server offers it (docs/same-node.md)
  bool fresh_results = false;
  // The bench's own head (when --head is not given).
  v1::Placement placement;
  v1::DType weight_dtype = v1::DTYPE_UNSPECIFIED;
  v1::MatmulPrecision matmul_precision = v1::MATMUL_PRECISION_UNSPECIFIED;
  bool zero_head = false;
  uint64_t seed = 0;
};

// INVALID_ARGUMENT naming the flag for one out of range; nothing is connected before.
absl::StatusOr<Settings> SettingsFromFlags();

// The same micro-batch, sent again and again: bf16 hidden states and int32 targets.
struct Batch {
  std::vector<uint16_t> hidden;
  std::vector<int32_t> targets;
};

client::Microbatch MakeMicrobatch(const std::string& head, const std::string& client_id,
                                  uint64_t sequence, int64_t n, const Batch& batch);

// One forward-only step over `batch`: its loss finite over every token; on a head of the bench's
// own (`own_head`), the first tokens' losses and dH rows also match a float64 computation on the
// host from the head's downloaded W. Returns the mean loss.
absl::StatusOr<double> CheckStep(client::Client& admin, const std::string& head, bool own_head,
                                 const Settings& settings, const Batch& batch);

// One answer of a timed stream: when it arrived and the tokens it counted.
struct Answered {
  Clock::time_point at;
  int64_t tokens = 0;
};

struct StreamRecord {
  std::vector<double> latencies;  // seconds, first byte sent to answer received
  std::vector<Answered> answers;
  absl::Status status;
};

struct TimedRun {
  Clock::time_point start;
  Clock::time_point stop;  // when sending was to stop (with --seconds)
  double elapsed = 0;      // seconds, to the last stream's end
  std::vector<StreamRecord> streams;
};

// `settings.streams` streams on `clients` (one each with dedicated connections, else all on the
// first), each keeping `settings.depth` micro-batches in flight, for --iterations micro-batches
// or --seconds.
TimedRun RunTimed(const std::vector<std::unique_ptr<client::Client>>& clients,
                  const std::string& head, const Settings& settings, const Batch& batch);

// Prints the run's tokens/s, steady-state rate and latency percentiles.
void Report(const TimedRun& run, const Settings& settings, const std::string& numerics);

}  // namespace losshead::cli::bench

#endif  // LOSSHEAD_CLIENT_CLI_BENCH_H_
