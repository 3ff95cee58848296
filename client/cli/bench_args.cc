// `losshead bench`: its flags, checked before anything connects.
#include <cmath>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "client/cli/bench.h"
#include "client/cli/command_line.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"

namespace losshead::cli::bench {

absl::StatusOr<Settings> SettingsFromFlags() {
  Settings s;
  s.tokens = SizeFlag(FLAGS_chunk_tokens, "bench");
  s.hidden_size = SizeFlag(FLAGS_hidden_size, "bench");
  s.vocab_size = SizeFlag(FLAGS_vocab_size, "bench");
  s.streams = absl::GetFlag(FLAGS_streams);
  s.depth = absl::GetFlag(FLAGS_depth);
  s.iterations = absl::GetFlag(FLAGS_iterations);
  s.seconds = absl::GetFlag(FLAGS_seconds);
  if (s.tokens < 1 || s.hidden_size < 1 || s.vocab_size < 1 || s.streams < 1 || s.depth < 1) {
    return absl::InvalidArgumentError(
        "--chunk_tokens --hidden_size --vocab_size --streams --depth must be >= 1");
  }
  if (s.iterations < 0 || (s.iterations == 0 && !(s.seconds > 0 && std::isfinite(s.seconds)))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--iterations must be >= 0 and, when it is 0, --seconds finite and > 0; got ",
                     s.iterations, " and ", s.seconds));
  }
  // They apply to the bench's own head.
  absl::StatusOr<v1::Placement> placement = PlacementFromFlags();
  if (!placement.ok()) return placement.status();
  s.placement = *std::move(placement);
  absl::StatusOr<v1::DType> dtype = WeightDTypeFromFlags();
  if (!dtype.ok()) return dtype.status();
  s.weight_dtype = *dtype;
  absl::StatusOr<v1::MatmulPrecision> precision = MatmulPrecisionFromFlags();
  if (!precision.ok()) return precision.status();
  s.matmul_precision = *precision;
  s.dedicated_connections = absl::GetFlag(FLAGS_dedicated_connections);
  s.same_node = absl::GetFlag(FLAGS_same_node);
  s.fresh_results = absl::GetFlag(FLAGS_fresh_results);
  s.zero_head = absl::GetFlag(FLAGS_zero_head);
  s.seed = absl::GetFlag(FLAGS_seed);
  return s;
}

}  // namespace losshead::cli::bench
