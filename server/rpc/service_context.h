// What the RPC handlers share: the devices, heads, workers, metrics and limits of one server.
#ifndef LOSSHEAD_SERVER_RPC_SERVICE_CONTEXT_H_
#define LOSSHEAD_SERVER_RPC_SERVICE_CONTEXT_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "losshead/kernels/backend.h"
#include "server/engine/admission.h"
#include "server/engine/head_registry.h"
#include "server/engine/idempotency_budget.h"
#include "server/engine/pinned_pool.h"
#include "server/engine/result_pool.h"
#include "server/engine/thread_pool.h"
#include "server/observability/metrics.h"
#include "server/observability/step_trace.h"

namespace losshead::server {

class StepReactor;
class SharedRegions;
class TokenTable;
class Checkpointer;
class GroupControl;
class GroupSecret;

// Live Step streams, so that shutdown can tell each to stop reading and finish once answered.
class StepStreams {
 public:
  void Add(StepReactor* reactor);
  void Remove(StepReactor* reactor);
  // Marks every live stream as draining and kicks it (outside this registry's lock).
  void DrainAll();
  // Blocks until no stream is live or `deadline` passes; true if none is live.
  bool WaitUntilNone(absl::Time deadline);

 private:
  absl::Mutex mu_;
  absl::flat_hash_set<StepReactor*> live_ ABSL_GUARDED_BY(mu_);
};

// A device's name in metric labels: "cuda:<ordinal>" (the CUDA ordinal, as --devices names it),
// or "<backend>:<position in --devices>" for a device without one (the CPU backend's).
inline std::string DeviceLabel(const kernels::Backend& device, size_t position) {
  const int ordinal = device.device_ordinal();
  return absl::StrCat(device.name(), ":", ordinal >= 0 ? static_cast<size_t>(ordinal) : position);
}

struct ServiceContext {
  std::vector<kernels::Backend*> devices;  // the server's, in --devices order

  // DeviceLabel of one of `devices`; "" for a backend that is none of them.
  std::string LabelOf(const kernels::Backend* device) const {
    for (size_t i = 0; i < devices.size(); ++i) {
      if (devices[i] == device) return DeviceLabel(*device, i);
    }
    return "";
  }

  HeadRegistry* registry = nullptr;
  ThreadPool* pool = nullptr;
  Metrics* metrics = nullptr;
  // Bearer tokens (server/security/auth.h); null when the server asks for none. Calls reach the
  // handlers already authorised for their method; handlers use it only for request-dependent rules.
  const TokenTable* tokens = nullptr;
  // Null when checkpoints are disabled (no --checkpoint_dir).
  Checkpointer* checkpointer = nullptr;
  // Server-wide bound on admitted micro-batches and their buffered request bytes.
  Admission* admission = nullptr;
  // Page-locked buffers that micro-batches are received into; null: ordinary memory.
  std::shared_ptr<PinnedPool> pinned;
  // Every head's dH buffers (HeadOptions::results); null when heads keep their own.
  std::shared_ptr<ResultPool> results;
  // The server-wide budget of remembered results (HeadOptions::idempotency_budget), for metrics;
  // null when heads have none.
  std::shared_ptr<IdempotencyBudget> remembered;
  // The process group of a head replicated across server processes (group_control.h); null for a
  // server of one process.
  GroupControl* group = nullptr;
  // With --group_secret_file: the processes' credential on ProcessControl.Lead and Apply, which
  // then take no other (group_secret.h); null otherwise.
  const GroupSecret* group_secret = nullptr;
  // Null unless --step_trace names a file.
  StepTrace* step_trace = nullptr;
  // The same-node path (docs/same-node.md): the registered regions, the socket that registers
  // them and this host's id, as Stats.same_node advertises them; null when it is off.
  SharedRegions* shared_regions = nullptr;
  std::string same_node_socket;
  std::string host_id;
  size_t max_message_bytes = size_t{4} << 20;
  size_t max_microbatch_bytes = size_t{1} << 30;
  // Micro-batches of one stream received but not yet answered; reading pauses at this bound.
  size_t max_inflight_per_stream = 4;
  absl::Time start_time;
  // Set at shutdown: new calls are answered UNAVAILABLE by the handlers themselves, so that a
  // caller sees a clean refusal while in-flight micro-batches are still being answered.
  std::atomic<bool> draining{false};
  StepStreams streams;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_SERVICE_CONTEXT_H_
