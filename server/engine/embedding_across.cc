// Head's tied input embedding on a head sharded across server processes
// (Placement.across_processes: docs/multi-process.md). Each process holds only its rows of W and
// dW, so a row goes to or from the process that owns it and nowhere else, over the group's
// point-to-point exchange (ProcessWindow::Exchange):
// - EmbeddingRows: every process reads the rows of the ids it owns and sends them to the origin
//   (the process whose client asked), which places them by position.
// - An EMBEDDING_GRAD micro-batch, in its turn: the origin orders dE's rows by id as one process
//   does (a stable sort) and sends each process the rows it owns, in the micro-batch's dtype;
//   each converts them and adds them on its shards. The bound the window reserves is the whole
//   micro-batch's (its largest |dE| from the origin, its most repeated id from the ids every
//   process has), so that every process decides alike and as one process would.
// dE goes by this exchange, not in StepControl: it is as large as a micro-batch's hidden states,
// far beyond a control message (--max_message_bytes), and this way each row crosses the network
// once, to its owner, instead of from the origin to the leader and from the leader to everyone.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/embedding_rows.h"
#include "server/engine/head.h"
#include "server/engine/process_window.h"
#include "server/engine/proto_convert.h"

namespace losshead::server {
namespace {

// The rows [begin, end) that process `process` of `processes` owns: its shards' together (a
// process's global shard ranks are consecutive, and so are their rows).
kernels::Shard ProcessRows(const ReplicaGroup& group, int process, int processes) {
  const int first = group.FirstShardOf(process);
  const int last =
      (process + 1 < processes ? group.FirstShardOf(process + 1) : group.shard_count()) - 1;
  return kernels::Shard{
      .begin = kernels::ShardRange(group.vocab_size(), group.shard_count(), first).begin,
      .end = kernels::ShardRange(group.vocab_size(), group.shard_count(), last).end};
}

std::span<const std::byte> Bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
std::span<std::byte> Bytes(std::string& s) {
  return {reinterpret_cast<std::byte*>(s.data()), s.size()};
}

}  // namespace

absl::Status Head::GatherEmbeddingRows(const std::vector<int64_t>& ids, size_t row_bytes,
                                       int origin, std::string& rows) {
  ProcessWindow& window = *options_.process_window;
  const int processes = window.size();
  const int me = group().process();
  // Each process's positions of `ids`, in order.
  std::vector<std::vector<size_t>> positions(processes);
  std::vector<kernels::Shard> owned(processes);
  for (int q = 0; q < processes; ++q) owned[q] = ProcessRows(group(), q, processes);
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int q = 0; q < processes; ++q) {
      if (ids[i] >= owned[q].begin && ids[i] < owned[q].end) {
        positions[q].push_back(i);
        break;
      }
    }
  }
  std::vector<std::string> parts(processes);
  std::vector<std::span<const std::byte>> sends(processes);
  std::vector<std::span<std::byte>> recvs(processes);
  if (me == origin) {
    for (int q = 0; q < processes; ++q) {
      if (q == me) continue;
      parts[q].resize(positions[q].size() * row_bytes);
      recvs[q] = Bytes(parts[q]);
    }
  } else {
    parts[me].resize(positions[me].size() * row_bytes);
    for (size_t i = 0; i < positions[me].size(); ++i) {
      std::memcpy(parts[me].data() + i * row_bytes, rows.data() + positions[me][i] * row_bytes,
                  row_bytes);
    }
    sends[origin] = Bytes(std::as_const(parts[me]));
  }
  LOSSHEAD_RETURN_IF_ERROR(window.Exchange("embedding rows", sends, recvs));
  if (me != origin) return absl::OkStatus();
  for (int q = 0; q < processes; ++q) {
    if (q == me) continue;
    for (size_t i = 0; i < positions[q].size(); ++i) {
      std::memcpy(rows.data() + positions[q][i] * row_bytes, parts[q].data() + i * row_bytes,
                  row_bytes);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const StepOutcome>> Head::RunEmbeddingGrad(const MicroBatch& mb,
                                                                          StepStats* stats,
                                                                          int origin,
                                                                          StepTurn& turn) {
  const v1::StepHeader& h = mb.header;
  const bool here = origin == group().process();
  const bool keyed = here && !h.client_id().empty();
  // The same checks as at the home, on the same ids: they pass here too.
  LOSSHEAD_ASSIGN_OR_RETURN(const kernels::DType dtype,
                            FloatDType(h.hidden_dtype(), "hidden_dtype"));
  const int64_t n = h.num_tokens();
  const int64_t d = hidden_size();
  LOSSHEAD_ASSIGN_OR_RETURN(const std::vector<int64_t> ids,
                            ParseRowIds(h.target_dtype(), mb.targets, vocab_size(), n));
  const size_t row_bytes = static_cast<size_t>(d) * kernels::DTypeSize(dtype);
  // dE's rows ordered by id as PrepareEmbeddingGrad orders them (stable: an id's rows keep the
  // order they were sent in), so that each row of dW gains the same terms in the same order.
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&ids](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  std::vector<int64_t> sorted(n);
  PreparedEmbeddingGrad p;
  int64_t repeats = 0;
  for (int64_t i = 0; i < n; ++i) {
    sorted[i] = ids[order[i]];
    repeats = (i > 0 && sorted[i] == sorted[i - 1]) ? repeats + 1 : 1;
    p.max_repeats = std::max(p.max_repeats, repeats);
  }
  const absl::string_view rows = here ? mb.hidden_bytes() : absl::string_view();
  if (here && rows.size() != static_cast<size_t>(n) * row_bytes) {
    return absl::InternalError("an embedding gradient's rows changed size since its checks");
  }
  p.max_abs = !here || mb.hidden_max_abs.has_value()
                  ? mb.hidden_max_abs.value_or(0.0f)
                  : kernels::MaxAbs(dtype, rows.data(), static_cast<size_t>(n) * d);
  // Each process's run of the sorted rows: those of the rows it owns.
  ProcessWindow& window = *options_.process_window;
  const int processes = window.size();
  const int me = group().process();
  std::vector<int64_t> lo(processes), hi(processes);
  for (int q = 0; q < processes; ++q) {
    const kernels::Shard owned = ProcessRows(group(), q, processes);
    lo[q] = std::lower_bound(sorted.begin(), sorted.end(), owned.begin) - sorted.begin();
    hi[q] = std::lower_bound(sorted.begin(), sorted.end(), owned.end) - sorted.begin();
  }
  // Each part starts with the micro-batch's turn, and every other process sends its turn to every
  // process: each hears from every other even when it owns none of the rows, so that a process
  // that is gone fails the exchange on every survivor (nothing added or counted there, as when a
  // loss micro-batch's broadcast fails), and a part of another turn is never taken for this one.
  const uint64_t stamp = turn.turn();
  std::vector<std::string> parts(processes);
  for (int q = 0; q < processes; ++q) {
    if (!here && q != me) continue;
    parts[q].resize(sizeof(stamp) + (hi[q] - lo[q]) * row_bytes);
    if (!here) continue;
    std::memcpy(parts[q].data(), &stamp, sizeof(stamp));
    for (int64_t i = lo[q]; i < hi[q]; ++i) {
      std::memcpy(parts[q].data() + sizeof(stamp) + (i - lo[q]) * row_bytes,
                  rows.data() + order[i] * row_bytes, row_bytes);
    }
  }
  std::string own_stamp(sizeof(stamp), '\0');
  std::memcpy(own_stamp.data(), &stamp, sizeof(stamp));
  std::vector<std::string> stamps(processes, std::string(sizeof(stamp), '\0'));
  std::vector<std::span<const std::byte>> sends(processes);
  std::vector<std::span<std::byte>> recvs(processes);
  for (int q = 0; q < processes; ++q) {
    if (q == me) continue;
    sends[q] = here ? Bytes(std::as_const(parts[q])) : Bytes(std::as_const(own_stamp));
    recvs[q] = q == origin ? Bytes(parts[me]) : Bytes(stamps[q]);
  }

  // No slots to take; the run's gate orders the exchange and the adds among the group's runs.
  LOSSHEAD_RETURN_IF_ERROR(turn.AwaitTake());
  turn.Taken();
  LOSSHEAD_RETURN_IF_ERROR(turn.AwaitRun());
  if (absl::Status sent = window.Exchange("an embedding gradient's rows", sends, recvs);
      !sent.ok()) {
    // Nothing was added here, and the group is broken: its window can never be cut again.
    absl::Status broken = absl::UnavailableError(
        absl::StrCat("embedding gradient (client '", h.client_id(), "', sequence ", h.sequence(),
                     ") could not reach every process of the head's group: ", sent.message(),
                     "; the group is broken and must be rebuilt",
                     keyed ? "; this key keeps this answer and is never computed again" : ""));
    if (keyed) cache_.Fail(h.client_id(), h.sequence(), broken);
    return broken;
  }
  for (int q = 0; q < processes; ++q) {
    if (q == me) continue;
    uint64_t received;
    std::memcpy(&received, q == origin ? parts[me].data() : stamps[q].data(), sizeof(received));
    if (received != stamp) {
      return absl::InternalError(absl::StrCat("the embedding gradient of turn ", stamp,
                                              " met process ", q, " at turn ", received,
                                              ": the group's order is broken"));
    }
  }
  p.ids.assign(sorted.begin() + lo[me], sorted.begin() + hi[me]);
  p.values.resize(p.ids.size() * d);
  kernels::ToFloat(dtype, parts[me].data() + sizeof(stamp), p.values.data(), p.values.size());
  // Elsewhere than at its home the micro-batch has no key here: nothing of it is remembered.
  v1::StepHeader header = h;
  if (!keyed) header.clear_client_id();
  absl::StatusOr<std::shared_ptr<StepOutcome>> outcome =
      AddEmbeddingGrad(p, header, stats, nullptr);
  turn.Ran();
  if (!outcome.ok()) return outcome.status();
  if (keyed) cache_.Complete(h.client_id(), h.sequence(), *outcome);
  {
    absl::MutexLock state(&state_mu_);
    --pending_outcomes_;
  }
  return std::shared_ptr<const StepOutcome>(*std::move(outcome));
}

}  // namespace losshead::server
