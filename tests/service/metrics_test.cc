// The Prometheus endpoint, scraped over HTTP after known traffic: counters equal what was sent,
// histograms are internally consistent, and every metric of docs/metrics.md is exported.
#include <cmath>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/optimizer_testing.h"
#include "tests/service/test_server.h"

#ifndef LOSSHEAD_SOURCE_DIR
#error "LOSSHEAD_SOURCE_DIR must name the repository root"
#endif

namespace losshead::testing {
namespace {

// The counters of what micro-batches asked for (asked_metrics_test.cc).
const std::set<std::string> kAskedMetrics = {
    "losshead_token_output_tokens_total", "losshead_top_k_microbatches_total",
    "losshead_loss_term_microbatches_total", "losshead_embedding_rows_total",
    "losshead_embedding_grad_rows_total"};

// (name, type) for each row of the table in docs/metrics.md.
std::vector<std::pair<std::string, std::string>> DocumentedMetrics() {
  std::ifstream in(std::string(LOSSHEAD_SOURCE_DIR) + "/docs/metrics.md");
  std::vector<std::pair<std::string, std::string>> out;
  const std::regex row(R"(^\|\s*`([a-z_]+)`\s*\|\s*([a-z]+)\s*\|)");
  std::string line;
  while (std::getline(in, line)) {
    std::smatch m;
    if (std::regex_search(line, m, row)) out.emplace_back(m[1], m[2]);
  }
  return out;
}

TEST(MetricsTest, ScrapedCountersMatchTrafficAndEveryDocumentedMetricIsExported) {
  auto server = TestServer::Start(size_t{4} << 20, /*metrics=*/true);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->metrics_port(), 0);
  auto client = (*server)->NewClient();
  constexpr int64_t d = 16, v = 37;
  auto head = CreateKnownHead(*client, "metered", v, d, v1::DTYPE_BF16, 1);
  ASSERT_TRUE(head.ok()) << head.status();

  // Three good micro-batches with ignored tokens, one replay, one error.
  int64_t tokens = 0;
  uint64_t bytes_in = 0;
  std::vector<HostBatch> batches;
  for (int i = 0; i < 3; ++i) batches.push_back(MakeBatch(20 + i, d, v, v1::DTYPE_BF16, 10 + i, 3));
  auto stream = client->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE((*stream)->Send(ToMicrobatch(head->name, "m", i + 1, batches[i])).ok());
    bytes_in += batches[i].hidden_bytes.size() + batches[i].target_bytes.size();
  }
  ASSERT_TRUE((*stream)->Send(ToMicrobatch(head->name, "m", 1, batches[0])).ok());  // replay
  client::Microbatch bad = ToMicrobatch(head->name, "m", 9, batches[1]);
  bad.num_tokens = 0;
  ASSERT_TRUE((*stream)->Send(bad).ok());
  for (int i = 0; i < 3; ++i) {
    auto got = (*stream)->Receive();
    ASSERT_TRUE(got.ok()) << got.status();
    tokens += got->token_count;
  }
  auto replay = (*stream)->Receive();
  ASSERT_TRUE(replay.ok() && replay->replayed);
  EXPECT_EQ((*stream)->Receive().status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*stream)->Finish().ok());
  // A server-side AdamW step over the three micro-batches: its counter, its latency histogram and
  // the optimizer's memory kinds. The pull after it finds an empty window.
  v1::OptimizerSpec adamw;
  adamw.set_kind(v1::OPTIMIZER_ADAMW);
  ASSERT_TRUE(client->SetOptimizer(head->name, adamw).ok());
  ASSERT_TRUE(
      client->ApplyOptimizer(ApplyRequest(head->name, "m", 1, AdamWParams(1e-3, 0.01))).ok());
  ASSERT_TRUE(client->PullGradient(head->name, v1::DTYPE_FP32, true).ok());
  EXPECT_EQ(client->GetHead("no-such-head").status().code(), absl::StatusCode::kNotFound);

  // A streaming call is counted when the server is done with it (OnDone), which may come after
  // the client has its status: scrape until the Step and pull calls are in.
  absl::StatusOr<Exposition> e;
  for (const absl::Time give_up = absl::Now() + absl::Seconds(20);;) {
    auto body = HttpGet((*server)->metrics_port(), "/metrics");
    ASSERT_TRUE(body.ok()) << body.status();
    e = ParseExposition(*body);
    ASSERT_TRUE(e.ok()) << e.status();
    if (e->Sum("losshead_rpcs_total", {{"method", "Step"}, {"code", "ok"}}) >= 1 &&
        e->Sum("losshead_rpcs_total", {{"method", "PullGradient"}, {"code", "ok"}}) >= 1) {
      break;
    }
    ASSERT_LT(absl::Now(), give_up) << "the Step and pull calls were never counted:\n" << *body;
    absl::SleepFor(absl::Milliseconds(10));
  }

  EXPECT_EQ(e->Sum("losshead_tokens_total", {{"head", "metered"}}), static_cast<double>(tokens));
  EXPECT_EQ(e->Sum("losshead_microbatches_total", {{"head", "metered"}, {"outcome", "ok"}}), 3);
  EXPECT_EQ(e->Sum("losshead_microbatches_total", {{"head", "metered"}, {"outcome", "replayed"}}),
            1);
  EXPECT_EQ(e->Sum("losshead_microbatches_total", {{"head", "metered"}, {"outcome", "error"}}), 1);
  EXPECT_GE(e->Sum("losshead_failures_total", {{"reason", "invalid_argument"}}), 1);
  EXPECT_GE(e->Sum("losshead_failures_total", {{"reason", "not_found"}}), 1);
  EXPECT_EQ(e->Sum("losshead_pulls_total", {{"head", "metered"}}), 1);
  EXPECT_EQ(e->Sum("losshead_pushes_total", {{"head", "metered"}}), 1);
  EXPECT_EQ(e->Sum("losshead_optimizer_applies_total", {{"head", "metered"}, {"outcome", "ok"}}),
            1);
  EXPECT_EQ(e->Sum("losshead_head_memory_bytes", {{"head", "metered"}, {"kind", "master_weights"}}),
            static_cast<double>(v * d * 4));
  EXPECT_EQ(
      e->Sum("losshead_head_memory_bytes", {{"head", "metered"}, {"kind", "optimizer_state"}}),
      static_cast<double>(2 * v * d * 4));
  EXPECT_EQ(e->Sum("losshead_heads"), 1);
  EXPECT_EQ(e->Sum("losshead_inflight_microbatches"), 0);
  EXPECT_GE(e->Sum("losshead_bytes_total", {{"direction", "in"}}), static_cast<double>(bytes_in));
  EXPECT_EQ(e->Sum("losshead_head_memory_bytes", {{"head", "metered"}, {"kind", "weights"}}),
            static_cast<double>(v * d * 2));
  EXPECT_EQ(e->Sum("losshead_head_memory_bytes", {{"head", "metered"}, {"kind", "gradient"}}),
            static_cast<double>(v * d * 4));
  // Each computed micro-batch has one compute observation; replays and errors are not computed.
  EXPECT_EQ(e->Sum("losshead_step_phase_duration_seconds_count",
                   {{"head", "metered"}, {"phase", "compute"}}),
            3);
  // Finished RPCs by code: at least the Step call, the pull and the failed GetHead.
  EXPECT_GE(e->Sum("losshead_rpcs_total", {{"code", "ok"}}), 3);
  EXPECT_GE(e->Sum("losshead_rpcs_total", {{"code", "not_found"}}), 1);

  // Histograms: cumulative buckets, +Inf bucket == _count, every series of one family consistent.
  for (const auto& [family, type] : e->types) {
    if (type != "histogram") continue;
    for (const Sample& count : e->Find(family + "_count")) {
      std::vector<Sample> buckets = e->Find(family + "_bucket", count.labels);
      ASSERT_FALSE(buckets.empty()) << family;
      double previous = 0, inf = -1;
      for (const Sample& b : buckets) {
        if (b.labels.size() != count.labels.size() + 1) continue;  // a series with more labels
        EXPECT_GE(b.value, previous) << family << " buckets not cumulative";
        previous = b.value;
        if (b.labels.at("le") == "+Inf") inf = b.value;
      }
      EXPECT_EQ(inf, count.value) << family << ": +Inf bucket != _count";
      ASSERT_EQ(e->Find(family + "_sum", count.labels).size(), 1u) << family;
      EXPECT_GE(e->Find(family + "_sum", count.labels)[0].value, 0) << family;
    }
  }

  const auto documented = DocumentedMetrics();
  ASSERT_GE(documented.size(), 13u) << "docs/metrics.md table not found";
  for (const auto& [name, type] : documented) {
    // Exported only by a server with --auth_tokens_file; tests/security checks their values.
    if (name.rfind("losshead_auth_", 0) == 0) continue;
    // Exported only by a server with --checkpoint_dir; deploy_metrics_test.cc checks their values.
    if (name.rfind("losshead_checkpoint_", 0) == 0) continue;
    // Exported once a micro-batch asks for them; asked_metrics_test.cc checks their values.
    if (kAskedMetrics.contains(name)) continue;
    auto it = e->types.find(name);
    ASSERT_NE(it, e->types.end()) << name << " missing from /metrics";
    EXPECT_EQ(it->second, type) << name;
    const std::string sample = type == "histogram" ? name + "_count" : name;
    EXPECT_FALSE(e->Find(sample).empty()) << name << " has no samples";
  }
}

}  // namespace
}  // namespace losshead::testing
