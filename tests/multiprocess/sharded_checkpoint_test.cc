// Checkpoint sets holding a head sharded across processes (Placement.across_processes) beside a
// replicated one, with 2 and 3 real server processes on loopback (CPU backend), against a
// one-process server whose head is sharded over as many CPU devices (the same bits):
// - a checkpoint writes each process's rows of the sharded head into its part; after more
//   training and one process killed (kill -9), the restarted set holds the cut: W (downloaded
//   through every process) and the window (pulled) bit for bit the reference's at the cut, every
//   client's progress acknowledged and persisted at the cut, and a further AdamW apply steps W
//   bit for bit as the reference's;
// - a process restarted with another device count than the one that wrote its rows refuses the
//   set (FAILED_PRECONDITION), and every process exits naming it.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
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

// Sharded across every process, on every device each has (placement.devices 0); `shards`
// devices on one process for the reference.
v1::HeadSpec WideSpec(int shards, bool across) {
  v1::HeadSpec spec;
  spec.set_name(kWide);
  spec.set_vocab_size(kWideVocab);
  spec.set_hidden_size(kHidden);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.3f);
  spec.mutable_init()->mutable_normal()->set_seed(5);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  spec.mutable_placement()->set_kind(v1::PLACEMENT_SHARDED);
  spec.mutable_placement()->set_devices(across ? 0 : shards);
  spec.mutable_placement()->set_across_processes(across);
  return spec;
}

v1::ApplyOptimizerRequest WideApply(uint64_t step_key) {
  v1::ApplyOptimizerRequest request;
  request.set_head(kWide);
  request.set_client_id("optimizer");
  request.set_step_key(step_key);
  request.mutable_params()->set_lr(0.05);
  request.mutable_params()->set_weight_decay(0.01);
  request.mutable_params()->set_beta1(0.9);
  request.mutable_params()->set_beta2(0.999);
  request.mutable_params()->set_eps(1e-8);
  request.set_max_norm(0.5);
  return request;
}

HostBatch WideBatch(int c, int k) {
  return MakeBatch(kTokens, kHidden, kWideVocab, v1::DTYPE_FP32, 700 + 31 * c + k,
                   /*ignore_every=*/5);
}

std::vector<std::string> Dirs(const std::string& name, int n) {
  std::vector<std::string> dirs;
  for (int p = 0; p < n; ++p) {
    dirs.push_back(absl::StrCat(::testing::TempDir(), "/sc_", getpid(), "_", name, "_p", p));
    fs::remove_all(dirs.back());
  }
  return dirs;
}

// Process p's flags: its directory, no periodic sets, and `devices` CPU devices.
std::function<std::vector<std::string>(int)> Flags(const std::vector<std::string>& dirs,
                                                   std::function<int(int)> devices = nullptr) {
  return [dirs, devices](int p) {
    // A process stopped alone waits for the others until its drain deadline (the final set).
    std::vector<std::string> flags = {"--checkpoint_dir=" + dirs[p], "--checkpoint_interval=0",
                                      "--drain_timeout=2s"};
    if (devices != nullptr && devices(p) > 1) {
      std::string list = "--devices=0";
      for (int d = 1; d < devices(p); ++d) absl::StrAppend(&list, ",", d);
      flags.push_back(list);
    }
    return flags;
  };
}

// Round k: every client's k-th micro-batch of both heads at its home, and at `reference`.
void StepRound(Group& group, int k, client::Client* reference) {
  const int n = static_cast<int>(group.clients.size());
  for (int c = 0; c < kClients; ++c) {
    const std::string id = ClientId(c);
    for (const bool wide : {true, false}) {
      // The micro-batch points into its batch: kept alive beside it.
      const HostBatch batch = wide ? WideBatch(c, k) : Batch(c, k);
      const client::Microbatch mb = ToMicrobatch(wide ? kWide : kHead, id, k + 1, batch);
      auto done = group.clients[Home(id, n)]->Step(mb);
      ASSERT_TRUE(done.ok()) << id << ": " << done.status();
      EXPECT_FALSE(done->replayed);
      if (reference != nullptr) {
        auto want = reference->Step(mb);
        ASSERT_TRUE(want.ok()) << want.status();
        if (wide) {
          EXPECT_EQ(done->loss_sum, want->loss_sum) << id;
          EXPECT_TRUE(done->grad_hidden == want->grad_hidden) << id << ": dH differs";
        }
      }
    }
  }
}

// What the cut holds, as every process shows it.
struct Cut {
  client::Bytes wide_w, wide_dw, lm_w, lm_dw;
  uint64_t wide_microbatches = 0;
};

// W and dW of both heads through every process (all alike), with the clients' progress at `at`.
Cut Capture(Group& group, uint64_t at) {
  Cut cut;
  const int n = static_cast<int>(group.clients.size());
  for (int p = 0; p < n; ++p) {
    client::Client& c = *group.clients[p];
    auto w = c.DownloadWeights(kWide);
    auto dw = c.PullGradient(kWide);
    auto lw = c.DownloadWeights(kHead);
    auto ldw = c.PullGradient(kHead);
    EXPECT_TRUE(w.ok() && dw.ok() && lw.ok() && ldw.ok()) << "process " << p;
    if (!w.ok() || !dw.ok() || !lw.ok() || !ldw.ok()) return cut;
    if (p == 0) {
      cut = {w->data, dw->data, lw->data, ldw->data, dw->summary.microbatch_count()};
    } else {
      EXPECT_TRUE(w->data == cut.wide_w) << "process " << p;
      EXPECT_TRUE(dw->data == cut.wide_dw) << "process " << p;
      EXPECT_TRUE(lw->data == cut.lm_w) << "process " << p;
      EXPECT_TRUE(ldw->data == cut.lm_dw) << "process " << p;
    }
  }
  for (int i = 0; i < kClients; ++i) {
    const std::string id = ClientId(i);
    for (const char* head : {kWide, kHead}) {
      auto progress = group.clients[Home(id, n)]->GetClientProgress(head, id);
      EXPECT_TRUE(progress.ok()) << progress.status();
      if (!progress.ok()) continue;
      EXPECT_EQ(progress->acknowledged_sequence(), at) << head << " " << id;
      EXPECT_EQ(progress->persisted_sequence(), at) << head << " " << id;
    }
  }
  return cut;
}

class ShardedCheckpointTest : public ::testing::TestWithParam<int> {};

TEST_P(ShardedCheckpointTest, AKilledProcessAndARestartComeBackToEachProcesssRows) {
  const int n = GetParam();
  const std::string name = absl::StrCat("shardckpt", n);
  const std::vector<std::string> dirs = Dirs(name, n);
  const GroupAddresses at(n);
  auto group = std::make_unique<Group>(at, name + "_a", Flags(dirs));
  ASSERT_TRUE(group->ok());
  std::string shards = "--devices=0";
  for (int d = 1; d < n; ++d) absl::StrAppend(&shards, ",", d);
  Single reference(name + "_ref", {shards});
  ASSERT_NE(reference.client, nullptr);
  v1::HeadSpec lm = Spec();
  lm.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  ASSERT_TRUE(group->clients[n - 1]->CreateHead(WideSpec(n, true)).ok());
  ASSERT_TRUE(group->clients[0]->CreateHead(lm).ok());
  ASSERT_TRUE(reference.client->CreateHead(WideSpec(n, false)).ok());
  ASSERT_TRUE(reference.client->CreateHead(lm).ok());

  // To the cut: a round, an apply of the wide head, another round left in both windows.
  StepRound(*group, 0, reference.client.get());
  auto first = group->clients[n - 1]->ApplyOptimizer(WideApply(1));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(reference.client->ApplyOptimizer(WideApply(1)).ok());
  StepRound(*group, 1, reference.client.get());

  auto written = group->clients[n - 1]->Checkpoint();
  ASSERT_TRUE(written.ok()) << written.status();
  ASSERT_EQ(written->heads_size(), 2);
  const Cut cut = Capture(*group, 2);
  EXPECT_EQ(cut.wide_microbatches, static_cast<uint64_t>(kClients));
  // The cut is the reference's: W and the window of the wide head, bit for bit.
  auto ref_w = reference.client->DownloadWeights(kWide);
  auto ref_dw = reference.client->PullGradient(kWide);
  ASSERT_TRUE(ref_w.ok() && ref_dw.ok());
  EXPECT_TRUE(cut.wide_w == ref_w->data);
  EXPECT_TRUE(cut.wide_dw == ref_dw->data);
  // Each part holds its process's rows of W only (the header's weights length, checkpoint.h):
  // together, W once.
  uint64_t weight_bytes = 0;
  const uint64_t whole = static_cast<uint64_t>(kWideVocab) * kHidden * sizeof(float);
  for (int p = 0; p < n; ++p) {
    const std::string part =
        absl::StrCat(dirs[p], "/sets/", std::string(19, '0'), "1/", kWide, ".lhck");
    std::ifstream in(part, std::ios::binary);
    ASSERT_TRUE(in.good()) << part;
    uint64_t bytes = 0;
    in.seekg(24);  // magic, version, reserved, meta bytes; then the weights' bytes
    in.read(reinterpret_cast<char*>(&bytes), sizeof(bytes));
    EXPECT_GT(bytes, 0u) << p;
    EXPECT_LT(bytes, whole) << p;
    weight_bytes += bytes;
  }
  EXPECT_EQ(weight_bytes, whole);

  // More training after the cut, then one process killed.
  StepRound(*group, 2, nullptr);
  ASSERT_TRUE(group->clients[0]->ApplyOptimizer(WideApply(2)).ok());
  StepRound(*group, 3, nullptr);
  // Within the probe's period: the survivors exit (their group broke).
  KillAndExpectTheOthersExit(*group, n - 1);
  if (::testing::Test::HasFatalFailure()) return;
  group.reset();

  // The set restarted: each process's rows back, the cut on every process.
  group = std::make_unique<Group>(at, name + "_b", Flags(dirs));
  ASSERT_TRUE(group->ok());
  const Cut restored = Capture(*group, 2);
  EXPECT_TRUE(restored.wide_w == cut.wide_w);
  EXPECT_TRUE(restored.wide_dw == cut.wide_dw);
  EXPECT_TRUE(restored.lm_w == cut.lm_w);
  EXPECT_TRUE(restored.lm_dw == cut.lm_dw);
  EXPECT_EQ(restored.wide_microbatches, cut.wide_microbatches);

  // The apply log is the cut's (apply 1 replays), and the optimizer state too: apply 2 steps W
  // as the reference's, bit for bit.
  auto again = group->clients[0]->ApplyOptimizer(WideApply(1));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->replayed());
  auto applied = group->clients[n - 1]->ApplyOptimizer(WideApply(2));
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_FALSE(applied->replayed());
  auto want = reference.client->ApplyOptimizer(WideApply(2));
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(applied->optimizer_step(), want->optimizer_step());
  EXPECT_EQ(applied->weights_version(), want->weights_version());
  EXPECT_EQ(applied->head_grad_norm(), want->head_grad_norm());
  auto want_w = reference.client->DownloadWeights(kWide);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  for (int p = 0; p < n; ++p) {
    auto w = group->clients[p]->DownloadWeights(kWide);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(w->data == want_w->data) << "process " << p << " stepped W otherwise";
  }
  // And micro-batches run on from the cut on every process (the bounds of W restored alike).
  StepRound(*group, 2, reference.client.get());
  for (auto& process : group->processes) process->Terminate();
  group.reset();

  // A process with another device count than the one that wrote its rows: every process
  // refuses the set, naming it (FAILED_PRECONDITION), and nothing is restored.
  std::vector<std::pair<int, std::string>> results(n);
  std::vector<std::thread> starts;
  const auto flags = Flags(dirs, [n](int p) { return p == n - 1 ? 2 : 1; });
  for (int p = 0; p < n; ++p) {
    starts.emplace_back([&, p] {
      std::vector<std::string> all = at.Flags(p);
      const std::vector<std::string> more = flags(p);
      all.insert(all.end(), more.begin(), more.end());
      const std::string log = LogPath(absl::StrCat(name, "_c_p", p));
      auto code = ServerProcess::RunToExit(LOSSHEAD_SERVER_BINARY, all, log, absl::Seconds(60));
      EXPECT_TRUE(code.ok()) << code.status();
      results[p] = {code.value_or(-1), ReadText(log)};
    });
  }
  for (std::thread& t : starts) t.join();
  for (const auto& [code, log] : results) {
    EXPECT_EQ(code, 1) << log;
    EXPECT_NE(log.find(absl::StrCat("cannot be restored: process ", n - 1, ": ")),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("FAILED_PRECONDITION"), std::string::npos) << log;
    EXPECT_NE(log.find("restored only in the group size, rank and device count that wrote it"),
              std::string::npos)
        << log;
  }
}

INSTANTIATE_TEST_SUITE_P(Processes, ShardedCheckpointTest, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat(info.param, "Processes");
                         });

}  // namespace
}  // namespace losshead::testing
