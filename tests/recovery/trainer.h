// A deterministic, resumable training loop against one head, for the crash-recovery tests.
//
// Each optimizer step s sends K micro-batches (client id kClientId, sequences s*K+1 .. s*K+K, data
// from fixed seeds) on one Step stream, pulls dW without reset, then pulls with reset, and pushes
// W - lr * dW computed on the host with expected_weights_version. After `steps` steps it sends K
// more micro-batches and stops (so the final dW is not empty).
//
// Resumable by construction: every round starts from the server's state (weights version,
// micro-batches since pull, the client id's acknowledged sequence) and does only what is missing.
// The trainer keeps its own master weights per version and the dW it pulled per step, as a real
// trainer keeps its optimizer state; reading dW before the resetting pull means a pull whose answer
// is lost never loses a gradient.
#ifndef LOSSHEAD_TESTS_RECOVERY_TRAINER_H_
#define LOSSHEAD_TESTS_RECOVERY_TRAINER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/client/client.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {

inline constexpr char kTrainHead[] = "lm";
inline constexpr char kClientId[] = "trainer-0";

struct TrainConfig {
  v1::DType dtype = v1::DTYPE_FP32;
  int64_t vocab = 96;
  int64_t hidden = 40;
  int64_t tokens = 16;  // per micro-batch
  int steps = 4;
  int per_step = 6;  // K
  float lr = 0.5f;
  // The head's placement (HeadSpec.placement; unset: one device), on a server started with at
  // least its devices.
  v1::Placement placement;
};

// kApplying, kApplyAnswered and kApplied are OptimizerTrainer's (optimizer_trainer.h).
enum class TrainEvent { kAnswered, kPulled, kReset, kPushed, kApplying, kApplyAnswered, kApplied };

struct Event {
  TrainEvent kind;
  int step = 0;
  int k = 0;              // kAnswered: index of the micro-batch in its step
  uint64_t sequence = 0;  // kAnswered: its sequence; the apply events: the step key
};

// Returning an error stops the round with it (e.g. after the hook killed the server).
using Hook = std::function<absl::Status(const Event&)>;

// What a run ends with, compared bit for bit between a faulty run and the fault-free one.
struct FinalState {
  client::Bytes weights;
  client::Bytes gradient;
  uint64_t weights_version = 0;
  uint64_t tokens_total = 0;
  uint64_t microbatches_total = 0;
  uint64_t tokens_since_pull = 0;
  uint64_t optimizer_step = 0;
};

// The head kTrainHead's W, dW (fp32, not reset) and counters.
absl::StatusOr<FinalState> ReadFinal(client::Client& client);

// The micro-batches of a run, step s and index k: client id kClientId, sequence s*K + k + 1,
// data from fixed seeds; and the answers they got. Steps 0 .. config.steps.
class MicrobatchSender {
 public:
  explicit MicrobatchSender(const TrainConfig& config);

  // Sends, on one Step stream, every micro-batch of `step` that is not both in the server's state
  // (sequence <= acknowledged) and answered; the hook sees each answer (kAnswered).
  absl::Status SendFrom(client::Client& client, int step, uint64_t acknowledged, const Hook& hook);

  uint64_t Sequence(int step, int k) const {
    return static_cast<uint64_t>(step) * per_step_ + k + 1;
  }
  const HostBatch& batch(uint64_t sequence) const { return batches_.at(sequence); }
  // First answer per sequence (replays and recomputations are checked against it).
  const std::map<uint64_t, client::StepResult>& answers() const { return answers_; }
  uint64_t max_answered() const { return max_answered_; }
  int first_sends() const { return first_sends_; }
  int resends() const { return resends_; }
  int replays() const { return replays_; }
  // Sequences whose recomputed answer differed from the first one (must stay 0 where dW is
  // accumulated directly; see DwAccumulation).
  int mismatched_answers() const { return mismatched_; }
  // Every answer after a sequence's first (replays and recomputations), in arrival order.
  const std::vector<std::pair<uint64_t, client::StepResult>>& later_answers() const {
    return later_answers_;
  }

 private:
  const int per_step_;
  std::map<uint64_t, HostBatch> batches_;
  std::map<uint64_t, client::StepResult> answers_;
  std::vector<std::pair<uint64_t, client::StepResult>> later_answers_;
  std::map<uint64_t, int> sent_;
  uint64_t max_answered_ = 0;
  int first_sends_ = 0;
  int resends_ = 0;
  int replays_ = 0;
  int mismatched_ = 0;
};

class Trainer {
 public:
  explicit Trainer(const TrainConfig& config);

  // One round: runs until training is done (OK) or a call fails (its status).
  absl::Status Run(client::Client& client, const Hook& hook);
  absl::StatusOr<FinalState> Final(client::Client& client) const { return ReadFinal(client); }

  uint64_t Sequence(int step, int k) const { return sender_.Sequence(step, k); }
  const HostBatch& batch(uint64_t sequence) const { return sender_.batch(sequence); }
  const std::map<uint64_t, client::StepResult>& answers() const { return sender_.answers(); }
  const std::map<int, client::Bytes>& pulled() const { return pulled_; }
  uint64_t max_answered() const { return sender_.max_answered(); }
  int first_sends() const { return sender_.first_sends(); }
  int resends() const { return sender_.resends(); }
  int replays() const { return sender_.replays(); }
  int mismatched_answers() const { return sender_.mismatched_answers(); }
  const std::vector<std::pair<uint64_t, client::StepResult>>& later_answers() const {
    return sender_.later_answers();
  }

 private:
  absl::Status EnsureHead(client::Client& client, v1::HeadInfo* info);

  const TrainConfig config_;
  MicrobatchSender sender_;
  std::map<uint64_t, std::vector<float>> master_;  // W by weights version, exact in the dtype
  std::map<int, client::Bytes> pulled_;
};

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_RECOVERY_TRAINER_H_
