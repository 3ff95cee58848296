// The series one answered Step micro-batch counts in (docs/metrics.md): its phases, its outcome,
// tokens, loss, the devices' busy time and the bytes sent. The edge says what happened in these
// terms, free of the engine's types, and this file decides which series that touches.
//
// Only existing heads get labelled series: a micro-batch naming a head that does not exist (a
// typo) counts in losshead_failures_total alone, so that it cannot mint a new time series.
#ifndef LOSSHEAD_SERVER_OBSERVABILITY_MICROBATCH_METRICS_H_
#define LOSSHEAD_SERVER_OBSERVABILITY_MICROBATCH_METRICS_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/time/time.h"
#include "server/observability/metrics.h"

namespace losshead::server {

struct MicrobatchRecord {
  // How far it got, which decides the series it counts in.
  enum class Reach {
    // Never reached a head: the head does not exist, or the call was gone before it started.
    // failures_total{method="Step"} alone.
    kNoHead,
    // Refused before it ran (at its header, by admission or by size); its head exists.
    // microbatches_total{outcome="error"} and failures_total.
    kRefused,
    // Its head took it (computed, replayed or failed there): the phases it went through, its
    // outcome, and for a computed one its tokens, loss and the devices' busy time.
    kRan,
  };
  Reach reach = Reach::kNoHead;
  int code = 0;  // the answer's status code (0: OK)
  bool replayed = false;
  bool forward_only = false;  // evaluation: outcome "forward", never "ok"
  double loss_sum = 0;
  int64_t tokens = 0;      // non-ignored tokens computed
  uint64_t bytes_out = 0;  // dH and per-token losses of an OK answer
  // What a computed micro-batch asked for and ran, counted with its tokens (never for a replay
  // or a refusal). An EMBEDDING_GRAD micro-batch has its rows and nothing else.
  int64_t embedding_grad_rows = 0;
  int64_t output_tokens = 0;  // tokens of the micro-batch (each output has a value for each)
  // The per-token outputs asked: logprob, entropy, lse, argmax.
  std::array<bool, 4> token_outputs{};
  bool top_k = false;
  bool policy_gradient = false;  // the loss kind; cross-entropy otherwise
  bool entropy_term = false;     // entropy_coef != 0
  bool kl_term = false;          // kl_coef > 0
  bool token_weights = false;    // per-token weights given
  // Phases (losshead_step_phase_duration_seconds); stage, compute and finish only of a computed
  // micro-batch, send once its last answer is written (RecordMicrobatchSent).
  absl::Duration receive;
  absl::Duration queue;
  absl::Duration stage;
  absl::Duration compute;
  absl::Duration finish;
};

// Records one micro-batch of `head` once it is answered. The run took `devices` devices;
// `device_label(i)` names the i-th ("cuda:0"; "" for one that is none of the server's, whose busy
// time is not recorded). Nothing here allocates beyond the series' own look-ups.
void RecordMicrobatch(Metrics& metrics, const std::string& head, const MicrobatchRecord& record,
                      size_t devices, absl::FunctionRef<std::string(size_t)> device_label);

// The send phase of a micro-batch whose head ran it, once its last answer is written.
void RecordMicrobatchSent(Metrics& metrics, const std::string& head, absl::Duration send);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_OBSERVABILITY_MICROBATCH_METRICS_H_
