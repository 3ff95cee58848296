// Checkpoints of a head replicated across 2 and 3 real server processes on loopback (CPU backend),
// each with its own --checkpoint_dir (docs/multi-process.md, "Checkpoints across processes"):
// - a checkpoint through any process is one set: every process's part, the leader's manifest,
//   the followers' COMMITTED markers; GetClientProgress says persisted once the set is complete;
// - after more training and one process killed (kill -9), every survivor exits (code 3, the
//   reason on stderr); the whole set restarted restores the checkpointed cut bit for bit: W on
//   every process, each process's window (and the group's pull), every client's progress, the
//   apply log; the optimizer's state equals a one-process reference's, through a further apply
//   (within fp32 rounding: the reference sums its window in another order);
// - a set without its manifest is not restored (the previous one is, and the newer parts go);
//   a follower told of a set the leader has no manifest for fails the start;
// - a missing part fails every process's start (NOT_FOUND), a damaged one too (DATA_LOSS), with
//   the process and the reason; put right, the start restores;
// - the leader's periodic sets are pruned to the newest kKeepSets on every process;
// - the error paths: an unknown head, named snapshots, no --checkpoint_dir, a --checkpoint_dir on
//   some processes only, tokens with periodic checkpoints.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/server_process.h"
#include "tests/multiprocess/group_util.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {
namespace {

namespace fs = std::filesystem;

constexpr int kKeepSets = 3;  // server/durability/group_checkpoint.h

// A fresh checkpoint directory per process.
std::vector<std::string> Dirs(const std::string& name, int n) {
  std::vector<std::string> dirs;
  for (int p = 0; p < n; ++p) {
    dirs.push_back(absl::StrCat(::testing::TempDir(), "/gc_", getpid(), "_", name, "_p", p));
    fs::remove_all(dirs.back());
  }
  return dirs;
}

std::function<std::vector<std::string>(int)> CheckpointFlags(const std::vector<std::string>& dirs,
                                                             std::string interval = "0") {
  // A process stopped alone waits for the others (the final set of a group stopping together)
  // until its drain deadline: these tests stop them one after another.
  return [dirs, interval](int p) {
    return std::vector<std::string>{"--checkpoint_dir=" + dirs[p],
                                    "--checkpoint_interval=" + interval, "--drain_timeout=2s"};
  };
}

std::string SetDir(const std::string& dir, uint64_t cut) {
  return absl::StrFormat("%s/sets/%020d", dir, cut);
}

// The sets in a process's directory, by cut, with the files each holds.
std::map<uint64_t, std::set<std::string>> Sets(const std::string& dir) {
  std::map<uint64_t, std::set<std::string>> sets;
  std::error_code ec;
  for (const auto& set : fs::directory_iterator(dir + "/sets", ec)) {
    std::set<std::string>& files = sets[std::stoull(set.path().filename().string())];
    for (const auto& f : fs::directory_iterator(set.path())) {
      files.insert(f.path().filename().string());
    }
  }
  return sets;
}

v1::HeadSpec AdamSpec() {
  v1::HeadSpec spec = Spec();
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  return spec;
}

v1::ApplyOptimizerRequest AdamApply(uint64_t step_key) {
  v1::ApplyOptimizerRequest request = Apply(step_key);
  v1::OptimizerHyperParams& params = *request.mutable_params();
  params.set_lr(0.01);
  params.set_beta1(0.9);
  params.set_beta2(0.99);
  params.set_eps(1e-8);
  params.set_weight_decay(0.01);
  return request;
}

// Round k of micro-batches: every client's k-th, at its home (and at `reference` when given).
void StepRound(Group& group, int k, client::Client* reference = nullptr) {
  const int n = static_cast<int>(group.clients.size());
  for (int c = 0; c < kClients; ++c) {
    const std::string id = ClientId(c);
    const HostBatch batch = Batch(c, k);
    const client::Microbatch mb = ToMicrobatch(kHead, id, k + 1, batch);
    auto done = group.clients[Home(id, n)]->Step(mb);
    ASSERT_TRUE(done.ok()) << id << ": " << done.status();
    EXPECT_FALSE(done->replayed);
    if (reference != nullptr) ASSERT_TRUE(reference->Step(mb).ok());
  }
}

// What a cut holds, as the clients see it.
struct State {
  std::vector<client::Bytes> weights;  // by process
  uint64_t weights_version = 0;
  std::vector<v1::HeadInfo> infos;  // by process: each one's window counters
  client::Bytes window;             // the group's pull (no reset)
  uint64_t window_tokens = 0;
  uint64_t window_microbatches = 0;
  std::map<std::string, v1::ClientProgress> progress;  // at each client's home
};

State Capture(Group& group) {
  const int n = static_cast<int>(group.clients.size());
  State s;
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(kHead);
    EXPECT_TRUE(w.ok()) << w.status();
    if (!w.ok()) return s;
    s.weights.push_back(w->data);
    s.weights_version = w->weights_version;
    auto info = group.clients[p]->GetHead(kHead);
    EXPECT_TRUE(info.ok()) << info.status();
    s.infos.push_back(info.value_or(v1::HeadInfo()));
  }
  auto pulled = group.clients[0]->PullGradient(kHead);
  EXPECT_TRUE(pulled.ok()) << pulled.status();
  if (pulled.ok()) {
    s.window = pulled->data;
    s.window_tokens = pulled->summary.token_count();
    s.window_microbatches = pulled->summary.microbatch_count();
  }
  for (int c = 0; c < kClients; ++c) {
    const std::string id = ClientId(c);
    auto progress = group.clients[Home(id, n)]->GetClientProgress(kHead, id);
    EXPECT_TRUE(progress.ok()) << progress.status();
    s.progress[id] = progress.value_or(v1::ClientProgress());
  }
  return s;
}

void ExpectSameState(const State& got, const State& want) {
  ASSERT_EQ(got.weights.size(), want.weights.size());
  EXPECT_EQ(got.weights_version, want.weights_version);
  for (size_t p = 0; p < want.weights.size(); ++p) {
    EXPECT_TRUE(got.weights[p] == want.weights[p]) << "process " << p << ": W is not the cut's";
    EXPECT_EQ(got.infos[p].tokens_since_pull(), want.infos[p].tokens_since_pull()) << p;
    EXPECT_EQ(got.infos[p].microbatches_since_pull(), want.infos[p].microbatches_since_pull()) << p;
    EXPECT_EQ(got.infos[p].tokens_total(), want.infos[p].tokens_total()) << p;
    EXPECT_EQ(got.infos[p].microbatches_total(), want.infos[p].microbatches_total()) << p;
    EXPECT_EQ(got.infos[p].optimizer_step(), want.infos[p].optimizer_step()) << p;
  }
  EXPECT_TRUE(got.window == want.window) << "the group's window is not the cut's";
  EXPECT_EQ(got.window_tokens, want.window_tokens);
  EXPECT_EQ(got.window_microbatches, want.window_microbatches);
  for (const auto& [id, want_progress] : want.progress) {
    const v1::ClientProgress& p = got.progress.at(id);
    EXPECT_EQ(p.acknowledged_sequence(), want_progress.acknowledged_sequence()) << id;
    // Restored: everything acknowledged is persisted.
    EXPECT_EQ(p.persisted_sequence(), want_progress.acknowledged_sequence()) << id;
  }
}

// Stops every process of `group` (SIGTERM, or reaps it if it already exited).
void StopAll(Group& group) {
  for (auto& process : group.processes) {
    if (process != nullptr) process->Terminate();
  }
}

class GroupCheckpointTest : public ::testing::TestWithParam<int> {};

TEST_P(GroupCheckpointTest, AKilledProcessAndARestartOfTheSetComeBackToTheCheckpointedCut) {
  const int n = GetParam();
  const std::string name = absl::StrCat("cut", n);
  const std::vector<std::string> dirs = Dirs(name, n);
  const GroupAddresses at(n);
  auto group = std::make_unique<Group>(at, name + "_a", CheckpointFlags(dirs));
  ASSERT_TRUE(group->ok());
  ASSERT_TRUE(group->clients[n - 1]->CreateHead(AdamSpec()).ok());
  Single reference(name + "_ref");
  ASSERT_NE(reference.client, nullptr);
  ASSERT_TRUE(reference.client->CreateHead(AdamSpec()).ok());

  // Train to the cut: a round, an apply, another round left in the window.
  StepRound(*group, 0, reference.client.get());
  ASSERT_TRUE(group->clients[0]->ApplyOptimizer(AdamApply(1)).ok());
  ASSERT_TRUE(reference.client->ApplyOptimizer(AdamApply(1)).ok());
  StepRound(*group, 1, reference.client.get());

  // The checkpoint, through the last follower: one set, every process's part.
  auto written = group->clients[n - 1]->Checkpoint();
  ASSERT_TRUE(written.ok()) << written.status();
  ASSERT_EQ(written->heads_size(), 1);
  EXPECT_EQ(written->heads(0).head(), kHead);
  EXPECT_EQ(written->heads(0).microbatches_since_pull(), static_cast<uint64_t>(kClients));
  ASSERT_EQ(written->heads(0).clients_size(), kClients) << "not every process's clients";
  for (const v1::ClientProgress& c : written->heads(0).clients()) {
    EXPECT_EQ(c.persisted_sequence(), 2u) << c.client_id();
  }
  for (int p = 0; p < n; ++p) {
    const auto sets = Sets(dirs[p]);
    ASSERT_EQ(sets.size(), 1u) << "process " << p;
    ASSERT_EQ(sets.begin()->first, 1u);
    EXPECT_TRUE(sets.begin()->second.contains(absl::StrCat(kHead, ".lhck"))) << p;
    EXPECT_EQ(sets.begin()->second.contains("MANIFEST"), p == 0) << p;
    EXPECT_EQ(sets.begin()->second.contains("COMMITTED"), p != 0) << p;
  }
  const State cut = Capture(*group);
  ASSERT_EQ(cut.window_microbatches, static_cast<uint64_t>(kClients));
  for (const auto& [id, progress] : cut.progress) {
    EXPECT_EQ(progress.acknowledged_sequence(), 2u) << id;
    EXPECT_EQ(progress.persisted_sequence(), 2u) << id;
  }

  // More training after the cut, then one process killed mid-training.
  StepRound(*group, 2);
  auto later = group->clients[0]->ApplyOptimizer(AdamApply(2));
  ASSERT_TRUE(later.ok()) << later.status();
  StepRound(*group, 3);
  const int victim = n - 1;
  group->processes[victim]->Kill();
  // A checkpoint now is not taken (no manifest): the group cannot cut.
  auto refused = group->clients[0]->Checkpoint();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  // Every survivor exits, saying why.
  for (int p = 0; p < n; ++p) {
    if (p == victim) continue;
    const std::optional<int> code = group->processes[p]->WaitForExit(absl::Seconds(20));
    ASSERT_TRUE(code.has_value()) << "process " << p << " still runs with its group broken";
    EXPECT_EQ(*code, kExitGroupBroken) << "process " << p;
    const std::string log = ReadText(LogPath(absl::StrCat(name, "_a_p", p)));
    EXPECT_NE(log.find("the process group is broken"), std::string::npos) << log;
  }
  group.reset();

  // The whole set restarted, as a supervisor would: the cut, bit for bit, on every process.
  group = std::make_unique<Group>(at, name + "_b", CheckpointFlags(dirs));
  ASSERT_TRUE(group->ok());
  for (int p = 0; p < n; ++p) {
    const std::string log = ReadText(LogPath(absl::StrCat(name, "_b_p", p)));
    EXPECT_NE(log.find("checkpoint set 1 restored on every process"), std::string::npos) << log;
    const auto sets = Sets(dirs[p]);
    EXPECT_EQ(sets.size(), 1u) << "process " << p << " kept the set that never completed";
  }
  ExpectSameState(Capture(*group), cut);

  // The apply log is the cut's: apply 1 is remembered, apply 2 (after the cut) is not.
  auto again = group->clients[n - 1]->ApplyOptimizer(AdamApply(1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->replayed());
  // The optimizer's state is the cut's: a further apply steps W as the reference's does.
  auto applied = group->clients[n - 1]->ApplyOptimizer(AdamApply(2));
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_FALSE(applied->replayed());
  auto want = reference.client->ApplyOptimizer(AdamApply(2));
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(applied->optimizer_step(), want->optimizer_step());
  EXPECT_EQ(applied->weights_version(), want->weights_version());
  EXPECT_EQ(applied->window().microbatch_count(), want->window().microbatch_count());
  auto want_w = reference.client->DownloadWeights(kHead);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  const std::vector<float> want_floats = Floats(want_w->data);
  const std::vector<double> want_wide(want_floats.begin(), want_floats.end());
  auto w0 = group->clients[0]->DownloadWeights(kHead);
  ASSERT_TRUE(w0.ok()) << w0.status();
  EXPECT_TRUE(AllClose(Floats(w0->data), want_wide, 1e-5));
  for (int p = 1; p < n; ++p) {
    auto w = group->clients[p]->DownloadWeights(kHead);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(w->data == w0->data) << "process " << p << " holds another W after the apply";
  }
  // What came after the cut was lost on every process alike: resent, it counts anew.
  const std::string id = ClientId(0);
  const HostBatch batch = Batch(0, 2);
  auto resent = group->clients[Home(id, n)]->Step(ToMicrobatch(kHead, id, 3, batch));
  ASSERT_TRUE(resent.ok()) << resent.status();
  EXPECT_FALSE(resent->replayed);
}

INSTANTIATE_TEST_SUITE_P(Processes, GroupCheckpointTest, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat(info.param, "Processes");
                         });

TEST(GroupCheckpointSetsTest, ASetWithoutItsManifestIsNotRestoredThePreviousOneIs) {
  constexpr int n = 2;
  const std::vector<std::string> dirs = Dirs("nomanifest", n);
  const GroupAddresses at(n);
  auto group = std::make_unique<Group>(at, "nomanifest_a", CheckpointFlags(dirs));
  ASSERT_TRUE(group->ok());
  ASSERT_TRUE(group->clients[0]->CreateHead(AdamSpec()).ok());
  StepRound(*group, 0);
  ASSERT_TRUE(group->clients[1]->Checkpoint().ok());
  const State first = Capture(*group);
  ASSERT_TRUE(group->clients[1]->ApplyOptimizer(AdamApply(1)).ok());
  StepRound(*group, 1);
  ASSERT_TRUE(group->clients[0]->Checkpoint().ok());
  StopAll(*group);
  group.reset();
  ASSERT_TRUE(fs::exists(SetDir(dirs[1], 2) + "/COMMITTED"));
  // The leader's manifest of set 2 gone while the follower was told it was written: the leader's
  // directory is not the one it wrote, and no process starts from an older state.
  ASSERT_TRUE(fs::remove(SetDir(dirs[0], 2) + "/MANIFEST"));
  for (const auto& [code, log] : StartExpectingExit(at, "nomanifest_b", CheckpointFlags(dirs))) {
    EXPECT_EQ(code, 1) << log;
    EXPECT_NE(log.find("FAILED_PRECONDITION: checkpoint set 1 cannot be restored: process 1: "
                       "process 1 holds set 2, complete, newer than the newest set the leader "
                       "has a manifest for (1)"),
              std::string::npos)
        << log;
  }
  // As if the leader had died before writing the manifest (so the follower never heard of it):
  // set 2 does not exist, whatever parts were written; set 1 is restored.
  ASSERT_TRUE(fs::remove(SetDir(dirs[1], 2) + "/COMMITTED"));
  group = std::make_unique<Group>(at, "nomanifest_c", CheckpointFlags(dirs));
  ASSERT_TRUE(group->ok());
  ExpectSameState(Capture(*group), first);
  for (int p = 0; p < n; ++p) {
    const auto sets = Sets(dirs[p]);
    ASSERT_EQ(sets.size(), 1u) << "process " << p;
    EXPECT_EQ(sets.begin()->first, 1u) << "process " << p;
  }
  // Numbering goes on from the restored set.
  ASSERT_TRUE(group->clients[1]->Checkpoint().ok());
  EXPECT_TRUE(fs::exists(SetDir(dirs[0], 2) + "/MANIFEST"));
  EXPECT_TRUE(fs::exists(SetDir(dirs[1], 2) + "/COMMITTED"));
}

TEST(GroupCheckpointSetsTest, AMissingOrDamagedPartFailsEveryProcessesStartWithTheReason) {
  constexpr int n = 3;
  const std::vector<std::string> dirs = Dirs("missing", n);
  const GroupAddresses at(n);
  auto group = std::make_unique<Group>(at, "missing_a", CheckpointFlags(dirs));
  ASSERT_TRUE(group->ok());
  ASSERT_TRUE(group->clients[0]->CreateHead(AdamSpec()).ok());
  StepRound(*group, 0);
  ASSERT_TRUE(group->clients[2]->Checkpoint().ok());
  const State cut = Capture(*group);
  StopAll(*group);
  group.reset();

  // Process 1's part missing: every process refuses to start, naming it.
  const std::string part = SetDir(dirs[1], 1);
  const std::string aside = dirs[1] + "_aside";
  fs::remove_all(aside);
  fs::rename(part, aside);
  for (const auto& [code, log] : StartExpectingExit(at, "missing_b", CheckpointFlags(dirs))) {
    EXPECT_EQ(code, 1) << log;
    EXPECT_NE(log.find("checkpoint set 1 cannot be restored: process 1: process 1 holds no part "
                       "of set 1"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("NOT_FOUND"), std::string::npos) << log;
  }
  // Back, but with one byte changed inside: DATA_LOSS, every process.
  fs::rename(aside, part);
  const std::string file = absl::StrCat(part, "/", kHead, ".lhck");
  const auto size = fs::file_size(file);
  char original = 0;
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(size - 5));
    f.get(original);
    f.seekp(static_cast<std::streamoff>(size - 5));
    f.put(static_cast<char>(original ^ 0x40));
  }
  for (const auto& [code, log] : StartExpectingExit(at, "missing_c", CheckpointFlags(dirs))) {
    EXPECT_EQ(code, 1) << log;
    EXPECT_NE(log.find("checkpoint set 1 cannot be restored: process 1: "), std::string::npos)
        << log;
    EXPECT_NE(log.find("DATA_LOSS"), std::string::npos) << log;
  }
  // Put right: the set is restored, nothing of it lost to the failed starts.
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size - 5));
    f.put(original);
  }
  group = std::make_unique<Group>(at, "missing_d", CheckpointFlags(dirs));
  ASSERT_TRUE(group->ok());
  ExpectSameState(Capture(*group), cut);
}

TEST(GroupCheckpointSetsTest, TheLeadersPeriodicSetsArePrunedOnEveryProcess) {
  constexpr int n = 2;
  const std::vector<std::string> dirs = Dirs("periodic", n);
  const GroupAddresses at(n);
  Group group(at, "periodic", CheckpointFlags(dirs, "200ms"));
  ASSERT_TRUE(group.ok());
  ASSERT_TRUE(group.clients[1]->CreateHead(AdamSpec()).ok());
  StepRound(group, 0);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (absl::Now() < until && (Sets(dirs[0]).empty() || Sets(dirs[0]).rbegin()->first < 6)) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  // The leader first: its periodic thread stops before it leaves; the follower then exits.
  EXPECT_EQ(group.processes[0]->Terminate(), 0);
  const std::optional<int> follower = group.processes[1]->WaitForExit(absl::Seconds(20));
  EXPECT_EQ(follower, std::optional<int>(kExitGroupBroken));
  const auto leader_sets = Sets(dirs[0]);
  const auto follower_sets = Sets(dirs[1]);
  ASSERT_FALSE(leader_sets.empty());
  EXPECT_GE(leader_sets.rbegin()->first, 6u) << "fewer periodic sets than expected";
  std::vector<uint64_t> manifests, committed;
  for (const auto& [cut, files] : leader_sets) {
    if (files.contains("MANIFEST")) manifests.push_back(cut);
  }
  for (const auto& [cut, files] : follower_sets) {
    if (files.contains("COMMITTED")) committed.push_back(cut);
  }
  EXPECT_EQ(manifests.size(), static_cast<size_t>(kKeepSets));
  EXPECT_EQ(committed, manifests);
  // Nothing older than the oldest set kept.
  EXPECT_EQ(leader_sets.begin()->first, manifests.front());
  EXPECT_EQ(follower_sets.begin()->first, manifests.front());
}

TEST(GroupCheckpointErrorsTest, EveryRefusalHasItsCode) {
  constexpr int n = 2;
  const std::vector<std::string> dirs = Dirs("errors", n);
  Group group(GroupAddresses(n), "errors", CheckpointFlags(dirs));
  ASSERT_TRUE(group.ok());
  ASSERT_TRUE(group.clients[0]->CreateHead(AdamSpec()).ok());
  for (int p = 0; p < n; ++p) {
    auto unknown = group.clients[p]->Checkpoint("no-such-head");
    ASSERT_FALSE(unknown.ok());
    EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
    // Named snapshots have their own tests (group_snapshot_test.cc); one of an unknown head is
    // refused as a checkpoint of it is, and none is listed.
    auto snapshot = group.clients[p]->SnapshotHead("no-such-head", "t1");
    ASSERT_FALSE(snapshot.ok());
    EXPECT_EQ(snapshot.status().code(), absl::StatusCode::kNotFound) << snapshot.status();
    auto listed = group.clients[p]->ListSnapshots(kHead);
    ASSERT_TRUE(listed.ok()) << listed.status();
    EXPECT_TRUE(listed->empty());
  }
  EXPECT_TRUE(Sets(dirs[0]).empty()) << "a refused checkpoint wrote a set";
  // A named head that exists: the set holds every head all the same.
  auto named = group.clients[1]->Checkpoint(kHead);
  ASSERT_TRUE(named.ok()) << named.status();

  Group plain(n, "errors_plain");
  ASSERT_TRUE(plain.ok());
  ASSERT_TRUE(plain.clients[0]->CreateHead(AdamSpec()).ok());
  for (int p = 0; p < n; ++p) {
    auto disabled = plain.clients[p]->Checkpoint();
    ASSERT_FALSE(disabled.ok());
    EXPECT_EQ(disabled.status().code(), absl::StatusCode::kFailedPrecondition) << disabled.status();
  }

  // Checkpoints on some processes only: no process starts.
  const auto mixed = StartExpectingExit(GroupAddresses(n), "errors_mixed", [&dirs](int p) {
    return p == 0 ? std::vector<std::string>{"--checkpoint_dir=" + dirs[0] + "_mixed"}
                  : std::vector<std::string>{};
  });
  for (const auto& [code, log] : mixed) {
    EXPECT_EQ(code, 1) << log;
    EXPECT_NE(log.find("FAILED_PRECONDITION"), std::string::npos) << log;
    EXPECT_NE(log.find("process 0 has a --checkpoint_dir and process 1 has none"),
              std::string::npos)
        << log;
  }

  // Periodic checkpoints of a group with tokens need the group's secret (group_security_test.cc):
  // without one, the start is refused.
  const std::string tokens = absl::StrCat(::testing::TempDir(), "/gc_", getpid(), "_tokens");
  std::ofstream(tokens) << "writer 0123456789abcdef0123456789\n";
  const GroupAddresses lonely(2);
  std::vector<std::string> flags = lonely.Flags(0);
  flags.push_back("--checkpoint_dir=" + dirs[0]);
  flags.push_back("--auth_tokens_file=" + tokens);
  const std::string log = LogPath("errors_tokens");
  auto code = ServerProcess::RunToExit(LOSSHEAD_SERVER_BINARY, flags, log, absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 1);
  const std::string text = ReadText(log);
  EXPECT_NE(text.find("INVALID_ARGUMENT"), std::string::npos) << text;
  EXPECT_NE(text.find("--group_secret_file"), std::string::npos) << text;
  EXPECT_NE(text.find("--checkpoint_interval=0"), std::string::npos) << text;
}

}  // namespace
}  // namespace losshead::testing
