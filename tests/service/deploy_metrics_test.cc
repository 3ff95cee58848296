// The metrics an operator of a deployment watches, scraped from a real server: the build, each
// head's checkpoints (writes, failures, size, age, the restore at start) and its training values
// (weights version, optimizer step, last loss, the last apply's norms), each equal to what the
// server answered or wrote; and status codes spelled the same way in every metric.
#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/optimizer_testing.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

namespace fs = std::filesystem;

Exposition Scrape(int port) {
  absl::StatusOr<std::string> body = HttpGet(port, "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  absl::StatusOr<Exposition> e = ParseExposition(body.value_or(""));
  EXPECT_TRUE(e.ok()) << e.status();
  return e.value_or(Exposition{});
}

// A fresh directory under the test's temporary directory.
std::string FreshDir(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

double MTime(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return absl::ToDoubleSeconds(absl::TimeFromTimespec(st.st_mtim) - absl::UnixEpoch());
}

std::unique_ptr<TestServer> StartWithCheckpoints(const std::string& dir) {
  server::ServerOptions options = TestServer::Options(kTestServerMessageBytes, /*metrics=*/true);
  options.checkpoint_dir = dir;
  options.checkpoint_interval = absl::ZeroDuration();  // writes on demand only
  auto server = TestServer::StartWith(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

TEST(DeployMetricsTest, CheckpointWritesFailuresAndRestoreAreExported) {
  const std::string dir = FreshDir("deploy-metrics-ckpt");
  const std::string file = dir + "/ck.lhck";
  double written_at = 0;
  uint64_t bytes = 0;
  {
    std::unique_ptr<TestServer> server = StartWithCheckpoints(dir);
    ASSERT_NE(server, nullptr);
    auto client = server->NewClient();
    ASSERT_TRUE(CreateKnownHead(*client, "ck", 24, 8, v1::DTYPE_BF16, 3).ok());

    Exposition e = Scrape(server->metrics_port());
    EXPECT_EQ(e.Sum("losshead_checkpoint_interval_seconds"), 0);
    EXPECT_EQ(e.Find("losshead_checkpoint_restore_duration_seconds").size(), 1u);
    // A head never written yet has no age to report.
    EXPECT_TRUE(
        e.Find("losshead_checkpoint_last_success_timestamp_seconds", {{"head", "ck"}}).empty());
    EXPECT_EQ(e.Sum("losshead_build_info", {{"version", "0.1.0"}, {"backend", "cpu"}}), 1);

    const double before = absl::ToUnixMicros(absl::Now()) / 1e6;
    auto written = client->Checkpoint("ck");
    ASSERT_TRUE(written.ok()) << written.status();
    const double after = absl::ToUnixMicros(absl::Now()) / 1e6;
    bytes = written->heads(0).bytes();
    ASSERT_EQ(bytes, fs::file_size(file));
    e = Scrape(server->metrics_port());
    EXPECT_EQ(e.Sum("losshead_checkpoint_writes_total", {{"head", "ck"}, {"result", "ok"}}), 1);
    EXPECT_EQ(e.Sum("losshead_checkpoint_writes_total", {{"head", "ck"}, {"result", "error"}}), 0);
    EXPECT_EQ(e.Sum("losshead_checkpoint_bytes", {{"head", "ck"}}), static_cast<double>(bytes));
    EXPECT_EQ(e.Sum("losshead_checkpoint_duration_seconds_count", {{"head", "ck"}}), 1);
    EXPECT_LE(e.Sum("losshead_checkpoint_duration_seconds_sum", {{"head", "ck"}}), after - before);
    written_at = e.Sum("losshead_checkpoint_last_success_timestamp_seconds", {{"head", "ck"}});
    EXPECT_GE(written_at, before);
    EXPECT_LE(written_at, after);

    // A write that fails (its temporary file's name is taken by a directory): counted as an
    // error, and the age keeps counting from the last good write.
    fs::create_directory(file + ".tmp");
    EXPECT_FALSE(client->Checkpoint("ck").ok());
    e = Scrape(server->metrics_port());
    EXPECT_EQ(e.Sum("losshead_checkpoint_writes_total", {{"head", "ck"}, {"result", "error"}}), 1);
    EXPECT_EQ(e.Sum("losshead_checkpoint_writes_total", {{"head", "ck"}, {"result", "ok"}}), 1);
    EXPECT_EQ(e.Sum("losshead_checkpoint_duration_seconds_count", {{"head", "ck"}}), 2);
    EXPECT_EQ(e.Sum("losshead_checkpoint_last_success_timestamp_seconds", {{"head", "ck"}}),
              written_at);
    fs::remove(file + ".tmp");
  }  // the final checkpoint at shutdown writes ck.lhck again

  // Restored at start: the file's size and modification time, and no write counted.
  std::unique_ptr<TestServer> server = StartWithCheckpoints(dir);
  ASSERT_NE(server, nullptr);
  Exposition e = Scrape(server->metrics_port());
  EXPECT_EQ(e.Sum("losshead_checkpoint_bytes", {{"head", "ck"}}),
            static_cast<double>(fs::file_size(file)));
  EXPECT_NEAR(e.Sum("losshead_checkpoint_last_success_timestamp_seconds", {{"head", "ck"}}),
              MTime(file), 1e-3);
  EXPECT_TRUE(e.Find("losshead_checkpoint_writes_total", {{"head", "ck"}}).empty());
  EXPECT_GE(e.Sum("losshead_checkpoint_restore_duration_seconds"), 0);

  // Put back from a named snapshot, the head's checkpoint is that snapshot: fresh again.
  auto client = server->NewClient();
  ASSERT_TRUE(client->SnapshotHead("ck", "mark").ok());
  const double before_restore = absl::ToUnixMicros(absl::Now()) / 1e6;
  ASSERT_TRUE(client->RestoreHead("ck", "mark").ok());
  e = Scrape(server->metrics_port());
  EXPECT_GE(e.Sum("losshead_checkpoint_last_success_timestamp_seconds", {{"head", "ck"}}),
            before_restore);
  EXPECT_EQ(e.Sum("losshead_checkpoint_bytes", {{"head", "ck"}}),
            static_cast<double>(fs::file_size(file)));
  EXPECT_TRUE(e.Find("losshead_checkpoint_writes_total", {{"head", "ck"}}).empty());

  // Deleting the head drops its checkpoint series with the rest.
  ASSERT_TRUE(client->Checkpoint("ck").ok());
  ASSERT_TRUE(client->DeleteHead("ck").ok());
  e = Scrape(server->metrics_port());
  for (const auto& [family, type] : e.types) {
    const std::string sample = type == "histogram" ? family + "_count" : family;
    EXPECT_TRUE(e.Find(sample, {{"head", "ck"}}).empty()) << family;
  }
}

TEST(DeployMetricsTest, TrainingValuesAreTheServersAnswers) {
  auto server = TestServer::Start(kTestServerMessageBytes, /*metrics=*/true);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = (*server)->NewClient();
  constexpr int64_t d = 16, v = 40;
  ASSERT_TRUE(CreateKnownHead(*client, "trained", v, d, v1::DTYPE_FP32, 5).ok());
  v1::OptimizerSpec adamw;
  adamw.set_kind(v1::OPTIMIZER_ADAMW);
  ASSERT_TRUE(client->SetOptimizer("trained", adamw).ok());

  // Two counted micro-batches, then a forward-only one: each kind's last loss per token. One at a
  // time: of micro-batches in flight together, "last" is the last to finish.
  auto stream = client->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  std::vector<client::StepResult> results;
  for (int i = 0; i < 3; ++i) {
    const HostBatch batch = MakeBatch(30 + i, d, v, v1::DTYPE_FP32, 70 + i, 4);
    client::Microbatch mb = ToMicrobatch("trained", "t", i + 1, batch);
    if (i == 2) mb.options.set_forward_only(true);
    ASSERT_TRUE((*stream)->Send(mb).ok());
    auto got = (*stream)->Receive();
    ASSERT_TRUE(got.ok()) << got.status();
    results.push_back(*std::move(got));
  }
  ASSERT_TRUE((*stream)->Finish().ok());
  ASSERT_TRUE(results[2].forward_only);

  // Clipped: the norms and the coefficient are the apply's answer.
  v1::ApplyOptimizerRequest request = ApplyRequest("trained", "t", 1, AdamWParams(1e-2, 0.0));
  request.set_max_norm(1e-3);
  request.set_trunk_grad_sq_norm(0.25);
  auto applied = client->ApplyOptimizer(request);
  ASSERT_TRUE(applied.ok()) << applied.status();
  ASSERT_LT(applied->clip_coefficient(), 1);

  Exposition e = Scrape((*server)->metrics_port());
  const std::map<std::string, std::string> head = {{"head", "trained"}};
  EXPECT_EQ(e.Sum("losshead_head_weights_version", head),
            static_cast<double>(applied->weights_version()));
  EXPECT_EQ(e.Sum("losshead_optimizer_step", head), 1);
  EXPECT_DOUBLE_EQ(e.Sum("losshead_head_last_loss", {{"head", "trained"}, {"outcome", "ok"}}),
                   results[1].loss_sum / results[1].token_count);
  EXPECT_DOUBLE_EQ(e.Sum("losshead_head_last_loss", {{"head", "trained"}, {"outcome", "forward"}}),
                   results[2].loss_sum / results[2].token_count);
  EXPECT_DOUBLE_EQ(e.Sum("losshead_optimizer_grad_norm", {{"head", "trained"}, {"scope", "head"}}),
                   applied->head_grad_norm());
  EXPECT_DOUBLE_EQ(e.Sum("losshead_optimizer_grad_norm", {{"head", "trained"}, {"scope", "total"}}),
                   applied->total_grad_norm());
  EXPECT_DOUBLE_EQ(e.Sum("losshead_optimizer_clip_coefficient", head), applied->clip_coefficient());

  // A replayed apply steps nothing and leaves the last step's values.
  request.set_max_norm(1e-3);
  auto replayed = client->ApplyOptimizer(request);
  ASSERT_TRUE(replayed.ok() && replayed->replayed());
  e = Scrape((*server)->metrics_port());
  EXPECT_EQ(e.Sum("losshead_optimizer_step", head), 1);
  EXPECT_DOUBLE_EQ(e.Sum("losshead_optimizer_clip_coefficient", head), applied->clip_coefficient());

  // One spelling of status codes: losshead_rpcs_total{code} as losshead_failures_total{reason}.
  EXPECT_EQ(client->GetHead("missing").status().code(), absl::StatusCode::kNotFound);
  for (absl::Time give_up = absl::Now() + absl::Seconds(10);
       Scrape((*server)->metrics_port()).Sum("losshead_rpcs_total", {{"code", "not_found"}}) < 1;
       absl::SleepFor(absl::Milliseconds(10))) {
    ASSERT_LT(absl::Now(), give_up) << "the refused GetHead was never counted";
  }
  e = Scrape((*server)->metrics_port());
  EXPECT_GE(e.Sum("losshead_rpcs_total", {{"method", "GetHead"}, {"code", "not_found"}}), 1);
  EXPECT_GE(e.Sum("losshead_failures_total", {{"method", "GetHead"}, {"reason", "not_found"}}), 1);
  for (const Sample& s : e.Find("losshead_rpcs_total")) {
    const std::string& code = s.labels.at("code");
    EXPECT_EQ(code.find_first_of("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), std::string::npos) << code;
  }

  ASSERT_TRUE(client->DeleteHead("trained").ok());
  e = Scrape((*server)->metrics_port());
  for (const char* family :
       {"losshead_head_weights_version", "losshead_optimizer_step", "losshead_head_last_loss",
        "losshead_optimizer_grad_norm", "losshead_optimizer_clip_coefficient"}) {
    EXPECT_TRUE(e.Find(family, head).empty()) << family;
  }
}

}  // namespace
}  // namespace losshead::testing
