// The loss terms over the wire (LossOptions logit_scale, temperature, entropy_coef, kind, clip_low,
// clip_high, kl_coef; StepHeader.token_inputs): the loss, dH and the pulled dW of each against a
// float64 reference on the server's own W, head defaults inherited and overridden; exactly-once
// (replay bit for bit, other inputs or terms ALREADY_EXISTS); every refusal's exact status with
// nothing counted; a finite advantage that would overflow OUT_OF_RANGE with the key left free.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kN = 23, kD = 10, kV = 37;
constexpr int64_t kIgnore = -100;

// What a micro-batch computes, in float64 from problem.h's definitions (reduction MEAN).
struct Terms {
  double scale = 1;  // logit_scale / temperature
  double entropy_coef = 0;
  bool policy = false;
  double clip_low = 0.2, clip_high = 0.2, kl_coef = 0;
  double softcap = 0;
  std::vector<float> weights, old_logprob, advantages, ref_logprob;  // empty: absent
};

struct Reference {
  double loss = 0;
  int64_t counted = 0;
  std::vector<double> grad_hidden;  // N x D
  std::vector<double> grad_weight;  // V x D
  std::vector<double> logprob;      // N
};

Reference Compute(const std::vector<float>& w, const HostBatch& b, const Terms& t) {
  Reference r;
  r.grad_hidden.assign(b.n * kD, 0.0);
  r.grad_weight.assign(kV * kD, 0.0);
  r.logprob.assign(b.n, 0.0);
  std::vector<std::vector<double>> g(b.n);  // dloss_t/dz, unreduced
  double loss_sum = 0;
  for (int64_t i = 0; i < b.n; ++i) {
    const int64_t y = b.targets[i];
    if (y == kIgnore) continue;
    ++r.counted;
    std::vector<double> z(kV);
    for (int64_t j = 0; j < kV; ++j) {
      double dot = 0;
      for (int64_t k = 0; k < kD; ++k) dot += double{b.hidden[i * kD + k]} * w[j * kD + k];
      z[j] = t.scale * dot;
      if (t.softcap > 0) z[j] = t.softcap * std::tanh(z[j] / t.softcap);
    }
    const double max = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (double x : z) sum += std::exp(x - max);
    const double lse = max + std::log(sum);
    std::vector<double> p(kV);
    double pz = 0;
    for (int64_t j = 0; j < kV; ++j) {
      p[j] = std::exp(z[j] - lse);
      pz += p[j] * z[j];
    }
    const double entropy = lse - pz;
    const double logp = z[y] - lse;
    r.logprob[i] = logp;
    const double weight = t.weights.empty() ? 1.0 : t.weights[i];
    double loss = 0, c = 0;  // c = dloss/dlog p
    if (t.policy) {
      const double a = t.advantages[i];
      const double ratio = std::exp(logp - t.old_logprob[i]);
      const double lo = 1 - t.clip_low, hi = 1 + t.clip_high;
      const double clipped = std::min(std::max(ratio, lo), hi);
      const double u = ratio * a, v = clipped * a;
      loss = -std::min(u, v);
      const double passes = ratio >= lo && ratio <= hi ? 1.0 : 0.0;
      const double share = u < v ? 1.0 : (u > v ? passes : (1 + passes) / 2);
      c = -a * share * ratio;
      if (t.kl_coef > 0) {
        // k3 clamped at 10 (torch.clamp(k3, max=10): the gradient passes at the bound).
        const double d = t.ref_logprob[i] - logp;
        const double k3 = std::exp(d) - d - 1;
        loss += t.kl_coef * std::min(k3, 10.0);
        if (k3 <= 10.0) c += t.kl_coef * (1 - std::exp(d));
      }
    } else {
      loss = -logp;
      c = -1;
    }
    loss += t.entropy_coef * entropy;
    loss_sum += weight * loss;
    g[i].resize(kV);
    for (int64_t j = 0; j < kV; ++j) {
      const double dlogp = (j == y ? 1.0 : 0.0) - p[j];
      const double dentropy = -p[j] * (z[j] - pz);
      // Chained through the soft-cap: dz/dx = 1 - (z / cap)^2.
      const double cap = t.softcap > 0 ? 1 - (z[j] / t.softcap) * (z[j] / t.softcap) : 1.0;
      g[i][j] = weight * (c * dlogp + t.entropy_coef * dentropy) * cap;
    }
  }
  const double mean = 1.0 / std::max<int64_t>(r.counted, 1);
  r.loss = loss_sum * mean;
  for (int64_t i = 0; i < b.n; ++i) {
    if (g[i].empty()) continue;
    for (int64_t j = 0; j < kV; ++j) {
      const double gj = g[i][j] * t.scale * mean;
      for (int64_t k = 0; k < kD; ++k) {
        r.grad_hidden[i * kD + k] += gj * w[j * kD + k];
        r.grad_weight[j * kD + k] += gj * b.hidden[i * kD + k];
      }
    }
  }
  return r;
}

std::vector<float> Uniform(size_t n, double lo, double hi, uint64_t seed) {
  std::vector<float> raw = RandomValues(n, 1.0, v1::DTYPE_FP32, seed);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    const double u = 0.5 + 0.5 * std::tanh(raw[i]);
    out[i] = static_cast<float>(lo + (hi - lo) * u);
  }
  return out;
}

class LossTermsTest : public SharedServerTest<> {
 protected:
  // One counted micro-batch on a fresh window: its loss, dH and the pulled dW against `want`.
  void ExpectStep(const std::string& head, const client::Microbatch& mb, const Reference& want) {
    auto got = client_->Step(mb);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->token_count, want.counted);
    EXPECT_NEAR(got->loss, want.loss, 2e-5 * std::max(1.0, std::abs(want.loss)));
    EXPECT_TRUE(AllClose(Decode(got->grad_hidden, v1::DTYPE_FP32), want.grad_hidden, 2e-5));
    auto pulled = client_->PullGradient(head, v1::DTYPE_FP32, /*reset=*/true);
    ASSERT_TRUE(pulled.ok()) << pulled.status();
    EXPECT_TRUE(AllClose(Decode(pulled->data, v1::DTYPE_FP32), want.grad_weight, 2e-5));
  }

  uint64_t Microbatches(const std::string& head) {
    auto info = client_->GetHead(head);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->microbatches_total() : 0;
  }
};

TEST_F(LossTermsTest, CrossEntropyTermsMatchFloat64WithHeadDefaultsAndOverrides) {
  auto head = CreateKnownHead(*client_, "ce-terms", kV, kD, v1::DTYPE_FP32, 3, 0.4);
  ASSERT_TRUE(head.ok()) << head.status();
  // The model's scale is the head's default; temperature and entropy come per request.
  v1::LossOptions defaults;
  defaults.set_logit_scale(1.75f);
  auto set = client_->SetLossOptions("ce-terms", defaults);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->spec().default_options().logit_scale(), 1.75f);
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 21, 4, kIgnore);
  const std::vector<float> weights = Uniform(kN, 0.0, 2.0, 22);
  uint64_t sequence = 0;
  struct Case {
    std::optional<float> temperature, entropy_coef;
    bool weighted;
  };
  for (const Case& c : {Case{std::nullopt, std::nullopt, false}, Case{0.8f, std::nullopt, false},
                        Case{std::nullopt, -0.05f, false}, Case{std::nullopt, std::nullopt, true},
                        Case{1.3f, 0.07f, true}}) {
    SCOPED_TRACE(absl::StrCat("temperature ", c.temperature.value_or(1), " entropy ",
                              c.entropy_coef.value_or(0), c.weighted ? " weighted" : ""));
    client::Microbatch mb = ToMicrobatch("ce-terms", "ce", ++sequence, batch);
    Terms t;
    t.scale = 1.75;
    if (c.temperature) {
      mb.loss_options.set_temperature(*c.temperature);
      t.scale = double{1.75f / *c.temperature};
    }
    if (c.entropy_coef) {
      mb.loss_options.set_entropy_coef(*c.entropy_coef);
      t.entropy_coef = *c.entropy_coef;
    }
    if (c.weighted) {
      mb.token_weights = weights;
      t.weights = weights;
    }
    ExpectStep("ce-terms", mb, Compute(head->weight, batch, t));
  }
  // A request's logit_scale overrides the head's.
  client::Microbatch mb = ToMicrobatch("ce-terms", "ce", ++sequence, batch);
  mb.loss_options.set_logit_scale(0.5f);
  Terms half;
  half.scale = 0.5;
  ExpectStep("ce-terms", mb, Compute(head->weight, batch, half));
}

TEST_F(LossTermsTest, PolicyGradientMatchesFloat64WithAndWithoutKl) {
  auto head = CreateKnownHead(*client_, "pg-terms", kV, kD, v1::DTYPE_FP32, 4, 0.5);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 31, 5, kIgnore);
  // Old log-probs near the current ones so that some ratios fall inside the clip range and some
  // outside it, on both sides.
  Terms probe;
  probe.scale = 1.0 / 0.9;
  const Reference current = Compute(head->weight, batch, probe);
  const std::vector<float> noise = Uniform(kN, -0.4, 0.4, 32);
  std::vector<float> old_logprob(kN), ref_logprob(kN);
  // Reference log-probs from 4 below to 4 above: k3 clamped (q - log p > 2.61) at some tokens,
  // with no soft-cap (the clamped term needs no bound of the logits).
  const std::vector<float> ref_noise = Uniform(kN, -4.0, 4.0, 33);
  for (int64_t i = 0; i < kN; ++i) {
    old_logprob[i] = static_cast<float>(current.logprob[i] + noise[i]);
    ref_logprob[i] = static_cast<float>(current.logprob[i] + ref_noise[i]);
  }
  const std::vector<float> advantages = Uniform(kN, -2.0, 2.0, 34);
  const std::vector<float> weights = Uniform(kN, 0.0, 1.0, 35);
  uint64_t sequence = 0;
  for (float kl : {0.0f, 0.1f}) {
    for (bool weighted : {false, true}) {
      SCOPED_TRACE(absl::StrCat("kl_coef ", kl, weighted ? " weighted" : ""));
      client::Microbatch mb = ToMicrobatch("pg-terms", "pg", ++sequence, batch);
      mb.loss_options.set_kind(v1::LOSS_KIND_POLICY_GRADIENT);
      mb.loss_options.set_temperature(0.9f);
      mb.loss_options.set_clip_low(0.2f);
      mb.loss_options.set_clip_high(0.28f);
      mb.loss_options.set_entropy_coef(-0.01f);
      mb.old_logprob = old_logprob;
      mb.advantages = advantages;
      Terms t;
      t.scale = double{1.0f / 0.9f};
      t.policy = true;
      t.clip_low = double{0.2f};
      t.clip_high = double{0.28f};
      t.entropy_coef = double{-0.01f};
      t.old_logprob = old_logprob;
      t.advantages = advantages;
      if (kl > 0) {
        mb.loss_options.set_kl_coef(kl);
        mb.ref_logprob = ref_logprob;
        t.kl_coef = kl;
        t.ref_logprob = ref_logprob;
      }
      if (weighted) {
        mb.token_weights = weights;
        t.weights = weights;
      }
      ExpectStep("pg-terms", mb, Compute(head->weight, batch, t));
    }
  }
}

// A head replicated or sharded over two devices of a server with two: the same terms as one
// device, against the same float64 reference (a sharded head's entropy term needs s from every
// shard, exchanged with the outputs' statistics).
class PlacedLossTermsTest : public LossTermsTest {
 protected:
  static void SetUpTestSuite() {
    server::ServerOptions options = TestServer::Options();
    options.devices = {0, 1};
    auto started = TestServer::StartWith(options);
    ASSERT_TRUE(started.ok()) << started.status();
    placed_server_ = started->release();
  }
  static void TearDownTestSuite() {
    delete placed_server_;
    placed_server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(placed_server_, nullptr);
    client_ = placed_server_->NewClient();
  }
  static TestServer* placed_server_;
};
TestServer* PlacedLossTermsTest::placed_server_ = nullptr;

TEST_F(PlacedLossTermsTest, ReplicatedAndShardedHeadsMatchFloat64) {
  for (v1::PlacementKind kind : {v1::PLACEMENT_REPLICATED, v1::PLACEMENT_SHARDED}) {
    v1::Placement placement;
    placement.set_kind(kind);
    placement.set_devices(2);
    const std::string name = absl::StrCat("placed-terms-", kind);
    SCOPED_TRACE(name);
    auto head = CreateKnownHead(*client_, name, kV, kD, v1::DTYPE_FP32, 6, 0.5, placement);
    ASSERT_TRUE(head.ok()) << head.status();
    const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 51, 7, kIgnore);
    const std::vector<float> weights = Uniform(kN, 0.0, 2.0, 52);
    const std::vector<float> old_logprob = Uniform(kN, -5.0, -2.0, 53);
    const std::vector<float> advantages = Uniform(kN, -1.5, 1.5, 54);
    // Cross-entropy with temperature, entropy term and weights.
    client::Microbatch ce = ToMicrobatch(name, "ce", 1, batch);
    ce.loss_options.set_temperature(1.3f);
    ce.loss_options.set_entropy_coef(0.07f);
    ce.token_weights = weights;
    Terms ce_terms;
    ce_terms.scale = double{1.0f / 1.3f};
    ce_terms.entropy_coef = double{0.07f};
    ce_terms.weights = weights;
    ExpectStep(name, ce, Compute(head->weight, batch, ce_terms));
    // The clipped policy gradient with an entropy bonus.
    client::Microbatch pg = ToMicrobatch(name, "pg", 2, batch);
    pg.loss_options.set_kind(v1::LOSS_KIND_POLICY_GRADIENT);
    pg.loss_options.set_entropy_coef(-0.02f);
    pg.old_logprob = old_logprob;
    pg.advantages = advantages;
    Terms pg_terms;
    pg_terms.policy = true;
    pg_terms.entropy_coef = double{-0.02f};
    pg_terms.old_logprob = old_logprob;
    pg_terms.advantages = advantages;
    ExpectStep(name, pg, Compute(head->weight, batch, pg_terms));
  }
}

TEST_F(LossTermsTest, ReplayIsBitForBitAndOtherTermsOrInputsAreAReusedKey) {
  auto head = CreateKnownHead(*client_, "pg-replay", kV, kD, v1::DTYPE_BF16, 5);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_BF16, 41, 6, kIgnore);
  const std::vector<float> old_logprob = Uniform(kN, -5.0, -1.0, 42);
  const std::vector<float> advantages = Uniform(kN, -1.0, 1.0, 43);
  client::Microbatch mb = ToMicrobatch("pg-replay", "r", 1, batch);
  mb.loss_options.set_kind(v1::LOSS_KIND_POLICY_GRADIENT);
  mb.old_logprob = old_logprob;
  mb.advantages = advantages;
  auto first = client_->Step(mb);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->replayed);
  auto again = client_->Step(mb);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->replayed);
  EXPECT_EQ(again->loss, first->loss);
  EXPECT_EQ(again->grad_hidden, first->grad_hidden);
  const uint64_t counted = Microbatches("pg-replay");

  std::vector<float> other_advantages = advantages;
  other_advantages[3] += 0.5f;
  client::Microbatch other_input = mb;
  other_input.advantages = other_advantages;
  client::Microbatch other_temperature = mb;
  other_temperature.loss_options.set_temperature(0.7f);
  client::Microbatch weighted = mb;
  const std::vector<float> ones(kN, 1.0f);
  weighted.token_weights = ones;
  for (const client::Microbatch* other : {&other_input, &other_temperature, &weighted}) {
    auto refused = client_->Step(*other);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists) << refused.status();
  }
  EXPECT_EQ(Microbatches("pg-replay"), counted);
}

TEST_F(LossTermsTest, RefusalsAreExactAndCountNothing) {
  auto head = CreateKnownHead(*client_, "refuse", kV, kD, v1::DTYPE_FP32, 6);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 51, 4, kIgnore);
  const std::vector<float> logprob = Uniform(kN, -4.0, -0.5, 52);
  const std::vector<float> advantages = Uniform(kN, -1.0, 1.0, 53);
  const std::vector<float> short_weights(kN - 1, 1.0f);
  // The first ignored token and the first counted one.
  size_t ignored = 0, counted = 0;
  while (ignored < batch.targets.size() && batch.targets[ignored] != kIgnore) ++ignored;
  while (counted < batch.targets.size() && batch.targets[counted] == kIgnore) ++counted;
  ASSERT_LT(ignored, batch.targets.size());
  ASSERT_LT(counted, batch.targets.size());
  std::vector<float> nan_counted = advantages;
  nan_counted[counted] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> nan_ignored = advantages;
  nan_ignored[ignored] = std::numeric_limits<float>::quiet_NaN();  // not read
  std::vector<float> huge = advantages;
  huge[counted] = 3e38f;
  const std::vector<float> heavy(kN, 3e38f);  // finite weights: the loss could overflow  // finite: the ratio term could overflow

  const auto policy = [&](uint64_t sequence) {
    client::Microbatch mb = ToMicrobatch("refuse", "x", sequence, batch);
    mb.loss_options.set_kind(v1::LOSS_KIND_POLICY_GRADIENT);
    mb.old_logprob = logprob;
    mb.advantages = advantages;
    return mb;
  };
  struct Case {
    std::string what;
    client::Microbatch mb;
    absl::StatusCode code;
  };
  std::vector<Case> cases;
  {
    client::Microbatch mb = policy(1);
    mb.old_logprob = {};
    cases.push_back(
        {"policy gradient without old_logprob", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = ToMicrobatch("refuse", "x", 1, batch);
    mb.advantages = advantages;
    mb.old_logprob = logprob;
    cases.push_back({"advantages with cross-entropy", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = policy(1);
    mb.ref_logprob = logprob;
    cases.push_back({"ref_logprob without kl_coef", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = policy(1);
    mb.loss_options.set_kl_coef(0.1f);
    cases.push_back({"kl_coef without ref_logprob", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = ToMicrobatch("refuse", "x", 1, batch);
    mb.loss_options.set_kl_coef(0.1f);
    cases.push_back({"kl_coef with cross-entropy", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = policy(1);
    mb.loss_options.set_label_smoothing(0.1f);
    cases.push_back(
        {"label smoothing with policy gradient", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = ToMicrobatch("refuse", "x", 1, batch);
    mb.token_weights = short_weights;
    cases.push_back({"token_weights one short", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = policy(1);
    mb.advantages = nan_counted;
    cases.push_back({"NaN advantage at a counted token", mb, absl::StatusCode::kInvalidArgument});
  }
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity()}) {
    client::Microbatch t = ToMicrobatch("refuse", "x", 1, batch);
    t.loss_options.set_temperature(bad);
    cases.push_back({absl::StrCat("temperature ", bad), t, absl::StatusCode::kInvalidArgument});
    client::Microbatch s = ToMicrobatch("refuse", "x", 1, batch);
    s.loss_options.set_logit_scale(bad);
    cases.push_back({absl::StrCat("logit_scale ", bad), s, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = ToMicrobatch("refuse", "x", 1, batch);
    mb.loss_options.set_logit_scale(1e-30f);
    mb.loss_options.set_temperature(1e10f);  // the quotient is subnormal
    cases.push_back({"scale / temperature subnormal", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = policy(1);
    mb.loss_options.set_clip_low(1.5f);
    cases.push_back({"clip_low 1.5", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = policy(1);
    mb.loss_options.set_clip_high(-0.1f);
    cases.push_back({"clip_high -0.1", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = ToMicrobatch("refuse", "x", 1, batch);
    mb.loss_options.set_entropy_coef(std::numeric_limits<float>::quiet_NaN());
    cases.push_back({"entropy_coef NaN", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = ToMicrobatch("refuse", "x", 1, batch);
    mb.loss_options.set_kind(static_cast<v1::LossKind>(7));
    cases.push_back({"kind 7", mb, absl::StatusCode::kInvalidArgument});
  }
  {
    client::Microbatch mb = policy(1);
    mb.advantages = huge;
    cases.push_back({"finite advantage that would overflow", mb, absl::StatusCode::kOutOfRange});
  }
  {
    client::Microbatch mb = ToMicrobatch("refuse", "x", 1, batch);
    mb.token_weights = heavy;
    cases.push_back({"finite weights that would overflow", mb, absl::StatusCode::kOutOfRange});
  }
  const uint64_t before = Microbatches("refuse");
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto got = client_->Step(c.mb);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), c.code) << got.status();
  }
  EXPECT_EQ(Microbatches("refuse"), before);
  auto window = client_->PullGradient("refuse", v1::DTYPE_FP32, false);
  ASSERT_TRUE(window.ok()) << window.status();
  EXPECT_EQ(window->summary.microbatch_count(), 0u);

  // Key 1 was never used up: it takes an honest micro-batch, and a NaN at an ignored token is
  // not read.
  client::Microbatch honest = policy(1);
  honest.advantages = nan_ignored;
  auto ok = client_->Step(honest);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(ok->replayed);
  EXPECT_TRUE(std::isfinite(ok->loss));
  EXPECT_EQ(Microbatches("refuse"), before + 1);
}

TEST_F(LossTermsTest, HeadDefaultsTakeTheNewOptionsAndRefuseBadOnes) {
  v1::HeadSpec spec;
  spec.set_name("defaults");
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_default_options()->set_logit_scale(0.125f);
  spec.mutable_default_options()->set_entropy_coef(0.01f);
  auto created = client_->CreateHead(spec);
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->spec().default_options().logit_scale(), 0.125f);
  EXPECT_EQ(created->spec().default_options().entropy_coef(), 0.01f);
  v1::LossOptions bad;
  bad.set_kl_coef(-1.0f);
  auto refused = client_->SetLossOptions("defaults", bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  spec.set_name("defaults-bad");
  spec.mutable_default_options()->set_temperature(0.0f);
  auto bad_head = client_->CreateHead(spec);
  ASSERT_FALSE(bad_head.ok());
  EXPECT_EQ(bad_head.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace losshead::testing
