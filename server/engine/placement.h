// How a head lies on its devices: the one interface through which the head and its step pipeline
// reach W, dW and the collectives, whatever the layout. Three implementations:
//
//   SingleDevicePlacement  one device holds all of W and dW (replicated_placement.h)
//   ReplicatedPlacement    every device holds all of W and a dW accumulator of its own; a
//                          micro-batch runs whole on one of them (replicated_placement.h)
//   ShardedPlacement       device r holds only its rows ShardRange(V, k, r) of W and dW; every
//                          micro-batch runs on all of them together (sharded_placement.h)
//
// Whatever differs between layouts is a virtual here, and nothing outside the implementations asks
// which one a head has. What does not differ is said once, in this base, in terms of two facts the
// implementations give: what each replica holds (Replica::held) and which replicas together hold
// every row of W exactly once (WeightHolders: replica 0 of a replicated head, every shard).
//
// Invariants every implementation keeps:
// - A micro-batch runs on the devices Take gives it, in ascending rank, under their compute locks
//   (ReplicaGroup::DeviceLocks); device 0 of them returns its results (loss, token count, dH,
//   per-token losses), and every one ends its run together.
// - Under the Cut, after ReduceGradientToOwners, each replica's rows `rows` of its dW hold the
//   window's sum of those rows, and whatever else its dW holds is zero: a pull, an apply or a
//   checkpoint reads or steps each replica's own rows and nothing else.
// - W is the same bits wherever a row is held more than once: it is written on the holders and
//   copied from there (BroadcastWeights after a write, GatherWeights after each replica stepped its
//   own rows).
// - Calls are per micro-batch or per cut, never per row: a micro-batch pays three virtual calls
//   (Take, Prepare, Run).
//
// The virtuals say what a step or a cut achieves, not how the devices reach each other, so that a
// placement across processes can implement them with its peers later. What assumes every device
// in this process is the base's: the ReplicaGroup it holds (such a placement would hold its local
// devices there) and the host copies CopyIn and CopyWeightsOut.
#ifndef LOSSHEAD_SERVER_ENGINE_PLACEMENT_H_
#define LOSSHEAD_SERVER_ENGINE_PLACEMENT_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"
#include "losshead/kernels/process_group.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/replica_group.h"
#include "server/engine/step_devices.h"
#include "server/engine/token_inputs.h"
#include "server/engine/token_outputs.h"

namespace losshead::server {

class DeviceScratch;

// What a micro-batch's run asks of its devices (the placement-free part of a prepared micro-batch).
struct StepRun {
  kernels::Problem problem;
  bool grad_weight = true;  // false: forward only (no dW, no stash)
  bool grad_hidden = true;
  bool per_token = false;
  TokenOutputs outputs;         // in slot 0's token_outputs buffer (token_outputs.h layout)
  TokenInputs inputs;           // in every slot's token_inputs buffer (token_inputs.h layout)
  size_t workspace_budget = 0;  // handed to Backend::WorkspaceBytes / PlanShard
  // The global shard holding the hidden states, which the run broadcasts to every other shard
  // before computing (PreparedStep::hidden_root); -1: every device staged its own.
  int hidden_root = -1;
};

// Where token output `output` of `run` lies in `slot`'s token_outputs buffer; null when not
// asked.
template <typename T>
T* TokenOutputIn(const IoSlot& slot, const StepRun& run, TokenOutput output) {
  if (!run.outputs.asks(output)) return nullptr;
  const size_t offset =
      static_cast<size_t>(run.outputs.slot(output)) * run.problem.n * kTokenOutputBytes;
  return reinterpret_cast<T*>(slot.token_outputs.as<char>() + offset);
}
// Where the top-k's ids and log-probs of `run` lie in `slot`'s token_outputs buffer; null when
// no top-k is asked.
inline int32_t* TopKIdsIn(const IoSlot& slot, const StepRun& run) {
  if (run.outputs.top_k == 0) return nullptr;
  return reinterpret_cast<int32_t*>(slot.token_outputs.as<char>() +
                                    run.outputs.top_k_ids_offset(run.problem.n));
}
inline float* TopKLogprobsIn(const IoSlot& slot, const StepRun& run) {
  if (run.outputs.top_k == 0) return nullptr;
  return reinterpret_cast<float*>(slot.token_outputs.as<char>() +
                                  run.outputs.top_k_logprobs_offset(run.problem.n));
}

// Where token input `input` of `run` lies in `slot`'s token_inputs buffer; null when absent.
inline const float* TokenInputIn(const IoSlot& slot, const StepRun& run, TokenInput input) {
  if (!run.inputs.has(input)) return nullptr;
  return slot.token_inputs.as<float>() + static_cast<size_t>(run.inputs.slot(input)) * run.problem.n;
}

class Placement {
 public:
  // The placement `spec` asks for, on `devices` (their number must be the placement's:
  // INVALID_ARGUMENT otherwise; a placement of 0 devices takes them all), its group created.
  // A sharded placement across processes (Placement.across_processes) takes `processes`, the
  // server's process group (FAILED_PRECONDITION without one), and is a collective call of every
  // process of it (ReplicaGroup::Create): `devices` are this process's shards.
  static absl::StatusOr<std::unique_ptr<Placement>> Create(
      std::span<kernels::Backend* const> devices, const v1::HeadSpec& spec, kernels::DType dtype,
      std::shared_ptr<kernels::ProcessGroup> processes = nullptr);

  virtual ~Placement() = default;
  Placement(const Placement&) = delete;
  Placement& operator=(const Placement&) = delete;

  ReplicaGroup& group() const { return *group_; }

  // The replicas that together hold every row of W once, in rank order.
  virtual std::span<Replica* const> WeightHolders() const = 0;

  // At creation, per replica: OK when some chunk of a one-token micro-batch fits `budget` bytes of
  // workspace on it (the run this placement would give it), so that a head that could never step
  // is refused at once.
  virtual absl::Status CheckWorkspace(Replica& replica, size_t budget) const = 0;

  // The devices a micro-batch of `tokens` runs on, its tokens queued on each and an I/O slot of
  // each taken (waiting for a free one, in rank order). One call per micro-batch.
  virtual void Take(int64_t tokens, StepDevices& devices) = 0;

  // Under the compute locks of `devices` (Take's): plans `run` on them and grows their buffers for
  // it (workspace; a shard's exchange buffers), and sets where each device's part of dW goes
  // (devices.stash(i): its stash's next rows, flushing it first where full, or dW itself). Nothing
  // of the micro-batch runs and nothing counted changes: an error (RESOURCE_EXHAUSTED,
  // INVALID_ARGUMENT, a failed flush's DATA_LOSS) is the micro-batch's answer as it is.
  virtual absl::Status Prepare(const StepRun& run, StepDevices& devices,
                               DeviceScratch& scratch) = 0;
  // Then, their slots staged: runs `run`, leaving the scalars (kStepScalarBytes: token count,
  // loss sum, correct count), dH, per-token losses and token outputs in slot 0's buffers. Enqueued
  // on the devices' streams; the caller copies the scalars back and waits. An error may leave
  // part of the run in dW, except UNIMPLEMENTED: the backends refused the arguments before
  // launching anything (an output they do not compute, say), and nothing was computed.
  virtual absl::Status Run(const StepRun& run, StepDevices& devices) = 0;
  // The device (global shard rank) that alone copies a micro-batch's hidden states in from the
  // host, Run broadcasting them to the others (StepRun::hidden_root); -1 where every device
  // copies its own.
  virtual int HiddenRoot() const { return -1; }

  // Under the Cut: every stash flushed and dW laid out as the file comment says (a fault of an
  // earlier flush answered: DATA_LOSS). Enqueued.
  virtual absl::Status ReduceGradientToOwners() = 0;
  // Under the Cut, after CopyIn of W: W made the same on every device that holds a row twice.
  virtual absl::Status BroadcastWeights() = 0;
  // Under the Cut, after each replica stepped its own rows of W: the same.
  virtual absl::Status GatherWeights() = 0;

  // Under the Cut. Elements [first, first + count) of a V x D tensor (`tensor`: weights or grad,
  // `element_bytes` each) from `host` to the holders that hold them (BroadcastWeights then copies
  // W to the other devices). Enqueued: `host` must stay valid until the holders synchronise.
  absl::Status CopyIn(kernels::DeviceBuffer Replica::*tensor, size_t element_bytes,
                      const char* host, int64_t first, int64_t count) const;
  // Under the holders' locks (or the Cut). The whole of W (V x D) to `host`, each holder its
  // rows. Enqueued.
  absl::Status CopyWeightsOut(char* host) const;
  // Waits for the holders' streams (those CopyWeightsOut used); the first error.
  absl::Status SynchronizeHolders() const;

 protected:
  explicit Placement(std::unique_ptr<ReplicaGroup> group) : group_(std::move(group)) {}

 private:
  std::unique_ptr<ReplicaGroup> group_;
};

// How many devices a head of a valid `placement` takes where `available` are there: 1 for one
// device, the number asked for a replicated or sharded head (0: all of them).
int PlacementDevices(const v1::Placement& placement, int available);
// Whether `placement` spreads a head over several devices (replicated or sharded).
bool SpreadPlacement(const v1::Placement& placement);
// The placement a head saved with `saved` takes on `k` devices (a restore): a one-device head on
// one device stays as it was; otherwise a sharded head stays sharded and any other becomes
// replicated, over the k devices.
v1::Placement PlacementOn(const v1::Placement& saved, int k);
// Rows of W and dW device `rank` of `k` holds under `placement` (Head::Footprint's measure).
int64_t HeldRows(const v1::Placement& placement, int64_t vocab_size, int k, int rank);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_PLACEMENT_H_
