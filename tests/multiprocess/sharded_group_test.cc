// A head sharded across 2 and 3 real server processes on loopback (CPU backend,
// Placement.across_processes), against a one-process server whose head is sharded over as many
// CPU devices (the same shards, the same host collective: the same bits) and against the
// independent fp64 reference:
// - creation through a follower gives every process its rows of the same W: downloads through
//   every process equal the one-process head's W bit for bit;
// - every micro-batch runs on every process in the leader's order: its loss and dH equal the
//   one-process sharded head's bit for bit (and the fp64 reference's within fp32 rounding),
//   whether it carries a client id (sent to its home; elsewhere FAILED_PRECONDITION naming it),
//   none, per-token weights, or is forward-only (counted nowhere), through any process; a replay
//   at the home is answered again and counted on no process;
// - a pull through every process gathers every process's rows: the one-process dW bit for bit,
//   with the same counters; an optimizer apply through a follower steps each process's rows:
//   the same norm and W bit for bit, every window empty; a push through a follower reaches
//   every process's rows; one of the wrong size is INVALID_ARGUMENT and changes nothing;
// - the refusals: across_processes without a group (FAILED_PRECONDITION) or on a replicated head
//   (INVALID_ARGUMENT), a taken name (ALREADY_EXISTS), EmbeddingRows of a bad id
//   (INVALID_ARGUMENT);
// - killing one process makes the next micro-batch, pull, download and apply UNAVAILABLE on the
//   others, and no process counts a micro-batch the others did not.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/server_process.h"
#include "tests/multiprocess/group_util.h"
#include "tests/service/host_tensors.h"
#include "tests/service/reference.h"

namespace losshead::testing {
namespace {

constexpr char kHead[] = "wide";
constexpr int64_t kVocab = 53;  // not a multiple of the shard counts: shards of unequal rows
constexpr int64_t kHidden = 20;
constexpr int64_t kTokens = 12;
constexpr int kClients = 5;
constexpr int kPerClient = 2;

// Sharded across every process of the group, `devices` shards on each.
v1::HeadSpec AcrossSpec(int devices) {
  return ShardedSpec(kHead, kVocab, kHidden, /*seed=*/5, devices, /*across=*/true);
}

// The same head on one process, sharded over `shards` devices.
v1::HeadSpec LocalSpec(int shards) {
  return ShardedSpec(kHead, kVocab, kHidden, /*seed=*/5, shards, /*across=*/false);
}

std::string ClientId(int c) { return absl::StrCat("learner-", c); }

HostBatch Batch(int c, int k) {
  return MakeBatch(kTokens, kHidden, kVocab, v1::DTYPE_FP32, 500 + 31 * c + k, /*ignore_every=*/5);
}

v1::ApplyOptimizerRequest Apply(uint64_t step_key) {
  v1::ApplyOptimizerRequest request;
  request.set_head(kHead);
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

// Loss and dH of `got` are `want`'s bits.
void ExpectSameStep(const client::StepResult& got, const client::StepResult& want,
                    const std::string& what) {
  EXPECT_EQ(got.loss_sum, want.loss_sum) << what;
  EXPECT_EQ(got.token_count, want.token_count) << what;
  EXPECT_EQ(got.weights_version, want.weights_version) << what;
  EXPECT_TRUE(got.grad_hidden == want.grad_hidden) << what << ": dH differs";
}

class ShardedGroupTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ShardedGroupTest, StepsCutsAndApplyEqualOneProcessShardedOverAsManyDevices) {
  const int n = GetParam().processes;
  const int devices = GetParam().devices;
  const std::string name = absl::StrCat("sharded", n, "x", devices);
  Group group(n, name, DeviceFlags(devices));
  ASSERT_TRUE(group.ok());
  Single one(name + "_one", DeviceFlags(n * devices));
  ASSERT_NE(one.client, nullptr);

  // Created through the last process (a follower).
  auto created = group.clients[n - 1]->CreateHead(AcrossSpec(devices));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(created->spec().placement().across_processes());
  EXPECT_EQ(created->devices_size(), devices);
  // Each process holds only its rows: W and dW of about V / (n x devices) rows per device.
  EXPECT_LT(created->memory().weights_bytes(),
            static_cast<uint64_t>(kVocab) * kHidden * sizeof(float));
  ASSERT_TRUE(one.client->CreateHead(LocalSpec(n * devices)).ok());
  auto initial = one.client->DownloadWeights(kHead);
  ASSERT_TRUE(initial.ok()) << initial.status();
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(kHead);
    ASSERT_TRUE(w.ok()) << "process " << p << ": " << w.status();
    EXPECT_EQ(w->weights_version, initial->weights_version);
    EXPECT_TRUE(w->data == initial->data) << "process " << p << " gathers another W";
  }

  // The independent oracle, for the first micro-batch: fp64 loss and dH from the initial W.
  {
    const HostBatch batch = Batch(0, 0);
    const RefResult ref = Reference(Floats(initial->data), batch.hidden, batch.targets, kTokens,
                                    kHidden, kVocab, RefOptions{});
    const client::Microbatch mb = ToMicrobatch(kHead, "", 0, batch);
    client::Microbatch eval = mb;
    eval.options.set_forward_only(true);
    // Forward-only through process n - 1 (no client id: it may land anywhere), counted nowhere.
    auto got = group.clients[n - 1]->Step(eval);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->forward_only);
    EXPECT_NEAR(got->loss, ref.loss, 1e-5 * std::abs(ref.loss));
    const std::vector<float> dh = Floats(got->grad_hidden);
    EXPECT_TRUE(AllClose(dh, ref.grad_hidden, 1e-5));
    auto want = one.client->Step(eval);
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectSameStep(*got, *want, "forward-only");
  }

  uint64_t tokens = 0, microbatches = 0;
  for (int k = 0; k < kPerClient; ++k) {
    for (int c = 0; c < kClients; ++c) {
      const std::string id = ClientId(c);
      const int home = Home(id, n);
      const HostBatch batch = Batch(c, k);
      const client::Microbatch mb = ToMicrobatch(kHead, id, k + 1, batch);
      if (k == 0) {
        // Elsewhere: its key lives at its home.
        auto refused = group.clients[(home + 1) % n]->Step(mb);
        ASSERT_FALSE(refused.ok());
        EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
            << refused.status();
        EXPECT_NE(refused.status().message().find(absl::StrCat("home=", group.addresses[home])),
                  std::string::npos)
            << refused.status();
      }
      auto done = group.clients[home]->Step(mb);
      ASSERT_TRUE(done.ok()) << id << " at process " << home << ": " << done.status();
      EXPECT_FALSE(done->replayed);
      auto want = one.client->Step(mb);
      ASSERT_TRUE(want.ok()) << want.status();
      ExpectSameStep(*done, *want, absl::StrCat(id, " k ", k));
      tokens += static_cast<uint64_t>(done->token_count);
      ++microbatches;
      if (k == 1) {
        auto again = group.clients[home]->Step(mb);
        ASSERT_TRUE(again.ok()) << again.status();
        EXPECT_TRUE(again->replayed);
        ExpectSameStep(*again, *want, "replay");
      }
    }
    // Without a client id, with per-token weights, through every process in turn.
    for (int p = 0; p < n; ++p) {
      const HostBatch batch = Batch(100 + p, k);
      std::vector<float> weights(kTokens);
      for (int64_t t = 0; t < kTokens; ++t) weights[t] = 0.25f * static_cast<float>(t % 5);
      client::Microbatch mb = ToMicrobatch(kHead, "", 0, batch);
      mb.token_weights = weights;
      auto done = group.clients[p]->Step(mb);
      ASSERT_TRUE(done.ok()) << "process " << p << ": " << done.status();
      auto want = one.client->Step(mb);
      ASSERT_TRUE(want.ok()) << want.status();
      ExpectSameStep(*done, *want, absl::StrCat("unkeyed through process ", p));
      tokens += static_cast<uint64_t>(done->token_count);
      ++microbatches;
    }
  }

  // Every process counted every micro-batch once (the replays and the forward-only none).
  for (int p = 0; p < n; ++p) {
    auto info = group.clients[p]->GetHead(kHead);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->microbatches_since_pull(), microbatches) << "process " << p;
    EXPECT_EQ(info->tokens_since_pull(), tokens) << "process " << p;
  }
  auto reference = one.client->PullGradient(kHead);
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ(reference->summary.microbatch_count(), microbatches);
  for (int p = 0; p < n; ++p) {
    auto pulled = group.clients[p]->PullGradient(kHead);
    ASSERT_TRUE(pulled.ok()) << "process " << p << ": " << pulled.status();
    EXPECT_EQ(pulled->summary.token_count(), tokens);
    EXPECT_EQ(pulled->summary.microbatch_count(), microbatches);
    EXPECT_TRUE(pulled->data == reference->data) << "process " << p << ": another dW";
  }

  // An apply through a follower: every process steps its rows; the same bits as one process.
  auto applied = group.clients[n - 1]->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(applied.ok()) << applied.status();
  auto want_applied = one.client->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(want_applied.ok()) << want_applied.status();
  EXPECT_EQ(applied->head_grad_norm(), want_applied->head_grad_norm());
  EXPECT_EQ(applied->clip_coefficient(), want_applied->clip_coefficient());
  EXPECT_EQ(applied->weights_version(), want_applied->weights_version());
  EXPECT_EQ(applied->window().microbatch_count(), microbatches);
  auto want_w = one.client->DownloadWeights(kHead);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  EXPECT_FALSE(want_w->data == initial->data);
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(kHead);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->weights_version, applied->weights_version());
    EXPECT_TRUE(w->data == want_w->data) << "process " << p << ": another W after the apply";
    auto window = group.clients[p]->PullGradient(kHead);
    ASSERT_TRUE(window.ok()) << window.status();
    EXPECT_EQ(window->summary.token_count(), 0u) << "process " << p;
    EXPECT_TRUE(std::all_of(window->data.begin(), window->data.end(),
                            [](std::byte b) { return b == std::byte{0}; }))
        << "process " << p << " kept part of the stepped window";
  }
  // A micro-batch against the stepped W: the same bits again.
  {
    const HostBatch batch = Batch(0, 7);
    const client::Microbatch mb = ToMicrobatch(kHead, ClientId(0), 10, batch);
    auto done = group.clients[Home(ClientId(0), n)]->Step(mb);
    ASSERT_TRUE(done.ok()) << done.status();
    auto want = one.client->Step(mb);
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectSameStep(*done, *want, "after the apply");
  }

  // A push through a follower reaches every process's rows; one of the wrong size nothing.
  const std::vector<float> pushed = RandomValues(kVocab * kHidden, 0.2, v1::DTYPE_FP32, 91);
  const client::Bytes pushed_bytes = Encode(pushed, v1::DTYPE_FP32);
  auto version = group.clients[1]->UploadWeights(kHead, v1::DTYPE_FP32, pushed_bytes);
  ASSERT_TRUE(version.ok()) << version.status();
  const client::Bytes short_bytes(pushed_bytes.begin(), pushed_bytes.end() - sizeof(float));
  auto refused_push = group.clients[0]->UploadWeights(kHead, v1::DTYPE_FP32, short_bytes);
  ASSERT_FALSE(refused_push.ok());
  EXPECT_EQ(refused_push.status().code(), absl::StatusCode::kInvalidArgument)
      << refused_push.status();
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(kHead);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->weights_version, *version) << "process " << p;
    EXPECT_TRUE(w->data == pushed_bytes) << "process " << p << " did not take the push";
  }

  // Deleted through a follower, on every process at once (as its collective needs over NCCL).
  ASSERT_TRUE(group.clients[n - 1]->DeleteHead(kHead).ok());
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(group.clients[p]->GetHead(kHead).status().code(), absl::StatusCode::kNotFound)
        << "process " << p;
  }
}

// Several micro-batches in flight at once (each process stages the next while one runs, in the
// leader's turns): every client on a thread of its own, through its home, beside unkeyed
// micro-batches through every process and a pull (which waits for those in flight), with loss
// and dH still the one-process head's bits (they depend on W alone, not on the order), every
// micro-batch counted once everywhere, and dW the one-process head's within fp32 rounding (the
// order of its sums is the turns').
TEST_P(ShardedGroupTest, MicroBatchesInFlightAtOnceEqualOneProcess) {
  const int n = GetParam().processes;
  const int devices = GetParam().devices;
  const std::string name = absl::StrCat("inflight", n, "x", devices);
  Group group(n, name, DeviceFlags(devices));
  ASSERT_TRUE(group.ok());
  Single one(name + "_one", DeviceFlags(n * devices));
  ASSERT_NE(one.client, nullptr);
  ASSERT_TRUE(group.clients[0]->CreateHead(AcrossSpec(devices)).ok());
  ASSERT_TRUE(one.client->CreateHead(LocalSpec(n * devices)).ok());

  constexpr int kRounds = 4;
  struct Sent {
    HostBatch batch;  // what mb points into
    client::Microbatch mb;
    absl::StatusOr<client::StepResult> got;
  };
  // Keyed ones per client, then unkeyed ones per process.
  std::vector<std::vector<Sent>> sent(kClients + n);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients + n; ++c) {
    const bool keyed = c < kClients;
    const std::string id = keyed ? ClientId(c) : "";
    const int process = keyed ? Home(id, n) : c - kClients;
    sent[c].resize(kRounds);
    for (int k = 0; k < kRounds; ++k) {
      Sent& s = sent[c][k];
      s.batch = Batch(c, k);
      s.mb = ToMicrobatch(kHead, id, keyed ? k + 1 : 0, s.batch);
      s.got = absl::UnknownError("not sent");
    }
    threads.emplace_back([&, c, process] {
      std::unique_ptr<client::Client> client = Connect(group.addresses[process]);
      for (Sent& s : sent[c]) s.got = client->Step(s.mb);
    });
  }
  // A cut among them: it waits for those in flight, and none starts until it is done.
  threads.emplace_back([&] {
    std::unique_ptr<client::Client> client = Connect(group.addresses[n - 1]);
    auto pulled = client->PullGradient(kHead);
    EXPECT_TRUE(pulled.ok()) << pulled.status();
  });
  for (std::thread& t : threads) t.join();

  uint64_t tokens = 0, microbatches = 0;
  for (int c = 0; c < kClients + n; ++c) {
    for (const Sent& s : sent[c]) {
      ASSERT_TRUE(s.got.ok()) << "sender " << c << ": " << s.got.status();
      auto want = one.client->Step(s.mb);
      ASSERT_TRUE(want.ok()) << want.status();
      ExpectSameStep(*s.got, *want, absl::StrCat("sender ", c));
      tokens += static_cast<uint64_t>(s.got->token_count);
      ++microbatches;
    }
  }
  auto reference = one.client->PullGradient(kHead);
  ASSERT_TRUE(reference.ok()) << reference.status();
  const std::vector<float> reference_dw = Floats(reference->data);
  const std::vector<double> want_dw(reference_dw.begin(), reference_dw.end());
  for (int p = 0; p < n; ++p) {
    auto pulled = group.clients[p]->PullGradient(kHead);
    ASSERT_TRUE(pulled.ok()) << "process " << p << ": " << pulled.status();
    EXPECT_EQ(pulled->summary.token_count(), tokens) << "process " << p;
    EXPECT_EQ(pulled->summary.microbatch_count(), microbatches) << "process " << p;
    EXPECT_TRUE(AllClose(Floats(pulled->data), want_dw, 1e-5)) << "process " << p;
  }
}

// One stream's micro-batches in flight at once (the stream sends its next one once the previous
// one's turn is fixed): they keep the stream's order on every process, so that dW is the
// one-process head's bit for bit, as are every loss and dH.
TEST_P(ShardedGroupTest, OneStreamsMicroBatchesInFlightKeepTheirOrder) {
  const int n = GetParam().processes;
  const int devices = GetParam().devices;
  const std::string name = absl::StrCat("stream", n, "x", devices);
  Group group(n, name, DeviceFlags(devices));
  ASSERT_TRUE(group.ok());
  Single one(name + "_one", DeviceFlags(n * devices));
  ASSERT_NE(one.client, nullptr);
  ASSERT_TRUE(group.clients[0]->CreateHead(AcrossSpec(devices)).ok());
  ASSERT_TRUE(one.client->CreateHead(LocalSpec(n * devices)).ok());

  constexpr int kInFlight = 8;
  const std::string id = ClientId(0);
  std::vector<HostBatch> batches;
  for (int k = 0; k < kInFlight; ++k) batches.push_back(Batch(0, k));
  std::unique_ptr<client::Client> client = Connect(group.addresses[Home(id, n)]);
  auto stream = client->OpenStepStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (int k = 0; k < kInFlight; ++k) {
    ASSERT_TRUE((*stream)->Send(ToMicrobatch(kHead, id, k + 1, batches[k])).ok());
  }
  for (int k = 0; k < kInFlight; ++k) {
    auto got = (*stream)->Receive();
    ASSERT_TRUE(got.ok()) << "micro-batch " << k + 1 << ": " << got.status();
    EXPECT_EQ(got->sequence, static_cast<uint64_t>(k + 1));
    auto want = one.client->Step(ToMicrobatch(kHead, id, k + 1, batches[k]));
    ASSERT_TRUE(want.ok()) << want.status();
    ExpectSameStep(*got, *want, absl::StrCat("micro-batch ", k + 1));
  }
  EXPECT_TRUE((*stream)->Finish().ok());
  auto reference = one.client->PullGradient(kHead);
  ASSERT_TRUE(reference.ok()) << reference.status();
  for (int p = 0; p < n; ++p) {
    auto pulled = group.clients[p]->PullGradient(kHead);
    ASSERT_TRUE(pulled.ok()) << "process " << p << ": " << pulled.status();
    EXPECT_EQ(pulled->summary.microbatch_count(), static_cast<uint64_t>(kInFlight));
    EXPECT_TRUE(pulled->data == reference->data) << "process " << p << ": another dW";
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShardedGroupTest,
                         ::testing::Values(Layout{2, 1}, Layout{3, 1}, Layout{2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return absl::StrCat(info.param.processes, "Processes",
                                               info.param.devices, "Devices");
                         });

// The same code over NCCL: two processes of one GPU each (process p on GPU p of this host)
// against one process sharded over both GPUs, within fp32 rounding (NCCL adds in an order of its
// own). Skipped where a server cannot start on two CUDA devices (no GPU, one, or a build without
// CUDA).
TEST(ShardedGroupCudaTest, TwoProcessesOfOneGpuEachAsOneProcessOverTwo) {
  auto probe = ServerProcess::Start(LOSSHEAD_SERVER_BINARY,
                                    {"--backend=cuda", "--devices=0,1", "--grad_stash_bytes=0"},
                                    LogPath("sharded_cuda_one"));
  if (!probe.ok()) {
    GTEST_SKIP() << "a server cannot start on two CUDA devices here: " << probe.status();
  }
  std::unique_ptr<client::Client> one = Connect((*probe)->target());
  ASSERT_NE(one, nullptr);
  constexpr int n = 2;
  Group group(GroupAddresses(n), "sharded_cuda", [](int p) {
    return std::vector<std::string>{"--backend=cuda", absl::StrCat("--devices=", p)};
  });
  ASSERT_TRUE(group.ok());
  ASSERT_TRUE(group.clients[1]->CreateHead(AcrossSpec(1)).ok());
  ASSERT_TRUE(one->CreateHead(LocalSpec(n)).ok());
  auto initial = one->DownloadWeights(kHead);
  ASSERT_TRUE(initial.ok()) << initial.status();
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(kHead);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(w->data == initial->data) << "process " << p << " gathers another W";
  }
  for (int k = 0; k < kPerClient; ++k) {
    for (int c = 0; c < kClients; ++c) {
      const std::string id = ClientId(c);
      const HostBatch batch = Batch(c, k);
      const client::Microbatch mb = ToMicrobatch(kHead, id, k + 1, batch);
      auto done = group.clients[Home(id, n)]->Step(mb);
      ASSERT_TRUE(done.ok()) << done.status();
      auto want = one->Step(mb);
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_NEAR(done->loss_sum, want->loss_sum, 1e-5 * std::abs(want->loss_sum));
      const std::vector<float> want_dh = Floats(want->grad_hidden);
      EXPECT_TRUE(AllClose(Floats(done->grad_hidden),
                           std::vector<double>(want_dh.begin(), want_dh.end()), 1e-5));
    }
  }
  auto reference = one->PullGradient(kHead);
  ASSERT_TRUE(reference.ok()) << reference.status();
  const std::vector<float> want_dw = Floats(reference->data);
  for (int p = 0; p < n; ++p) {
    auto pulled = group.clients[p]->PullGradient(kHead);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    EXPECT_EQ(pulled->summary.microbatch_count(), reference->summary.microbatch_count());
    EXPECT_TRUE(
        AllClose(Floats(pulled->data), std::vector<double>(want_dw.begin(), want_dw.end()), 1e-5))
        << "process " << p;
  }
  auto applied = group.clients[0]->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(applied.ok()) << applied.status();
  auto want_applied = one->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(want_applied.ok()) << want_applied.status();
  EXPECT_NEAR(applied->head_grad_norm(), want_applied->head_grad_norm(),
              1e-5 * want_applied->head_grad_norm());
  auto want_w = one->DownloadWeights(kHead);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  const std::vector<float> want_floats = Floats(want_w->data);
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(kHead);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(AllClose(Floats(w->data),
                         std::vector<double>(want_floats.begin(), want_floats.end()), 1e-5))
        << "process " << p;
  }
  // Deleted through a follower: every process tears its communicators down together (within the
  // call's deadline), and a new head of the name can be created.
  ASSERT_TRUE(group.clients[1]->DeleteHead(kHead).ok());
  for (int p = 0; p < n; ++p) {
    EXPECT_EQ(group.clients[p]->GetHead(kHead).status().code(), absl::StatusCode::kNotFound)
        << "process " << p;
  }
  EXPECT_TRUE(group.clients[0]->CreateHead(AcrossSpec(1)).ok());
}

TEST(ShardedGroupRefusalTest, EachRefusalHasItsCodeAndChangesNothing) {
  // Without a group.
  Single alone("sharded_alone");
  ASSERT_NE(alone.client, nullptr);
  auto no_group = alone.client->CreateHead(AcrossSpec(1));
  ASSERT_FALSE(no_group.ok());
  EXPECT_EQ(no_group.status().code(), absl::StatusCode::kFailedPrecondition) << no_group.status();

  constexpr int n = 2;
  Group group(n, "sharded_refusals");
  ASSERT_TRUE(group.ok());
  v1::HeadSpec replicated = AcrossSpec(1);
  replicated.mutable_placement()->set_kind(v1::PLACEMENT_REPLICATED);
  auto wrong_kind = group.clients[1]->CreateHead(replicated);
  ASSERT_FALSE(wrong_kind.ok());
  EXPECT_EQ(wrong_kind.status().code(), absl::StatusCode::kInvalidArgument) << wrong_kind.status();
  ASSERT_TRUE(group.clients[1]->CreateHead(AcrossSpec(1)).ok());
  auto taken = group.clients[0]->CreateHead(AcrossSpec(1));
  ASSERT_FALSE(taken.ok());
  EXPECT_EQ(taken.status().code(), absl::StatusCode::kAlreadyExists) << taken.status();
  // EmbeddingRows of an id outside the vocabulary (sharded_embedding_test.cc has the rest).
  const int64_t ids[] = {0, kVocab};
  auto rows = group.clients[0]->EmbeddingRows(kHead, ids);
  ASSERT_FALSE(rows.ok());
  EXPECT_EQ(rows.status().code(), absl::StatusCode::kInvalidArgument) << rows.status();
  // The group still serves the head after every refusal.
  const HostBatch batch = Batch(0, 0);
  const std::string id = ClientId(0);
  auto step = group.clients[Home(id, n)]->Step(ToMicrobatch(kHead, id, 1, batch));
  ASSERT_TRUE(step.ok()) << step.status();
  for (int p = 0; p < n; ++p) {
    auto info = group.clients[p]->GetHead(kHead);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->microbatches_since_pull(), 1u) << "process " << p;
  }
}

TEST(ShardedGroupFailureTest, AKilledProcessMakesStepsAndCutsUnavailableCountingNothing) {
  constexpr int n = 3;
  Group group(n, "sharded_killed");
  ASSERT_TRUE(group.ok());
  ASSERT_TRUE(group.clients[0]->CreateHead(AcrossSpec(1)).ok());
  for (int c = 0; c < kClients; ++c) {
    const std::string id = ClientId(c);
    const HostBatch batch = Batch(c, 0);
    ASSERT_TRUE(group.clients[Home(id, n)]->Step(ToMicrobatch(kHead, id, 1, batch)).ok());
  }
  group.processes[2]->Kill();
  // A micro-batch at its home on a survivor: it cannot run on every shard.
  int survivor_client = -1;
  for (int c = 0; c < kClients && survivor_client < 0; ++c) {
    if (Home(ClientId(c), n) != 2) survivor_client = c;
  }
  ASSERT_GE(survivor_client, 0);
  const std::string id = ClientId(survivor_client);
  const HostBatch batch = Batch(survivor_client, 1);
  const client::Microbatch mb = ToMicrobatch(kHead, id, 2, batch);
  const auto start = std::chrono::steady_clock::now();
  auto step = group.clients[Home(id, n)]->Step(mb);
  ASSERT_FALSE(step.ok());
  EXPECT_EQ(step.status().code(), absl::StatusCode::kUnavailable) << step.status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8));
  // Sent again: still UNAVAILABLE, never run.
  auto again = group.clients[Home(id, n)]->Step(mb);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  for (int p = 0; p < 2; ++p) {
    auto pull = group.clients[p]->PullGradient(kHead);
    ASSERT_FALSE(pull.ok());
    EXPECT_EQ(pull.status().code(), absl::StatusCode::kUnavailable) << pull.status();
    auto download = group.clients[p]->DownloadWeights(kHead);
    ASSERT_FALSE(download.ok());
    EXPECT_EQ(download.status().code(), absl::StatusCode::kUnavailable) << download.status();
    auto apply = group.clients[p]->ApplyOptimizer(Apply(1));
    ASSERT_FALSE(apply.ok());
    EXPECT_EQ(apply.status().code(), absl::StatusCode::kUnavailable) << apply.status();
    // Every survivor counts the micro-batches before the kill and none after.
    auto info = group.clients[p]->GetHead(kHead);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->microbatches_since_pull(), static_cast<uint64_t>(kClients)) << "process " << p;
    EXPECT_EQ(info->weights_version(), 1u) << "process " << p;
  }
}

}  // namespace
}  // namespace losshead::testing
