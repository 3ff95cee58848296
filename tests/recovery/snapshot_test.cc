// Named head snapshots over gRPC with an in-process server: a snapshot at step k of an AdamW run,
// restored after more steps and micro-batches, puts back W, the window, the version, the step
// count and (as the further applies show, bit for bit against the uninterrupted run) the master
// weights and moments; restores after a restart and into a deleted head; listing and deleting;
// the exact codes of every refusal, each of which changes nothing.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "server/durability/checkpoint.h"
#include "server/server.h"
#include "tests/service/host_tensors.h"
#include "tests/service/optimizer_testing.h"

namespace losshead::testing {
namespace {

constexpr int64_t kV = 40, kD = 16;

server::ServerOptions Options(const std::string& checkpoint_dir) {
  server::ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.backend = kernels::BackendKind::kCpu;
  options.worker_threads = 2;
  options.workspace_bytes = size_t{64} << 20;
  options.checkpoint_dir = checkpoint_dir;
  options.checkpoint_interval = absl::ZeroDuration();
  // A stash of about a dozen tokens, added to dW only when full and at cuts: every rerun of the
  // same micro-batches and cuts gives dW the same bits.
  options.grad_stash_bytes = 12 * (kV + kD) * sizeof(float);
  options.grad_stash_idle = absl::InfiniteDuration();
  return options;
}

std::unique_ptr<server::Server> Start(const server::ServerOptions& options) {
  auto server = server::Server::Start(options);
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

std::unique_ptr<client::Client> ClientOf(const server::Server& server) {
  client::ClientOptions options;
  options.deadline = absl::Seconds(30);
  auto c = client::Client::Connect(absl::StrCat("127.0.0.1:", server.port()), options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

v1::HeadSpec AdamWSpec(const std::string& name) {
  v1::HeadSpec spec;
  spec.set_name(name);
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(v1::DTYPE_BF16);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_init()->mutable_normal()->set_seed(9);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  return spec;
}

class SnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            absl::StrCat("losshead-snapshot-", ::testing::UnitTest::GetInstance()->random_seed(),
                         "-", reinterpret_cast<uintptr_t>(this)))
               .string();
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // The micro-batch of `sequence`, the same content every time it is asked for.
  const HostBatch& Batch(uint64_t sequence) {
    auto it = batches_.find(sequence);
    if (it == batches_.end()) {
      it = batches_
               .emplace(sequence, MakeBatch(4 + static_cast<int64_t>(sequence % 3), kD, kV,
                                            v1::DTYPE_BF16, 7000 + sequence, /*ignore_every=*/4))
               .first;
    }
    return it->second;
  }

  // One training step s of head "h": two micro-batches (client "t", sequences 10 s + 1 and
  // 10 s + 2), then the clipped AdamW apply with key s. Returns the micro-batches' loss sums.
  std::vector<double> TrainStep(client::Client& c, uint64_t s, const std::string& head = "h") {
    std::vector<double> losses;
    for (uint64_t q : {10 * s + 1, 10 * s + 2}) {
      auto r = c.Step(ToMicrobatch(head, "t", q, Batch(q)));
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) return losses;
      EXPECT_FALSE(r->replayed) << "sequence " << q;
      losses.push_back(r->loss_sum);
    }
    v1::ApplyOptimizerRequest apply = ApplyRequest(head, "trainer", s, AdamWParams(0.02, 0.01));
    apply.set_max_norm(0.5);
    auto applied = c.ApplyOptimizer(apply);
    EXPECT_TRUE(applied.ok()) << applied.status();
    if (applied.ok()) EXPECT_FALSE(applied->replayed()) << "step " << s;
    return losses;
  }

  static client::Bytes W(client::Client& c, const std::string& head = "h") {
    auto w = c.DownloadWeights(head);
    EXPECT_TRUE(w.ok()) << w.status();
    return w.ok() ? w->data : client::Bytes();
  }

  std::string dir_;
  std::map<uint64_t, HostBatch> batches_;
};

TEST_F(SnapshotTest, ARestoredHeadContinuesBitForBitAsTheUninterruptedRun) {
  auto server = Start(Options(dir_));
  auto c = ClientOf(*server);
  ASSERT_TRUE(c->CreateHead(AdamWSpec("h")).ok());
  for (uint64_t s = 1; s <= 3; ++s) TrainStep(*c, s);
  // A micro-batch in the window: the snapshot holds it and the applies after it include it.
  ASSERT_TRUE(c->Step(ToMicrobatch("h", "t", 35, Batch(35))).ok());

  const absl::Time before = absl::Now();
  auto snap = c->SnapshotHead("h", "step-3");
  ASSERT_TRUE(snap.ok()) << snap.status();
  auto at_snapshot = c->GetHead("h");
  ASSERT_TRUE(at_snapshot.ok());
  EXPECT_EQ(snap->tag(), "step-3");
  EXPECT_EQ(snap->head(), "h");
  EXPECT_EQ(snap->weights_version(), at_snapshot->weights_version());
  EXPECT_EQ(snap->weights_version(), 4u);  // 1 at creation, one per apply
  EXPECT_EQ(snap->optimizer_step(), 3u);
  const std::string file = dir_ + "/snapshots/step-3/h.lhck";
  ASSERT_TRUE(std::filesystem::exists(file));
  EXPECT_EQ(snap->bytes(), std::filesystem::file_size(file));
  EXPECT_GE(snap->unix_time(), absl::ToUnixMicros(before) * 1e-6 - 1);
  EXPECT_LE(snap->unix_time(), absl::ToUnixMicros(absl::Now()) * 1e-6 + 1);
  // Nothing else is written: the head's own checkpoint is not.
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/h.lhck"));
  const client::Bytes w3 = W(*c);

  // The uninterrupted run, three more steps.
  std::vector<std::vector<double>> losses;
  for (uint64_t s = 4; s <= 6; ++s) losses.push_back(TrainStep(*c, s));
  const client::Bytes w6 = W(*c);
  auto uninterrupted = c->GetHead("h");
  ASSERT_TRUE(uninterrupted.ok());
  ASSERT_NE(w6, w3);

  auto restored = c->RestoreHead("h", "step-3");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->weights_version(), snap->weights_version());
  EXPECT_EQ(restored->optimizer_step(), 3u);
  EXPECT_EQ(restored->microbatches_since_pull(), 1u);
  EXPECT_EQ(restored->tokens_since_pull(), at_snapshot->tokens_since_pull());
  EXPECT_EQ(restored->tokens_total(), at_snapshot->tokens_total());
  EXPECT_EQ(restored->spec().optimizer().kind(), v1::OPTIMIZER_ADAMW);
  EXPECT_EQ(W(*c), w3);
  auto window = c->WindowSummary("h");
  ASSERT_TRUE(window.ok()) << window.status();
  EXPECT_EQ(window->microbatch_count(), 1u);

  // The same steps again: new to the restored head (its remembered micro-batches and applies are
  // the snapshot's), computed on its restored W, master weights and moments.
  for (uint64_t s = 4; s <= 6; ++s) EXPECT_EQ(TrainStep(*c, s), losses[s - 4]) << "step " << s;
  EXPECT_EQ(W(*c), w6);
  auto again = c->GetHead("h");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->weights_version(), uninterrupted->weights_version());
  EXPECT_EQ(again->optimizer_step(), 6u);
  EXPECT_EQ(again->tokens_total(), uninterrupted->tokens_total());
  auto dw_again = c->PullGradient("h");
  ASSERT_TRUE(dw_again.ok());
  EXPECT_EQ(dw_again->summary.microbatch_count(), 0u);
}

TEST_F(SnapshotTest, ASnapshotOutlivesARestartAndTheRestoreIsTheNewCheckpoint) {
  client::Bytes w3;
  uint64_t version3 = 0;
  v1::SnapshotInfo snap;
  {
    auto server = Start(Options(dir_));
    auto c = ClientOf(*server);
    ASSERT_TRUE(c->CreateHead(AdamWSpec("h")).ok());
    for (uint64_t s = 1; s <= 2; ++s) TrainStep(*c, s);
    auto written = c->SnapshotHead("h", "s2");
    ASSERT_TRUE(written.ok()) << written.status();
    snap = *written;
    TrainStep(*c, 3);
    w3 = W(*c);
    auto info = c->GetHead("h");
    ASSERT_TRUE(info.ok());
    version3 = info->weights_version();
  }  // shutdown writes the head's checkpoint: step 3
  auto server = Start(Options(dir_));
  auto c = ClientOf(*server);
  // The head comes back as its checkpoint holds it; a snapshot is never restored by itself.
  auto info = c->GetHead("h");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->weights_version(), version3);
  EXPECT_EQ(info->optimizer_step(), 3u);
  auto listed = c->ListSnapshots("h");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].tag(), "s2");
  EXPECT_EQ((*listed)[0].weights_version(), snap.weights_version());
  EXPECT_EQ((*listed)[0].optimizer_step(), 2u);
  EXPECT_EQ((*listed)[0].bytes(), snap.bytes());

  auto restored = c->RestoreHead("h", "s2");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->weights_version(), snap.weights_version());
  EXPECT_EQ(restored->optimizer_step(), 2u);
  // The restore is durable at once: a crash now comes back to it, not to step 3.
  auto file = server::ReadCheckpointFile(dir_ + "/h.lhck");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->weights_version, snap.weights_version());
  EXPECT_EQ(file->optimizer_step, 2u);
  // And the snapshot is still there, untouched by the head's later checkpoints.
  ASSERT_TRUE(c->Checkpoint("h").ok());
  TrainStep(*c, 3);
  EXPECT_EQ(W(*c), w3);
  ASSERT_TRUE(c->Checkpoint("h").ok());
  auto kept = server::ReadCheckpointFile(dir_ + "/snapshots/s2/h.lhck");
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->weights_version, snap.weights_version());
  EXPECT_EQ(kept->optimizer_step, 2u);
}

TEST_F(SnapshotTest, RestoreRecreatesADeletedHeadWithinMaxHeads) {
  server::ServerOptions options = Options(dir_);
  options.max_heads = 1;
  auto server = Start(options);
  auto c = ClientOf(*server);
  v1::HeadSpec spec = AdamWSpec("g");
  spec.mutable_placement()->set_kind(v1::PLACEMENT_SINGLE);
  ASSERT_TRUE(c->CreateHead(spec).ok());
  TrainStep(*c, 1, "g");
  auto snap = c->SnapshotHead("g", "t");
  ASSERT_TRUE(snap.ok()) << snap.status();
  const client::Bytes w = W(*c, "g");
  // Deleting a head leaves its snapshots: they belong to the training run.
  ASSERT_TRUE(c->DeleteHead("g").ok());
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/g.lhck"));
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/snapshots/t/g.lhck"));

  ASSERT_TRUE(c->CreateHead(AdamWSpec("h")).ok());
  EXPECT_EQ(c->RestoreHead("g", "t").status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(c->GetHead("g").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(c->DeleteHead("h").ok());

  auto restored = c->RestoreHead("g", "t");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->spec().placement().kind(), v1::PLACEMENT_SINGLE);
  EXPECT_EQ(restored->weights_version(), snap->weights_version());
  EXPECT_EQ(restored->optimizer_step(), 1u);
  EXPECT_EQ(W(*c, "g"), w);
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/g.lhck"));  // a restart keeps it
  // The apply log came back too: a repeat of step 1's apply is answered from it.
  v1::ApplyOptimizerRequest apply = ApplyRequest("g", "trainer", 1, AdamWParams(0.02, 0.01));
  apply.set_max_norm(0.5);
  auto replay = c->ApplyOptimizer(apply);
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(replay->replayed());
  EXPECT_EQ(replay->optimizer_step(), 1u);
  EXPECT_EQ(W(*c, "g"), w);
}

TEST_F(SnapshotTest, ARestoreKeepsTheSnapshotsPlacement) {
  server::ServerOptions options = Options(dir_);
  options.devices = {0, 1, 2};  // three CPU devices
  auto server = Start(options);
  auto c = ClientOf(*server);
  v1::HeadSpec spec = AdamWSpec("h");
  spec.mutable_placement()->set_kind(v1::PLACEMENT_SHARDED);
  spec.mutable_placement()->set_devices(2);
  ASSERT_TRUE(c->CreateHead(spec).ok());
  TrainStep(*c, 1);
  ASSERT_TRUE(c->SnapshotHead("h", "sharded").ok());
  const client::Bytes w1 = W(*c);
  const std::vector<double> losses = TrainStep(*c, 2);
  const client::Bytes w2 = W(*c);
  // Replaced meanwhile by a one-device head of the same name: the restore brings the placement
  // back with the rest.
  ASSERT_TRUE(c->DeleteHead("h").ok());
  ASSERT_TRUE(c->CreateHead(AdamWSpec("h")).ok());
  auto restored = c->RestoreHead("h", "sharded");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->spec().placement().kind(), v1::PLACEMENT_SHARDED);
  EXPECT_EQ(restored->spec().placement().devices(), 2u);
  EXPECT_EQ(restored->devices_size(), 2);
  EXPECT_EQ(restored->optimizer_step(), 1u);
  EXPECT_EQ(W(*c), w1);
  EXPECT_EQ(TrainStep(*c, 2), losses);
  EXPECT_EQ(W(*c), w2);
}

TEST_F(SnapshotTest, ListAndDeletePruneSnapshots) {
  auto server = Start(Options(dir_));
  auto c = ClientOf(*server);
  ASSERT_TRUE(c->CreateHead(AdamWSpec("h")).ok());
  ASSERT_TRUE(c->CreateHead(AdamWSpec("g")).ok());
  auto none = c->ListSnapshots("h");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
  ASSERT_TRUE(c->SnapshotHead("h", "b").ok());
  TrainStep(*c, 1);
  ASSERT_TRUE(c->SnapshotHead("h", "a").ok());
  ASSERT_TRUE(c->SnapshotHead("g", "a").ok());
  // A snapshot of the same tag is replaced.
  TrainStep(*c, 2);
  auto replaced = c->SnapshotHead("h", "a");
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  EXPECT_EQ(replaced->optimizer_step(), 2u);

  auto listed = c->ListSnapshots("h");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].tag(), "a");
  EXPECT_EQ((*listed)[0].optimizer_step(), 2u);
  EXPECT_EQ((*listed)[0].weights_version(), 3u);
  EXPECT_EQ((*listed)[1].tag(), "b");
  EXPECT_EQ((*listed)[1].optimizer_step(), 0u);
  EXPECT_EQ((*listed)[1].weights_version(), 1u);
  for (const v1::SnapshotInfo& s : *listed) EXPECT_EQ(s.head(), "h");

  ASSERT_TRUE(c->DeleteSnapshot("h", "a").ok());
  listed = c->ListSnapshots("h");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].tag(), "b");
  EXPECT_EQ(c->RestoreHead("h", "a").status().code(), absl::StatusCode::kNotFound);
  // g's snapshot of that tag stays, and its directory with it until it goes too.
  EXPECT_TRUE(std::filesystem::exists(dir_ + "/snapshots/a/g.lhck"));
  ASSERT_TRUE(c->DeleteSnapshot("g", "a").ok());
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/snapshots/a"));
  auto g = c->ListSnapshots("g");
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(g->empty());
  // A listing needs no head: the snapshots of a deleted one are listed too.
  ASSERT_TRUE(c->DeleteHead("h").ok());
  listed = c->ListSnapshots("h");
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 1u);
}

TEST_F(SnapshotTest, RefusalsHaveExactCodesAndChangeNothing) {
  {
    auto plain = Start(Options(""));
    auto c = ClientOf(*plain);
    ASSERT_TRUE(c->CreateHead(AdamWSpec("h")).ok());
    EXPECT_EQ(c->SnapshotHead("h", "t").status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(c->RestoreHead("h", "t").status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(c->DeleteSnapshot("h", "t").code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(c->ListSnapshots("h").status().code(), absl::StatusCode::kFailedPrecondition);
  }
  auto server = Start(Options(dir_));
  auto c = ClientOf(*server);
  ASSERT_TRUE(c->CreateHead(AdamWSpec("h")).ok());
  TrainStep(*c, 1);
  ASSERT_TRUE(c->SnapshotHead("h", "ok").ok());
  TrainStep(*c, 2);
  auto before = c->GetHead("h");
  ASSERT_TRUE(before.ok());
  const client::Bytes w = W(*c);

  for (const std::string tag : {std::string(".hidden"), std::string(".."), std::string("a/b"),
                                std::string("sp ace"), std::string(129, 'a'), std::string("é")}) {
    EXPECT_EQ(c->SnapshotHead("h", tag).status().code(), absl::StatusCode::kInvalidArgument) << tag;
    EXPECT_EQ(c->RestoreHead("h", tag).status().code(), absl::StatusCode::kInvalidArgument) << tag;
    EXPECT_EQ(c->DeleteSnapshot("h", tag).code(), absl::StatusCode::kInvalidArgument) << tag;
  }
  EXPECT_TRUE(c->SnapshotHead("h", std::string(128, 'a')).ok());
  EXPECT_TRUE(c->SnapshotHead("h", "a.b_c-9").ok());
  EXPECT_EQ(c->SnapshotHead("h", "").status().code(), absl::StatusCode::kInvalidArgument);
  // A tag names one head's snapshot: a request for every head is refused.
  EXPECT_EQ(c->SnapshotHead("", "t").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->ListSnapshots("a/b").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->RestoreHead("../h", "ok").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->SnapshotHead("nope", "t").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->RestoreHead("h", "missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->RestoreHead("nope", "ok").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->DeleteSnapshot("h", "missing").code(), absl::StatusCode::kNotFound);

  // A corrupt snapshot: one byte of W flipped, then one cut short.
  const std::string file = dir_ + "/snapshots/ok/h.lhck";
  const auto size = std::filesystem::file_size(file);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(size / 2));
    char byte = 0;
    f.read(&byte, 1);
    byte ^= 0x10;
    f.seekp(static_cast<std::streamoff>(size / 2));
    f.write(&byte, 1);
  }
  EXPECT_EQ(c->RestoreHead("h", "ok").status().code(), absl::StatusCode::kDataLoss);
  std::filesystem::resize_file(file, size - 3);
  EXPECT_EQ(c->RestoreHead("h", "ok").status().code(), absl::StatusCode::kDataLoss);
  // A snapshot of another head under this head's name.
  std::filesystem::create_directories(dir_ + "/snapshots/other");
  std::filesystem::copy_file(dir_ + "/snapshots/a.b_c-9/h.lhck", dir_ + "/snapshots/other/g.lhck");
  EXPECT_EQ(c->RestoreHead("g", "other").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(c->GetHead("g").status().code(), absl::StatusCode::kNotFound);

  auto after = c->GetHead("h");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->weights_version(), before->weights_version());
  EXPECT_EQ(after->optimizer_step(), before->optimizer_step());
  EXPECT_EQ(after->tokens_total(), before->tokens_total());
  EXPECT_EQ(W(*c), w);
  // The corrupt one is still listed (from what of its header can be read) for pruning.
  auto listed = c->ListSnapshots("h");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->size(), 3u);
  EXPECT_TRUE(c->DeleteSnapshot("h", "ok").ok());
}

}  // namespace
}  // namespace losshead::testing
