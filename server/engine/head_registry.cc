#include "server/engine/head_registry.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace losshead::server {
namespace {

// Bytes per element of a validated weight dtype.
uint64_t WeightDTypeBytes(v1::DType dtype) { return dtype == v1::DTYPE_FP32 ? 4 : 2; }

HeadOptions WithLenders(HeadOptions options) {
  if (options.stash_lenders == nullptr) options.stash_lenders = std::make_shared<StashLenders>();
  return options;
}

}  // namespace

void StashLenders::Add(const std::shared_ptr<Head>& head) {
  absl::MutexLock lock(&mu_);
  std::erase_if(heads_, [](const std::weak_ptr<Head>& h) { return h.expired(); });
  heads_.push_back(head);
}

void StashLenders::Freed(std::span<kernels::Backend* const> devices) {
  std::vector<std::shared_ptr<Head>> heads;
  {
    absl::MutexLock lock(&mu_);
    for (const std::weak_ptr<Head>& weak : heads_) {
      if (std::shared_ptr<Head> head = weak.lock(); head != nullptr) heads.push_back(head);
    }
  }
  for (const std::shared_ptr<Head>& head : heads) {
    for (const kernels::Backend* device : devices) head->RetryStashes(device);
  }
}

size_t StashLenders::TakeBack(kernels::Backend& device, const Head* asking, size_t bytes) {
  std::vector<std::shared_ptr<Head>> others;
  {
    absl::MutexLock lock(&mu_);
    for (const std::weak_ptr<Head>& weak : heads_) {
      std::shared_ptr<Head> head = weak.lock();
      if (head != nullptr && head.get() != asking) others.push_back(std::move(head));
    }
  }
  const kernels::MemoryInfo memory = device.memory_info();
  if (memory.total_bytes == 0 || bytes <= memory.free_bytes) return 0;
  size_t held = 0;
  for (const std::shared_ptr<Head>& head : others) held += head->StashBytes(&device);
  // Only where that makes room: a buffer that would not fit even so leaves the stashes be.
  if (held == 0 || bytes > memory.free_bytes + held) return 0;
  size_t released = 0;
  for (const std::shared_ptr<Head>& head : others) {
    released += head->TryReleaseStashes(&device);
    if (bytes <= memory.free_bytes + released) break;
  }
  return released;
}

HeadRegistry::HeadRegistry(std::vector<kernels::Backend*> devices, HeadOptions options,
                           HeadLimits limits)
    : devices_(std::move(devices)), options_(WithLenders(std::move(options))), limits_(limits) {}

absl::Status HeadRegistry::CheckHeadBytes(const v1::HeadSpec& spec) const {
  // V < 2^31 and D < 2^63 after validation; the product is checked in 128 bits. Each optimizer
  // buffer (master, moments) is one fp32 per weight.
  const uint64_t buffers =
      HasOptimizer(spec.optimizer())
          ? StateBufferCount(spec.optimizer()) + (spec.weight_dtype() == v1::DTYPE_FP32 ? 0 : 1)
          : 0;
  const unsigned __int128 head_bytes = static_cast<unsigned __int128>(spec.vocab_size()) *
                                       static_cast<unsigned __int128>(spec.hidden_size()) *
                                       (WeightDTypeBytes(spec.weight_dtype()) + 4 + 4 * buffers);
  // Without a configured limit, sizes past what any device holds stay Head::Create's
  // RESOURCE_EXHAUSTED.
  const bool limited = limits_.max_head_bytes != std::numeric_limits<uint64_t>::max();
  if (limited && head_bytes > limits_.max_head_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a ", spec.vocab_size(), " x ", spec.hidden_size(),
                     " head needs more than the server's limit of ", limits_.max_head_bytes,
                     " bytes for W, dW and its optimizer (--max_head_bytes)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<kernels::Backend*>> HeadRegistry::Place(const v1::Placement& placement,
                                                                   bool at_most) const {
  LOSSHEAD_RETURN_IF_ERROR(Head::ValidatePlacement(placement));
  const int available = static_cast<int>(devices_.size());
  int k = PlacementDevices(placement, available);
  if (k > available) {
    if (!at_most) {
      return absl::InvalidArgumentError(absl::StrCat(
          "placement asks for ", k, " devices but the server has ", available, " (--devices)"));
    }
    k = available;
  }
  // The k devices with the most free memory, kept in the server's order (rank order).
  std::vector<int> order(available);
  std::vector<uint64_t> free(available);
  for (int i = 0; i < available; ++i) {
    order[i] = i;
    free[i] = devices_[i]->memory_info().free_bytes;
  }
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return free[a] > free[b]; });
  order.resize(k);
  std::sort(order.begin(), order.end());
  std::vector<kernels::Backend*> chosen;
  for (int i : order) chosen.push_back(devices_[i]);
  return chosen;
}

absl::StatusOr<std::shared_ptr<Head>> HeadRegistry::Create(const v1::HeadSpec& spec) {
  LOSSHEAD_RETURN_IF_ERROR(Head::ValidateSpec(spec));
  LOSSHEAD_RETURN_IF_ERROR(CheckHeadBytes(spec));
  {
    absl::MutexLock lock(&mu_);
    if (heads_.contains(spec.name()) || creating_.contains(spec.name())) {
      return absl::AlreadyExistsError(absl::StrCat("head '", spec.name(), "' already exists"));
    }
    if (heads_.size() + creating_.size() >= limits_.max_heads) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the server holds its limit of ", limits_.max_heads,
                       " heads (--max_heads); delete one first"));
    }
    creating_.insert(spec.name());
  }
  absl::StatusOr<std::vector<kernels::Backend*>> devices = Place(spec.placement());
  if (devices.ok()) {
    std::vector<uint64_t> needed;
    for (const Head::DeviceFootprint& f : Head::Footprint(spec, devices->size())) {
      needed.push_back(f.total());
    }
    MakeRoom(*devices, needed);
  }
  absl::StatusOr<std::shared_ptr<Head>> head =
      devices.ok() ? Head::Create(*devices, spec, options_) : devices.status();
  absl::MutexLock lock(&mu_);
  creating_.erase(spec.name());
  if (head.ok()) {
    options_.stash_lenders->Add(*head);
    heads_.emplace(spec.name(), *head);
  }
  return head;
}

absl::StatusOr<std::shared_ptr<Head>> HeadRegistry::SetOptimizer(
    const std::string& name, const v1::OptimizerSpec& optimizer) {
  LOSSHEAD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, Get(name));
  LOSSHEAD_RETURN_IF_ERROR(ValidateOptimizerSpec(optimizer));
  v1::HeadSpec spec = head->Info().spec();
  *spec.mutable_optimizer() = optimizer;
  LOSSHEAD_RETURN_IF_ERROR(CheckHeadBytes(spec));
  // The new optimizer's buffers are allocated while the old one's still stand.
  const std::vector<kernels::Backend*> devices = head->devices();
  std::vector<uint64_t> needed;
  for (const Head::DeviceFootprint& f : Head::Footprint(spec, devices.size())) {
    needed.push_back(f.optimizer);
  }
  MakeRoom(devices, needed);
  LOSSHEAD_RETURN_IF_ERROR(head->SetOptimizer(optimizer));
  return head;
}

void HeadRegistry::MakeRoom(std::span<kernels::Backend* const> devices,
                            const std::vector<uint64_t>& needed) const {
  const std::vector<std::shared_ptr<Head>> heads = List();
  for (size_t r = 0; r < devices.size(); ++r) {
    const kernels::MemoryInfo memory = devices[r]->memory_info();
    if (memory.total_bytes == 0 || needed[r] <= memory.free_bytes) continue;
    uint64_t stashed = 0;
    for (const std::shared_ptr<Head>& head : heads) stashed += head->StashBytes(devices[r]);
    // Only where that makes room: a request that would not fit even so leaves the stashes be.
    if (stashed == 0 || needed[r] > memory.free_bytes + stashed) continue;
    for (const std::shared_ptr<Head>& head : heads) head->ReleaseStashes(devices[r]);
  }
}

absl::Status HeadRegistry::Adopt(std::shared_ptr<Head> head) {
  absl::MutexLock lock(&mu_);
  const std::string& name = head->name();
  if (heads_.contains(name) || creating_.contains(name)) {
    return absl::AlreadyExistsError(absl::StrCat("head '", name, "' already exists"));
  }
  options_.stash_lenders->Add(head);
  heads_.emplace(name, std::move(head));
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Head>> HeadRegistry::Restore(
    const HeadCheckpointData& data, absl::FunctionRef<absl::Status()> commit) {
  const std::string& name = data.spec.name();
  if (absl::Status s = Head::ValidateSpec(data.spec); !s.ok()) {
    return absl::DataLossError(absl::StrCat("snapshot holds an invalid spec: ", s.message()));
  }
  LOSSHEAD_RETURN_IF_ERROR(CheckHeadBytes(data.spec));
  {
    absl::MutexLock lock(&mu_);
    if (creating_.contains(name)) {
      return absl::AbortedError(
          absl::StrCat("head '", name, "' is being created or restored by another call"));
    }
    if (!heads_.contains(name) && heads_.size() + creating_.size() >= limits_.max_heads) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the server holds its limit of ", limits_.max_heads,
                       " heads (--max_heads); delete one first"));
    }
    creating_.insert(name);  // a CreateHead of the name meanwhile is ALREADY_EXISTS
  }
  absl::StatusOr<std::vector<kernels::Backend*>> devices =
      Place(data.spec.placement(), /*at_most=*/true);
  if (devices.ok()) {
    std::vector<uint64_t> needed;
    for (const Head::DeviceFootprint& f : Head::Footprint(data.spec, devices->size())) {
      needed.push_back(f.total());
    }
    MakeRoom(*devices, needed);
  }
  absl::StatusOr<std::shared_ptr<Head>> head =
      devices.ok() ? Head::Restore(*devices, data, options_) : devices.status();
  if (head.ok()) {
    if (absl::Status committed = commit(); !committed.ok()) head = committed;
  }
  std::shared_ptr<Head> replaced;  // released outside the lock: freeing may wait for the device
  {
    absl::MutexLock lock(&mu_);
    creating_.erase(name);
    if (head.ok()) {
      options_.stash_lenders->Add(*head);
      std::shared_ptr<Head>& slot = heads_[name];
      replaced = std::move(slot);
      slot = *head;
    }
  }
  return head;
}

absl::StatusOr<std::shared_ptr<Head>> HeadRegistry::Get(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = heads_.find(name);
  if (it == heads_.end()) return absl::NotFoundError(absl::StrCat("no head named '", name, "'"));
  return it->second;
}

std::vector<std::shared_ptr<Head>> HeadRegistry::List() const {
  std::vector<std::shared_ptr<Head>> out;
  {
    absl::MutexLock lock(&mu_);
    out.reserve(heads_.size());
    for (const auto& [name, head] : heads_) out.push_back(head);
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a->name() < b->name(); });
  return out;
}

absl::Status HeadRegistry::Delete(const std::string& name) {
  std::shared_ptr<Head> doomed;  // released outside the lock: freeing may wait for the device
  {
    absl::MutexLock lock(&mu_);
    auto it = heads_.find(name);
    if (it == heads_.end()) return absl::NotFoundError(absl::StrCat("no head named '", name, "'"));
    doomed = std::move(it->second);
    heads_.erase(it);
  }
  // Its memory is freed now, or when the work still holding it ends: either way ~Head then has
  // the stashes that gave way try again.
  doomed.reset();
  return absl::OkStatus();
}

size_t HeadRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return heads_.size();
}

}  // namespace losshead::server
