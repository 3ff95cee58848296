// A server of several devices (three CPU devices here) end to end: a replicated head spreads over
// them and says so, its gradient window (and a vocabulary-sharded head's) is the float64 sum of
// every micro-batch sent while pulls with reset cut it from another client, and its checkpoint
// restores onto however many devices the next server has.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

v1::Placement Replicated(uint32_t devices) {
  v1::Placement placement;
  placement.set_kind(v1::PLACEMENT_REPLICATED);
  placement.set_devices(devices);
  return placement;
}

v1::Placement Sharded(uint32_t devices) {
  v1::Placement placement = Replicated(devices);
  placement.set_kind(v1::PLACEMENT_SHARDED);
  return placement;
}

std::unique_ptr<TestServer> StartOn(std::vector<int> devices, const std::string& checkpoints = "") {
  server::ServerOptions options = TestServer::Options();
  options.devices = std::move(devices);
  options.checkpoint_dir = checkpoints;
  auto server = TestServer::StartWith(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

TEST(ReplicatedServiceTest, HeadsArePlacedOnTheDevicesTheyAskFor) {
  auto server = StartOn({0, 1, 2});
  ASSERT_NE(server, nullptr);
  auto client = server->NewClient();
  auto stats = client->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->devices_size(), 3);
  EXPECT_EQ(stats->device().name(), stats->devices(0).name());

  constexpr int64_t v = 29, d = 8;
  auto all = CreateKnownHead(*client, "all", v, d, v1::DTYPE_BF16, 1, 0.5, Replicated(0));
  ASSERT_TRUE(all.ok()) << all.status();
  auto info = client->GetHead("all");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->spec().placement().kind(), v1::PLACEMENT_REPLICATED);
  EXPECT_EQ(info->spec().placement().devices(), 3u);
  ASSERT_EQ(info->devices_size(), 3);
  ASSERT_EQ(info->device_memory_size(), 3);
  for (const v1::HeadMemory& memory : info->device_memory()) {
    EXPECT_EQ(memory.weights_bytes(), static_cast<uint64_t>(v * d * 2));
    EXPECT_EQ(memory.gradient_bytes(), static_cast<uint64_t>(v * d * 4));
  }
  EXPECT_EQ(info->memory().weights_bytes(), static_cast<uint64_t>(3 * v * d * 2));

  auto two = CreateKnownHead(*client, "two", v, d, v1::DTYPE_BF16, 2, 0.5, Replicated(2));
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(client->GetHead("two")->devices_size(), 2);
  auto one = CreateKnownHead(*client, "one", v, d, v1::DTYPE_BF16, 3);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(client->GetHead("one")->devices_size(), 1);

  v1::HeadSpec spec;
  spec.set_name("four");
  spec.set_vocab_size(v);
  spec.set_hidden_size(d);
  spec.set_weight_dtype(v1::DTYPE_BF16);
  *spec.mutable_placement() = Replicated(4);
  auto four = client->CreateHead(spec);
  EXPECT_EQ(four.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(four.status().message(),
            "placement asks for 4 devices but the server has 3 (--devices)");
  EXPECT_EQ(client->GetHead("four").status().code(), absl::StatusCode::kNotFound);
}

// Three streams with three micro-batches in flight each, while another client pulls with reset:
// the pulls add up to the float64 sum of every micro-batch, each counted once.
void PullsWithResetLoseNothing(const v1::Placement& placement) {
  auto server = StartOn({0, 1, 2});
  ASSERT_NE(server, nullptr);
  auto admin = server->NewClient();
  constexpr int kSteppers = 3, kPerStepper = 8;
  constexpr int64_t n = 24, d = 16, v = 53;  // 53 rows: the devices own 17, 18 and 18
  auto head = CreateKnownHead(*admin, "racing", v, d, v1::DTYPE_FP32, 4, 0.5, placement);
  ASSERT_TRUE(head.ok()) << head.status();

  std::vector<double> want_dw(v * d, 0.0);
  uint64_t want_tokens = 0;
  std::vector<std::vector<HostBatch>> batches(kSteppers);
  std::vector<std::vector<RefResult>> want(kSteppers);
  for (int s = 0; s < kSteppers; ++s) {
    for (int i = 0; i < kPerStepper; ++i) {
      batches[s].push_back(MakeBatch(n, d, v, v1::DTYPE_FP32, 900 + 17 * s + i, 2 + (i % 4)));
      want[s].push_back(
          Reference(head->weight, batches[s][i].hidden, batches[s][i].targets, n, d, v, {}));
      want_tokens += want[s][i].token_count;
      for (size_t k = 0; k < want_dw.size(); ++k) want_dw[k] += want[s][i].grad_weight[k];
    }
  }

  std::atomic<int> running{kSteppers};
  std::vector<absl::Status> statuses(kSteppers + 1);
  std::vector<std::vector<client::StepResult>> results(kSteppers);
  std::vector<double> pulled_dw(v * d, 0.0);
  uint64_t pulled_tokens = 0, pulled_microbatches = 0;
  auto add_pull = [&](const client::PulledGradient& g) {
    pulled_tokens += g.summary.token_count();
    pulled_microbatches += g.summary.microbatch_count();
    const std::vector<float> dw = Decode(g.data, v1::DTYPE_FP32);
    for (size_t k = 0; k < dw.size(); ++k) pulled_dw[k] += dw[k];
  };
  std::vector<std::thread> threads;
  for (int s = 0; s < kSteppers; ++s) {
    threads.emplace_back([&, s] {
      auto client = server->NewClient();
      auto stream = client->OpenStepStream();
      if (!stream.ok()) {
        statuses[s] = stream.status();
        running.fetch_sub(1);
        return;
      }
      auto receive = [&] {
        auto got = (*stream)->Receive();
        if (got.ok()) {
          results[s].push_back(*got);
        } else {
          statuses[s] = got.status();
        }
      };
      for (int i = 0; i < kPerStepper; ++i) {
        // Three in flight: a stream's micro-batches run on several replicas at once.
        absl::Status sent = (*stream)->Send(
            ToMicrobatch(head->name, absl::StrCat("stepper", s), i + 1, batches[s][i]));
        if (!sent.ok()) statuses[s] = sent;
        if ((*stream)->outstanding() >= 3) receive();
      }
      while ((*stream)->outstanding() > 0) receive();
      if (statuses[s].ok()) statuses[s] = (*stream)->Finish();
      running.fetch_sub(1);
    });
  }
  threads.emplace_back([&] {
    auto client = server->NewClient();
    while (running.load() > 0) {
      auto g = client->PullGradient(head->name, v1::DTYPE_FP32, /*reset=*/true);
      if (!g.ok()) {
        statuses[kSteppers] = g.status();
        return;
      }
      add_pull(*g);
    }
  });
  for (auto& t : threads) t.join();
  for (const absl::Status& s : statuses) ASSERT_TRUE(s.ok()) << s;

  for (int s = 0; s < kSteppers; ++s) {
    ASSERT_EQ(results[s].size(), static_cast<size_t>(kPerStepper));
    for (int i = 0; i < kPerStepper; ++i) {
      EXPECT_NEAR(results[s][i].loss, want[s][i].loss, 1e-5 * std::max(1.0, want[s][i].loss));
      EXPECT_TRUE(AllClose(Decode(results[s][i].grad_hidden, results[s][i].grad_hidden_dtype),
                           want[s][i].grad_hidden, 1e-4));
    }
  }
  auto last = admin->PullGradient(head->name, v1::DTYPE_FP32, true);
  ASSERT_TRUE(last.ok()) << last.status();
  add_pull(*last);
  EXPECT_EQ(pulled_tokens, want_tokens);
  EXPECT_EQ(pulled_microbatches, static_cast<uint64_t>(kSteppers * kPerStepper));
  EXPECT_TRUE(AllClose(std::vector<float>(pulled_dw.begin(), pulled_dw.end()), want_dw, 1e-4));
  // Every replica ran micro-batches (each sized its workspace).
  auto info = admin->GetHead(head->name);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->spec().placement().kind(), placement.kind());
  ASSERT_EQ(info->device_memory_size(), 3);
  for (const v1::HeadMemory& memory : info->device_memory()) {
    EXPECT_GT(memory.workspace_bytes(), 0u);
  }
}

TEST(ReplicatedServiceTest, PullsWithResetWhileStreamsStepLoseNothingAndCountNothingTwice) {
  PullsWithResetLoseNothing(Replicated(3));
}

TEST(ShardedServiceTest, PullsWithResetWhileStreamsStepLoseNothingAndCountNothingTwice) {
  PullsWithResetLoseNothing(Sharded(3));
}

TEST(ReplicatedServiceTest, CheckpointRestoresOntoTheDevicesTheNextServerHas) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / absl::StrCat("losshead-replicated-", getpid()))
          .string();
  std::filesystem::remove_all(dir);
  constexpr int64_t n = 20, d = 12, v = 31;
  client::Bytes saved_dw;
  client::DownloadedWeights saved_w;
  {
    auto server = StartOn({0, 1}, dir);
    ASSERT_NE(server, nullptr);
    auto client = server->NewClient();
    auto head = CreateKnownHead(*client, "kept", v, d, v1::DTYPE_BF16, 5, 0.5, Replicated(2));
    ASSERT_TRUE(head.ok()) << head.status();
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(client
                      ->Step(ToMicrobatch("kept", "c", i + 1,
                                          MakeBatch(n, d, v, v1::DTYPE_BF16, 70 + i, 3)))
                      .ok());
    }
    auto pulled = client->PullGradient("kept", v1::DTYPE_FP32, false);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    saved_dw = pulled->data;
    auto w = client->DownloadWeights("kept", v1::DTYPE_BF16);
    ASSERT_TRUE(w.ok()) << w.status();
    saved_w = *w;
    ASSERT_TRUE(client->Checkpoint().ok());
  }
  for (std::vector<int> devices : {std::vector<int>{0}, std::vector<int>{0, 1, 2}}) {
    auto server = StartOn(devices, dir);
    ASSERT_NE(server, nullptr);
    auto client = server->NewClient();
    auto info = client->GetHead("kept");
    ASSERT_TRUE(info.ok()) << info.status();
    // Asked for 2: all of a one-device server, and 2 of a three-device one.
    EXPECT_EQ(info->devices_size(), devices.size() == 1 ? 1 : 2);
    auto pulled = client->PullGradient("kept", v1::DTYPE_FP32, false);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    EXPECT_EQ(pulled->data, saved_dw);  // reduced once before the save: restored as it was
    EXPECT_EQ(pulled->summary.microbatch_count(), 4u);
    auto w = client->DownloadWeights("kept", v1::DTYPE_BF16);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->data, saved_w.data);
    EXPECT_EQ(w->weights_version, saved_w.weights_version);
    // A repeated key still replays rather than counting again.
    auto replay =
        client->Step(ToMicrobatch("kept", "c", 4, MakeBatch(n, d, v, v1::DTYPE_BF16, 73, 3)));
    ASSERT_TRUE(replay.ok()) << replay.status();
    EXPECT_EQ(client->GetHead("kept")->microbatches_since_pull(), 4u);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace losshead::testing
