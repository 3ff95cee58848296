// A deterministic, resumable training loop with the server-side AdamW, for the crash-recovery
// tests.
//
// Each optimizer step s sends K micro-batches (MicrobatchSender: client id kClientId, sequences
// s*K+1 .. s*K+K) on one Step stream, then applies AdamW on the server with step key s + 1
// (client id kApplyClientId), a warm-up + cosine learning rate, and clipping by the global norm
// over the head and a trunk whose squared gradient norm is fixed per step. After `steps` steps it
// sends K more micro-batches and stops (so the final dW is not empty). The head's W is pushed
// once, before the first step (weights version 2); apply s + 1 makes version s + 3.
//
// Resumable by construction: every round starts from the server's state, whose optimizer step
// count says how many applies it holds, and does only what is missing. An apply that landed but
// whose answer never came (the connection died first) is retried with its key: the server
// answers it from its record of applies without stepping again. An apply that was answered but
// is missing from the restarted server's state (the crash came before a checkpoint held it) is
// detected by the step count falling below the last answered key; its micro-batches are resent
// where the checkpoint lacks them and it is applied again with the same key, which the restored
// record does not hold: its answer must equal the first one bit for bit.
#ifndef LOSSHEAD_TESTS_RECOVERY_OPTIMIZER_TRAINER_H_
#define LOSSHEAD_TESTS_RECOVERY_OPTIMIZER_TRAINER_H_

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/client/client.h"
#include "losshead/v1/losshead.pb.h"
#include "tests/recovery/trainer.h"

namespace losshead::testing {

inline constexpr char kApplyClientId[] = "trainer-0/optimizer";

struct OptimizerTrainConfig {
  // Shapes, steps and micro-batches per step (its lr is not used).
  TrainConfig run = {.dtype = v1::DTYPE_BF16, .steps = 5, .per_step = 4};
  double peak_lr = 0.02;
  int warmup_steps = 2;
  double weight_decay = 0.01;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double eps = 1e-8;
  double max_norm = 0.085;
};

class OptimizerTrainer {
 public:
  explicit OptimizerTrainer(const OptimizerTrainConfig& config);

  // One round: runs until training is done (OK) or a call fails (its status). The hook sees
  // kApplying before an apply is sent, kApplyAnswered once its answer is in (an error from the
  // hook drops the answer, as a connection lost before it arrived would) and kApplied once it is
  // recorded; for all three, Event::step is the step and Event::sequence its key.
  absl::Status Run(client::Client& client, const Hook& hook);
  absl::StatusOr<FinalState> Final(client::Client& client) const { return ReadFinal(client); }

  // The apply of `step`: key step + 1, its learning rate, the trunk's squared norm, and the
  // weights version it must find.
  v1::ApplyOptimizerRequest Request(int step) const;
  double LearningRate(int step) const;

  const MicrobatchSender& microbatches() const { return sender_; }
  // The first answer per step key, replayed cleared (retries and redone applies are checked
  // against it).
  const std::map<uint64_t, v1::ApplyOptimizerResponse>& applies() const { return applies_; }
  int apply_sends() const { return apply_sends_; }
  // Applies sent again with a key already sent (retries after a crash).
  int apply_resends() const { return apply_resends_; }
  // Answers with replayed set: the apply had landed and the server answered from its record.
  int apply_replays() const { return apply_replays_; }
  // Applies answered to the trainer that a restarted server turned out not to hold (the crash
  // came before a checkpoint did), counted once per crash that lost them.
  int lost_applies() const { return lost_applies_; }
  // Answers that differed from the first answer of their key (must stay 0 where dW is
  // accumulated directly; see DwAccumulation).
  int mismatched_applies() const { return mismatched_applies_; }
  // Every answer after a key's first, replayed cleared, in arrival order.
  const std::vector<std::pair<uint64_t, v1::ApplyOptimizerResponse>>& later_applies() const {
    return later_applies_;
  }

 private:
  absl::Status EnsureHead(client::Client& client, v1::HeadInfo* info);
  absl::Status Apply(client::Client& client, int step, const Hook& hook);

  const OptimizerTrainConfig config_;
  MicrobatchSender sender_;
  std::map<uint64_t, v1::ApplyOptimizerResponse> applies_;
  std::vector<std::pair<uint64_t, v1::ApplyOptimizerResponse>> later_applies_;
  std::map<uint64_t, int> apply_sent_;
  uint64_t last_answered_key_ = 0;  // of the last answer, whichever key that was
  int apply_sends_ = 0;
  int apply_resends_ = 0;
  int apply_replays_ = 0;
  int lost_applies_ = 0;
  int mismatched_applies_ = 0;
};

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_RECOVERY_OPTIMIZER_TRAINER_H_
