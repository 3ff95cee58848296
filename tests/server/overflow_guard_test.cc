// A micro-batch whose loss, dH or part of dW could overflow is refused (OUT_OF_RANGE) before it
// runs, on every placement, with deferred dW on and off: the shared window stays exactly what the
// honest micro-batches made it (fp64 reference), and the next honest one counts as before. Each
// refused input here overflows for real on the code without the guard (a NaN loss and a NaN
// window); the inputs are valid (finite in the head's dtype) and the options within their ranges.
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "server/engine/head.h"
#include "tests/server/placed_head_util.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Decode;
using testing::Encode;
using testing::kD;
using testing::MakeSample;
using testing::Pull;
using testing::Pulled;
using testing::ReferenceMean;
using testing::Sample;
using testing::Weights;

constexpr int64_t kV = 37;

enum class Placement { kOne, kReplicated, kSharded };

struct Case {
  Placement placement;
  bool deferred;  // a gradient stash on every device
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const char* placement = info.param.placement == Placement::kOne          ? "OneDevice"
                          : info.param.placement == Placement::kReplicated ? "Replicated3"
                                                                           : "Sharded3";
  return absl::StrCat(placement, info.param.deferred ? "Deferred" : "Direct");
}

class OverflowGuardTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const int k = GetParam().placement == Placement::kOne ? 1 : 3;
    for (int r = 0; r < k; ++r) {
      auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
      ASSERT_TRUE(backend.ok()) << backend.status();
      owned_.push_back(std::move(*backend));
      devices_.push_back(owned_.back().get());
    }
    v1::HeadSpec spec;
    spec.set_name("h");
    spec.set_vocab_size(kV);
    spec.set_hidden_size(kD);
    spec.set_weight_dtype(v1::DTYPE_BF16);
    spec.mutable_init()->mutable_normal()->set_std(0.5f);
    spec.mutable_init()->mutable_normal()->set_seed(5);
    if (k > 1) {
      spec.mutable_placement()->set_kind(GetParam().placement == Placement::kReplicated
                                             ? v1::PLACEMENT_REPLICATED
                                             : v1::PLACEMENT_SHARDED);
      spec.mutable_placement()->set_devices(k);
    }
    HeadOptions options;
    if (GetParam().deferred) options.grad_stash_bytes = size_t{1} << 20;
    auto head = Head::Create(devices_, spec, options);
    ASSERT_TRUE(head.ok()) << head.status();
    head_ = *head;
    w_ = Decode(Weights(*head_), v1::DTYPE_BF16);
  }

  // Counts `s` (it must be accepted) and remembers it for the reference window.
  void StepHonest(const Sample& s) {
    StepStats stats;
    auto out = head_->Step(s.mb, &stats);
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE(std::isfinite((*out)->loss));
    counted_.push_back(&s);
  }

  // The window is exactly the honest micro-batches': counters, and values against fp64.
  void ExpectWindowOfHonestOnes(const std::string& what) {
    const Pulled got = Pull(*head_, /*reset=*/false);
    uint64_t tokens = 0;
    std::vector<double> want(static_cast<size_t>(kV * kD), 0.0);
    for (const Sample* s : counted_) {
      tokens += static_cast<uint64_t>(s->tokens);
      const auto r = ReferenceMean(s->hidden, w_, s->targets, s->mb.header.num_tokens(), kD, kV);
      for (size_t i = 0; i < want.size(); ++i) want[i] += r.grad_weight[i];
    }
    EXPECT_EQ(got.summary.microbatch_count(), counted_.size()) << what;
    EXPECT_EQ(got.summary.token_count(), tokens) << what;
    testing::ExpectClose(got.values, want, 1e-4, what, 1e-3);
  }

  std::vector<std::unique_ptr<kernels::Backend>> owned_;
  std::vector<kernels::Backend*> devices_;
  std::shared_ptr<Head> head_;
  std::vector<float> w_;
  std::vector<const Sample*> counted_;
};

// Refused with OUT_OF_RANGE, and nothing of it reaches the window.
void ExpectRefused(Head& head, const MicroBatch& mb, const std::string& what) {
  StepStats stats;
  auto out = head.Step(mb, &stats);
  ASSERT_FALSE(out.ok()) << what << ": answered OK, loss " << (*out)->loss;
  EXPECT_EQ(out.status().code(), absl::StatusCode::kOutOfRange) << what << ": " << out.status();
  EXPECT_NE(out.status().message().find("nothing was computed or counted"), absl::string_view::npos)
      << out.status();
}

TEST_P(OverflowGuardTest, InputsThatWouldOverflowAreRefusedAndTheWindowStaysExact) {
  const Sample a1 = MakeSample(6, kV, v1::DTYPE_BF16, 101, "a", 1);
  const Sample a2 = MakeSample(9, kV, v1::DTYPE_BF16, 102, "a", 2);
  StepHonest(a1);
  StepHonest(a2);

  // One hidden row of 3e38: finite in bf16, its logits are not in fp32.
  Sample huge = MakeSample(5, kV, v1::DTYPE_BF16, 103, "b", 1);
  std::vector<float> hidden = huge.hidden;
  for (int64_t k = 0; k < kD; ++k) hidden[2 * kD + k] = 3e38f;
  huge.mb.hidden = Encode(hidden, v1::DTYPE_BF16);
  ExpectRefused(*head_, huge.mb, "a hidden row of 3e38");

  // z_loss within its range whose lse^2 term overflows the loss.
  Sample zloss = MakeSample(5, kV, v1::DTYPE_BF16, 104, "b", 2);
  zloss.mb.header.mutable_loss_options()->set_z_loss(3e37f);
  ExpectRefused(*head_, zloss.mb, "z_loss 3e37");

  // An upstream gradient that overflows dH and dW.
  Sample scaled = MakeSample(5, kV, v1::DTYPE_BF16, 105, "b", 3);
  scaled.mb.header.mutable_options()->set_grad_scale(3e38f);
  scaled.mb.header.mutable_options()->set_reduction(v1::REDUCTION_SUM);
  ExpectRefused(*head_, scaled.mb, "grad_scale 3e38");

  // Forward-only too: its loss and dH would not be finite.
  Sample eval = huge;
  eval.mb.header.mutable_options()->set_forward_only(true);
  ExpectRefused(*head_, eval.mb, "a forward-only row of 3e38");

  ExpectWindowOfHonestOnes("after the refusals");
  // The refused keys were not remembered: the same key with honest content counts.
  const Sample b1 = MakeSample(7, kV, v1::DTYPE_BF16, 106, "b", 1);
  StepHonest(b1);
  ExpectWindowOfHonestOnes("after an honest micro-batch");
}

TEST_P(OverflowGuardTest, AWindowThatWouldOverflowRefusesUntilItIsCut) {
  // Each micro-batch is finite on its own (a part of dW up to about 1e37); their sum is not.
  auto sample = [](uint64_t sequence) {
    Sample s = MakeSample(6, kV, v1::DTYPE_BF16, 200 + sequence, "a", sequence);
    s.mb.header.mutable_options()->set_grad_scale(1e36f);
    s.mb.header.mutable_options()->set_reduction(v1::REDUCTION_SUM);
    return s;
  };
  std::vector<Sample> sent;
  sent.reserve(64);
  absl::Status refused;
  for (uint64_t sequence = 1; sequence <= 64 && refused.ok(); ++sequence) {
    sent.push_back(sample(sequence));
    StepStats stats;
    auto out = head_->Step(sent.back().mb, &stats);
    if (!out.ok()) refused = out.status();
  }
  ASSERT_FALSE(refused.ok()) << "64 micro-batches of parts up to 1e37 fit one fp32 window";
  EXPECT_EQ(refused.code(), absl::StatusCode::kOutOfRange) << refused;
  EXPECT_NE(refused.message().find("gradient window"), absl::string_view::npos) << refused;
  const size_t accepted = sent.size() - 1;
  EXPECT_GE(accepted, 2u);

  const Pulled window = Pull(*head_, /*reset=*/true);
  EXPECT_EQ(window.summary.microbatch_count(), accepted);
  for (size_t i = 0; i < window.values.size(); ++i) {
    ASSERT_TRUE(std::isfinite(window.values[i])) << "dW[" << i << "] = " << window.values[i];
  }
  // A new window takes the refused micro-batch.
  StepStats stats;
  auto again = head_->Step(sent.back().mb, &stats);
  EXPECT_TRUE(again.ok()) << again.status();
}

INSTANTIATE_TEST_SUITE_P(Placements, OverflowGuardTest,
                         ::testing::Values(Case{Placement::kOne, false},
                                           Case{Placement::kOne, true},
                                           Case{Placement::kReplicated, false},
                                           Case{Placement::kReplicated, true},
                                           Case{Placement::kSharded, false},
                                           Case{Placement::kSharded, true}),
                         Name);

}  // namespace
}  // namespace losshead::server
