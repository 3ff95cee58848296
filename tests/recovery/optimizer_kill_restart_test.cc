// kill -9 of a real losshead-server process in a training run with the server-side AdamW (bf16 W,
// fp32 master weights), restart from its checkpoint directory, resume: every apply must step
// exactly once: none lost, none twice, whether the crash came before its send, while it was in
// flight, after it landed but before its answer arrived, or after its answer but before a
// checkpoint held it. The final W, dW and step count must equal those of a fault-free run: bit for
// bit where dW is accumulated directly, within summation order with deferred dW (the server's
// default).
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/server_process.h"
#include "tests/recovery/optimizer_trainer.h"
#include "tests/recovery/recovery_process.h"
#include "tests/recovery/run_comparison.h"

#ifndef LOSSHEAD_SERVER_BINARY
#error "LOSSHEAD_SERVER_BINARY must name the losshead-server executable"
#endif

namespace losshead::testing {
namespace {

const OptimizerTrainConfig kConfig;

// The fault-free run, once, with dW accumulated directly.
struct Reference {
  FinalState final;
  uint64_t workspace_bytes = 0;  // the head's, at the end
  std::map<uint64_t, v1::ApplyOptimizerResponse> applies;
  std::map<uint64_t, client::StepResult> answers;
};

const Reference& TheReference() {
  static const Reference* ref = [] {
    auto* r = new Reference();
    const std::string dir = RecoveryTempDir();
    {
      auto process = ServerProcess::Start(LOSSHEAD_SERVER_BINARY,
                                          {"--backend=cpu", "--worker_threads=2", kBitExactFlag},
                                          dir + "/ref.log");
      EXPECT_TRUE(process.ok()) << process.status();
      if (!process.ok()) return r;
      auto c = ConnectToServer(**process);
      OptimizerTrainer trainer(kConfig);
      absl::Status run = trainer.Run(*c, [](const Event&) { return absl::OkStatus(); });
      EXPECT_TRUE(run.ok()) << run;
      auto final = trainer.Final(*c);
      EXPECT_TRUE(final.ok()) << final.status();
      if (final.ok()) r->final = std::move(*final);
      r->workspace_bytes = HeadWorkspaceBytes(*c, kTrainHead);
      r->applies = trainer.applies();
      r->answers = trainer.microbatches().answers();
      EXPECT_EQ(trainer.apply_sends(), kConfig.run.steps);
      EXPECT_EQ(trainer.apply_resends() + trainer.apply_replays() + trainer.lost_applies(), 0);
    }
    std::filesystem::remove_all(dir);
    return r;
  }();
  return *ref;
}

// The scenarios below run once with each DwAccumulation; the random kills also with the head
// replicated on, or sharded over, two CPU devices (ZeRO-1 AdamW: each device steps its rows).
class OptimizerKillRestartBase : public ::testing::Test {
 protected:
  explicit OptimizerKillRestartBase(DwAccumulation accumulation,
                                    v1::PlacementKind placement = v1::PLACEMENT_UNSPECIFIED)
      : accumulation_(accumulation), placement_(placement) {
    if (!OneDevice()) {
      config_.run.placement.set_kind(placement);
      config_.run.placement.set_devices(2);
    }
  }
  bool OneDevice() const { return placement_ == v1::PLACEMENT_UNSPECIFIED; }

  void SetUp() override {
    dir_ = RecoveryTempDir();
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override {
    if (killer_.joinable()) killer_.join();
    process_.reset();
    std::filesystem::remove_all(dir_);
  }

  void StartServer() {
    std::vector<std::string> flags = {"--backend=cpu", "--worker_threads=2",
                                      "--checkpoint_dir=" + dir_ + "/ckpt", checkpoint_interval_};
    if (!OneDevice()) flags.push_back("--devices=0,1");  // two CPU devices
    for (const std::string& flag : AccumulationFlags(accumulation_, kConfig.run.vocab,
                                                     kConfig.run.hidden, kConfig.run.tokens)) {
      flags.push_back(flag);
    }
    auto process = ServerProcess::Start(LOSSHEAD_SERVER_BINARY, flags, dir_ + "/server.log");
    ASSERT_TRUE(process.ok()) << process.status();
    process_ = std::move(*process);
    client_ = ConnectToServer(*process_);
    ASSERT_NE(client_, nullptr);
    ++starts_;
  }
  absl::Status CheckpointNow() { return client_->Checkpoint().status(); }
  absl::Status KillNow() {
    process_->Kill();
    ++kills_;
    return absl::AbortedError("server killed by the test");
  }

  // Runs the trainer to the end, restarting the server after each fault; `after_restart` runs
  // once the restarted server answers, before the trainer resumes.
  void RunToEnd(
      OptimizerTrainer& trainer, const Hook& hook,
      const std::function<void()>& after_restart = [] {}) {
    for (int round = 0;; ++round) {
      ASSERT_LT(round, 12) << "too many restarts";
      absl::Status run = trainer.Run(*client_, hook);
      if (killer_.joinable()) killer_.join();
      if (run.ok() && process_->Running()) return;
      // A failure is only acceptable when the server is gone (killed by the test).
      ASSERT_FALSE(process_->Running()) << "the run failed with a live server: " << run;
      ASSERT_NO_FATAL_FAILURE(StartServer());
      after_restart();
    }
  }

  // The head as the restarted server holds it.
  v1::HeadInfo Head() {
    auto info = client_->GetHead(kTrainHead);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? *info : v1::HeadInfo();
  }

  void ExpectEqualsReference(const OptimizerTrainer& trainer, const std::string& scenario) {
    const Reference& ref = TheReference();
    // Against the one-device fault-free run, whatever this run's placement.
    RunComparison compare(accumulation_, OneDevice());
    auto final = trainer.Final(*client_);
    ASSERT_TRUE(final.ok()) << final.status();
    if (!OneDevice()) {
      // Restored whole, on both devices.
      const v1::HeadInfo info = Head();
      EXPECT_EQ(info.spec().placement().kind(), placement_);
      EXPECT_EQ(info.devices_size(), 2);
    }
    compare.Tensor(final->weights, ref.final.weights, kConfig.run.dtype, "final W");
    compare.Tensor(final->gradient, ref.final.gradient, v1::DTYPE_FP32, "final dW");
    EXPECT_EQ(final->optimizer_step, static_cast<uint64_t>(kConfig.run.steps));
    EXPECT_EQ(final->optimizer_step, ref.final.optimizer_step);
    EXPECT_EQ(final->weights_version, ref.final.weights_version);
    EXPECT_EQ(final->microbatches_total, ref.final.microbatches_total);
    EXPECT_EQ(final->tokens_total, ref.final.tokens_total);
    EXPECT_EQ(final->tokens_since_pull, ref.final.tokens_since_pull);
    // Every apply, and every answer again to its key, answered what the fault-free run's did: the
    // same window, norms, clipping coefficient, version and step count.
    ASSERT_EQ(trainer.applies().size(), ref.applies.size());
    auto expect_apply = [&](uint64_t key, const v1::ApplyOptimizerResponse& got) {
      const v1::ApplyOptimizerResponse& want = ref.applies.at(key);
      const std::string what = absl::StrCat("apply ", key);
      EXPECT_EQ(got.window().SerializeAsString(), want.window().SerializeAsString()) << what;
      EXPECT_EQ(got.weights_version(), want.weights_version()) << what;
      EXPECT_EQ(got.optimizer_step(), want.optimizer_step()) << what;
      compare.Sum(got.head_grad_norm(), want.head_grad_norm(), v1::DTYPE_FP32,
                  what + ": head norm");
      compare.Sum(got.total_grad_norm(), want.total_grad_norm(), v1::DTYPE_FP32,
                  what + ": total norm");
      compare.Sum(got.clip_coefficient(), want.clip_coefficient(), v1::DTYPE_FP32,
                  what + ": clip coefficient");
    };
    for (const auto& [key, answer] : ref.applies) {
      auto it = trainer.applies().find(key);
      ASSERT_NE(it, trainer.applies().end()) << "apply " << key << " never answered";
      expect_apply(key, it->second);
    }
    for (const auto& [key, answer] : trainer.later_applies()) expect_apply(key, answer);
    const MicrobatchSender& sent = trainer.microbatches();
    for (const auto& [seq, answer] : ref.answers) {
      auto it = sent.answers().find(seq);
      ASSERT_NE(it, sent.answers().end()) << "sequence " << seq << " never answered";
      compare.Answer(it->second, answer, kConfig.run.dtype, absl::StrCat("sequence ", seq));
    }
    for (const auto& [seq, answer] : sent.later_answers()) {
      compare.Answer(answer, ref.answers.at(seq), kConfig.run.dtype,
                     absl::StrCat("sequence ", seq, ", answered again"));
    }
    if (accumulation_ == DwAccumulation::kDeferred && OneDevice()) {
      // The stash was there: the head's workspace holds it on top of the direct run's buffers.
      EXPECT_GT(HeadWorkspaceBytes(*client_, kTrainHead), ref.workspace_bytes);
    }
    double min_coefficient = 1;
    for (const auto& [key, answer] : ref.applies) {
      min_coefficient = std::min(min_coefficient, answer.clip_coefficient());
    }
    std::printf(
        "[figures] %s, dW=%s%s: applies %zu (smallest clip coefficient %.3f), apply sends %d, "
        "resent %d (replayed %d), answered then lost in a crash %d; micro-batches %zu, resent %d "
        "(replayed %d); kills %d, restarts %d; largest deviation from the fault-free run %.3g, "
        "within bounds: %s\n",
        scenario.c_str(), AccumulationName(accumulation_),
        OneDevice()
            ? ""
            : (placement_ == v1::PLACEMENT_SHARDED ? ", sharded over 2" : ", replicated on 2"),
        ref.applies.size(), min_coefficient, trainer.apply_sends(), trainer.apply_resends(),
        trainer.apply_replays(), trainer.lost_applies(), ref.answers.size(), sent.resends(),
        sent.replays(), kills_, starts_ - 1, compare.worst(),
        ::testing::Test::HasFailure() ? "no" : "yes");
  }

  const DwAccumulation accumulation_;
  const v1::PlacementKind placement_;
  OptimizerTrainConfig config_ = kConfig;  // with the placement
  std::string dir_;
  std::string checkpoint_interval_ = "--checkpoint_interval=0";
  std::unique_ptr<ServerProcess> process_;
  std::unique_ptr<client::Client> client_;
  std::thread killer_;
  int starts_ = 0;
  int kills_ = 0;
};

class OptimizerKillRestartTest : public OptimizerKillRestartBase,
                                 public ::testing::WithParamInterface<DwAccumulation> {
 protected:
  OptimizerKillRestartTest() : OptimizerKillRestartBase(GetParam()) {}
};

bool Is(const Event& e, TrainEvent kind, int step) { return e.kind == kind && e.step == step; }

// The reference clips some applies and not others, so the trunk's norm takes part in the result.
TEST(OptimizerReferenceTest, ClipsSomeApplies) {
  const Reference& ref = TheReference();
  ASSERT_EQ(ref.applies.size(), static_cast<size_t>(kConfig.run.steps));
  int clipped = 0;
  for (const auto& [key, answer] : ref.applies) {
    EXPECT_GT(answer.clip_coefficient(), 0.0);
    clipped += answer.clip_coefficient() < 1.0;
  }
  EXPECT_GT(clipped, 0);
  EXPECT_LT(clipped, kConfig.run.steps);
}

// The checkpoint holds step 1's micro-batches; apply 2 is answered, then the server dies before
// another checkpoint. The restarted server is back at one apply with step 1's window whole: the
// trainer sees that the apply it was answered is gone and applies it again with the same key,
// which the restored record of applies does not hold. The answer equals the first.
TEST_P(OptimizerKillRestartTest, AnsweredApplyLostBeforeCheckpoint) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  OptimizerTrainer trainer(config_);
  bool killed = false;
  Hook hook = [&](const Event& e) -> absl::Status {
    if (killed) return absl::OkStatus();
    if (Is(e, TrainEvent::kApplying, 1)) return CheckpointNow();
    if (Is(e, TrainEvent::kApplied, 1)) {
      killed = true;
      return KillNow();
    }
    return absl::OkStatus();
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook, [&] {
    const v1::HeadInfo info = Head();
    EXPECT_EQ(info.optimizer_step(), 1u);
    EXPECT_EQ(info.weights_version(), 3u);
    EXPECT_EQ(info.microbatches_since_pull(), static_cast<uint64_t>(kConfig.run.per_step));
  }));
  EXPECT_EQ(kills_, 1);
  EXPECT_EQ(trainer.lost_applies(), 1);
  EXPECT_EQ(trainer.apply_resends(), 1);
  EXPECT_EQ(trainer.apply_replays(), 0);
  EXPECT_EQ(trainer.microbatches().resends(), 0);
  ExpectEqualsReference(trainer, "answered apply lost before a checkpoint");
}

// Apply 3 lands and a checkpoint holds it, but its answer never reaches the trainer. After the
// restart the step count says it landed: the retry with its key is answered from the restored
// record (replayed) with the original answer, and steps nothing.
TEST_P(OptimizerKillRestartTest, AnswerLostAfterCheckpointedApply) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  OptimizerTrainer trainer(config_);
  bool killed = false;
  Hook hook = [&](const Event& e) -> absl::Status {
    if (killed || !Is(e, TrainEvent::kApplyAnswered, 2)) return absl::OkStatus();
    killed = true;
    if (absl::Status s = CheckpointNow(); !s.ok()) return s;
    return KillNow();
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook, [&] {
    const v1::HeadInfo info = Head();
    EXPECT_EQ(info.optimizer_step(), 3u);
    EXPECT_EQ(info.weights_version(), 5u);
    EXPECT_EQ(info.microbatches_since_pull(), 0u);
  }));
  EXPECT_EQ(trainer.lost_applies(), 0);
  EXPECT_EQ(trainer.apply_resends(), 1);
  EXPECT_EQ(trainer.apply_replays(), 1);
  ExpectEqualsReference(trainer, "answer lost, apply checkpointed");
}

// Apply 3 lands but neither its answer nor a checkpoint of it survives (the last checkpoint was
// taken as it was sent): the restarted server holds step 2's whole window and two applies; the
// retry with the same key steps for the first time.
TEST_P(OptimizerKillRestartTest, AnswerAndApplyLostTogether) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  OptimizerTrainer trainer(config_);
  bool killed = false;
  Hook hook = [&](const Event& e) -> absl::Status {
    if (killed) return absl::OkStatus();
    if (Is(e, TrainEvent::kApplying, 2)) return CheckpointNow();
    if (Is(e, TrainEvent::kApplyAnswered, 2)) {
      killed = true;
      return KillNow();
    }
    return absl::OkStatus();
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook, [&] {
    const v1::HeadInfo info = Head();
    EXPECT_EQ(info.optimizer_step(), 2u);
    EXPECT_EQ(info.microbatches_since_pull(), static_cast<uint64_t>(kConfig.run.per_step));
  }));
  EXPECT_EQ(trainer.lost_applies(), 0);
  EXPECT_EQ(trainer.apply_resends(), 1);
  EXPECT_EQ(trainer.apply_replays(), 0);
  ExpectEqualsReference(trainer, "answer and apply lost");
}

// The server is frozen (SIGSTOP) as apply 4 is sent, and killed 100 ms later: the request sits in
// its socket, sent and never answered. The retry after the restart steps for the first time.
TEST_P(OptimizerKillRestartTest, KillWithApplyInFlight) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  OptimizerTrainer trainer(config_);
  bool killed = false;
  Hook hook = [&](const Event& e) -> absl::Status {
    if (killed || !Is(e, TrainEvent::kApplying, 3)) return absl::OkStatus();
    killed = true;
    if (absl::Status s = CheckpointNow(); !s.ok()) return s;
    // SIGSTOP takes effect asynchronously: wait until the whole server has stopped (the parent
    // hears of it once its last thread has), or it could still answer the apply sent next.
    process_->Signal(SIGSTOP);
    int wstatus = 0;
    if (waitpid(process_->pid(), &wstatus, WUNTRACED) != process_->pid() || !WIFSTOPPED(wstatus)) {
      return absl::InternalError("the server did not stop");
    }
    ++kills_;
    ServerProcess* victim = process_.get();
    killer_ = std::thread([victim] {
      absl::SleepFor(absl::Milliseconds(100));
      victim->Kill();
    });
    return absl::OkStatus();
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook, [&] {
    const v1::HeadInfo info = Head();
    EXPECT_EQ(info.optimizer_step(), 3u);
    EXPECT_EQ(info.microbatches_since_pull(), static_cast<uint64_t>(kConfig.run.per_step));
  }));
  EXPECT_EQ(trainer.lost_applies(), 0);
  EXPECT_EQ(trainer.apply_resends(), 1);
  EXPECT_EQ(trainer.apply_replays(), 0);
  ExpectEqualsReference(trainer, "kill with an apply in flight");
}

INSTANTIATE_TEST_SUITE_P(Accumulations, OptimizerKillRestartTest,
                         ::testing::Values(DwAccumulation::kDirect, DwAccumulation::kDeferred),
                         [](const auto& info) { return AccumulationName(info.param); });

// Periodic checkpoints every 5 ms and three kills at seeded random moments (a random event, then
// a random delay of up to 2 ms while the trainer goes on), so that they land anywhere: inside a
// step, an apply or a checkpoint write. Whatever the cut, the result is exact.
using RandomKillParam = std::tuple<int, DwAccumulation, v1::PlacementKind>;

class OptimizerRandomKillTest : public OptimizerKillRestartBase,
                                public ::testing::WithParamInterface<RandomKillParam> {
 protected:
  OptimizerRandomKillTest()
      : OptimizerKillRestartBase(std::get<1>(GetParam()), std::get<2>(GetParam())) {}
};

TEST_P(OptimizerRandomKillTest, ResultIsExact) {
  checkpoint_interval_ = "--checkpoint_interval=5ms";
  ASSERT_NO_FATAL_FAILURE(StartServer());
  OptimizerTrainer trainer(config_);
  const int seed = std::get<0>(GetParam());
  // The run has 5 x (4 answers + 3 apply events) + 4 answers = 39 events.
  RandomKills kills(static_cast<uint32_t>(seed), /*window=*/12, /*max_delay_us=*/2000);
  Hook hook = [&](const Event&) -> absl::Status {
    if (kills.MaybeKill(process_.get(), killer_)) ++kills_;
    return absl::OkStatus();
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook));
  EXPECT_GE(kills_, 1);
  ExpectEqualsReference(trainer,
                        "random kills, checkpoints every 5 ms, seed " + std::to_string(seed));
}

std::string RandomKillName(const ::testing::TestParamInfo<RandomKillParam>& info) {
  const auto& [seed, accumulation, placement] = info.param;
  std::string name = absl::StrCat(seed, "_", AccumulationName(accumulation));
  if (placement == v1::PLACEMENT_REPLICATED) absl::StrAppend(&name, "_replicated2");
  if (placement == v1::PLACEMENT_SHARDED) absl::StrAppend(&name, "_sharded2");
  return name;
}

INSTANTIATE_TEST_SUITE_P(Seeds, OptimizerRandomKillTest,
                         ::testing::Combine(::testing::Values(11, 12, 13),
                                            ::testing::Values(DwAccumulation::kDirect,
                                                              DwAccumulation::kDeferred),
                                            ::testing::Values(v1::PLACEMENT_UNSPECIFIED)),
                         RandomKillName);
INSTANTIATE_TEST_SUITE_P(
    Placed, OptimizerRandomKillTest,
    ::testing::Combine(::testing::Values(11, 12), ::testing::Values(DwAccumulation::kDeferred),
                       ::testing::Values(v1::PLACEMENT_REPLICATED, v1::PLACEMENT_SHARDED)),
    RandomKillName);

}  // namespace
}  // namespace losshead::testing
