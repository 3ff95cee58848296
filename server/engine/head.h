// A head: W (V x D) on its devices as its Placement lays it out (one device, replicated, or
// vocabulary-sharded: placement.h), its fp32 dW accumulators, a weights version, the gradient
// window's counters, default loss options and idempotency state. Thread-safe. The head
// coordinates; what runs on the devices is its placement's and the step pipeline's parts'.
//
// A device's compute lock serialises what touches its W or dW: a micro-batch runs under the compute
// locks of the devices its placement gives it (one replica's, or every shard's), taken in rank
// order. Pulls, pushes, optimizer applies and checkpoints take every device's lock
// (ReplicaGroup::Cut). A micro-batch holds its locks while it launches its run; the run is then in
// flight (Replica::runs_in_flight) and the locks go to the next micro-batch, whose run the devices
// take up behind it, while this one waits for its own work and counts it. A cut, once it holds
// every lock, waits for the runs in flight to be done and counted, so a pull with reset sees every
// micro-batch either entirely before its cut or entirely after. A micro-batch's copies in (host ->
// device) and out (dH back to the host) use buffers of their own (an I/O slot of each device) and
// overlap the run of another micro-batch. Another, short mutex (state_mu_, always taken after any
// compute lock) guards the counters and options so that Info() never waits for compute. Callers
// hold heads by shared_ptr: deleting a head from the registry while work runs on it is safe; the
// memory goes when the last holder lets go.
//
// The members are defined by concern: the head itself in head.cc, the step pipeline in
// step_pipeline.cc, the gradient window (pull, discard, push, download) in gradient_window.cc,
// the server-side optimizer in optimizer_apply.cc, the checkpoint cut in head_checkpoint.cc (what
// they share: head_internal.h).
#ifndef LOSSHEAD_SERVER_ENGINE_HEAD_H_
#define LOSSHEAD_SERVER_ENGINE_HEAD_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/problem.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/apply_log.h"
#include "server/engine/device_scratch.h"
#include "server/engine/embedding_rows.h"
#include "server/engine/head_bias.h"
#include "server/engine/head_checkpoint.h"
#include "server/engine/head_optimizer.h"
#include "server/engine/idempotency_budget.h"
#include "server/engine/idempotency_cache.h"
#include "server/engine/micro_batch.h"
#include "server/engine/placement.h"
#include "server/engine/replica_group.h"
#include "server/engine/result_pool.h"
#include "server/engine/step_devices.h"
#include "server/engine/step_outcome.h"
#include "server/engine/step_prepare.h"
#include "server/engine/step_turns.h"
#include "server/engine/window_counters.h"

namespace losshead::server {

class StashLenders;
class ProcessWindow;

struct HeadOptions {
  size_t workspace_budget_bytes = size_t{1} << 30;  // handed to Backend::WorkspaceBytes
  size_t idempotency_window = 64;
  size_t idempotency_max_bytes_per_client = size_t{256} << 20;
  // The server-wide bound (bytes, age) on remembered results, shared by every head of a server;
  // null: the head's results have none beyond the two above.
  std::shared_ptr<IdempotencyBudget> idempotency_budget;
  size_t apply_window = 16;  // optimizer responses remembered per client id (ApplyLog)
  // Deferred dW (docs/deferred-dw.md): bytes of the gradient stash on each device of a head (a
  // shard's stash holds its columns of G); 0 = off. Counted micro-batches that fit leave G and H
  // there and are answered without the dW GEMM. The stash is added to dW when the next micro-batch
  // does not fit, before every cut that reads dW (pull, optimizer apply, checkpoint), and once its
  // device has been idle for grad_stash_idle (never when infinite: dW is then the same bits on
  // every rerun of one stream).
  size_t grad_stash_bytes = 0;
  absl::Duration grad_stash_idle = absl::InfiniteDuration();
  // Host buffers for dH, shared by every head of a server; null: the head keeps a small pool of
  // its own.
  std::shared_ptr<ResultPool> results;
  // The heads of a server whose idle stashes a micro-batch short of device memory for its buffers
  // may take back (HeadRegistry sets it); null: it takes back only its own head's stash.
  std::shared_ptr<StashLenders> stash_lenders;
  // A head with a server-side optimizer whose window passes this many micro-batches without a
  // cut (an apply, a pull with reset or a discard) is logged once per window: a training loop
  // that never steps the head or never discards its window. 0: never.
  uint64_t window_warn_microbatches = 0;
  // A head replicated across server processes (process_window.h): its cuts (pull, discard,
  // optimizer apply) sum the gradient windows of every process, each of which must make the same
  // cuts of this head in the same order. Null: the head is this process's alone. An output
  // bias's db is summed beside dW, so that b steps alike on every process.
  std::shared_ptr<ProcessWindow> process_window;
};

// dW (or W) copied to the host, with what it covers.
struct GradientSnapshot {
  v1::GradientSummary summary;
  std::string data;  // V x D in summary.dtype, then db (V) for a head with a bias
};

struct WeightsSnapshot {
  uint64_t version = 0;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  std::string data;   // V x D, then b (V) for a head with a bias (DownloadWeights)
  bool bias = false;  // data ends with b
};

class Head {
 public:
  // Validates `spec` (INVALID_ARGUMENT), allocates W, dW and checks the workspace budget
  // (RESOURCE_EXHAUSTED), initialises W (zeros, or normal(0, std) drawn on the host as
  // weight_init.h says) and zeroes dW. The head holds one replica per device of `devices` (rank
  // order); their number must be the one the spec's placement asks for (INVALID_ARGUMENT
  // otherwise; a placement of 0 devices takes them all).
  static absl::StatusOr<std::shared_ptr<Head>> Create(std::span<kernels::Backend* const> devices,
                                                      const v1::HeadSpec& spec,
                                                      const HeadOptions& options);
  // On one device.
  static absl::StatusOr<std::shared_ptr<Head>> Create(kernels::Backend& backend,
                                                      const v1::HeadSpec& spec,
                                                      const HeadOptions& options) {
    kernels::Backend* const devices[] = {&backend};
    return Create(devices, spec, options);
  }
  // Frees the head's device memory (each replica waits for its stream's work first), then the
  // other heads' stashes that are off for want of memory on those devices try again
  // (StashLenders::Freed).
  ~Head();

  // Checks only the spec's fields (name syntax excepted); no allocation.
  static absl::Status ValidateSpec(const v1::HeadSpec& spec);
  // A head name's syntax, [A-Za-z0-9_.-]{1,128} (INVALID_ARGUMENT), as ValidateSpec checks it.
  static absl::Status ValidateName(const std::string& name);
  // The placement's kind and device count (INVALID_ARGUMENT), without the server's devices.
  static absl::Status ValidatePlacement(const v1::Placement& placement);

  // What a head of `spec` (valid, and not too large to allocate: Create's first checks) holds on
  // each of k devices, in rank order: W and dW (a shard: its rows of them), and the optimizer's
  // master weights and state of the rows the device owns. Create refuses a head that does not
  // fit the devices' free memory.
  struct DeviceFootprint {
    uint64_t tensors = 0;
    uint64_t optimizer = 0;
    uint64_t total() const { return tensors + optimizer; }
  };
  static std::vector<DeviceFootprint> Footprint(const v1::HeadSpec& spec, int k);

  // Replaces the default loss options (validated: INVALID_ARGUMENT).
  absl::Status SetDefaultOptions(const v1::LossOptions& options);

  // The step pipeline (step_pipeline.cc).
  // What the header alone decides: the codes Step would answer for num_tokens < 1, a bad dtype or
  // option, or a problem the backend cannot run (INVALID_ARGUMENT), before any data arrives.
  absl::Status CheckHeader(const v1::StepHeader& header) const;
  // Runs one micro-batch: validation (INVALID_ARGUMENT; FAILED_PRECONDITION on a weights version
  // mismatch), idempotent replay (see IdempotencyCache; ALREADY_EXISTS for a key reused with other
  // content), forward + backward, dW accumulation. Any error before the run leaves W, dW and the
  // counters as they were. A device failure once the run has begun is DATA_LOSS: the micro-batch
  // may be in dW (it is counted when it got as far as the copy of its results), and with a client
  // id its key keeps that answer, so that no retry adds it again. A forward-only micro-batch
  // (StepOptions.forward_only) is validated and run the same way under the compute lock (it uses
  // the head's workspace and stream, and must not see W half pushed) but adds nothing to dW,
  // counts nothing and bypasses the idempotency cache.
  //
  // The micro-batch runs on the devices its placement gives it (Placement::Take: the replica with
  // the least work queued, or every shard); staged micro-batches take a device largest first
  // (ComputeQueue). `on_ordered`, when given, is called once this micro-batch holds its devices,
  // before its run: on one device, whatever the
  // caller runs from then on comes after it in dW. A Step stream starts its next micro-batch
  // there, so that this one's copy back overlaps the next one's staging and run (on a replicated
  // head the next one may run beside it, on another replica). It is not called for a
  // micro-batch that never reaches the device (refused, replayed).
  absl::StatusOr<std::shared_ptr<const StepOutcome>> Step(
      const MicroBatch& microbatch, StepStats* stats,
      const std::function<void()>& on_ordered = nullptr);

  // A head sharded across server processes (Placement.across_processes) runs every micro-batch
  // on every process at once, in the order the group's leader gives (docs/multi-process.md), so
  // Step's parts are called apart. At the micro-batch's home (where its client sent it),
  // ClaimStep validates it (INVALID_ARGUMENT, ...: nothing sent anywhere) and answers a replay
  // (the remembered outcome, or its failure) or claims its key (null: run it). Then every process
  // calls RunStep with the same micro-batch, keyed at its home only (which settles the claim as
  // Step would); a claim that never ran is freed with AbandonStep (a settled one stays). A run
  // whose exchanges with the other processes failed is UNAVAILABLE (the group is broken: the
  // window can never be cut again), and the key keeps that answer: the micro-batch is never
  // computed again anywhere. Forward-only micro-batches and those without a client id claim
  // nothing. An EMBEDDING_GRAD micro-batch goes the same way: validated and claimed at its home,
  // run on every process in its turn, its rows of dE sent from its home to the process owning
  // each (embedding_across.cc), each process adding only its own rows and counting it.
  bool across_processes() const { return group().across_processes(); }
  // `*hidden_abs`: the largest |h| in the head's dtype (of an EMBEDDING_GRAD micro-batch, |dE|),
  // which the other processes take as theirs.
  absl::StatusOr<std::shared_ptr<const StepOutcome>> ClaimStep(const MicroBatch& microbatch,
                                                               StepStats* stats, float* hidden_abs);
  // `origin`: the process that received the micro-batch (its home, where it is keyed, its
  // results read and its hidden states held; elsewhere MicroBatch::hidden_elsewhere).
  // `turn`: its place in the group's order of such micro-batches (step_turns.h).
  absl::StatusOr<std::shared_ptr<const StepOutcome>> RunStep(const MicroBatch& microbatch,
                                                             StepStats* stats, int origin,
                                                             StepTurn& turn);
  void AbandonStep(const v1::StepHeader& header);

  // The gradient window (gradient_window.cc).
  // Copies dW out (fp32 or bf16) with the counters it covers; with `reset`, zeroes both in the same
  // critical section as the copy.
  absl::StatusOr<GradientSnapshot> PullGradient(v1::DType dtype, bool reset);

  // A pull's summary without its data (dtype as PullGradient's, no bytes): dW never leaves the
  // device. With `discard`, the window is dropped in the same cut as a pull with reset (each
  // micro-batch wholly in it or wholly in the next): dW zeroed, the counters it covers reset and
  // the deferred-dW stash emptied without reaching dW. The summary is what was dropped.
  absl::StatusOr<v1::GradientSummary> WindowSummary(v1::DType dtype, bool discard);

  // The open window now: its micro-batches and tokens, and the time since its first micro-batch
  // was counted (zero when it is empty; for a window a restore brought back, since the restore).
  struct WindowState {
    uint64_t microbatches = 0;
    uint64_t tokens = 0;
    absl::Duration age;
  };
  WindowState Window() const;

  // W = data (REPLACE) or W += data (ADD); data is V x D of `dtype`, followed by V values of b
  // for a head with a bias (b = or += them too). INVALID_ARGUMENT on a size mismatch or a
  // non-finite value, FAILED_PRECONDITION on a version mismatch; W and b are unchanged on error.
  // Returns the new version.
  absl::StatusOr<uint64_t> PushWeights(v1::DType dtype, v1::PushMode mode, const std::string& data,
                                       std::optional<uint64_t> expected_version);

  // W converted to `dtype` (UNSPECIFIED: the head's dtype) with its version; b follows it, in
  // the same dtype, for a head with a bias.
  absl::StatusOr<WeightsSnapshot> DownloadWeights(v1::DType dtype);

  // The tied input embedding (embedding_rows.cc; StepKind in the proto). The rows of W for `ids`
  // (id_dtype INT32 | INT64, each in [0, V): INVALID_ARGUMENT otherwise, or for none) in `dtype`
  // (UNSPECIFIED: the head's), in the order of the ids, with the version they were read at
  // (FAILED_PRECONDITION when not `expected_version`). Reads only: W, dW and the counters stay.
  // A head sharded across processes: a collective call of every process in the group leader's
  // order, `origin` being the process whose client asked. Each process reads the rows it owns
  // and sends them to the origin, which alone gets the rows (the others' snapshot holds the
  // version only); the checks decide alike everywhere before anything is sent.
  absl::StatusOr<WeightsSnapshot> EmbeddingRows(v1::DType id_dtype, absl::string_view ids,
                                                v1::DType dtype,
                                                std::optional<uint64_t> expected_version,
                                                int origin = -1);
  // EmbeddingRows' checks of the request alone (INVALID_ARGUMENT as it answers them), so that a
  // process of a group refuses a bad one before asking the others.
  absl::Status CheckEmbeddingRows(v1::DType id_dtype, absl::string_view ids, v1::DType dtype) const;

  // The server-side optimizer (optimizer_apply.cc).
  // Replaces the optimizer (INVALID_ARGUMENT for a bad spec); the new one starts afresh: state
  // zero, step count 0, master weights taken from W. RESOURCE_EXHAUSTED when its buffers do not
  // fit: the old optimizer stays as it was. Remembered applies are kept (keys still increase).
  absl::Status SetOptimizer(const v1::OptimizerSpec& spec);
  // One optimizer step over the gradient window, exactly once per (client id, step key); see
  // ApplyOptimizerRequest in the proto for the semantics and codes. Errors change nothing.
  absl::StatusOr<v1::ApplyOptimizerResponse> ApplyOptimizer(
      const v1::ApplyOptimizerRequest& request);

  // The checkpoint cut (head_checkpoint.cc). A consistent cut taken under the compute lock: W, dW,
  // counters, defaults and idempotency state; every micro-batch is wholly in it or wholly out.
  // UNIMPLEMENTED for a head sharded across processes (each process holds only its rows): its
  // checkpoints are checkpoint sets' parts.
  absl::StatusOr<HeadCheckpointData> Snapshot();
  // A checkpoint set's part (durability/group_checkpoint.h): Snapshot's cut, except that a head
  // sharded across processes gives this process's rows only (HeadCheckpointData::rows) with what
  // every process holds alike and this process's clients. No exchange with other processes.
  absl::StatusOr<HeadCheckpointData> SnapshotPart();
  // A head holding exactly `data` (validated: DATA_LOSS when sizes or the spec do not fit), on
  // `devices` whatever placement it was saved with: the file is the same for every placement.
  // The restored spec's placement names the devices it got. A part holding only some rows
  // (data.rows: a head sharded across processes) is restored only by the process that wrote it,
  // in a group of its size over as many devices, as a collective call of every process
  // (each restoring its part of the same set): FAILED_PRECONDITION outside a group or in another
  // group size, rank or device count, DATA_LOSS when its rows are not those the process owns.
  static absl::StatusOr<std::shared_ptr<Head>> Restore(std::span<kernels::Backend* const> devices,
                                                       const HeadCheckpointData& data,
                                                       const HeadOptions& options);
  static absl::StatusOr<std::shared_ptr<Head>> Restore(kernels::Backend& backend,
                                                       const HeadCheckpointData& data,
                                                       const HeadOptions& options) {
    kernels::Backend* const devices[] = {&backend};
    return Restore(devices, data, options);
  }
  // After `data` (a Snapshot of this head) is durable: its applied sequences become persisted.
  void MarkPersisted(const HeadCheckpointData& data);
  // Highest applied sequence of `client_id` now, and as of the last durable checkpoint.
  v1::ClientProgress Progress(const std::string& client_id) const;

  v1::HeadInfo Info() const;
  const std::string& name() const { return spec_.name(); }
  int64_t vocab_size() const { return spec_.vocab_size(); }
  int64_t hidden_size() const { return spec_.hidden_size(); }
  // Whether the head has an output bias (HeadSpec.bias).
  bool has_bias() const { return spec_.bias(); }
  // Values a push, a download or a pull carries: V x D, plus V with a bias.
  size_t tensor_elements() const {
    return static_cast<size_t>(vocab_size()) * hidden_size() +
           (has_bias() ? static_cast<size_t>(vocab_size()) : 0);
  }
  kernels::DType dtype() const { return dtype_; }
  // Devices holding the head (its replicas).
  int device_count() const { return group().size(); }
  // Those devices, in rank order.
  std::vector<kernels::Backend*> devices() const;
  // Device bytes over every replica.
  size_t weights_bytes() const;
  size_t gradient_bytes() const;
  size_t workspace_bytes() const;
  OptimizerFootprint optimizer_bytes() const;
  uint64_t weights_version() const;
  // Device bytes of this head's deferred-dW stashes on `device`, read without locks.
  size_t StashBytes(const kernels::Backend* device) const;
  // Gives those stashes' memory back, so that a buffer that only speeds micro-batches up never
  // stands in the way of memory that something needs: a new head, an optimizer's state, a
  // micro-batch's buffers. Each stash is added to dW first (nothing counted is lost), and the
  // head adds to dW directly on that device until RetryStashes. Takes the compute locks of the
  // replicas on `device`, one at a time. Returns the bytes given back.
  size_t ReleaseStashes(const kernels::Backend* device);
  // After memory on `device` was freed: the stashes there that are off for want of memory
  // (given back, or never fitted) are tried again at their next micro-batch. Takes no lock.
  void RetryStashes(const kernels::Backend* device);
  // ReleaseStashes for another head's micro-batch (StashLenders), which holds compute locks of
  // its own: only the replicas on `device` whose compute lock is free at once give their stash
  // back (one at work keeps it).
  size_t TryReleaseStashes(const kernels::Backend* device);

  // What the head holds on each of its devices, in rank order (HeadInfo.device_memory).
  struct DeviceShare {
    const kernels::Backend* device = nullptr;
    v1::HeadMemory memory;
  };
  std::vector<DeviceShare> MemoryByDevice() const;

 private:
  // What a run leaves in its scalars.
  struct RunScalars {
    int64_t token_count = 0;
    float loss_sum = 0;
    int64_t correct_count = 0;  // when asked
  };

  Head(std::unique_ptr<Placement> placement, const v1::HeadSpec& spec, kernels::DType dtype,
       const HeadOptions& options);
  ReplicaGroup& group() const { return placement_->group(); }
  absl::Status Initialize(size_t workspace_budget, bool init_weights);

  std::vector<DeviceShare> MemoryByDeviceLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // Sharded across processes: `tensor` (V x D, this process's rows in place) completed with every
  // other process's rows (a collective call: every process makes it for the same cut). Nothing
  // to do for a head of this process alone (gradient_window.cc).
  absl::Status GatherOtherRows(std::string& tensor, size_t element_bytes);
  // Under the cut, for a head with an output bias: the window's db (V values, ReadGradBias),
  // sharded across processes completed with every other process's rows (a collective call, as
  // GatherOtherRows), so that every process holds the whole of db and decides on it alike.
  absl::StatusOr<std::vector<float>> GroupGradBias();
  // After a micro-batch was counted in the window: the warning of
  // HeadOptions::window_warn_microbatches, once per window (gradient_window.cc).
  void WarnOfUnappliedWindowLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);

  // The step pipeline (step_pipeline.cc).
  StepTarget StepTargetOf() const;
  v1::LossOptions Defaults() const;
  // Runs a prepared micro-batch; with a client id, completes its idempotency claim, or fails it
  // when the device fails once the run has begun (see Step, also for `on_ordered`).
  // With `turn` (a head sharded across processes), its slots are taken and its run entered in
  // the group's order (step_turns.h).
  absl::StatusOr<std::shared_ptr<const StepOutcome>> Compute(
      const PreparedStep& prepared, StepStats* stats, const std::string& client_id,
      uint64_t sequence, const std::function<void()>& on_ordered, StepTurn* turn = nullptr);
  // Compute's part on its devices: under their compute locks its turn, the checks against W and
  // the window (ReserveRun) and the placement's run launched; then, in flight, the wait for its
  // work and the counters; the outcome's version. A device
  // failure once the run has begun is DATA_LOSS, kept by the key (see Step).
  absl::StatusOr<RunScalars> RunOnDevices(const PreparedStep& p, StepDevices& devices,
                                          StepStats* stats, const std::string& client_id,
                                          uint64_t sequence,
                                          const std::function<void()>& on_ordered,
                                          StepTurn* group_turn, StepOutcome& outcome);
  // Under the micro-batch's compute locks: the weights version it runs against
  // (FAILED_PRECONDITION when not the expected one) with its part of the window's bound reserved
  // (ReserveStepBounds, measuring W itself when only the optimizer's bound of W refuses it).
  absl::StatusOr<uint64_t> ReserveRun(const PreparedStep& p, std::span<Replica* const> devices);
  // Under the micro-batch's compute locks and state_mu_: OUT_OF_RANGE when its loss, dH or part
  // of dW could overflow, or the gradient window with it (kernels::CheckStepBounds); otherwise
  // reserves its part of the window's bound. Nothing changes on a refusal.
  absl::Status ReserveStepBounds(const PreparedStep& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // A run counted in the window (while it is in flight: before a Cut can begin).
  void CountRun(int64_t token_count, uint64_t version);
  // The largest |w| of W, read from `held` (replicas whose compute lock the caller holds and
  // which together hold every row: one replica, or every shard) through the host. For the rare
  // micro-batch that the optimizer's bound of W (which may lie far above W) would refuse.
  absl::StatusOr<float> MeasureWeights(std::span<Replica* const> held);
  void FinishOutcome(const PreparedStep& p, const RunScalars& scalars, std::string grad_hidden,
                     const std::vector<float>& per_token, const std::string& token_outputs,
                     StepOutcome* outcome) const;

  // An EMBEDDING_GRAD micro-batch (embedding_rows.cc): prepared, then replayed from or claimed
  // in the idempotency cache as a loss micro-batch is (one key space), then added to dW.
  absl::StatusOr<std::shared_ptr<const StepOutcome>> StepEmbeddingGrad(
      const MicroBatch& microbatch, StepStats* stats, const std::function<void()>& on_ordered);
  // Under the holders' compute locks: the version check, the window's bound reserved
  // (OUT_OF_RANGE), the rows added on each holder, the micro-batch counted (no tokens). A device
  // failure once the adds began is DATA_LOSS, kept by the key.
  absl::StatusOr<std::shared_ptr<StepOutcome>> AddEmbeddingGrad(
      const PreparedEmbeddingGrad& prepared, const v1::StepHeader& header, StepStats* stats,
      const std::function<void()>& on_ordered);
  // Under the holders' compute locks: the rows of W for `ids` that this process holds, each
  // copied to its position in `rows` (ids.size() x `row_bytes`); the others left as they are.
  absl::Status ReadHeldRows(const std::vector<int64_t>& ids, size_t row_bytes, std::string& rows);
  // Sharded across processes (embedding_across.cc). EmbeddingRows' exchange: every other
  // process's rows of `ids` sent to `origin` into their positions of `rows` (a collective call).
  absl::Status GatherEmbeddingRows(const std::vector<int64_t>& ids, size_t row_bytes, int origin,
                                   std::string& rows);
  // RunStep of an EMBEDDING_GRAD micro-batch: in its turn, the origin sends each process the rows
  // of dE it owns (ordered by id as one process orders them), and each adds them
  // (AddEmbeddingGrad) with the whole micro-batch's bound. Keyed at the origin only.
  absl::StatusOr<std::shared_ptr<const StepOutcome>> RunEmbeddingGrad(const MicroBatch& microbatch,
                                                                      StepStats* stats, int origin,
                                                                      StepTurn& turn);

  // The server-side optimizer (optimizer_apply.cc).
  // Each replica's optimizer buffers for its rows (contents undefined); RESOURCE_EXHAUSTED names
  // the one that did not fit.
  absl::StatusOr<std::vector<OptimizerBuffers>> AllocateOptimizers(
      const v1::OptimizerSpec& spec) const;
  // Makes `buffers` (fresh, one per replica) the optimizer: zeroed state, master from W. Under
  // the cut.
  absl::Status InstallOptimizer(std::vector<OptimizerBuffers> buffers);
  // Takes master from W when a push has changed W since (see master_version). Under the cut.
  absl::Status SyncMaster();
  // Sharded across processes: every process's `mine`, one after another in process rank order
  // (a collective call, as GatherOtherRows).
  absl::StatusOr<std::vector<double>> GatherDoubles(absl::string_view what,
                                                    const std::vector<double>& mine);

  // How the head lies on its devices; reset first in ~Head.
  std::unique_ptr<Placement> placement_;
  const v1::HeadSpec spec_;  // default_options here are the creation-time ones; see defaults_
  const kernels::DType dtype_;
  const HeadOptions options_;
  // Buffers and stashes the micro-batches borrow of the devices' memory.
  DeviceScratch scratch_;
  // dH result buffers, recycled: each outcome gives its buffer back when the cache and the
  // responses in flight are done with it. Declared before cache_ so that it outlives the outcomes
  // the cache holds (they hold it too).
  const std::shared_ptr<ResultPool> results_;
  IdempotencyCache cache_;

  // Optimizer responses remembered per client: under the cut. (The device state, the compute
  // locks and the I/O slots are the replicas'; every compute lock is taken before state_mu_.)
  ApplyLog applies_;
  // The output bias and its optimizer state (head_bias.h; empty without one): under the cut.
  HeadBias bias_;

  // Counters and options; written under both mutexes when tied to device state, read under this.
  mutable absl::Mutex state_mu_;
  v1::LossOptions defaults_ ABSL_GUARDED_BY(state_mu_);
  uint64_t version_ ABSL_GUARDED_BY(state_mu_) = 1;
  // The gradient window's counters, totals and dW bound.
  WindowCounters window_ ABSL_GUARDED_BY(state_mu_);
  // What Info reports of the optimizer (its buffers are the replicas', under the cut).
  v1::OptimizerSpec optimizer_spec_ ABSL_GUARDED_BY(state_mu_);
  uint64_t optimizer_step_ ABSL_GUARDED_BY(state_mu_) = 0;
  OptimizerFootprint optimizer_footprint_ ABSL_GUARDED_BY(state_mu_);
  // Micro-batches counted in dW whose outcome is not yet remembered for replay (their dH is being
  // copied out). A snapshot waits for none under the cut: see Snapshot.
  int pending_outcomes_ ABSL_GUARDED_BY(state_mu_) = 0;
  // The overflow guard of W (kernels/step_bound.h; the window's is window_'s), written under the
  // cut and this mutex: a bound on |W|, exact after an init, a push or a restore, the optimizer's
  // magnitude bound after an apply.
  double weight_abs_ ABSL_GUARDED_BY(state_mu_) = 0;
  bool weight_abs_exact_ ABSL_GUARDED_BY(state_mu_) = true;  // false after an apply

  // Per client id: the highest applied sequence in the last durable checkpoint.
  mutable absl::Mutex persisted_mu_;
  absl::flat_hash_map<std::string, uint64_t> persisted_ ABSL_GUARDED_BY(persisted_mu_);
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_HEAD_H_
