// The order in which every process of a group runs the micro-batches of heads sharded across
// them (GroupControl numbers them: docs/multi-process.md). Every process runs every such
// micro-batch, and their exchanges pair up only if each process enters the runs in the same
// order; a process may still take the next micro-batches' slots and stage them while the one
// ahead runs, as one process does for its own streams. So a turn has two gates: its slots are
// taken only after every earlier turn's were (so that the earliest turn waiting for slots always
// gets them first: no deadlock over them), and its run starts only after every earlier turn's run
// is over.
//
// Invariants: turns are numbered 1, 2, ... and each process sees every number exactly once; a turn
// that ends before passing a gate (its micro-batch failed early) passes it then, so that the turns
// after it go on. A gate that does not open within the timeout is UNAVAILABLE: an earlier turn
// never came, and the group is broken.
//
// Thread-safe.
#ifndef LOSSHEAD_SERVER_ENGINE_STEP_TURNS_H_
#define LOSSHEAD_SERVER_ENGINE_STEP_TURNS_H_

#include <cstdint>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace losshead::server {

class StepTurns {
 public:
  explicit StepTurns(absl::Duration timeout) : timeout_(timeout) {}

 private:
  friend class StepTurn;
  struct Gate {
    uint64_t passed = 0;       // every turn up to this one has passed
    std::set<uint64_t> early;  // turns past `passed + 1` that passed already
  };
  // Blocks until every turn before `turn` has passed `gate` (UNAVAILABLE after the timeout).
  absl::Status Await(Gate& gate, uint64_t turn, absl::string_view what);
  void Pass(Gate& gate, uint64_t turn);

  const absl::Duration timeout_;
  absl::Mutex mu_;
  Gate take_ ABSL_GUARDED_BY(mu_);
  Gate run_ ABSL_GUARDED_BY(mu_);
};

// One micro-batch's turn, passing its gates in order; what it has not passed when it goes, it
// passes then.
class StepTurn {
 public:
  StepTurn(StepTurns& turns, uint64_t turn) : turns_(turns), turn_(turn) {}
  ~StepTurn();
  StepTurn(const StepTurn&) = delete;
  StepTurn& operator=(const StepTurn&) = delete;

  uint64_t turn() const { return turn_; }
  // Before and after taking its slots.
  absl::Status AwaitTake();
  void Taken();
  // Before and after its run (over once the devices have finished it).
  absl::Status AwaitRun();
  void Ran();

 private:
  StepTurns& turns_;
  const uint64_t turn_;
  bool taken_ = false;
  bool ran_ = false;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_STEP_TURNS_H_
