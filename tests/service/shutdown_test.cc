// Graceful shutdown: work in flight is answered, new calls are refused with UNAVAILABLE.
#include <chrono>
#include <cmath>
#include <thread>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

TEST(ShutdownTest, InFlightMicrobatchIsAnsweredAndNewCallsAreUnavailable) {
  auto server = TestServer::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->NewClient();
  ASSERT_NE(client, nullptr);

  // About 50 GFLOP: several hundred milliseconds on a CPU, so it still runs when Shutdown starts.
  constexpr int64_t n = 4096, d = 256, v = 8192;
  v1::HeadSpec spec;
  spec.set_name("long");
  spec.set_vocab_size(v);
  spec.set_hidden_size(d);
  spec.set_weight_dtype(v1::DTYPE_BF16);
  ASSERT_TRUE(client->CreateHead(spec).ok());
  const HostBatch batch = MakeBatch(n, d, v, v1::DTYPE_BF16, 1);

  auto stream = client->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->Send(ToMicrobatch("long", "s", 1, batch)).ok());
  // Wait until the server holds the whole micro-batch (inflight counts it once received).
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    auto stats = client->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    if (stats->inflight_microbatches() > 0) break;
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "micro-batch never went in flight";
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }

  // Late calls go on a connection of their own. The late micro-batch's bytes may still be unread
  // when the server closes its connections, and a socket closed with unread bytes is reset (TCP
  // RST), which discards what the client had not yet read on that connection: on a shared one,
  // the very answer this test waits for.
  client::ClientOptions late_options;
  late_options.dedicated_connection = true;
  late_options.deadline = absl::Seconds(30);
  auto late_client = client::Client::Connect((*server)->target(), late_options);
  ASSERT_TRUE(late_client.ok()) << late_client.status();
  ASSERT_TRUE((*late_client)->GetHead("long").ok());  // connected before the shutdown begins

  std::thread stopper([&] { (*server)->server().Shutdown(absl::Seconds(30)); });
  // Shutdown has begun once health leaves SERVING (or the call is refused outright).
  for (;;) {
    auto health = client->Health();
    if (!health.ok() || *health != client::ServingStatus::kServing) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

  // From here the answer must still be on its way: Receive blocks until it comes.
  const auto shutdown_seen = std::chrono::steady_clock::now();
  absl::StatusOr<client::StepResult> result;
  std::chrono::steady_clock::duration blocked{};
  std::thread receiver([&] {
    result = (*stream)->Receive();
    blocked = std::chrono::steady_clock::now() - shutdown_seen;
  });

  // A call that starts now is refused.
  auto late = (*late_client)->GetHead("long");
  EXPECT_EQ(late.status().code(), absl::StatusCode::kUnavailable) << late.status();
  // A small one: refused at its header, a large one's unread bytes could get its connection
  // reset when the server closes what is left open, and its answer with it.
  auto late_step =
      (*late_client)->Step(ToMicrobatch("long", "s", 2, MakeBatch(4, d, v, v1::DTYPE_BF16, 2)));
  EXPECT_EQ(late_step.status().code(), absl::StatusCode::kUnavailable) << late_step.status();

  // The micro-batch in flight completes, correctly: a zero head's loss is log V on every token.
  receiver.join();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_GT(blocked, std::chrono::milliseconds(20))
      << "the micro-batch finished before Shutdown began; the test proved nothing";
  EXPECT_EQ(result->token_count, n);
  EXPECT_NEAR(result->loss, std::log(static_cast<double>(v)), 1e-4);
  EXPECT_EQ(result->grad_hidden.size(), static_cast<size_t>(n * d * 2));
  (void)(*stream)->Finish();  // OK or UNAVAILABLE: the server may close the call after answering

  stopper.join();
  (*server)->server().Wait();
  auto after = client->GetHead("long");
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
}

}  // namespace
}  // namespace losshead::testing
