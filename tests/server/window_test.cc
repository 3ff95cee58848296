// The gradient window seen without its data: a summary that leaves it as it is, a discard that
// drops it in one cut (micro-batches after it counted in the next window, which pulls as the
// float64 reference of those alone), the window's size and age, and the warning logged once per
// window when a head with an optimizer is never stepped. CPU backend.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "server/engine/head.h"
#include "tests/server/fp32_microbatch.h"
#include "tests/server/placed_head_util.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Decode;
using testing::ExpectClose;
using testing::kD;
using testing::MakeSample;
using testing::Pulled;
using testing::ReferenceMean;
using testing::Sample;

constexpr int64_t kV = 23;

class WindowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cpu = kernels::CreateBackend(kernels::BackendKind::kCpu);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    backend_ = std::move(*cpu);
  }

  std::shared_ptr<Head> MakeHead(const HeadOptions& options,
                                 v1::OptimizerKind optimizer = v1::OPTIMIZER_NONE) {
    v1::HeadSpec spec = Fp32HeadSpec(kV, kD, 3);
    spec.mutable_optimizer()->set_kind(optimizer);
    auto head = Head::Create(*backend_, spec, options);
    EXPECT_TRUE(head.ok()) << head.status();
    if (!head.ok()) return nullptr;
    w_ = Decode(testing::Weights(**head), v1::DTYPE_FP32);
    return *head;
  }

  // Micro-batches of 3-9 tokens with fresh content, sequences from `first`.
  std::vector<Sample> Samples(int count, uint64_t first) {
    std::vector<Sample> out;
    for (int i = 0; i < count; ++i) {
      const uint64_t seq = first + i;
      out.push_back(
          MakeSample(3 + static_cast<int64_t>(seq * 5 % 7), kV, v1::DTYPE_FP32, seed_++, "c", seq));
    }
    return out;
  }

  void StepAll(Head& head, const std::vector<Sample>& samples) {
    for (const Sample& s : samples) {
      StepStats stats;
      auto outcome = head.Step(s.mb, &stats);
      ASSERT_TRUE(outcome.ok()) << outcome.status();
    }
  }

  std::vector<double> ReferenceWindow(const std::vector<Sample>& samples) const {
    std::vector<double> window(kV * kD, 0.0);
    for (const Sample& s : samples) {
      const auto r = ReferenceMean(s.hidden, w_, s.targets, s.mb.header.num_tokens(), kD, kV);
      for (size_t i = 0; i < window.size(); ++i) window[i] += r.grad_weight[i];
    }
    return window;
  }

  static uint64_t Tokens(const std::vector<Sample>& samples) {
    uint64_t tokens = 0;
    for (const Sample& s : samples) tokens += s.tokens;
    return tokens;
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::vector<float> w_;
  uint64_t seed_ = 100 + ::testing::UnitTest::GetInstance()->random_seed();
};

TEST_F(WindowTest, ASummaryLeavesTheWindowAndItsDw) {
  std::shared_ptr<Head> head = MakeHead(HeadOptions{});
  ASSERT_NE(head, nullptr);
  const std::vector<Sample> samples = Samples(3, 1);
  StepAll(*head, samples);

  auto summary = head->WindowSummary(v1::DTYPE_UNSPECIFIED, /*discard=*/false);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->microbatch_count(), 3u);
  EXPECT_EQ(summary->token_count(), Tokens(samples));
  EXPECT_EQ(summary->min_weights_version(), 1u);
  EXPECT_EQ(summary->max_weights_version(), 1u);
  EXPECT_EQ(summary->vocab_size(), kV);
  EXPECT_EQ(summary->hidden_size(), kD);
  EXPECT_EQ(summary->dtype(), v1::DTYPE_FP32);
  EXPECT_EQ(summary->total_bytes(), 0u);
  EXPECT_FALSE(summary->was_reset());

  // A dtype a pull would refuse is refused alike, and changes nothing either.
  EXPECT_EQ(head->WindowSummary(v1::DTYPE_FP16, false).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(head->WindowSummary(v1::DTYPE_FP16, true).status().code(),
            absl::StatusCode::kInvalidArgument);

  const Pulled pulled = testing::Pull(*head, /*reset=*/false);
  EXPECT_EQ(pulled.summary.microbatch_count(), 3u);
  EXPECT_EQ(pulled.summary.token_count(), Tokens(samples));
  ExpectClose(pulled.values, ReferenceWindow(samples), 1e-5, "dW after a summary");
}

TEST_F(WindowTest, ADiscardDropsTheWindowAndCountsOnlyWhatFollows) {
  std::shared_ptr<Head> head = MakeHead(HeadOptions{});
  ASSERT_NE(head, nullptr);
  const std::vector<Sample> dropped = Samples(4, 1);
  StepAll(*head, dropped);
  const uint64_t total_before = head->Info().tokens_total();

  auto discarded = head->WindowSummary(v1::DTYPE_BF16, /*discard=*/true);
  ASSERT_TRUE(discarded.ok()) << discarded.status();
  EXPECT_EQ(discarded->microbatch_count(), 4u);
  EXPECT_EQ(discarded->token_count(), Tokens(dropped));
  EXPECT_EQ(discarded->dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(discarded->total_bytes(), 0u);
  EXPECT_TRUE(discarded->was_reset());
  v1::HeadInfo info = head->Info();
  EXPECT_EQ(info.microbatches_since_pull(), 0u);
  EXPECT_EQ(info.tokens_since_pull(), 0u);
  EXPECT_EQ(info.tokens_total(), total_before);  // what was computed stays computed
  auto empty = head->WindowSummary(v1::DTYPE_FP32, true);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->microbatch_count(), 0u);
  EXPECT_EQ(empty->min_weights_version(), 0u);

  // A repeat of a discarded micro-batch is a replay: it stays out of the window.
  StepStats stats;
  auto replay = head->Step(dropped[0].mb, &stats);
  ASSERT_TRUE(replay.ok()) << replay.status();
  EXPECT_TRUE(stats.replayed);

  const std::vector<Sample> kept = Samples(3, 5);
  StepAll(*head, kept);
  const Pulled pulled = testing::Pull(*head, /*reset=*/true);
  EXPECT_EQ(pulled.summary.microbatch_count(), 3u);
  EXPECT_EQ(pulled.summary.token_count(), Tokens(kept));
  ExpectClose(pulled.values, ReferenceWindow(kept), 1e-5, "dW of the micro-batches after");
}

TEST_F(WindowTest, TheWindowReportsItsSizeAndAge) {
  std::shared_ptr<Head> head = MakeHead(HeadOptions{});
  ASSERT_NE(head, nullptr);
  Head::WindowState w = head->Window();
  EXPECT_EQ(w.microbatches, 0u);
  EXPECT_EQ(w.age, absl::ZeroDuration());

  const absl::Time before = absl::Now();
  const std::vector<Sample> samples = Samples(2, 1);
  StepAll(*head, samples);
  absl::SleepFor(absl::Milliseconds(30));
  w = head->Window();
  EXPECT_EQ(w.microbatches, 2u);
  EXPECT_EQ(w.tokens, Tokens(samples));
  EXPECT_GE(w.age, absl::Milliseconds(30));
  EXPECT_LE(w.age, absl::Now() - before);

  ASSERT_TRUE(head->WindowSummary(v1::DTYPE_FP32, true).ok());
  w = head->Window();
  EXPECT_EQ(w.microbatches, 0u);
  EXPECT_EQ(w.tokens, 0u);
  EXPECT_EQ(w.age, absl::ZeroDuration());

  // The next window's age starts at its own first micro-batch.
  StepAll(*head, Samples(1, 3));
  EXPECT_LT(head->Window().age, absl::Milliseconds(30));
}

// The warning lines `run` wrote to stderr.
template <typename Fn>
std::vector<std::string> WarningsOf(Fn run) {
  ::testing::internal::CaptureStderr();
  run();
  std::vector<std::string> lines;
  for (absl::string_view line : absl::StrSplit(::testing::internal::GetCapturedStderr(), '\n')) {
    if (absl::StrContains(line, "--unapplied_window_warn_microbatches")) {
      lines.emplace_back(line);
    }
  }
  return lines;
}

TEST_F(WindowTest, AWindowGrowingWithoutAnApplyIsLoggedOncePerWindow) {
  std::shared_ptr<Head> head =
      MakeHead(HeadOptions{.window_warn_microbatches = 3}, v1::OPTIMIZER_SGD);
  ASSERT_NE(head, nullptr);
  EXPECT_TRUE(WarningsOf([&] { StepAll(*head, Samples(3, 1)); }).empty());  // at the limit
  std::vector<std::string> warned = WarningsOf([&] { StepAll(*head, Samples(3, 4)); });
  ASSERT_EQ(warned.size(), 1u);  // past it, once however far
  EXPECT_NE(warned[0].find("head 'h'"), std::string::npos) << warned[0];
  EXPECT_NE(warned[0].find("4 micro-batches"), std::string::npos) << warned[0];

  // An apply opens a new window, which warns again once past the limit.
  v1::ApplyOptimizerRequest apply;
  apply.set_client_id("trainer");
  apply.set_step_key(1);
  apply.mutable_params()->set_lr(0.1);
  ASSERT_TRUE(head->ApplyOptimizer(apply).ok());
  EXPECT_EQ(WarningsOf([&] { StepAll(*head, Samples(5, 7)); }).size(), 1u);
  // So does a discard (a trainer's zero_grad).
  ASSERT_TRUE(head->WindowSummary(v1::DTYPE_FP32, true).ok());
  EXPECT_EQ(WarningsOf([&] { StepAll(*head, Samples(4, 12)); }).size(), 1u);
}

TEST_F(WindowTest, OnlyAHeadWithAnOptimizerAndANonZeroLimitWarns) {
  std::shared_ptr<Head> plain = MakeHead(HeadOptions{.window_warn_microbatches = 1});
  ASSERT_NE(plain, nullptr);
  // Without a server-side optimizer the trainer pulls dW itself, on its own schedule.
  EXPECT_TRUE(WarningsOf([&] { StepAll(*plain, Samples(3, 1)); }).empty());
  std::shared_ptr<Head> off =
      MakeHead(HeadOptions{.window_warn_microbatches = 0}, v1::OPTIMIZER_ADAMW);
  ASSERT_NE(off, nullptr);
  EXPECT_TRUE(WarningsOf([&] { StepAll(*off, Samples(5, 1)); }).empty());
}

}  // namespace
}  // namespace losshead::server
