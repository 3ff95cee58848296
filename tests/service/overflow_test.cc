// A client cannot poison the shared gradient window with finite input, end to end: a micro-batch
// whose loss, dH or part of dW could overflow (one hidden row of 3e38, valid in bf16) is answered
// OUT_OF_RANGE among the stream's answers, counted under losshead_failures_total{reason=
// "out_of_range"}, and adds nothing: the window holds exactly the other clients' micro-batches
// (float64 reference) and the optimizer applies over it as if the probe had never been sent.
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/optimizer_testing.h"
#include "tests/service/reference.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kN = 16, kD = 12, kV = 43;

using OverflowTest = SharedServerTest<kTestServerMessageBytes, /*kMetrics=*/true>;

double Failures(int metrics_port) {
  auto body = HttpGet(metrics_port, "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  if (!body.ok()) return -1;
  auto e = ParseExposition(*body);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? e->Sum("losshead_failures_total", {{"method", "Step"}, {"reason", "out_of_range"}})
                : -1;
}

TEST_F(OverflowTest, AHiddenRowOf3e38IsRefusedAndOtherClientsWindowStaysExact) {
  const std::string name = "overflow-probe";
  auto head = CreateKnownHead(*client_, name, kV, kD, v1::DTYPE_BF16, /*seed=*/3);
  ASSERT_TRUE(head.ok()) << head.status();
  v1::OptimizerSpec adamw;
  adamw.set_kind(v1::OPTIMIZER_ADAMW);
  ASSERT_TRUE(client_->SetOptimizer(name, adamw).ok());
  const double failures_before = Failures(server_->metrics_port());

  // Two honest micro-batches from one client; the probe from another, between and after them.
  std::vector<HostBatch> honest;
  for (uint64_t seed : {11, 12}) honest.push_back(MakeBatch(kN, kD, kV, v1::DTYPE_BF16, seed, 5));
  HostBatch probe = MakeBatch(kN, kD, kV, v1::DTYPE_BF16, 13);
  for (int64_t k = 0; k < kD; ++k) probe.hidden[3 * kD + k] = 3e38f;
  probe.hidden_bytes = Encode(probe.hidden, v1::DTYPE_BF16);
  ASSERT_TRUE(std::isfinite(Decode(probe.hidden_bytes, v1::DTYPE_BF16)[3 * kD]));

  ASSERT_TRUE(client_->Step(ToMicrobatch(name, "honest", 1, honest[0])).ok());
  auto refused = client_->Step(ToMicrobatch(name, "probe", 1, probe));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kOutOfRange)
      << (refused.ok() ? "answered OK, loss " + std::to_string(refused->loss)
                       : refused.status().ToString());
  ASSERT_TRUE(client_->Step(ToMicrobatch(name, "honest", 2, honest[1])).ok());
  client::Microbatch eval = ToMicrobatch(name, "probe", 2, probe);
  eval.options.set_forward_only(true);
  EXPECT_EQ(client_->Step(eval).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(Failures(server_->metrics_port()) - failures_before, 2);

  auto pulled = client_->PullGradient(name, v1::DTYPE_FP32, /*reset=*/false);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.microbatch_count(), 2u);
  std::vector<double> want(static_cast<size_t>(kV * kD), 0.0);
  uint64_t tokens = 0;
  for (const HostBatch& b : honest) {
    const RefResult r = Reference(head->weight, b.hidden, b.targets, kN, kD, kV, RefOptions{});
    for (size_t i = 0; i < want.size(); ++i) want[i] += r.grad_weight[i];
    tokens += static_cast<uint64_t>(r.token_count);
  }
  EXPECT_EQ(pulled->summary.token_count(), tokens);
  EXPECT_TRUE(AllClose(Decode(pulled->data, v1::DTYPE_FP32), want, 1e-5));

  // The window is the honest client's: the optimizer steps over it.
  auto applied = client_->ApplyOptimizer(ApplyRequest(name, "t", 1, AdamWParams(0.01, 0.0)));
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(applied->window().microbatch_count(), 2u);
  auto weights = Weights(*client_, name);
  ASSERT_TRUE(weights.ok()) << weights.status();
  for (float w : *weights) ASSERT_TRUE(std::isfinite(w));
  client_->DeleteHead(name).IgnoreError();
}

}  // namespace
}  // namespace losshead::testing
