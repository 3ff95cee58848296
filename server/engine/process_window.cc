#include "server/engine/process_window.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace losshead::server {
namespace {

// The counters of a window as they travel: fixed size, so that every process sends the same
// number of bytes.
struct Counters {
  uint64_t tokens = 0;
  uint64_t microbatches = 0;
  uint64_t min_version = 0;  // 0: no micro-batch
  uint64_t max_version = 0;
};

}  // namespace

absl::StatusOr<std::shared_ptr<ProcessWindow>> ProcessWindow::Create(
    std::shared_ptr<kernels::ProcessGroup> group) {
  // The sum runs on the host whatever the heads' devices: one CPU backend per process.
  LOSSHEAD_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<kernels::Backend>> backends,
                            kernels::CreateBackends(kernels::BackendKind::kCpu, {}));
  std::unique_ptr<kernels::Backend> backend = std::move(backends.front());
  LOSSHEAD_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Stream> stream, backend->CreateStream());
  kernels::Backend* const local[] = {backend.get()};
  LOSSHEAD_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Collective> collective,
                            kernels::CreateProcessCollective(group, local));
  return std::shared_ptr<ProcessWindow>(new ProcessWindow(
      std::move(group), std::move(backend), std::move(stream), std::move(collective)));
}

absl::StatusOr<v1::GradientSummary> ProcessWindow::GatherCounters(const v1::GradientSummary& mine) {
  const Counters own{.tokens = mine.token_count(),
                     .microbatches = mine.microbatch_count(),
                     .min_version = mine.min_weights_version(),
                     .max_version = mine.max_weights_version()};
  LOSSHEAD_ASSIGN_OR_RETURN(
      std::vector<std::vector<std::byte>> all,
      group_->AllGather(
          "the gradient window's counters",
          std::span<const std::byte>(reinterpret_cast<const std::byte*>(&own), sizeof(own))));
  v1::GradientSummary sum = mine;
  Counters total;
  for (const std::vector<std::byte>& bytes : all) {
    if (bytes.size() != sizeof(Counters)) {
      return absl::InternalError("a process sent window counters of another size");
    }
    Counters c;
    std::memcpy(&c, bytes.data(), sizeof(c));
    total.tokens += c.tokens;
    total.microbatches += c.microbatches;
    if (c.microbatches == 0) continue;
    total.min_version =
        total.min_version == 0 ? c.min_version : std::min(total.min_version, c.min_version);
    total.max_version = std::max(total.max_version, c.max_version);
  }
  sum.set_token_count(total.tokens);
  sum.set_microbatch_count(total.microbatches);
  sum.set_min_weights_version(total.min_version);
  sum.set_max_weights_version(total.max_version);
  return sum;
}

absl::Status ProcessWindow::SumCounters(v1::GradientSummary& summary) {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_RETURN_IF_ERROR(group_->health());
  LOSSHEAD_ASSIGN_OR_RETURN(summary, GatherCounters(summary));
  return absl::OkStatus();
}

absl::Status ProcessWindow::Sum(std::span<float> values, v1::GradientSummary& summary) {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_RETURN_IF_ERROR(group_->health());
  const size_t bytes = values.size() * sizeof(float);
  // The collective takes its backend's memory: the window goes there and back (a CPU backend's
  // memory is the host's, so both copies are memcpy).
  LOSSHEAD_ASSIGN_OR_RETURN(kernels::DeviceBuffer buffer, backend_->Allocate(bytes));
  LOSSHEAD_RETURN_IF_ERROR(backend_->CopyToDevice(buffer.data(), values.data(), bytes, *stream_));
  void* const buffers[] = {buffer.data()};
  kernels::Stream* const streams[] = {stream_.get()};
  LOSSHEAD_RETURN_IF_ERROR(collective_->AllReduce(buffers, static_cast<int64_t>(values.size()),
                                                  kernels::DType::kFP32, kernels::ReduceOp::kSum,
                                                  streams));
  LOSSHEAD_RETURN_IF_ERROR(stream_->Synchronize());
  LOSSHEAD_ASSIGN_OR_RETURN(v1::GradientSummary sum, GatherCounters(summary));
  LOSSHEAD_RETURN_IF_ERROR(backend_->CopyToHost(values.data(), buffer.data(), bytes, *stream_));
  LOSSHEAD_RETURN_IF_ERROR(stream_->Synchronize());
  summary = std::move(sum);
  return absl::OkStatus();
}

absl::Status ProcessWindow::Broadcast(std::string& data, int root) {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_RETURN_IF_ERROR(group_->health());
  if (root < 0 || root >= size()) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast root ", root, " is not a process"));
  }
  // Root sends to every process, the others receive from root only; nothing else moves.
  std::string received(root == rank() ? 0 : data.size(), '\0');
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data.data()),
                                         data.size());
  std::vector<std::span<const std::byte>> sends(size());
  std::vector<std::span<std::byte>> recvs(size());
  if (root == rank()) {
    for (int q = 0; q < size(); ++q) {
      if (q != root) sends[q] = bytes;
    }
  } else {
    recvs[root] = std::span<std::byte>(reinterpret_cast<std::byte*>(received.data()),
                                       received.size());
  }
  LOSSHEAD_RETURN_IF_ERROR(group_->Exchange("a push of W", sends, recvs));
  if (root != rank()) data = std::move(received);
  return absl::OkStatus();
}

absl::Status ProcessWindow::Exchange(absl::string_view what,
                                     std::span<const std::span<const std::byte>> sends,
                                     std::span<const std::span<std::byte>> recvs) {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_RETURN_IF_ERROR(group_->health());
  return group_->Exchange(what, sends, recvs);
}

absl::StatusOr<std::vector<absl::Status>> ProcessWindow::GatherStatuses(absl::string_view what,
                                                                        const absl::Status& mine) {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_RETURN_IF_ERROR(group_->health());
  return kernels::GatherStatuses(*group_, what, mine);
}

absl::StatusOr<std::vector<std::string>> ProcessWindow::AllGather(absl::string_view what,
                                                                  absl::string_view mine) {
  absl::MutexLock lock(&mu_);
  LOSSHEAD_RETURN_IF_ERROR(group_->health());
  // The lengths first (fixed size), so that each process knows what every other sends.
  const uint64_t length = mine.size();
  LOSSHEAD_ASSIGN_OR_RETURN(
      std::vector<std::vector<std::byte>> lengths,
      group_->AllGather(what, std::span<const std::byte>(
                                  reinterpret_cast<const std::byte*>(&length), sizeof(length))));
  std::vector<std::string> all(size());
  std::vector<std::span<const std::byte>> sends(size());
  std::vector<std::span<std::byte>> recvs(size());
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(mine.data()),
                                         mine.size());
  for (int q = 0; q < size(); ++q) {
    if (lengths[q].size() != sizeof(uint64_t)) {
      return absl::InternalError("a process sent a length of another size");
    }
    uint64_t theirs;
    std::memcpy(&theirs, lengths[q].data(), sizeof(theirs));
    if (q == rank()) {
      all[q] = std::string(mine);
      continue;
    }
    sends[q] = bytes;
    all[q].assign(theirs, '\0');
    recvs[q] = std::span<std::byte>(reinterpret_cast<std::byte*>(all[q].data()), all[q].size());
  }
  LOSSHEAD_RETURN_IF_ERROR(group_->Exchange(what, sends, recvs));
  return all;
}

absl::Status ProcessWindow::GatherRows(absl::string_view what, std::string& data, size_t begin,
                                       size_t end) {
  if (begin > end || end > data.size()) {
    return absl::InternalError(
        absl::StrCat("rows [", begin, ", ", end, ") outside ", data.size(), " bytes"));
  }
  // Each process sends where its rows start, then the rows.
  std::string mine(sizeof(uint64_t), '\0');
  const uint64_t at = begin;
  std::memcpy(mine.data(), &at, sizeof(at));
  mine.append(data, begin, end - begin);
  LOSSHEAD_ASSIGN_OR_RETURN(std::vector<std::string> all, AllGather(what, mine));
  for (int q = 0; q < size(); ++q) {
    if (q == rank()) continue;
    uint64_t theirs;
    if (all[q].size() < sizeof(theirs)) return absl::InternalError("a process sent no rows");
    std::memcpy(&theirs, all[q].data(), sizeof(theirs));
    const size_t count = all[q].size() - sizeof(theirs);
    if (theirs > data.size() || count > data.size() - theirs) {
      return absl::InternalError(absl::StrCat("process ", q, " sent rows outside the tensor"));
    }
    std::memcpy(data.data() + theirs, all[q].data() + sizeof(theirs), count);
  }
  return absl::OkStatus();
}

}  // namespace losshead::server
