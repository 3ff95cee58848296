// kill -9 of a real losshead-server process in the middle of a training run, restart from its
// checkpoint directory, resume: no micro-batch may be lost or counted twice, and the final W and dW
// must equal those of a fault-free run: bit for bit where dW is accumulated directly, and within
// fp32 summation order with deferred dW (the server's default), whose stash the kills, restarts
// and checkpoints cut at other moments than in the fault-free run.
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/server_process.h"
#include "tests/recovery/recovery_process.h"
#include "tests/recovery/run_comparison.h"
#include "tests/recovery/trainer.h"

#ifndef LOSSHEAD_SERVER_BINARY
#error "LOSSHEAD_SERVER_BINARY must name the losshead-server executable"
#endif

namespace losshead::testing {
namespace {

// The fault-free run, once per dtype, on one device with dW accumulated directly.
struct Reference {
  FinalState final;
  uint64_t workspace_bytes = 0;  // the head's, at the end
  std::map<int, client::Bytes> pulled;
  std::map<uint64_t, client::StepResult> answers;
};

const Reference& ReferenceFor(TrainConfig config) {
  static auto* cache = new std::map<int, Reference>();
  auto it = cache->find(config.dtype);
  if (it != cache->end()) return it->second;
  config.placement.Clear();  // on one device, whatever the faulted run's placement
  const std::string dir = RecoveryTempDir();
  Reference ref;
  {
    auto process = ServerProcess::Start(LOSSHEAD_SERVER_BINARY,
                                        {"--backend=cpu", "--worker_threads=2", kBitExactFlag},
                                        dir + "/ref.log");
    EXPECT_TRUE(process.ok()) << process.status();
    if (process.ok()) {
      auto c = ConnectToServer(**process);
      Trainer trainer(config);
      absl::Status run = trainer.Run(*c, [](const Event&) { return absl::OkStatus(); });
      EXPECT_TRUE(run.ok()) << run;
      auto final = trainer.Final(*c);
      EXPECT_TRUE(final.ok()) << final.status();
      if (final.ok()) ref.final = std::move(*final);
      ref.workspace_bytes = HeadWorkspaceBytes(*c, kTrainHead);
      ref.pulled = trainer.pulled();
      ref.answers = trainer.answers();
    }
  }
  std::filesystem::remove_all(dir);
  return cache->emplace(config.dtype, std::move(ref)).first->second;
}

struct KillRestartParam {
  v1::DType dtype;
  DwAccumulation accumulation;
  // The head on 2 CPU devices, replicated or vocabulary-sharded; unspecified: one device.
  v1::PlacementKind placement = v1::PLACEMENT_UNSPECIFIED;
};

std::string ParamName(const ::testing::TestParamInfo<KillRestartParam>& info) {
  const KillRestartParam& p = info.param;
  std::string name = absl::StrCat(v1::DType_Name(p.dtype), "_", AccumulationName(p.accumulation));
  if (p.placement == v1::PLACEMENT_REPLICATED) absl::StrAppend(&name, "_replicated2");
  if (p.placement == v1::PLACEMENT_SHARDED) absl::StrAppend(&name, "_sharded2");
  return name;
}

class KillRestartTest : public ::testing::TestWithParam<KillRestartParam> {
 protected:
  void SetUp() override {
    dir_ = RecoveryTempDir();
    ASSERT_FALSE(dir_.empty());
    config_.dtype = GetParam().dtype;
    accumulation_ = GetParam().accumulation;
    if (GetParam().placement != v1::PLACEMENT_UNSPECIFIED) {
      config_.placement.set_kind(GetParam().placement);
      config_.placement.set_devices(2);
    }
  }
  bool OneDevice() const { return GetParam().placement == v1::PLACEMENT_UNSPECIFIED; }
  void TearDown() override {
    process_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::vector<std::string> Flags() const {
    std::vector<std::string> flags = {"--backend=cpu", "--worker_threads=2",
                                      "--checkpoint_dir=" + dir_ + "/ckpt"};
    if (!OneDevice()) flags.push_back("--devices=0,1");  // two CPU devices
    for (const std::vector<std::string>& more :
         {AccumulationFlags(accumulation_, config_.vocab, config_.hidden, config_.tokens),
          extra_flags_}) {
      flags.insert(flags.end(), more.begin(), more.end());
    }
    return flags;
  }
  void StartServer() {
    auto process = ServerProcess::Start(LOSSHEAD_SERVER_BINARY, Flags(), dir_ + "/server.log");
    ASSERT_TRUE(process.ok()) << process.status();
    process_ = std::move(*process);
    client_ = ConnectToServer(*process_);
    ASSERT_NE(client_, nullptr);
    ++starts_;
  }
  absl::Status CheckpointNow() {
    absl::StatusOr<v1::CheckpointResponse> r = client_->Checkpoint();
    return r.status();
  }
  absl::Status KillNow() {
    process_->Kill();
    ++kills_;
    return absl::AbortedError("server killed by the test");
  }

  // Runs `trainer` to the end, restarting the server after each fault; `after_restart` runs once
  // the restarted server answers, before the trainer resumes.
  void RunToEnd(Trainer& trainer, const Hook& hook,
                const std::function<void()>& after_restart = [] {}) {
    for (int round = 0;; ++round) {
      ASSERT_LT(round, 12) << "too many restarts";
      absl::Status run = trainer.Run(*client_, hook);
      if (killer_.joinable()) killer_.join();
      if (run.ok() && process_->Running()) return;
      // A failure is only acceptable when the server is gone (killed by the test).
      ASSERT_FALSE(process_->Running()) << "the run failed with a live server: " << run;
      const uint64_t acknowledged = trainer.max_answered();
      ASSERT_NO_FATAL_FAILURE(StartServer());
      auto progress = client_->GetClientProgress(kTrainHead, kClientId);
      if (progress.ok()) {
        // A restored server knows no more than its checkpoint.
        EXPECT_EQ(progress->has_acknowledged_sequence(), progress->has_persisted_sequence());
        EXPECT_EQ(progress->acknowledged_sequence(), progress->persisted_sequence());
        const uint64_t persisted = progress->persisted_sequence();
        if (acknowledged > persisted) lost_acknowledged_ += acknowledged - persisted;
      } else {
        EXPECT_TRUE(absl::IsNotFound(progress.status())) << progress.status();
        lost_acknowledged_ += acknowledged;
      }
      after_restart();
    }
  }

  void ExpectEqualsReference(const Trainer& trainer, const std::string& scenario) {
    const Reference& ref = ReferenceFor(config_);
    // Against the one-device fault-free run, whatever this run's placement.
    RunComparison compare(accumulation_, OneDevice());
    auto final = trainer.Final(*client_);
    ASSERT_TRUE(final.ok()) << final.status();
    if (!OneDevice()) {
      // Restored whole, on both devices.
      auto info = client_->GetHead(kTrainHead);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->spec().placement().kind(), GetParam().placement);
      EXPECT_EQ(info->devices_size(), 2);
    }
    compare.Tensor(final->weights, ref.final.weights, config_.dtype, "final W");
    compare.Tensor(final->gradient, ref.final.gradient, v1::DTYPE_FP32, "final dW");
    EXPECT_EQ(final->weights_version, ref.final.weights_version);
    // Counted exactly once each: totals equal the fault-free run's.
    EXPECT_EQ(final->microbatches_total, ref.final.microbatches_total);
    EXPECT_EQ(final->tokens_total, ref.final.tokens_total);
    EXPECT_EQ(final->tokens_since_pull, ref.final.tokens_since_pull);
    ASSERT_EQ(trainer.pulled().size(), ref.pulled.size());
    for (const auto& [step, dw] : ref.pulled) {
      compare.Tensor(trainer.pulled().at(step), dw, v1::DTYPE_FP32,
                     absl::StrCat("step ", step, "'s dW"));
    }
    for (const auto& [seq, answer] : ref.answers) {
      auto it = trainer.answers().find(seq);
      ASSERT_NE(it, trainer.answers().end()) << "sequence " << seq << " never answered";
      compare.Answer(it->second, answer, config_.dtype, absl::StrCat("sequence ", seq));
    }
    // Replays and recomputations answer what the fault-free run did.
    for (const auto& [seq, answer] : trainer.later_answers()) {
      compare.Answer(answer, ref.answers.at(seq), config_.dtype,
                     absl::StrCat("sequence ", seq, ", answered again"));
    }
    if (accumulation_ == DwAccumulation::kDeferred && OneDevice()) {
      // The stash was there: the head's workspace holds it on top of the direct run's buffers.
      EXPECT_GT(HeadWorkspaceBytes(*client_, kTrainHead), ref.workspace_bytes);
    }
    std::printf(
        "[figures] %s dtype=%s dW=%s%s: micro-batches %zu, first sends %d, resent %d (replayed "
        "%d), acknowledged then lost in a crash %llu, kills %d, restarts %d, largest deviation "
        "from the fault-free run %.3g, within bounds: %s\n",
        scenario.c_str(), v1::DType_Name(config_.dtype).c_str(), AccumulationName(accumulation_),
        OneDevice() ? ""
                    : (GetParam().placement == v1::PLACEMENT_SHARDED ? ", sharded over 2"
                                                                     : ", replicated on 2"),
        ref.answers.size(), trainer.first_sends(), trainer.resends(), trainer.replays(),
        static_cast<unsigned long long>(lost_acknowledged_), kills_, starts_ - 1, compare.worst(),
        ::testing::Test::HasFailure() ? "no" : "yes");
  }

  TrainConfig config_;
  DwAccumulation accumulation_ = DwAccumulation::kDirect;
  std::string dir_;
  std::vector<std::string> extra_flags_ = {"--checkpoint_interval=0"};
  std::unique_ptr<ServerProcess> process_;
  std::unique_ptr<client::Client> client_;
  std::thread killer_;
  int starts_ = 0;
  int kills_ = 0;
  uint64_t lost_acknowledged_ = 0;
};

// Checkpoint once the 3rd micro-batch of step 1 is answered (the server may have applied more of
// the pipelined step by then: the response says how many), kill after the 2nd micro-batch of
// step 2 was answered: the rest of step 1, its pull and push, and step 2's first micro-batches are
// lost. The client resends exactly the micro-batches above the persisted sequence; resends of
// persisted ones are replays with the original answer.
TEST_P(KillRestartTest, KillAfterCheckpointMidStep) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  Trainer trainer(config_);
  bool killed = false;
  uint64_t persisted = 0;
  Hook hook = [&](const Event& e) -> absl::Status {
    if (killed || e.kind != TrainEvent::kAnswered) return absl::OkStatus();
    if (e.step == 1 && e.k == 2) {
      absl::StatusOr<v1::CheckpointResponse> r = client_->Checkpoint(kTrainHead);
      if (!r.ok()) return r.status();
      EXPECT_EQ(r->heads(0).clients(0).client_id(), kClientId);
      persisted = r->heads(0).clients(0).persisted_sequence();
      EXPECT_GE(persisted, trainer.Sequence(1, 2));
      EXPECT_LE(persisted, trainer.Sequence(1, 5));
      EXPECT_EQ(r->heads(0).microbatches_since_pull(), persisted - trainer.Sequence(0, 5));
    }
    if (e.step == 2 && e.k == 1) {
      killed = true;
      return KillNow();
    }
    return absl::OkStatus();
  };
  bool checked = false;
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook, [&] {
    if (checked) return;
    checked = true;
    auto progress = client_->GetClientProgress(kTrainHead, kClientId);
    ASSERT_TRUE(progress.ok()) << progress.status();
    EXPECT_EQ(progress->persisted_sequence(), persisted);
    EXPECT_EQ(progress->acknowledged_sequence(), persisted);
    // Replays after the restore: the original loss and dH, nothing counted.
    auto before = client_->GetHead(kTrainHead);
    ASSERT_TRUE(before.ok());
    const uint64_t in_dw = persisted - trainer.Sequence(0, 5);
    EXPECT_EQ(before->microbatches_since_pull(), in_dw);
    EXPECT_EQ(before->weights_version(), 3u);  // step 1's push was lost
    for (uint64_t seq : {trainer.Sequence(1, 0), persisted}) {
      auto r = client_->Step(ToMicrobatch(kTrainHead, kClientId, seq, trainer.batch(seq)));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_TRUE(r->replayed);
      const client::StepResult& original = trainer.answers().at(seq);
      EXPECT_EQ(r->loss_sum, original.loss_sum);
      EXPECT_EQ(r->loss, original.loss);
      EXPECT_EQ(r->grad_hidden, original.grad_hidden);
    }
    auto after = client_->GetHead(kTrainHead);
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(after->microbatches_since_pull(), in_dw);
    EXPECT_EQ(after->tokens_total(), before->tokens_total());
  }));
  EXPECT_EQ(kills_, 1);
  EXPECT_EQ(lost_acknowledged_, trainer.Sequence(2, 1) - persisted);
  ExpectEqualsReference(trainer, "kill after checkpoint mid-step");
}

// Kill while a whole step's micro-batches are in the server's hands (2 answered, 4 in flight),
// with the last checkpoint taken right after the previous push.
TEST_P(KillRestartTest, KillMidStream) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  Trainer trainer(config_);
  bool killed = false;
  Hook hook = [&](const Event& e) -> absl::Status {
    if (killed) return absl::OkStatus();
    if (e.kind == TrainEvent::kPushed && e.step == 1) return CheckpointNow();
    if (e.kind == TrainEvent::kAnswered && e.step == 2 && e.k == 1) {
      killed = true;
      return KillNow();
    }
    return absl::OkStatus();
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook));
  EXPECT_EQ(lost_acknowledged_, 2u);
  ExpectEqualsReference(trainer, "kill mid-stream");
}

// The reset pull is checkpointed, the push is not: the trainer pushes from the dW it holds.
TEST_P(KillRestartTest, KillBetweenResetAndPush) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  Trainer trainer(config_);
  bool killed = false;
  Hook hook = [&](const Event& e) -> absl::Status {
    if (killed || e.step != 2 || e.kind != TrainEvent::kReset) return absl::OkStatus();
    killed = true;
    if (absl::Status s = CheckpointNow(); !s.ok()) return s;
    return KillNow();
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook));
  EXPECT_EQ(lost_acknowledged_, 0u);
  ExpectEqualsReference(trainer, "kill between reset and push");
}

// Checkpoint before the reset, kill after the push: the reset and the push are lost; the restored
// accumulator still holds the step's micro-batches and the trainer pulls and pushes again.
TEST_P(KillRestartTest, KillAfterPushBeforeCheckpoint) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  Trainer trainer(config_);
  bool killed = false;
  Hook hook = [&](const Event& e) -> absl::Status {
    if (killed || e.step != 0) return absl::OkStatus();
    if (e.kind == TrainEvent::kPulled) return CheckpointNow();
    if (e.kind == TrainEvent::kPushed) {
      killed = true;
      return KillNow();
    }
    return absl::OkStatus();
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook));
  ExpectEqualsReference(trainer, "kill after push, before checkpoint");
}

// SIGTERM: the drain answers what was received and the final checkpoint holds all of it.
TEST_P(KillRestartTest, GracefulShutdownLosesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartServer());
  Trainer trainer(config_);
  bool stopped = false;
  Hook hook = [&](const Event& e) -> absl::Status {
    if (stopped || e.kind != TrainEvent::kAnswered || e.step != 2 || e.k != 3) {
      return absl::OkStatus();
    }
    stopped = true;
    EXPECT_EQ(process_->Terminate(), 0);
    return absl::AbortedError("server stopped by the test");
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook));
  EXPECT_EQ(lost_acknowledged_, 0u);
  ExpectEqualsReference(trainer, "graceful shutdown");
}

// Periodic checkpoints every 20 ms and up to three kills at seeded random moments (a random event,
// then a random delay of up to 3 ms while the trainer goes on, so the kill lands anywhere: inside
// a step, a pull, a push or a checkpoint write): whatever the cut, the result is exact.
TEST_P(KillRestartTest, RandomKillsWithPeriodicCheckpoints) {
  extra_flags_ = {"--checkpoint_interval=20ms"};
  ASSERT_NO_FATAL_FAILURE(StartServer());
  Trainer trainer(config_);
  RandomKills kills(1234 + static_cast<uint32_t>(config_.dtype), /*window=*/10,
                    /*max_delay_us=*/3000);
  Hook hook = [&](const Event&) -> absl::Status {
    if (kills.MaybeKill(process_.get(), killer_)) ++kills_;
    return absl::OkStatus();
  };
  ASSERT_NO_FATAL_FAILURE(RunToEnd(trainer, hook));
  // The first kill always lands; a later one may find the run already finished.
  EXPECT_GE(kills_, 1);
  ExpectEqualsReference(trainer, "random kills, checkpoints every 20 ms");
}

// Every scenario on one device with both accumulations, and with the server's default (deferred)
// on a head replicated on or sharded over two CPU devices: restored whole from its checkpoint,
// its runs equal the one-device fault-free run up to summation order.
INSTANTIATE_TEST_SUITE_P(
    Runs, KillRestartTest,
    ::testing::Values(
        KillRestartParam{v1::DTYPE_FP32, DwAccumulation::kDirect},
        KillRestartParam{v1::DTYPE_FP32, DwAccumulation::kDeferred},
        KillRestartParam{v1::DTYPE_BF16, DwAccumulation::kDirect},
        KillRestartParam{v1::DTYPE_BF16, DwAccumulation::kDeferred},
        KillRestartParam{v1::DTYPE_FP32, DwAccumulation::kDeferred, v1::PLACEMENT_REPLICATED},
        KillRestartParam{v1::DTYPE_BF16, DwAccumulation::kDeferred, v1::PLACEMENT_REPLICATED},
        KillRestartParam{v1::DTYPE_FP32, DwAccumulation::kDeferred, v1::PLACEMENT_SHARDED},
        KillRestartParam{v1::DTYPE_BF16, DwAccumulation::kDeferred, v1::PLACEMENT_SHARDED}),
    ParamName);

// A corrupt or torn checkpoint: the server refuses to start, naming the file.
TEST(CorruptCheckpointTest, ServerRefusesToStart) {
  const std::string dir = RecoveryTempDir();
  const std::string ckpt = dir + "/ckpt";
  const std::string log = dir + "/server.log";
  const std::vector<std::string> flags = {"--backend=cpu", kBitExactFlag,
                                          "--checkpoint_dir=" + ckpt, "--checkpoint_interval=0"};
  {
    auto process = ServerProcess::Start(LOSSHEAD_SERVER_BINARY, flags, log);
    ASSERT_TRUE(process.ok()) << process.status();
    auto c = ConnectToServer(**process);
    TrainConfig config;
    Trainer trainer(config);
    ASSERT_TRUE(trainer.Run(*c, [](const Event&) { return absl::OkStatus(); }).ok());
    ASSERT_EQ((*process)->Terminate(), 0);
  }
  const std::string file = ckpt + "/lm.lhck";
  std::string good = ReadText(file);
  ASSERT_GT(good.size(), 1000u);
  auto write = [&](const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  };
  struct Case {
    std::string what;
    std::string path;
    std::string bytes;
    std::string message;
  };
  std::string flipped = good;
  flipped[flipped.size() / 2] ^= 0x10;
  std::vector<Case> cases = {
      {"one bit flipped in W", file, flipped, "checksum mismatch"},
      {"torn (cut short)", file, good.substr(0, good.size() - 100), "torn write"},
      {"not a checkpoint", file, std::string(200, 'x'), "bad magic"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    write(c.path, c.bytes);
    const size_t offset = ReadText(log).size();
    auto code = ServerProcess::RunToExit(LOSSHEAD_SERVER_BINARY, flags, log, absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 1);
    const std::string out = ReadText(log).substr(offset);
    EXPECT_NE(out.find(file), std::string::npos) << out;
    EXPECT_NE(out.find(c.message), std::string::npos) << out;
    EXPECT_NE(out.find("DATA_LOSS"), std::string::npos) << out;
  }
  // The intact file again: the server starts, and a stale temporary file is cleaned up.
  write(file, good);
  write(file + ".tmp", "partial");
  {
    auto process = ServerProcess::Start(LOSSHEAD_SERVER_BINARY, flags, log);
    ASSERT_TRUE(process.ok()) << process.status();
    EXPECT_FALSE(std::filesystem::exists(file + ".tmp"));
    auto c = ConnectToServer(**process);
    auto info = c->GetHead(kTrainHead);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->microbatches_total(), 6u * 5);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace losshead::testing
