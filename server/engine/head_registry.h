// The heads of a server by name.
#ifndef LOSSHEAD_SERVER_ENGINE_HEAD_REGISTRY_H_
#define LOSSHEAD_SERVER_ENGINE_HEAD_REGISTRY_H_

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "losshead/kernels/backend.h"
#include "losshead/v1/losshead.pb.h"
#include "server/engine/head.h"
#include "server/engine/head_checkpoint.h"

namespace losshead::server {

// Operator limits on what CreateHead may allocate (a writer token must not be able to fill the
// device or the host with heads).
struct HeadLimits {
  // Heads on the server, those being created included; beyond it RESOURCE_EXHAUSTED (deleting a
  // head makes room, so a retry later can succeed).
  size_t max_heads = std::numeric_limits<size_t>::max();
  // W + dW + optimizer bytes of one head (V x D x (dtype bytes + 4), plus the master weights and
  // state of its optimizer); beyond it INVALID_ARGUMENT: no retry on this server can succeed, as
  // for any other spec outside the server's bounds.
  uint64_t max_head_bytes = std::numeric_limits<uint64_t>::max();
};

// The heads of a server, as lenders of their deferred-dW stashes to a micro-batch of another head
// whose buffers do not fit its device (DeviceScratch::Ensure). That micro-batch holds compute
// locks of its own, so nothing here waits for a lock: a head at work on the device keeps its
// stash.
class StashLenders {
 public:
  void Add(const std::shared_ptr<Head>& head);
  // A head's memory on `devices` was freed: every other head's stash there that is off for want of
  // memory tries again at its next micro-batch (Head::RetryStashes; takes no lock).
  void Freed(std::span<kernels::Backend* const> devices);
  // Where `bytes` are not free on `device` but would be with the other heads' stashes there, gives
  // those back (Head::TryReleaseStashes), head by head until the bytes are free. Returns the bytes
  // given back (0 where that would not make room: the stashes are left be).
  size_t TakeBack(kernels::Backend& device, const Head* asking, size_t bytes);

 private:
  absl::Mutex mu_;
  std::vector<std::weak_ptr<Head>> heads_ ABSL_GUARDED_BY(mu_);  // a deleted head's expire
};

class HeadRegistry {
 public:
  // Heads go on `devices` (the server's, in its order; at least one), which outlive the registry.
  // Its heads lend their stashes to each other (StashLenders), unless `options` names lenders.
  HeadRegistry(std::vector<kernels::Backend*> devices, HeadOptions options, HeadLimits limits = {});
  HeadRegistry(kernels::Backend& backend, HeadOptions options, HeadLimits limits = {})
      : HeadRegistry(std::vector<kernels::Backend*>{&backend}, options, limits) {}

  // INVALID_ARGUMENT for a bad spec, one above limits.max_head_bytes or a placement on more
  // devices than the server has, ALREADY_EXISTS for a taken name (also while another create of
  // the same name is allocating), RESOURCE_EXHAUSTED when limits.max_heads are there or the
  // device memory does not suffice, counting the heads' deferred-dW stashes there as free
  // (MakeRoom). Limits are checked before anything is allocated. Allocation and initialisation
  // run in the caller's thread, outside the registry's lock.
  absl::StatusOr<std::shared_ptr<Head>> Create(const v1::HeadSpec& spec);
  // Head::SetOptimizer on `name` after the same max_head_bytes check as Create (INVALID_ARGUMENT);
  // NOT_FOUND for an unknown name. The stashes on the head's devices make room for the
  // optimizer's buffers as for Create. Returns the head.
  absl::StatusOr<std::shared_ptr<Head>> SetOptimizer(const std::string& name,
                                                     const v1::OptimizerSpec& optimizer);
  // Registers a head built elsewhere (a restored checkpoint); ALREADY_EXISTS for a taken name.
  absl::Status Adopt(std::shared_ptr<Head> head);
  // Puts the head named in `data` (a snapshot of it) in the place of the one of that name, or
  // adds it where there is none. The restored head is built beside the old one, which goes on
  // serving meanwhile: on the devices the registry gives its saved placement (all of them where it
  // asks for more), with the heads' stashes there making room as for Create. Then `commit` runs
  // (making the restore durable); only when it succeeds is the head swapped under the registry's
  // lock: calls that already hold the old head finish on it, every later one finds the restored
  // head. INVALID_ARGUMENT above limits.max_head_bytes, RESOURCE_EXHAUSTED for a new name when
  // limits.max_heads are there or when the devices lack the memory, ABORTED while a head of that
  // name is being created or restored, DATA_LOSS for data that does not make a head, or
  // `commit`'s error; on any error nothing changed.
  absl::StatusOr<std::shared_ptr<Head>> Restore(const HeadCheckpointData& data,
                                                absl::FunctionRef<absl::Status()> commit);
  // NOT_FOUND for an unknown name.
  absl::StatusOr<std::shared_ptr<Head>> Get(const std::string& name) const;
  // Sorted by name.
  std::vector<std::shared_ptr<Head>> List() const;
  // Removes the name at once; the head's memory is freed when the work still holding it ends,
  // and the other heads' stashes that gave way on its devices are tried again then (~Head).
  absl::Status Delete(const std::string& name);
  size_t size() const;
  const HeadOptions& head_options() const { return options_; }
  const std::vector<kernels::Backend*>& devices() const { return devices_; }

  // The devices a head of `placement` goes on: the ones with the most free memory (the first
  // among equals), in the server's order. INVALID_ARGUMENT for more devices than the server has,
  // unless `at_most` (a restore: the file fits any placement), which takes them all instead.
  absl::StatusOr<std::vector<kernels::Backend*>> Place(const v1::Placement& placement,
                                                       bool at_most = false) const;

 private:
  // Deferred-dW stashes only speed micro-batches up: on each device r of `devices` where
  // needed[r] bytes are not free but would be without the heads' stashes there, those stashes
  // are given back (Head::ReleaseStashes).
  void MakeRoom(std::span<kernels::Backend* const> devices,
                const std::vector<uint64_t>& needed) const;
  // INVALID_ARGUMENT when a head of `spec` would exceed limits_.max_head_bytes.
  absl::Status CheckHeadBytes(const v1::HeadSpec& spec) const;

  const std::vector<kernels::Backend*> devices_;
  const HeadOptions options_;
  const HeadLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Head>> heads_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<std::string> creating_ ABSL_GUARDED_BY(mu_);
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_HEAD_REGISTRY_H_
