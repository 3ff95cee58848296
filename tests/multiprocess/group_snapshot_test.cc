// Named snapshots of a head held by a process group (real losshead-server processes on loopback,
// CPU backend), replicated across 2 and 3 processes and sharded across 2 x 1 and 2 x 2 CPU
// devices, against a one-process server given the same micro-batches and applies (one device
// for the replicated head, as many as the group's shards for the sharded one):
// - a snapshot taken through a follower, training on (micro-batches, an apply), and a restore
//   through another process bring back, on every process, W, the weights version, each
//   process's window counters, the group's window (pulled) and each client's progress bit for bit
//   as they were at the snapshot; the optimizer state too: the next AdamW apply after the restore
//   steps W to the very bits the same apply gave at the snapshot, and equal to the one-process
//   reference's (bit for bit sharded, within fp32 rounding replicated, whose window is summed in
//   another order); every process lists the snapshot alike;
// - every refusal, through every process, with the same code everywhere and nothing changed:
//   a taken tag (ALREADY_EXISTS), an unknown head or snapshot (NOT_FOUND), a bad tag
//   (INVALID_ARGUMENT), a part missing on one process (NOT_FOUND for a restore and a delete,
//   naming it), a damaged part (DATA_LOSS), no --checkpoint_dir (FAILED_PRECONDITION);
// - a process stopped during a snapshot: the take fails and the group restarts with no such
//   snapshot listed anywhere (the leader's part written, no manifest), and the tag can be taken.
// And the final checkpoint set of a group stopping in order: every process stopped with SIGTERM
// at once takes one, which the restart comes back to; a follower stopped alone takes none.
#include <signal.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/server_process.h"
#include "tests/multiprocess/group_util.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {
namespace {

namespace fs = std::filesystem;

constexpr char kWide[] = "wide";
constexpr int64_t kWideVocab = 53;  // shards of unequal rows

struct Layout {
  int processes;
  int devices;  // per process (sharded only)
  bool sharded;
};

std::string LayoutName(const Layout& l) {
  return l.sharded ? absl::StrCat("Sharded", l.processes, "x", l.devices)
                   : absl::StrCat("Replicated", l.processes);
}

// The head under test: replicated across the group (one device on each process), or sharded
// across it (`across`) on every device of each; for the reference, sharded over `shards`.
v1::HeadSpec HeadSpecOf(const Layout& l, bool across) {
  v1::HeadSpec spec;
  spec.set_name(l.sharded ? kWide : kHead);
  spec.set_vocab_size(l.sharded ? kWideVocab : kVocab);
  spec.set_hidden_size(kHidden);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.3f);
  spec.mutable_init()->mutable_normal()->set_seed(17);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  if (l.sharded) {
    spec.mutable_placement()->set_kind(v1::PLACEMENT_SHARDED);
    spec.mutable_placement()->set_devices(across ? 0 : l.processes * l.devices);
    spec.mutable_placement()->set_across_processes(across);
  }
  return spec;
}

v1::ApplyOptimizerRequest AdamApply(const std::string& head, uint64_t step_key) {
  v1::ApplyOptimizerRequest request;
  request.set_head(head);
  request.set_client_id("optimizer");
  request.set_step_key(step_key);
  v1::OptimizerHyperParams& params = *request.mutable_params();
  params.set_lr(0.02);
  params.set_beta1(0.9);
  params.set_beta2(0.99);
  params.set_eps(1e-8);
  params.set_weight_decay(0.01);
  return request;
}

std::vector<std::string> Dirs(const std::string& name, int n) {
  std::vector<std::string> dirs;
  for (int p = 0; p < n; ++p) {
    dirs.push_back(absl::StrCat(::testing::TempDir(), "/gs_", getpid(), "_", name, "_p", p));
    fs::remove_all(dirs.back());
  }
  return dirs;
}

// Process p's flags: its directory (none when `dirs` is empty), no periodic sets, `devices` CPU
// devices.
std::function<std::vector<std::string>(int)> Flags(const std::vector<std::string>& dirs,
                                                   int devices = 1) {
  return [dirs, devices](int p) {
    std::vector<std::string> flags;
    if (!dirs.empty()) {
      flags = {"--checkpoint_dir=" + dirs[p], "--checkpoint_interval=0"};
    }
    if (devices > 1) {
      std::string list = "--devices=0";
      for (int d = 1; d < devices; ++d) absl::StrAppend(&list, ",", d);
      flags.push_back(list);
    }
    return flags;
  };
}

std::string PartPath(const std::string& dir, const std::string& tag, const std::string& head) {
  return absl::StrCat(dir, "/group_snapshots/", tag, "/", head, ".lhck");
}

// Round k: every client's k-th micro-batch at its home (and at `reference` when given).
void StepRound(Group& group, const Layout& l, int k, client::Client* reference) {
  const int n = static_cast<int>(group.clients.size());
  const std::string head = l.sharded ? kWide : kHead;
  for (int c = 0; c < kClients; ++c) {
    const std::string id = ClientId(c);
    const HostBatch batch = MakeBatch(kTokens, kHidden, l.sharded ? kWideVocab : kVocab,
                                      v1::DTYPE_FP32, 4000 + 53 * c + k, /*ignore_every=*/5);
    const client::Microbatch mb = ToMicrobatch(head, id, k + 1, batch);
    auto done = group.clients[Home(id, n)]->Step(mb);
    ASSERT_TRUE(done.ok()) << id << ": " << done.status();
    EXPECT_FALSE(done->replayed) << id;
    if (reference != nullptr) ASSERT_TRUE(reference->Step(mb).ok());
  }
}

// What a cut holds, as the clients of every process see it.
struct State {
  std::vector<client::Bytes> weights;  // by process
  std::vector<v1::HeadInfo> infos;     // by process: each one's window counters
  client::Bytes window;                // the group's pull (no reset)
  uint64_t window_microbatches = 0;
  std::vector<uint64_t> acknowledged;  // by client, at its home
};

State Capture(Group& group, const std::string& head) {
  const int n = static_cast<int>(group.clients.size());
  State s;
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(head);
    auto info = group.clients[p]->GetHead(head);
    EXPECT_TRUE(w.ok() && info.ok()) << "process " << p;
    if (!w.ok() || !info.ok()) return s;
    s.weights.push_back(w->data);
    s.infos.push_back(*info);
  }
  auto pulled = group.clients[n - 1]->PullGradient(head);
  EXPECT_TRUE(pulled.ok()) << pulled.status();
  if (pulled.ok()) {
    s.window = pulled->data;
    s.window_microbatches = pulled->summary.microbatch_count();
  }
  for (int c = 0; c < kClients; ++c) {
    const std::string id = ClientId(c);
    auto progress = group.clients[Home(id, n)]->GetClientProgress(head, id);
    EXPECT_TRUE(progress.ok()) << progress.status();
    s.acknowledged.push_back(progress.ok() ? progress->acknowledged_sequence() : 0);
  }
  return s;
}

void ExpectSameState(const State& got, const State& want) {
  ASSERT_EQ(got.weights.size(), want.weights.size());
  for (size_t p = 0; p < want.weights.size(); ++p) {
    EXPECT_TRUE(got.weights[p] == want.weights[p]) << "process " << p << ": W is not the cut's";
    const v1::HeadInfo& g = got.infos[p];
    const v1::HeadInfo& w = want.infos[p];
    EXPECT_EQ(g.weights_version(), w.weights_version()) << p;
    EXPECT_EQ(g.optimizer_step(), w.optimizer_step()) << p;
    EXPECT_EQ(g.tokens_since_pull(), w.tokens_since_pull()) << p;
    EXPECT_EQ(g.microbatches_since_pull(), w.microbatches_since_pull()) << p;
    EXPECT_EQ(g.tokens_total(), w.tokens_total()) << p;
    EXPECT_EQ(g.microbatches_total(), w.microbatches_total()) << p;
  }
  EXPECT_TRUE(got.window == want.window) << "the group's window is not the cut's";
  EXPECT_EQ(got.window_microbatches, want.window_microbatches);
  EXPECT_EQ(got.acknowledged, want.acknowledged);
}

// Every process lists exactly `tags` for `head`, alike.
void ExpectListed(Group& group, const std::string& head, const std::vector<std::string>& tags) {
  std::vector<v1::SnapshotInfo> first;
  for (size_t p = 0; p < group.clients.size(); ++p) {
    auto listed = group.clients[p]->ListSnapshots(head);
    ASSERT_TRUE(listed.ok()) << "process " << p << ": " << listed.status();
    std::vector<std::string> got;
    for (const v1::SnapshotInfo& info : *listed) got.push_back(info.tag());
    EXPECT_EQ(got, tags) << "process " << p;
    if (p == 0) {
      first = *listed;
    } else if (listed->size() == first.size()) {
      for (size_t i = 0; i < first.size(); ++i) {
        EXPECT_EQ((*listed)[i].SerializeAsString(), first[i].SerializeAsString()) << p;
      }
    }
  }
}

void PrintTo(const Layout& l, std::ostream* os) { *os << LayoutName(l); }

class GroupSnapshotTest : public ::testing::TestWithParam<Layout> {};

TEST_P(GroupSnapshotTest, ARestoreThroughAnotherProcessBringsEveryProcessBackToTheSnapshot) {
  const Layout l = GetParam();
  const int n = l.processes;
  const std::string name = absl::StrCat("snap", LayoutName(l));
  const std::string head = l.sharded ? kWide : kHead;
  const std::vector<std::string> dirs = Dirs(name, n);
  Group group(GroupAddresses(n), name, Flags(dirs, l.sharded ? l.devices : 1));
  ASSERT_TRUE(group.ok());
  std::vector<std::string> reference_flags;
  if (l.sharded) reference_flags = Flags({}, n * l.devices)(0);
  Single reference(name + "_ref", reference_flags);
  ASSERT_NE(reference.client, nullptr);
  ASSERT_TRUE(group.clients[n - 1]->CreateHead(HeadSpecOf(l, true)).ok());
  ASSERT_TRUE(reference.client->CreateHead(HeadSpecOf(l, false)).ok());

  // To the snapshot: a round, an apply, another round left in the window.
  StepRound(group, l, 0, reference.client.get());
  ASSERT_TRUE(group.clients[0]->ApplyOptimizer(AdamApply(head, 1)).ok());
  ASSERT_TRUE(reference.client->ApplyOptimizer(AdamApply(head, 1)).ok());
  StepRound(group, l, 1, reference.client.get());
  const State cut = Capture(group, head);
  ASSERT_EQ(cut.window_microbatches, static_cast<uint64_t>(kClients));

  // Taken through a follower: every process holds its part, every process lists it.
  auto taken = group.clients[n - 1]->SnapshotHead(head, "s1");
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(taken->tag(), "s1");
  EXPECT_EQ(taken->head(), head);
  EXPECT_EQ(taken->weights_version(), cut.infos[0].weights_version());
  EXPECT_EQ(taken->optimizer_step(), 1u);
  uint64_t part_bytes = 0;
  for (int p = 0; p < n; ++p) {
    std::error_code ec;
    const uint64_t bytes = fs::file_size(PartPath(dirs[p], "s1", head), ec);
    EXPECT_FALSE(ec) << "process " << p << " holds no part";
    part_bytes += bytes;
  }
  EXPECT_EQ(taken->bytes(), part_bytes);
  ExpectListed(group, head, {"s1"});

  // The next apply at the snapshot, as the group takes it: what the restored state must repeat.
  auto at_cut = group.clients[0]->ApplyOptimizer(AdamApply(head, 2));
  ASSERT_TRUE(at_cut.ok()) << at_cut.status();
  std::vector<client::Bytes> stepped;
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(head);
    ASSERT_TRUE(w.ok()) << w.status();
    stepped.push_back(w->data);
  }

  // Training goes on past it.
  StepRound(group, l, 2, nullptr);
  ASSERT_TRUE(group.clients[n - 1]->ApplyOptimizer(AdamApply(head, 3)).ok());
  StepRound(group, l, 3, nullptr);
  ASSERT_FALSE(Capture(group, head).weights[0] == cut.weights[0]);

  // Restored through another process than the one that took it: the cut on every process.
  const int via = n == 2 ? 0 : 1;
  auto restored = group.clients[via]->RestoreHead(head, "s1");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->weights_version(), cut.infos[0].weights_version());
  EXPECT_EQ(restored->microbatches_since_pull(), cut.infos[via].microbatches_since_pull());
  ExpectSameState(Capture(group, head), cut);
  ExpectListed(group, head, {"s1"});

  // The optimizer state is the snapshot's: apply 2 (after the snapshot, so not in its apply log)
  // steps W to the bits it gave at the snapshot, on every process...
  auto again = group.clients[n - 1]->ApplyOptimizer(AdamApply(head, 2));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->replayed());
  EXPECT_EQ(again->optimizer_step(), at_cut->optimizer_step());
  EXPECT_EQ(again->weights_version(), at_cut->weights_version());
  EXPECT_EQ(again->head_grad_norm(), at_cut->head_grad_norm());
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(head);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(w->data == stepped[p]) << "process " << p << " stepped W otherwise";
  }
  // ... and as the one-process reference's.
  auto want = reference.client->ApplyOptimizer(AdamApply(head, 2));
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(again->optimizer_step(), want->optimizer_step());
  EXPECT_EQ(again->weights_version(), want->weights_version());
  auto want_w = reference.client->DownloadWeights(head);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  if (l.sharded) {
    EXPECT_EQ(again->head_grad_norm(), want->head_grad_norm());
    EXPECT_TRUE(stepped[0] == want_w->data) << "W is not the one-process sharded head's";
  } else {
    const std::vector<float> want_floats = Floats(want_w->data);
    EXPECT_TRUE(AllClose(Floats(stepped[0]),
                         std::vector<double>(want_floats.begin(), want_floats.end()), 1e-5));
  }
  // Micro-batches sent after the snapshot count anew.
  StepRound(group, l, 2, nullptr);

  // Deleted through a follower: listed nowhere, its parts gone everywhere.
  ASSERT_TRUE(group.clients[n - 1]->DeleteSnapshot(head, "s1").ok());
  ExpectListed(group, head, {});
  for (int p = 0; p < n; ++p) {
    EXPECT_FALSE(fs::exists(PartPath(dirs[p], "s1", head))) << "process " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, GroupSnapshotTest,
                         ::testing::Values(Layout{2, 1, false}, Layout{3, 1, false},
                                           Layout{2, 1, true}, Layout{2, 2, true}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return LayoutName(info.param);
                         });

// Every process answers `call(p)` with `code`.
void ExpectEverywhere(int n, absl::StatusCode code, const std::string& what,
                      const std::function<absl::Status(int)>& call) {
  for (int p = 0; p < n; ++p) {
    const absl::Status s = call(p);
    EXPECT_EQ(s.code(), code) << what << " through process " << p << ": " << s;
  }
}

TEST(GroupSnapshotRefusalsTest, EveryRefusalIsEveryProcesssAndChangesNothing) {
  const int n = 3;
  const std::vector<std::string> dirs = Dirs("refusals", n);
  Group group(GroupAddresses(n), "snaprefusals", Flags(dirs));
  ASSERT_TRUE(group.ok());
  v1::HeadSpec spec = Spec();
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  ASSERT_TRUE(group.clients[1]->CreateHead(spec).ok());
  const Layout l{n, 1, false};
  StepRound(group, l, 0, nullptr);
  ASSERT_TRUE(group.clients[2]->SnapshotHead(kHead, "s1").ok());
  ASSERT_TRUE(group.clients[1]->SnapshotHead(kHead, "s2").ok());
  StepRound(group, l, 1, nullptr);
  const State before = Capture(group, kHead);
  auto c = [&](int p) -> client::Client& { return *group.clients[p]; };

  ExpectEverywhere(n, absl::StatusCode::kAlreadyExists, "a taken tag",
                   [&](int p) { return c(p).SnapshotHead(kHead, "s1").status(); });
  ExpectEverywhere(n, absl::StatusCode::kNotFound, "a take of an unknown head",
                   [&](int p) { return c(p).SnapshotHead("nohead", "s3").status(); });
  ExpectEverywhere(n, absl::StatusCode::kInvalidArgument, "a bad tag",
                   [&](int p) { return c(p).SnapshotHead(kHead, ".hidden").status(); });
  ExpectEverywhere(n, absl::StatusCode::kInvalidArgument, "a restore of a bad tag",
                   [&](int p) { return c(p).RestoreHead(kHead, "a/b").status(); });
  ExpectEverywhere(n, absl::StatusCode::kNotFound, "a restore of an unknown snapshot",
                   [&](int p) { return c(p).RestoreHead(kHead, "nosuch").status(); });
  ExpectEverywhere(n, absl::StatusCode::kNotFound, "a delete of an unknown snapshot",
                   [&](int p) { return c(p).DeleteSnapshot(kHead, "nosuch"); });
  ExpectEverywhere(n, absl::StatusCode::kInvalidArgument, "a listing of a bad head name",
                   [&](int p) { return c(p).ListSnapshots("bad name").status(); });

  // A part missing on one process: a restore or delete of it is refused by every process,
  // naming that process, and nothing is removed anywhere.
  ASSERT_TRUE(fs::remove(PartPath(dirs[2], "s1", kHead)));
  for (int p = 0; p < n; ++p) {
    const absl::Status restore = c(p).RestoreHead(kHead, "s1").status();
    EXPECT_EQ(restore.code(), absl::StatusCode::kNotFound) << p << ": " << restore;
    EXPECT_NE(restore.message().find("process 2 "), absl::string_view::npos) << restore;
    const absl::Status removed = c(p).DeleteSnapshot(kHead, "s1");
    EXPECT_EQ(removed.code(), absl::StatusCode::kNotFound) << p << ": " << removed;
    EXPECT_NE(removed.message().find("process 2 "), absl::string_view::npos) << removed;
  }
  for (int p = 0; p < 2; ++p) EXPECT_TRUE(fs::exists(PartPath(dirs[p], "s1", kHead))) << p;

  // A damaged part on one process: DATA_LOSS on every process.
  {
    std::fstream part(PartPath(dirs[1], "s2", kHead),
                      std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(part.good());
    part.seekp(-9, std::ios::end);
    part.put('\x5a');
  }
  ExpectEverywhere(n, absl::StatusCode::kDataLoss, "a restore of a damaged part",
                   [&](int p) { return c(p).RestoreHead(kHead, "s2").status(); });

  // Nothing changed anywhere: the state, and both snapshots still listed.
  ExpectSameState(Capture(group, kHead), before);
  ExpectListed(group, kHead, {"s1", "s2"});

  // Without checkpoints there are no snapshots: FAILED_PRECONDITION everywhere.
  Group bare(GroupAddresses(2), "snapbare", Flags({}));
  ASSERT_TRUE(bare.ok());
  ASSERT_TRUE(bare.clients[1]->CreateHead(spec).ok());
  ExpectEverywhere(2, absl::StatusCode::kFailedPrecondition, "a take without checkpoints",
                   [&](int p) { return bare.clients[p]->SnapshotHead(kHead, "s1").status(); });
  ExpectEverywhere(2, absl::StatusCode::kFailedPrecondition, "a listing without checkpoints",
                   [&](int p) { return bare.clients[p]->ListSnapshots(kHead).status(); });
  ExpectEverywhere(2, absl::StatusCode::kFailedPrecondition, "a restore without checkpoints",
                   [&](int p) { return bare.clients[p]->RestoreHead(kHead, "s1").status(); });
}

TEST(GroupSnapshotFailureTest, AProcessStoppedDuringASnapshotLeavesNoHalfSnapshotListed) {
  const int n = 2;
  const std::vector<std::string> dirs = Dirs("stopped", n);
  const GroupAddresses at(n);
  auto group = std::make_unique<Group>(at, "snapstopped_a", Flags(dirs));
  ASSERT_TRUE(group->ok());
  v1::HeadSpec spec = Spec();
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  ASSERT_TRUE(group->clients[0]->CreateHead(spec).ok());
  const Layout l{n, 1, false};
  StepRound(*group, l, 0, nullptr);
  ASSERT_TRUE(group->clients[1]->SnapshotHead(kHead, "whole").ok());
  ASSERT_TRUE(group->clients[0]->Checkpoint().ok());  // the head survives the restart
  const State whole = Capture(*group, kHead);
  StepRound(*group, l, 1, nullptr);

  // The follower stops; a snapshot through the leader writes the leader's part and waits for
  // the follower, until the leader's watch finds its group broken and ends it.
  group->processes[1]->Signal(SIGSTOP);
  auto half = group->clients[0]->SnapshotHead(kHead, "half");
  ASSERT_FALSE(half.ok());
  EXPECT_EQ(half.status().code(), absl::StatusCode::kUnavailable) << half.status();
  const std::optional<int> code = group->processes[0]->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, kExitGroupBroken);
  EXPECT_TRUE(fs::exists(PartPath(dirs[0], "half", kHead))) << "the leader never wrote its part";
  group->processes[1]->Kill();
  group.reset();

  // The group restarted: only the whole snapshot is listed anywhere, the half one cannot be
  // restored, and its tag can be taken again.
  group = std::make_unique<Group>(at, "snapstopped_b", Flags(dirs));
  ASSERT_TRUE(group->ok());
  ExpectListed(*group, kHead, {"whole"});
  ExpectEverywhere(n, absl::StatusCode::kNotFound, "a restore of the half snapshot",
                   [&](int p) { return group->clients[p]->RestoreHead(kHead, "half").status(); });
  auto restored = group->clients[1]->RestoreHead(kHead, "whole");
  ASSERT_TRUE(restored.ok()) << restored.status();
  ExpectSameState(Capture(*group, kHead), whole);
  ASSERT_TRUE(group->clients[1]->SnapshotHead(kHead, "half").ok());
  ExpectListed(*group, kHead, {"half", "whole"});
}

// Every process of `group` stopped with SIGTERM at once (each waits for the others to take the
// final set): their exit codes and logs, by rank.
std::vector<std::pair<int, std::string>> StopAll(Group& group, const std::string& name) {
  std::vector<std::pair<int, std::string>> out;
  for (auto& process : group.processes) process->Signal(SIGTERM);
  for (size_t p = 0; p < group.processes.size(); ++p) {
    const std::optional<int> code = group.processes[p]->WaitForExit(absl::Seconds(60));
    out.emplace_back(code.value_or(-1), ReadText(LogPath(absl::StrCat(name, "_p", p))));
  }
  return out;
}

class GroupShutdownTest : public ::testing::TestWithParam<int> {};

TEST_P(GroupShutdownTest, StoppingEveryProcessTakesAFinalSetARestartComesBackTo) {
  const int n = GetParam();
  const std::string name = absl::StrCat("final", n);
  const std::vector<std::string> dirs = Dirs(name, n);
  const GroupAddresses at(n);
  auto group = std::make_unique<Group>(at, name + "_a", Flags(dirs));
  ASSERT_TRUE(group->ok());
  const Layout l{n, 1, false};
  ASSERT_TRUE(group->clients[n - 1]->CreateHead(HeadSpecOf(l, true)).ok());
  // Trained, never checkpointed: everything answered is only in the processes' memory.
  StepRound(*group, l, 0, nullptr);
  ASSERT_TRUE(group->clients[0]->ApplyOptimizer(AdamApply(kHead, 1)).ok());
  StepRound(*group, l, 1, nullptr);
  const State before = Capture(*group, kHead);

  // Every process stopped in order: each exits 0, the set taken once all were stopping.
  const auto stopped = StopAll(*group, name + "_a");
  for (const auto& [code, log] : stopped) {
    EXPECT_EQ(code, 0) << log;
    EXPECT_NE(log.find("final checkpoint set taken on every process"), std::string::npos) << log;
  }
  group.reset();

  // The restart comes back to it: the state at the stop, every acknowledged sequence persisted.
  group = std::make_unique<Group>(at, name + "_b", Flags(dirs));
  ASSERT_TRUE(group->ok());
  for (int p = 0; p < n; ++p) {
    const std::string log = ReadText(LogPath(absl::StrCat(name, "_b_p", p)));
    EXPECT_NE(log.find("checkpoint set 1 restored on every process"), std::string::npos) << log;
  }
  ExpectSameState(Capture(*group, kHead), before);
  for (int c = 0; c < kClients; ++c) {
    const std::string id = ClientId(c);
    auto progress = group->clients[Home(id, n)]->GetClientProgress(kHead, id);
    ASSERT_TRUE(progress.ok()) << progress.status();
    EXPECT_EQ(progress->persisted_sequence(), 2u) << id;
  }
}

INSTANTIATE_TEST_SUITE_P(Processes, GroupShutdownTest, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat(info.param, "Processes");
                         });

TEST(GroupShutdownAloneTest, AFollowerStoppingAloneLeavesWithoutASetItsGroupRestartsFromTheLast) {
  const int n = 2;
  const std::vector<std::string> dirs = Dirs("alone", n);
  const GroupAddresses at(n);
  auto flags = [&](int p) {
    std::vector<std::string> f = Flags(dirs)(p);
    f.push_back("--drain_timeout=2s");
    return f;
  };
  auto group = std::make_unique<Group>(at, "alone_a", flags);
  ASSERT_TRUE(group->ok());
  const Layout l{n, 1, false};
  ASSERT_TRUE(group->clients[0]->CreateHead(HeadSpecOf(l, true)).ok());
  StepRound(*group, l, 0, nullptr);
  ASSERT_TRUE(group->clients[1]->Checkpoint().ok());
  const State at_set = Capture(*group, kHead);
  StepRound(*group, l, 1, nullptr);

  // The follower alone: it waits for the others until its drain deadline, then leaves with no
  // set; the leader's watch finds its group broken.
  group->processes[1]->Signal(SIGTERM);
  const std::optional<int> follower = group->processes[1]->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(follower.has_value());
  EXPECT_EQ(*follower, 0);
  const std::string log = ReadText(LogPath("alone_a_p1"));
  EXPECT_NE(log.find("no final checkpoint set: DEADLINE_EXCEEDED"), std::string::npos) << log;
  const std::optional<int> leader = group->processes[0]->WaitForExit(absl::Seconds(30));
  ASSERT_TRUE(leader.has_value());
  EXPECT_EQ(*leader, kExitGroupBroken);
  group.reset();

  // The restart comes back to the last complete set, the later round lost alike everywhere.
  group = std::make_unique<Group>(at, "alone_b", flags);
  ASSERT_TRUE(group->ok());
  ExpectSameState(Capture(*group, kHead), at_set);
}

}  // namespace
}  // namespace losshead::testing
