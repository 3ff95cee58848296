#include "server/engine/step_turns.h"

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace losshead::server {

absl::Status StepTurns::Await(Gate& gate, uint64_t turn, absl::string_view what) {
  absl::MutexLock lock(&mu_);
  auto open = [&gate, turn]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return gate.passed + 1 >= turn; };
  if (mu_.AwaitWithTimeout(absl::Condition(&open), timeout_)) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("micro-batch ", turn, " of the group waited ", absl::FormatDuration(timeout_),
                   " to ", what, ": an earlier one (", gate.passed + 1,
                   ") never came to this process, so the group is broken"));
}

void StepTurns::Pass(Gate& gate, uint64_t turn) {
  absl::MutexLock lock(&mu_);
  if (turn <= gate.passed) return;
  gate.early.insert(turn);
  while (!gate.early.empty() && *gate.early.begin() == gate.passed + 1) {
    gate.early.erase(gate.early.begin());
    ++gate.passed;
  }
}

StepTurn::~StepTurn() {
  Taken();
  Ran();
}

absl::Status StepTurn::AwaitTake() {
  return turns_.Await(turns_.take_, turn_, "take its devices' slots");
}

void StepTurn::Taken() {
  if (taken_) return;
  taken_ = true;
  turns_.Pass(turns_.take_, turn_);
}

absl::Status StepTurn::AwaitRun() { return turns_.Await(turns_.run_, turn_, "run"); }

void StepTurn::Ran() {
  if (ran_) return;
  ran_ = true;
  turns_.Pass(turns_.run_, turn_);
}

}  // namespace losshead::server
