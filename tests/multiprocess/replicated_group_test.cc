// A head replicated across 2 and 3 real server processes on loopback (CPU backend), against
// one-process servers given the same micro-batches:
// - each client's micro-batches go to its home (FNV-1a 64 of its id mod N, computed here
//   independently); a micro-batch sent elsewhere is FAILED_PRECONDITION naming the home's address
//   and counts nothing, and the C++ client's Step follows it there; a replay at the home is not
//   counted twice;
// - a pull through any process equals, bit for bit, the sum in fp64 in process order (rounded
//   once) of the windows of N one-process servers, server p given process p's micro-batches in
//   the same order (the process collective's promise), and one server given all of them within
//   fp32 rounding (its dW adds the micro-batches in another order);
// - an optimizer apply through a follower leaves W the same bits on every process, within fp32
//   rounding of the one-process server's after the same apply, and empties every window; a push
//   through a follower reaches every process, and one refused (a wrong size) changes nothing;
// - killing one process makes the next cut UNAVAILABLE on the others and changes nothing there;
// - a process whose group never forms exits with the reason.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "grpcpp/grpcpp.h"
#include "losshead/client/client.h"
#include "losshead/v1/process_control.grpc.pb.h"
#include "tests/common/server_process.h"
#include "tests/multiprocess/group_util.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {
namespace {

class ReplicatedGroupTest : public ::testing::TestWithParam<int> {};

TEST_P(ReplicatedGroupTest, StepsAtHomeCutAsOneProcessAndApplyKeepsWIdentical) {
  const int n = GetParam();
  Group group(n, absl::StrCat("group", n));
  ASSERT_TRUE(group.ok());
  // Membership: every process lists every address, itself at its rank.
  for (int p = 0; p < n; ++p) {
    auto stub = v1::ProcessControl::NewStub(
        grpc::CreateChannel(group.addresses[p], grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    v1::MembersResponse members;
    ASSERT_TRUE(stub->Members(&context, v1::MembersRequest(), &members).ok());
    EXPECT_EQ(members.rank(), p);
    EXPECT_EQ(std::vector<std::string>(members.addresses().begin(), members.addresses().end()),
              group.addresses);
  }
  // Created through the last process (a follower): every process holds the head, the same W.
  ASSERT_TRUE(group.clients[n - 1]->CreateHead(Spec()).ok());
  Single all("all" + std::to_string(n));
  ASSERT_NE(all.client, nullptr);
  ASSERT_TRUE(all.client->CreateHead(Spec()).ok());
  std::vector<std::unique_ptr<Single>> per_process;
  for (int p = 0; p < n; ++p) {
    per_process.push_back(std::make_unique<Single>(absl::StrCat("proc", n, "_", p)));
    ASSERT_NE(per_process[p]->client, nullptr);
    ASSERT_TRUE(per_process[p]->client->CreateHead(Spec()).ok());
  }
  auto initial = all.client->DownloadWeights(kHead);
  ASSERT_TRUE(initial.ok()) << initial.status();
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(kHead);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(w->data == initial->data) << "process " << p << " holds another W";
  }

  // Micro-batches in one fixed order, each to its client's home (and to the references); the
  // last round through a client of process 0 that follows the redirect to each home.
  std::unique_ptr<client::Client> redirected = Connect(group.addresses[0], /*follow=*/true);
  ASSERT_NE(redirected, nullptr);
  uint64_t tokens = 0, microbatches = 0;
  for (int k = 0; k < kPerClient; ++k) {
    for (int c = 0; c < kClients; ++c) {
      const std::string id = ClientId(c);
      const int home = Home(id, n);
      const HostBatch batch = Batch(c, k);
      const client::Microbatch mb = ToMicrobatch(kHead, id, k + 1, batch);
      if (k == 0) {
        // First to a process that is not its home: refused, naming the home, counting nothing.
        const int elsewhere = (home + 1) % n;
        auto refused = group.clients[elsewhere]->Step(mb);
        ASSERT_FALSE(refused.ok());
        EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
            << refused.status();
        EXPECT_NE(refused.status().message().find(absl::StrCat("home=", group.addresses[home])),
                  std::string::npos)
            << refused.status();
      }
      auto done = (k == kPerClient - 1 ? *redirected : *group.clients[home]).Step(mb);
      ASSERT_TRUE(done.ok()) << "client " << id << " at process " << home << ": " << done.status();
      EXPECT_FALSE(done->replayed);
      auto want = all.client->Step(mb);
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(done->loss_sum, want->loss_sum) << "client " << id << " k " << k;
      ASSERT_TRUE(per_process[home]->client->Step(mb).ok());
      tokens += static_cast<uint64_t>(done->token_count);
      ++microbatches;
      if (k == 1) {
        // A replay at the home: answered again, not counted again.
        auto again = group.clients[home]->Step(mb);
        ASSERT_TRUE(again.ok()) << again.status();
        EXPECT_TRUE(again->replayed);
      }
    }
  }

  // A pull through every process: the same summary and bits everywhere.
  std::vector<double> summed(static_cast<size_t>(kVocab * kHidden), 0.0);
  for (int p = 0; p < n; ++p) {
    auto local = per_process[p]->client->PullGradient(kHead);
    ASSERT_TRUE(local.ok()) << local.status();
    const std::vector<float> values = Floats(local->data);
    for (size_t i = 0; i < values.size(); ++i) summed[i] += values[i];
  }
  std::vector<float> bit_exact(summed.size());
  for (size_t i = 0; i < summed.size(); ++i) bit_exact[i] = static_cast<float>(summed[i]);
  auto reference = all.client->PullGradient(kHead);
  ASSERT_TRUE(reference.ok()) << reference.status();
  const std::vector<float> one_process = Floats(reference->data);
  std::vector<double> one_process_wide(one_process.begin(), one_process.end());
  for (int p = 0; p < n; ++p) {
    auto pulled = group.clients[p]->PullGradient(kHead);
    ASSERT_TRUE(pulled.ok()) << "process " << p << ": " << pulled.status();
    EXPECT_EQ(pulled->summary.token_count(), tokens);
    EXPECT_EQ(pulled->summary.microbatch_count(), microbatches);
    EXPECT_EQ(pulled->summary.token_count(), reference->summary.token_count());
    EXPECT_EQ(pulled->summary.microbatch_count(), reference->summary.microbatch_count());
    const std::vector<float> got = Floats(pulled->data);
    ASSERT_EQ(got.size(), bit_exact.size());
    EXPECT_EQ(std::memcmp(got.data(), bit_exact.data(), got.size() * sizeof(float)), 0)
        << "process " << p << ": not the fp64 sum of the processes' windows";
    EXPECT_TRUE(AllClose(got, one_process_wide, 1e-5)) << "process " << p;
  }

  // An optimizer step through a follower: W the same bits on every process, the one-process
  // server's within fp32 rounding, every window empty.
  auto applied = group.clients[n - 1]->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(applied.ok()) << applied.status();
  auto want_applied = all.client->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(want_applied.ok()) << want_applied.status();
  EXPECT_EQ(applied->window().token_count(), tokens);
  EXPECT_EQ(applied->window().microbatch_count(), microbatches);
  EXPECT_NEAR(applied->head_grad_norm(), want_applied->head_grad_norm(),
              1e-5 * want_applied->head_grad_norm());
  EXPECT_EQ(applied->weights_version(), want_applied->weights_version());
  auto want_w = all.client->DownloadWeights(kHead);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  const std::vector<float> want_floats = Floats(want_w->data);
  const std::vector<double> want_wide(want_floats.begin(), want_floats.end());
  auto w0 = group.clients[0]->DownloadWeights(kHead);
  ASSERT_TRUE(w0.ok()) << w0.status();
  EXPECT_FALSE(w0->data == initial->data) << "the apply did not step W";
  EXPECT_TRUE(AllClose(Floats(w0->data), want_wide, 1e-5));
  for (int p = 0; p < n; ++p) {
    auto w = group.clients[p]->DownloadWeights(kHead);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->weights_version, applied->weights_version());
    EXPECT_TRUE(w->data == w0->data) << "process " << p << " holds another W after the apply";
    auto window = group.clients[p]->PullGradient(kHead);
    ASSERT_TRUE(window.ok()) << window.status();
    EXPECT_EQ(window->summary.token_count(), 0u) << "process " << p;
  }
  // A push through a follower reaches every process; one of the wrong size changes nothing.
  const std::vector<float> pushed = RandomValues(kVocab * kHidden, 0.2, v1::DTYPE_FP32, 77);
  const client::Bytes pushed_bytes = Encode(pushed, v1::DTYPE_FP32);
  auto version = group.clients[1]->UploadWeights(kHead, v1::DTYPE_FP32, pushed_bytes);
  ASSERT_TRUE(version.ok()) << version.status();
  auto want_version = all.client->UploadWeights(kHead, v1::DTYPE_FP32, pushed_bytes);
  ASSERT_TRUE(want_version.ok()) << want_version.status();
  EXPECT_EQ(*version, *want_version);
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

  // The same apply again, through another process: remembered, nothing stepped.
  auto replayed = group.clients[0]->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(replayed->replayed());
  EXPECT_EQ(replayed->weights_version(), applied->weights_version());
  auto unchanged = group.clients[n - 1]->DownloadWeights(kHead);
  ASSERT_TRUE(unchanged.ok()) << unchanged.status();
  EXPECT_EQ(unchanged->weights_version, *version);
}

INSTANTIATE_TEST_SUITE_P(Processes, ReplicatedGroupTest, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat(info.param, "Processes");
                         });

// Inside each process the head may itself be spread over several devices (two CPU devices per
// process here): the cut reduces each process's replicas or shards to their rows' owners before
// the processes sum their windows, and the apply steps each owner's rows.
class LocalPlacementTest : public ::testing::TestWithParam<v1::PlacementKind> {};

TEST_P(LocalPlacementTest, EveryProcessSpreadOverTwoDevicesCutsAsOneProcess) {
  constexpr int n = 2;
  const std::string name = absl::StrCat("placement", static_cast<int>(GetParam()));
  Group group(n, name, {"--devices=0,1"});
  ASSERT_TRUE(group.ok());
  v1::HeadSpec spec = Spec();
  spec.mutable_placement()->set_kind(GetParam());
  spec.mutable_placement()->set_devices(2);
  ASSERT_TRUE(group.clients[1]->CreateHead(spec).ok());
  Single all(name + "_all");
  ASSERT_NE(all.client, nullptr);
  ASSERT_TRUE(all.client->CreateHead(Spec()).ok());
  for (int k = 0; k < kPerClient; ++k) {
    for (int c = 0; c < kClients; ++c) {
      const std::string id = ClientId(c);
      const HostBatch batch = Batch(c, k);
      const client::Microbatch mb = ToMicrobatch(kHead, id, k + 1, batch);
      ASSERT_TRUE(group.clients[Home(id, n)]->Step(mb).ok());
      ASSERT_TRUE(all.client->Step(mb).ok());
    }
  }
  auto reference = all.client->PullGradient(kHead);
  ASSERT_TRUE(reference.ok()) << reference.status();
  const std::vector<float> want = Floats(reference->data);
  const std::vector<double> want_wide(want.begin(), want.end());
  for (int p = 0; p < n; ++p) {
    auto pulled = group.clients[p]->PullGradient(kHead);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    EXPECT_EQ(pulled->summary.token_count(), reference->summary.token_count());
    EXPECT_TRUE(AllClose(Floats(pulled->data), want_wide, 1e-5)) << "process " << p;
  }
  auto applied = group.clients[0]->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(applied.ok()) << applied.status();
  ASSERT_TRUE(all.client->ApplyOptimizer(Apply(1)).ok());
  auto want_w = all.client->DownloadWeights(kHead);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  const std::vector<float> want_floats = Floats(want_w->data);
  const std::vector<double> want_w_wide(want_floats.begin(), want_floats.end());
  auto w0 = group.clients[0]->DownloadWeights(kHead);
  ASSERT_TRUE(w0.ok()) << w0.status();
  EXPECT_TRUE(AllClose(Floats(w0->data), want_w_wide, 1e-5));
  auto w1 = group.clients[1]->DownloadWeights(kHead);
  ASSERT_TRUE(w1.ok()) << w1.status();
  EXPECT_TRUE(w1->data == w0->data) << "the processes hold different W after the apply";
  for (int p = 0; p < n; ++p) {
    auto window = group.clients[p]->PullGradient(kHead);
    ASSERT_TRUE(window.ok()) << window.status();
    EXPECT_EQ(window->summary.token_count(), 0u) << "process " << p;
    EXPECT_TRUE(std::all_of(window->data.begin(), window->data.end(),
                            [](std::byte b) { return b == std::byte{0}; }))
        << "process " << p << " kept part of the stepped window";
  }
}

INSTANTIATE_TEST_SUITE_P(Placements, LocalPlacementTest,
                         ::testing::Values(v1::PLACEMENT_REPLICATED, v1::PLACEMENT_SHARDED),
                         [](const ::testing::TestParamInfo<v1::PlacementKind>& info) {
                           return info.param == v1::PLACEMENT_REPLICATED ? "Replicated"
                                                                         : "Sharded";
                         });

TEST(ReplicatedGroupFailureTest, AKilledProcessMakesTheNextCutUnavailableAndChangesNothing) {
  constexpr int n = 3;
  Group group(n, "killed");
  ASSERT_TRUE(group.ok());
  ASSERT_TRUE(group.clients[0]->CreateHead(Spec()).ok());
  for (int c = 0; c < kClients; ++c) {
    const std::string id = ClientId(c);
    const HostBatch batch = Batch(c, 0);
    ASSERT_TRUE(group.clients[Home(id, n)]->Step(ToMicrobatch(kHead, id, 1, batch)).ok());
  }
  auto before = group.clients[0]->DownloadWeights(kHead);
  ASSERT_TRUE(before.ok()) << before.status();
  group.processes[2]->Kill();
  const auto start = std::chrono::steady_clock::now();
  auto through_follower = group.clients[1]->ApplyOptimizer(Apply(1));
  ASSERT_FALSE(through_follower.ok());
  EXPECT_EQ(through_follower.status().code(), absl::StatusCode::kUnavailable)
      << through_follower.status();
  // Within the op timeout (5 s), with room for scheduling.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(8));
  auto through_leader = group.clients[0]->ApplyOptimizer(Apply(1));
  ASSERT_FALSE(through_leader.ok());
  EXPECT_EQ(through_leader.status().code(), absl::StatusCode::kUnavailable)
      << through_leader.status();
  auto pull = group.clients[1]->PullGradient(kHead, v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_FALSE(pull.ok());
  EXPECT_EQ(pull.status().code(), absl::StatusCode::kUnavailable) << pull.status();
  // The survivors changed nothing: W and its version as before.
  for (int p = 0; p < 2; ++p) {
    auto w = group.clients[p]->DownloadWeights(kHead);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->weights_version, before->weights_version) << "process " << p;
    EXPECT_TRUE(w->data == before->data) << "process " << p;
  }
  // A micro-batch at its home on a survivor: its window can never be cut now.
  for (int c = 0; c < kClients; ++c) {
    const std::string id = ClientId(c);
    if (Home(id, n) == 2) continue;
    const HostBatch batch = Batch(c, 1);
    auto step = group.clients[Home(id, n)]->Step(ToMicrobatch(kHead, id, 2, batch));
    ASSERT_FALSE(step.ok());
    EXPECT_EQ(step.status().code(), absl::StatusCode::kUnavailable) << step.status();
    break;
  }
}

TEST(ReplicatedGroupFailureTest, AProcessWhoseGroupNeverFormsExitsWithTheReason) {
  const std::vector<int> ports = FreeLoopbackPorts(3);
  const std::string log = LogPath("lonely");
  auto code = ServerProcess::RunToExit(
      LOSSHEAD_SERVER_BINARY,
      {"--backend=cpu", absl::StrCat("--listen=127.0.0.1:", ports[0]),
       absl::StrCat("--group_peers=127.0.0.1:", ports[1], ",127.0.0.1:", ports[2]),
       "--group_rank=0", "--group_bootstrap_timeout=500ms"},
      log, absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 1);
  const std::string text = ReadText(log);
  EXPECT_NE(text.find("the process group did not form"), std::string::npos) << text;
  EXPECT_NE(text.find("DEADLINE_EXCEEDED"), std::string::npos) << text;
  EXPECT_NE(text.find(absl::StrCat("127.0.0.1:", ports[2])), std::string::npos) << text;
}

}  // namespace
}  // namespace losshead::testing
