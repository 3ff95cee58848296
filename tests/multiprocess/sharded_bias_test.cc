// A head with an output bias (HeadSpec.bias) sharded across 2 and 3 real server processes on
// loopback (CPU backend, Placement.across_processes), 2 x 1, 3 x 1 and 2 x 2 processes x
// devices, against a one-process server whose head is sharded over as many CPU devices with the
// same spec (the same shards, the same host collective: the same bits):
// - W and b pushed through a follower (replaced, or a delta added) reach every process's rows:
//   DownloadWeights through every process answers the one-process head's W and b bit for bit;
// - loss and dH of micro-batches keyed at their homes, unkeyed through every process (with
//   per-token weights) and forward-only are the one-process head's bit for bit (b enters every
//   shard's logits over its rows);
// - a pull through every process gathers every process's rows of dW and of db: the one-process
//   head's bit for bit;
// - AdamW applies through a follower, with a bias_weight_decay of their own and clipping: the
//   same norm and clip coefficient, W and b bit for bit after each, every window's db empty;
// - a checkpoint set holds b, its state and db: after more training and one process killed
//   (kill -9), the restarted set holds the cut's W, b, dW and db, and a further apply steps them
//   bit for bit as the one-process head does.
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
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

constexpr char kBiased[] = "biased_wide";
constexpr int64_t kBiasVocab = 53;  // not a multiple of the shard counts: shards of unequal rows
constexpr int64_t kBiasHidden = 20;
constexpr int64_t kBiasTokens = 12;
constexpr int kBiasClients = 5;

// Sharded across every process of the group, `devices` shards on each, with an output bias.
v1::HeadSpec BiasedAcross(int devices) {
  v1::HeadSpec spec =
      ShardedSpec(kBiased, kBiasVocab, kBiasHidden, /*seed=*/17, devices, /*across=*/true);
  spec.set_bias(true);
  return spec;
}

// The same head on one process, sharded over `shards` devices.
v1::HeadSpec BiasedLocal(int shards) {
  v1::HeadSpec spec = BiasedAcross(shards);
  spec.mutable_placement()->set_across_processes(false);
  return spec;
}

std::string BiasClient(int c) { return absl::StrCat("biased-learner-", c); }

HostBatch BiasBatch(int c, int k) {
  return MakeBatch(kBiasTokens, kBiasHidden, kBiasVocab, v1::DTYPE_FP32, 300 + 31 * c + k,
                   /*ignore_every=*/5);
}

// AdamW with a weight decay for b of its own, clipped (max_norm below the window's norm).
v1::ApplyOptimizerRequest BiasApply(uint64_t step_key) {
  v1::ApplyOptimizerRequest request;
  request.set_head(kBiased);
  request.set_client_id("optimizer");
  request.set_step_key(step_key);
  request.mutable_params()->set_lr(0.05);
  request.mutable_params()->set_weight_decay(0.01);
  request.mutable_params()->set_bias_weight_decay(0.03);
  request.mutable_params()->set_beta1(0.9);
  request.mutable_params()->set_beta2(0.999);
  request.mutable_params()->set_eps(1e-8);
  request.set_max_norm(0.02);
  return request;
}

bool AllZero(const client::Bytes& bytes) {
  for (std::byte b : bytes) {
    if (b != std::byte{0}) return false;
  }
  return true;
}

void ExpectSameStep(const client::StepResult& got, const client::StepResult& want,
                    const std::string& what) {
  EXPECT_EQ(got.loss_sum, want.loss_sum) << what;
  EXPECT_EQ(got.token_count, want.token_count) << what;
  EXPECT_EQ(got.weights_version, want.weights_version) << what;
  EXPECT_TRUE(got.grad_hidden == want.grad_hidden) << what << ": dH differs";
}

// Round k: each client's micro-batch at its home (sequence k + 1), an unkeyed one with
// per-token weights through every process, and a forward-only one through the last process,
// each against `reference` (skipped where it is null). Returns the micro-batches counted.
uint64_t StepRound(Group& group, int k, client::Client* reference) {
  const int n = static_cast<int>(group.clients.size());
  uint64_t counted = 0;
  for (int c = 0; c < kBiasClients; ++c) {
    const std::string id = BiasClient(c);
    const HostBatch batch = BiasBatch(c, k);
    const client::Microbatch mb = ToMicrobatch(kBiased, id, k + 1, batch);
    auto done = group.clients[Home(id, n)]->Step(mb);
    EXPECT_TRUE(done.ok()) << id << ": " << done.status();
    if (!done.ok()) return counted;
    ++counted;
    if (reference == nullptr) continue;
    auto want = reference->Step(mb);
    EXPECT_TRUE(want.ok()) << want.status();
    if (want.ok()) ExpectSameStep(*done, *want, absl::StrCat(id, " round ", k));
  }
  std::vector<float> weights(kBiasTokens);
  for (int64_t t = 0; t < kBiasTokens; ++t) weights[t] = 0.25f * static_cast<float>(t % 5);
  for (int p = 0; p < n; ++p) {
    const HostBatch batch = BiasBatch(100 + p, k);
    client::Microbatch mb = ToMicrobatch(kBiased, "", 0, batch);
    mb.token_weights = weights;
    auto done = group.clients[p]->Step(mb);
    EXPECT_TRUE(done.ok()) << "process " << p << ": " << done.status();
    if (!done.ok()) return counted;
    ++counted;
    if (reference == nullptr) continue;
    auto want = reference->Step(mb);
    EXPECT_TRUE(want.ok()) << want.status();
    if (want.ok()) ExpectSameStep(*done, *want, absl::StrCat("unkeyed through process ", p));
  }
  const HostBatch eval_batch = BiasBatch(200, k);
  client::Microbatch eval = ToMicrobatch(kBiased, "", 0, eval_batch);
  eval.options.set_forward_only(true);
  auto done = group.clients[n - 1]->Step(eval);
  EXPECT_TRUE(done.ok()) << done.status();
  if (done.ok() && reference != nullptr) {
    EXPECT_TRUE(done->forward_only);
    auto want = reference->Step(eval);
    EXPECT_TRUE(want.ok()) << want.status();
    if (want.ok()) ExpectSameStep(*done, *want, "forward-only");
  }
  return counted;
}

// W and b through every process equal `want`'s, bit for bit.
void ExpectWeights(Group& group, const client::DownloadedWeights& want, const std::string& what) {
  for (size_t p = 0; p < group.clients.size(); ++p) {
    auto w = group.clients[p]->DownloadWeights(kBiased);
    ASSERT_TRUE(w.ok()) << "process " << p << ": " << w.status();
    EXPECT_TRUE(w->has_bias);
    EXPECT_EQ(w->weights_version, want.weights_version) << what << ", process " << p;
    EXPECT_TRUE(w->data == want.data) << what << ": process " << p << " answers another W";
    EXPECT_TRUE(w->bias == want.bias) << what << ": process " << p << " answers another b";
  }
}

// dW and db pulled through every process (no reset) equal `want`'s, bit for bit.
void ExpectWindow(Group& group, const client::PulledGradient& want, const std::string& what) {
  for (size_t p = 0; p < group.clients.size(); ++p) {
    auto pulled = group.clients[p]->PullGradient(kBiased);
    ASSERT_TRUE(pulled.ok()) << "process " << p << ": " << pulled.status();
    EXPECT_TRUE(pulled->summary.bias());
    EXPECT_EQ(pulled->summary.token_count(), want.summary.token_count()) << what;
    EXPECT_EQ(pulled->summary.microbatch_count(), want.summary.microbatch_count()) << what;
    EXPECT_TRUE(pulled->data == want.data) << what << ": process " << p << " answers another dW";
    EXPECT_TRUE(pulled->bias == want.bias) << what << ": process " << p << " answers another db";
  }
}

// W and b pushed through process 1 (a follower) and to the reference: random, so that b shows
// in every logit.
void PushRandom(Group& group, client::Client& reference, uint64_t seed) {
  const std::vector<float> w = RandomValues(kBiasVocab * kBiasHidden, 0.2, v1::DTYPE_FP32, seed);
  const std::vector<float> b = RandomValues(kBiasVocab, 0.5, v1::DTYPE_FP32, seed + 1);
  const client::Bytes w_bytes = Encode(w, v1::DTYPE_FP32);
  const client::Bytes b_bytes = Encode(b, v1::DTYPE_FP32);
  const client::PushRequest push{
      .head = kBiased, .dtype = v1::DTYPE_FP32, .data = w_bytes, .bias = b_bytes};
  auto pushed = group.clients[1]->PushWeights(push);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  auto want = reference.PushWeights(push);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(*pushed, *want);
  auto want_w = reference.DownloadWeights(kBiased);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  EXPECT_TRUE(want_w->bias == b_bytes);
  ExpectWeights(group, *want_w, "after the push");
}

// An apply through the last process (a follower) and on the reference: the same norm, clip
// coefficient, W and b, and every window empty.
void ExpectSameApply(Group& group, client::Client& reference, uint64_t step_key) {
  const int n = static_cast<int>(group.clients.size());
  auto applied = group.clients[n - 1]->ApplyOptimizer(BiasApply(step_key));
  ASSERT_TRUE(applied.ok()) << applied.status();
  auto want = reference.ApplyOptimizer(BiasApply(step_key));
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(applied->head_grad_norm(), want->head_grad_norm()) << "apply " << step_key;
  EXPECT_EQ(applied->clip_coefficient(), want->clip_coefficient()) << "apply " << step_key;
  EXPECT_LT(want->clip_coefficient(), 1.0) << "the apply should clip";
  EXPECT_EQ(applied->weights_version(), want->weights_version());
  EXPECT_EQ(applied->window().microbatch_count(), want->window().microbatch_count());
  auto want_w = reference.DownloadWeights(kBiased);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  ExpectWeights(group, *want_w, absl::StrCat("after apply ", step_key));
  for (int p = 0; p < n; ++p) {
    auto window = group.clients[p]->PullGradient(kBiased);
    ASSERT_TRUE(window.ok()) << window.status();
    EXPECT_EQ(window->summary.token_count(), 0u) << "process " << p;
    EXPECT_TRUE(AllZero(window->data)) << "process " << p << " kept part of dW";
    EXPECT_TRUE(AllZero(window->bias)) << "process " << p << " kept part of db";
  }
}

class ShardedBiasTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ShardedBiasTest, StepsPullsPushesAndAppliesEqualOneProcessShardedOverAsManyDevices) {
  const int n = GetParam().processes;
  const int devices = GetParam().devices;
  const std::string name = absl::StrCat("shardbias", n, "x", devices);
  Group group(n, name, DeviceFlags(devices));
  ASSERT_TRUE(group.ok());
  Single one(name + "_one", DeviceFlags(n * devices));
  ASSERT_NE(one.client, nullptr);

  // Created through the last process (a follower).
  auto created = group.clients[n - 1]->CreateHead(BiasedAcross(devices));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(created->spec().bias());
  ASSERT_TRUE(one.client->CreateHead(BiasedLocal(n * devices)).ok());
  auto initial = one.client->DownloadWeights(kBiased);
  ASSERT_TRUE(initial.ok()) << initial.status();
  ExpectWeights(group, *initial, "as created");

  PushRandom(group, *one.client, 41);
  const uint64_t counted = StepRound(group, 0, one.client.get());
  EXPECT_EQ(counted, static_cast<uint64_t>(kBiasClients + n));
  auto reference = one.client->PullGradient(kBiased);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_EQ(reference->bias.size(), kBiasVocab * sizeof(float));
  EXPECT_FALSE(AllZero(reference->bias));
  ExpectWindow(group, *reference, "round 0");

  // Two applies, so that b's optimizer state (every row's, on every process) shows too.
  ExpectSameApply(group, *one.client, 1);
  StepRound(group, 1, one.client.get());
  ExpectSameApply(group, *one.client, 2);
  // Micro-batches against the stepped W and b: the same bits again.
  StepRound(group, 2, one.client.get());
  auto after = one.client->PullGradient(kBiased);
  ASSERT_TRUE(after.ok()) << after.status();
  ExpectWindow(group, *after, "round 2");

  // A delta added to W and b through a follower (PUSH_MODE_ADD): b + delta on every process.
  {
    const client::Bytes dw =
        Encode(RandomValues(kBiasVocab * kBiasHidden, 0.01, v1::DTYPE_FP32, 61), v1::DTYPE_FP32);
    const client::Bytes db =
        Encode(RandomValues(kBiasVocab, 0.1, v1::DTYPE_FP32, 62), v1::DTYPE_FP32);
    const client::PushRequest add{.head = kBiased,
                                  .dtype = v1::DTYPE_FP32,
                                  .data = dw,
                                  .bias = db,
                                  .mode = v1::PUSH_MODE_ADD};
    auto added = group.clients[n - 1]->PushWeights(add);
    ASSERT_TRUE(added.ok()) << added.status();
    ASSERT_TRUE(one.client->PushWeights(add).ok());
    auto want_w = one.client->DownloadWeights(kBiased);
    ASSERT_TRUE(want_w.ok()) << want_w.status();
    ExpectWeights(group, *want_w, "after an added delta");
  }

  // A discard through a follower empties db on every process.
  ASSERT_TRUE(group.clients[n - 1]->DiscardGradient(kBiased).ok());
  for (int p = 0; p < n; ++p) {
    auto window = group.clients[p]->PullGradient(kBiased);
    ASSERT_TRUE(window.ok()) << window.status();
    EXPECT_TRUE(AllZero(window->bias)) << "process " << p << " kept db after the discard";
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShardedBiasTest,
                         ::testing::Values(Layout{2, 1}, Layout{3, 1}, Layout{2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return absl::StrCat(info.param.processes, "Processes",
                                               info.param.devices, "Devices");
                         });

std::vector<std::string> CheckpointDirs(const std::string& name, int n) {
  std::vector<std::string> dirs;
  for (int p = 0; p < n; ++p) {
    dirs.push_back(absl::StrCat(::testing::TempDir(), "/sb_", getpid(), "_", name, "_p", p));
    fs::remove_all(dirs.back());
  }
  return dirs;
}

std::function<std::vector<std::string>(int)> CheckpointFlags(const std::vector<std::string>& dirs) {
  return [dirs](int p) {
    return std::vector<std::string>{"--checkpoint_dir=" + dirs[p], "--checkpoint_interval=0",
                                    "--drain_timeout=2s"};
  };
}

class ShardedBiasCheckpointTest : public ::testing::TestWithParam<int> {};

TEST_P(ShardedBiasCheckpointTest, AKilledProcessAndARestartComeBackToBAndDb) {
  const int n = GetParam();
  const std::string name = absl::StrCat("shardbiasckpt", n);
  const std::vector<std::string> dirs = CheckpointDirs(name, n);
  const GroupAddresses at(n);
  auto group = std::make_unique<Group>(at, name + "_a", CheckpointFlags(dirs));
  ASSERT_TRUE(group->ok());
  Single one(name + "_one", DeviceFlags(n));
  ASSERT_NE(one.client, nullptr);
  ASSERT_TRUE(group->clients[n - 1]->CreateHead(BiasedAcross(1)).ok());
  ASSERT_TRUE(one.client->CreateHead(BiasedLocal(n)).ok());

  // To the cut: W and b pushed, a round, an apply, another round left in the window.
  PushRandom(*group, *one.client, 73);
  StepRound(*group, 0, one.client.get());
  ExpectSameApply(*group, *one.client, 1);
  StepRound(*group, 1, one.client.get());
  auto written = group->clients[n - 1]->Checkpoint();
  ASSERT_TRUE(written.ok()) << written.status();
  auto cut_w = one.client->DownloadWeights(kBiased);
  auto cut_window = one.client->PullGradient(kBiased);
  ASSERT_TRUE(cut_w.ok() && cut_window.ok());
  EXPECT_FALSE(AllZero(cut_window->bias));
  ExpectWeights(*group, *cut_w, "at the cut");
  ExpectWindow(*group, *cut_window, "at the cut");

  // More training after the cut (not on the reference), then one process killed.
  StepRound(*group, 2, nullptr);
  ASSERT_TRUE(group->clients[0]->ApplyOptimizer(BiasApply(2)).ok());
  StepRound(*group, 3, nullptr);
  KillAndExpectTheOthersExit(*group, n - 1);
  if (::testing::Test::HasFatalFailure()) return;
  group.reset();

  // The set restarted: W, b, dW and db of the cut on every process, and the optimizer state of
  // W and b: apply 2 steps them as the reference's, bit for bit.
  group = std::make_unique<Group>(at, name + "_b", CheckpointFlags(dirs));
  ASSERT_TRUE(group->ok());
  ExpectWeights(*group, *cut_w, "restored");
  ExpectWindow(*group, *cut_window, "restored");
  ExpectSameApply(*group, *one.client, 2);
  StepRound(*group, 2, one.client.get());
}

INSTANTIATE_TEST_SUITE_P(Processes, ShardedBiasCheckpointTest, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat(info.param, "Processes");
                         });

}  // namespace
}  // namespace losshead::testing
