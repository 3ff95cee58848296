// A server of three CPU devices, scraped: each device's memory series hold what the heads placed
// on it hold, and each device's busy time is the compute time of the micro-batches that ran on it
// (every shard's device for a sharded head, the replica that ran it for a replicated one).
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int kDevices = 3;
constexpr int64_t kV = 29, kD = 8;  // 29 rows over 3 shards: 9, 10, 10

v1::Placement PlacementOf(v1::PlacementKind kind) {
  v1::Placement placement;
  placement.set_kind(kind);
  placement.set_devices(kDevices);
  return placement;
}

std::string Device(int i) { return absl::StrCat("cpu:", i); }

// Scrapes until `head` has `computed` compute observations (the server records a micro-batch's
// phases when it is done with it, which may be just after the client has its answer).
Exposition ScrapeAfter(int port, const std::string& head, int computed) {
  for (const absl::Time give_up = absl::Now() + absl::Seconds(20);;) {
    auto body = HttpGet(port, "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    if (!body.ok()) return {};
    auto e = ParseExposition(*body);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return {};
    if (e->Sum("losshead_step_phase_duration_seconds_count",
               {{"head", head}, {"phase", "compute"}}) >= computed ||
        absl::Now() > give_up) {
      return *e;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

// Sends `count` micro-batches of 12 tokens on `streams` concurrent streams; all must succeed.
void Step(client::Client& client, const std::string& head, int streams, int count, uint64_t seed) {
  std::vector<std::thread> threads;
  for (int s = 0; s < streams; ++s) {
    threads.emplace_back([&, s] {
      auto stream = client.OpenStepStream();
      ASSERT_TRUE(stream.ok()) << stream.status();
      std::vector<HostBatch> batches;
      for (int i = s; i < count; i += streams) {
        batches.push_back(MakeBatch(12, kD, kV, v1::DTYPE_BF16, seed + i));
      }
      for (size_t i = 0; i < batches.size(); ++i) {
        ASSERT_TRUE((*stream)
                        ->Send(ToMicrobatch(head, absl::StrCat(head, "-", s), i + 1, batches[i]))
                        .ok());
      }
      for (size_t i = 0; i < batches.size(); ++i) {
        auto answer = (*stream)->Receive();
        ASSERT_TRUE(answer.ok()) << answer.status();
      }
      ASSERT_TRUE((*stream)->Finish().ok());
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(DeviceMetricsTest, EachDeviceReportsItsOwnMemoryAndBusyTime) {
  server::ServerOptions options = TestServer::Options(kTestServerMessageBytes, /*metrics=*/true);
  options.devices = {0, 1, 2};
  auto server = TestServer::StartWith(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->metrics_port();
  ASSERT_GT(port, 0);
  auto client = (*server)->NewClient();

  // Before any head: every device has its series, busy from 0 and no head memory.
  {
    auto body = HttpGet(port, "/metrics");
    ASSERT_TRUE(body.ok()) << body.status();
    auto e = ParseExposition(*body);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->Find("losshead_device_busy_seconds_total").size(), size_t{kDevices});
    for (int i = 0; i < kDevices; ++i) {
      ASSERT_EQ(e->Find("losshead_device_busy_seconds_total", {{"device", Device(i)}}).size(), 1u);
      EXPECT_EQ(e->Sum("losshead_device_busy_seconds_total", {{"device", Device(i)}}), 0);
      EXPECT_EQ(
          e->Sum("losshead_device_memory_bytes", {{"device", Device(i)}, {"kind", "weights"}}), 0);
      const double total =
          e->Sum("losshead_device_memory_bytes", {{"device", Device(i)}, {"kind", "total"}});
      EXPECT_GT(total, 0) << Device(i);  // the host's memory, for a CPU device
      EXPECT_LE(e->Sum("losshead_device_memory_bytes", {{"device", Device(i)}, {"kind", "free"}}),
                total);
    }
  }

  ASSERT_TRUE(CreateKnownHead(*client, "sharded", kV, kD, v1::DTYPE_BF16, 1, 0.5,
                              PlacementOf(v1::PLACEMENT_SHARDED))
                  .ok());
  ASSERT_TRUE(CreateKnownHead(*client, "replicated", kV, kD, v1::DTYPE_BF16, 2, 0.5,
                              PlacementOf(v1::PLACEMENT_REPLICATED))
                  .ok());

  // A sharded micro-batch runs on every shard: each device's busy time is the head's compute time.
  Step(*client, "sharded", 1, 3, 100);
  Exposition after_sharded = ScrapeAfter(port, "sharded", 3);
  const double sharded_compute = after_sharded.Sum("losshead_step_phase_duration_seconds_sum",
                                                   {{"head", "sharded"}, {"phase", "compute"}});
  ASSERT_GT(sharded_compute, 0);
  std::vector<double> busy(kDevices);
  for (int i = 0; i < kDevices; ++i) {
    busy[i] = after_sharded.Sum("losshead_device_busy_seconds_total", {{"device", Device(i)}});
    EXPECT_NEAR(busy[i], sharded_compute, 1e-9 * sharded_compute) << Device(i);
  }

  // A replicated micro-batch runs on one replica: the devices' busy time grows by the head's
  // compute time in all.
  Step(*client, "replicated", 3, 9, 200);
  Exposition after_replicated = ScrapeAfter(port, "replicated", 9);
  const double replicated_compute = after_replicated.Sum(
      "losshead_step_phase_duration_seconds_sum", {{"head", "replicated"}, {"phase", "compute"}});
  ASSERT_GT(replicated_compute, 0);
  double grown = 0;
  for (int i = 0; i < kDevices; ++i) {
    const double now =
        after_replicated.Sum("losshead_device_busy_seconds_total", {{"device", Device(i)}});
    EXPECT_GE(now, busy[i]) << Device(i);
    grown += now - busy[i];
  }
  EXPECT_NEAR(grown, replicated_compute, 1e-9 * (sharded_compute + replicated_compute));

  // Memory: shard i's rows [V i / k, V (i + 1) / k) of W (bf16) and dW (fp32), plus a whole
  // replica of each.
  for (int i = 0; i < kDevices; ++i) {
    const int64_t rows = kV * (i + 1) / kDevices - kV * i / kDevices;
    const std::map<std::string, std::string> weights{{"device", Device(i)}, {"kind", "weights"}};
    const std::map<std::string, std::string> gradient{{"device", Device(i)}, {"kind", "gradient"}};
    EXPECT_EQ(after_replicated.Sum("losshead_device_memory_bytes", weights),
              static_cast<double>((rows + kV) * kD * 2))
        << Device(i);
    EXPECT_EQ(after_replicated.Sum("losshead_device_memory_bytes", gradient),
              static_cast<double>((rows + kV) * kD * 4))
        << Device(i);
  }
  // The devices together hold what the heads say they hold.
  for (const char* kind : {"weights", "gradient", "workspace"}) {
    EXPECT_EQ(after_replicated.Sum("losshead_device_memory_bytes", {{"kind", kind}}),
              after_replicated.Sum("losshead_head_memory_bytes", {{"kind", kind}}))
        << kind;
  }

  // Deleting the heads gives their memory back on every device.
  ASSERT_TRUE(client->DeleteHead("sharded").ok());
  ASSERT_TRUE(client->DeleteHead("replicated").ok());
  auto body = HttpGet(port, "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  auto e = ParseExposition(*body);
  ASSERT_TRUE(e.ok()) << e.status();
  for (int i = 0; i < kDevices; ++i) {
    EXPECT_EQ(e->Sum("losshead_device_memory_bytes", {{"device", Device(i)}, {"kind", "weights"}}),
              0)
        << Device(i);
  }
}

}  // namespace
}  // namespace losshead::testing
