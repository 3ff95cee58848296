// kill -9 of a real losshead-server process in a training run with the server-side AdamW (bf16 W,
// fp32 master weights), restart from its checkpoint directory, resume: the final W, dW and
// optimizer step count must equal those of a fault-free run bit for bit, and every apply must
// step exactly once: none lost, none twice, whether the crash came before its send, while it was
// in flight, after it landed but before its answer arrived, or after its answer but before a
// checkpoint held it.
#include <signal.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/server_process.h"
#include "tests/recovery/recovery_process.h"
#include "tests/recovery/optimizer_trainer.h"

#ifndef LOSSHEAD_SERVER_BINARY
#error "LOSSHEAD_SERVER_BINARY must name the losshead-server executable"
#endif

namespace losshead::testing {
namespace {

const OptimizerTrainConfig kConfig;

// The fault-free run, once.
struct Reference {
  FinalState final;
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

class OptimizerKillRestartTest : public ::testing::Test {
 protected:
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
    std::vector<std::string> flags = {"--backend=cpu", "--worker_threads=2", kBitExactFlag,
                                      "--checkpoint_dir=" + dir_ + "/ckpt", checkpoint_interval_};
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
    auto final = trainer.Final(*client_);
    ASSERT_TRUE(final.ok()) << final.status();
    ASSERT_EQ(final->weights.size(), ref.final.weights.size());
    ASSERT_EQ(final->gradient.size(), ref.final.gradient.size());
    EXPECT_EQ(
        0, std::memcmp(final->weights.data(), ref.final.weights.data(), ref.final.weights.size()))
        << "final W differs";
    EXPECT_EQ(0, std::memcmp(final->gradient.data(), ref.final.gradient.data(),
                             ref.final.gradient.size()))
        << "final dW differs";
    EXPECT_EQ(final->optimizer_step, static_cast<uint64_t>(kConfig.run.steps));
    EXPECT_EQ(final->optimizer_step, ref.final.optimizer_step);
    EXPECT_EQ(final->weights_version, ref.final.weights_version);
    EXPECT_EQ(final->microbatches_total, ref.final.microbatches_total);
    EXPECT_EQ(final->tokens_total, ref.final.tokens_total);
    EXPECT_EQ(final->tokens_since_pull, ref.final.tokens_since_pull);
    // Every apply answered what the fault-free run's did: the same window, norms, clipping
    // coefficient, version and step count.
    ASSERT_EQ(trainer.applies().size(), ref.applies.size());
    for (const auto& [key, answer] : ref.applies) {
      auto it = trainer.applies().find(key);
      ASSERT_NE(it, trainer.applies().end()) << "apply " << key << " never answered";
      EXPECT_EQ(it->second.SerializeAsString(), answer.SerializeAsString())
          << key << ": " << it->second.ShortDebugString() << " vs " << answer.ShortDebugString();
    }
    EXPECT_EQ(trainer.mismatched_applies(), 0);
    const MicrobatchSender& sent = trainer.microbatches();
    for (const auto& [seq, answer] : ref.answers) {
      auto it = sent.answers().find(seq);
      ASSERT_NE(it, sent.answers().end()) << "sequence " << seq << " never answered";
      EXPECT_EQ(it->second.loss_sum, answer.loss_sum) << seq;
      EXPECT_EQ(it->second.grad_hidden, answer.grad_hidden) << seq;
    }
    EXPECT_EQ(sent.mismatched_answers(), 0);
    double min_coefficient = 1;
    for (const auto& [key, answer] : ref.applies) {
      min_coefficient = std::min(min_coefficient, answer.clip_coefficient());
    }
    std::printf(
        "[figures] %s: applies %zu (smallest clip coefficient %.3f), apply sends %d, resent %d "
        "(replayed %d), answered then lost in a crash %d; micro-batches %zu, resent %d "
        "(replayed %d); kills %d, restarts %d; final W, dW and step count bit-identical: %s\n",
        scenario.c_str(), ref.applies.size(), min_coefficient, trainer.apply_sends(),
        trainer.apply_resends(), trainer.apply_replays(), trainer.lost_applies(),
        ref.answers.size(), sent.resends(), sent.replays(), kills_, starts_ - 1,
        ::testing::Test::HasFailure() ? "no" : "yes");
  }

  std::string dir_;
  std::string checkpoint_interval_ = "--checkpoint_interval=0";
  std::unique_ptr<ServerProcess> process_;
  std::unique_ptr<client::Client> client_;
  std::thread killer_;
  int starts_ = 0;
  int kills_ = 0;
};

bool Is(const Event& e, TrainEvent kind, int step) { return e.kind == kind && e.step == step; }

// The reference clips some applies and not others, so the trunk's norm takes part in the result.
TEST_F(OptimizerKillRestartTest, ReferenceClipsSomeApplies) {
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
TEST_F(OptimizerKillRestartTest, AnsweredApplyLostBeforeCheckpoint) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  OptimizerTrainer trainer(kConfig);
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
TEST_F(OptimizerKillRestartTest, AnswerLostAfterCheckpointedApply) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  OptimizerTrainer trainer(kConfig);
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
TEST_F(OptimizerKillRestartTest, AnswerAndApplyLostTogether) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  OptimizerTrainer trainer(kConfig);
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
TEST_F(OptimizerKillRestartTest, KillWithApplyInFlight) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  OptimizerTrainer trainer(kConfig);
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

// Periodic checkpoints every 5 ms and three kills at seeded random moments (a random event, then
// a random delay of up to 2 ms while the trainer goes on), so that they land anywhere: inside a
// step, an apply or a checkpoint write. Whatever the cut, the result is exact.
class OptimizerRandomKillTest : public OptimizerKillRestartTest,
                                public ::testing::WithParamInterface<int> {};

TEST_P(OptimizerRandomKillTest, ResultIsExact) {
  checkpoint_interval_ = "--checkpoint_interval=5ms";
  ASSERT_NO_FATAL_FAILURE(StartServer());
  OptimizerTrainer trainer(kConfig);
  // The run has 5 x (4 answers + 3 apply events) + 4 answers = 39 events.
  RandomKills kills(static_cast<uint32_t>(GetParam()), /*window=*/12, /*max_delay_us=*/2000);
  Hook hook = [&](const Event&) -> absl::Status {
    if (kills.MaybeKill(process_.get(), killer_)) ++kills_;
    return absl::OkStatus();
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook));
  EXPECT_GE(kills_, 1);
  ExpectEqualsReference(trainer,
                        "random kills, checkpoints every 5 ms, seed " + std::to_string(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Seeds, OptimizerRandomKillTest, ::testing::Values(11, 12, 13));

}  // namespace
}  // namespace losshead::testing
