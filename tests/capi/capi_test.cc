// The C ABI's version 4 entry points (lh_step_many_with_inputs, lh_embedding_rows) against a real
// server: token inputs reach the loss (float64 references), embedding rows and gradients are
// exact, and bad lengths or null pointers are refused with INVALID_ARGUMENT before anything is
// sent. Version 3's layouts are pinned here, since a version only adds (capi.h).
#include "losshead/capi.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/capi/capi_fixture.h"

// Callers built against version 3 keep working only if its structs keep their layout.
static_assert(sizeof(lh_status) == 1036);
static_assert(sizeof(lh_microbatch) == 208);
static_assert(offsetof(lh_microbatch, top_k_capacity) == 200);
static_assert(sizeof(lh_step_result) == 1168);
static_assert(offsetof(lh_step_result, top_k_logprobs_count) == 1160);

namespace {

constexpr int kInvalidArgument = 3;
constexpr int kFailedPrecondition = 9;
constexpr int kFp32 = 3;  // losshead.v1.DType
constexpr int kInt32 = 4;
constexpr int kInt64 = 5;
constexpr int64_t kV = 11;
constexpr int64_t kD = 8;

// Protobuf wire encoding of the few option fields these tests set (the test links no protobuf
// code of its own: see CMakeLists.txt).
std::string Varint(uint64_t v) {
  std::string out;
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
  return out;
}
std::string VarintField(int field, uint64_t v) { return Varint(field << 3) + Varint(v); }
std::string FloatField(int field, float f) {
  std::string out = Varint((field << 3) | 5);
  char bytes[4];
  std::memcpy(bytes, &f, 4);
  return out + std::string(bytes, 4);
}
// StepOptions.reduction = REDUCTION_SUM, and forward_only.
const std::string kSum = VarintField(2, 2);
const std::string kSumForward = VarintField(2, 2) + VarintField(7, 1);

std::vector<float> Random(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

// Float64 logits of one token's hidden state against W.
std::vector<double> Logits(const std::vector<float>& w, const float* h) {
  std::vector<double> z(kV);
  for (int64_t v = 0; v < kV; ++v) {
    double s = 0;
    for (int64_t d = 0; d < kD; ++d) s += static_cast<double>(h[d]) * w[v * kD + d];
    z[v] = s;
  }
  return z;
}
double LogSumExp(const std::vector<double>& z) {
  const double m = *std::max_element(z.begin(), z.end());
  double s = 0;
  for (double x : z) s += std::exp(x - m);
  return m + std::log(s);
}

class CapiTest : public CapiServerTest {
 protected:
  // A fresh fp32 V x D head holding `weight` (with the `losshead` tool: see CMakeLists.txt).
  std::string Head(const std::vector<float>& weight) {
    const std::string name = CreateHead(kV, kD);
    uint64_t version = 0;
    lh_status status{};
    EXPECT_EQ(lh_push_weights(client_, name.c_str(), kFp32, weight.data(),
                              weight.size() * sizeof(float), 0, 0, 0, &version, &status),
              0)
        << status.message;
    return name;
  }

  // dW of `head` (fp32, V x D), pulled with reset, and its summary.
  std::vector<float> Pull(const std::string& head, lh_gradient_summary* summary) {
    std::vector<float> grad(kV * kD, -1.0f);
    lh_status status{};
    EXPECT_EQ(lh_pull_gradient(client_, head.c_str(), kFp32, 1, grad.data(),
                               grad.size() * sizeof(float), summary, &status),
              0)
        << status.message;
    return grad;
  }
};

// A loss micro-batch of N fp32 hidden states and int32 targets, dH into `grad`.
struct Batch {
  std::string head;
  std::vector<float> hidden;
  std::vector<int32_t> targets;
  std::vector<float> grad;
  std::string options;
  std::string loss_options;

  lh_microbatch C(uint64_t sequence) {
    grad.assign(hidden.size(), 0.0f);
    lh_microbatch mb{};
    mb.head = head.c_str();
    mb.client_id = "capi";
    mb.sequence = sequence;
    mb.num_tokens = static_cast<int64_t>(targets.size());
    mb.hidden_dtype = kFp32;
    mb.hidden = hidden.data();
    mb.hidden_bytes = hidden.size() * sizeof(float);
    mb.target_dtype = kInt32;
    mb.targets = targets.data();
    mb.targets_bytes = targets.size() * sizeof(int32_t);
    mb.options = options.data();
    mb.options_bytes = options.size();
    mb.loss_options = loss_options.data();
    mb.loss_options_bytes = loss_options.size();
    mb.grad_hidden_out = grad.data();
    mb.grad_hidden_capacity = grad.size() * sizeof(float);
    return mb;
  }
};

Batch RandomBatch(const std::string& head, int64_t n, uint64_t seed) {
  Batch b{.head = head, .hidden = Random(n * kD, seed, -1.5f, 1.5f)};
  std::mt19937_64 rng(seed + 1);
  for (int64_t t = 0; t < n; ++t) b.targets.push_back(static_cast<int32_t>(rng() % kV));
  return b;
}

TEST_F(CapiTest, VersionFourAddsItsFunctionsUnderItsOwnSymbolVersion) {
  EXPECT_GE(lh_capi_version(), 4);  // a later version only adds (capi_bias_test: 5)
  EXPECT_GE(LH_CAPI_VERSION, 4);
  for (const char* name : {"lh_step_many", "lh_push_weights", "lh_pull_gradient",
                           "lh_download_weights", "lh_client_connect"}) {
    EXPECT_NE(dlvsym(RTLD_DEFAULT, name, "LH_CAPI_3"), nullptr) << name;
  }
  for (const char* name : {"lh_step_many_with_inputs", "lh_embedding_rows"}) {
    EXPECT_NE(dlvsym(RTLD_DEFAULT, name, "LH_CAPI_4"), nullptr) << name;
    EXPECT_EQ(dlvsym(RTLD_DEFAULT, name, "LH_CAPI_3"), nullptr) << name;
  }
}

TEST_F(CapiTest, TokenWeightsReachTheLoss) {
  const int64_t n = 24;
  const std::vector<float> w = Random(kV * kD, 1, -0.8f, 0.8f);
  Batch b = RandomBatch(Head(w), n, 2);
  b.options = kSum;
  const std::vector<float> weights = Random(n, 3, 0.0f, 2.0f);
  lh_microbatch mb = b.C(1);
  lh_microbatch_inputs in{.kind = 0, .token_weights = weights.data(), .token_weights_count = n};
  lh_step_result result{};
  lh_status status{};
  ASSERT_EQ(lh_step_many_with_inputs(client_, &mb, &in, 1, 1, &result, &status), 0)
      << status.message;
  ASSERT_EQ(result.status.code, 0) << result.status.message;
  // Reference: sum_t w_t (lse_t - z_t[y_t]), dH_t = w_t sum_v (p_tv - [v = y_t]) W_v.
  double loss = 0;
  for (int64_t t = 0; t < n; ++t) {
    const std::vector<double> z = Logits(w, &b.hidden[t * kD]);
    const double lse = LogSumExp(z);
    loss += weights[t] * (lse - z[b.targets[t]]);
    for (int64_t d = 0; d < kD; ++d) {
      double g = 0;
      for (int64_t v = 0; v < kV; ++v) {
        g += (std::exp(z[v] - lse) - (v == b.targets[t] ? 1.0 : 0.0)) * w[v * kD + d];
      }
      EXPECT_NEAR(b.grad[t * kD + d], weights[t] * g, 1e-5) << "dH[" << t << "][" << d << "]";
    }
  }
  EXPECT_EQ(result.token_count, n);
  EXPECT_NEAR(result.loss_sum, loss, 1e-5 * std::abs(loss));
  EXPECT_EQ(result.grad_hidden_bytes, n * kD * sizeof(float));
}

TEST_F(CapiTest, PolicyGradientInputsReachTheLoss) {
  const int64_t n = 20;
  const std::vector<float> w = Random(kV * kD, 4, -0.8f, 0.8f);
  Batch b = RandomBatch(Head(w), n, 5);
  b.options = kSumForward;
  const float clip_low = 0.2f, clip_high = 0.28f, kl = 0.05f;
  b.loss_options =
      VarintField(9, 2) + FloatField(10, clip_low) + FloatField(11, clip_high) + FloatField(12, kl);
  const std::vector<float> old_logprob = Random(n, 6, -4.0f, -1.0f);
  const std::vector<float> advantages = Random(n, 7, -1.0f, 1.0f);
  const std::vector<float> ref_logprob = Random(n, 8, -4.0f, -1.0f);
  lh_microbatch mb = b.C(0);
  lh_microbatch_inputs in{.old_logprob = old_logprob.data(),
                          .old_logprob_count = n,
                          .advantages = advantages.data(),
                          .advantages_count = n,
                          .ref_logprob = ref_logprob.data(),
                          .ref_logprob_count = n};
  lh_step_result result{};
  lh_status status{};
  ASSERT_EQ(lh_step_many_with_inputs(client_, &mb, &in, 1, 1, &result, &status), 0)
      << status.message;
  ASSERT_EQ(result.status.code, 0) << result.status.message;
  EXPECT_EQ(result.forward_only, 1);
  double loss = 0;
  for (int64_t t = 0; t < n; ++t) {
    const std::vector<double> z = Logits(w, &b.hidden[t * kD]);
    const double logp = z[b.targets[t]] - LogSumExp(z);
    const double ratio = std::exp(logp - old_logprob[t]);
    const double a = advantages[t];
    const double clipped = std::clamp(ratio, 1.0 - clip_low, 1.0 + clip_high);
    const double diff = ref_logprob[t] - logp;
    loss += -std::min(ratio * a, clipped * a) + kl * std::min(std::exp(diff) - diff - 1.0, 10.0);
  }
  EXPECT_NEAR(result.loss_sum, loss, 1e-5 * std::max(1.0, std::abs(loss)));
}

TEST_F(CapiTest, BadLengthsAndNullPointersAreRefusedBeforeAnythingIsSent) {
  const int64_t n = 6;
  const std::vector<float> w = Random(kV * kD, 9, -0.8f, 0.8f);
  const std::string head = Head(w);
  Batch b = RandomBatch(head, n, 10);
  b.options = kSum;
  const std::vector<float> values(n + 1, 1.0f);
  lh_microbatch mbs[2] = {b.C(1), b.C(2)};
  lh_step_result results[2] = {};
  auto refused = [&](const lh_microbatch_inputs& second, const char* what) {
    lh_microbatch_inputs in[2] = {{.token_weights = values.data(), .token_weights_count = n},
                                  second};
    lh_status status{};
    EXPECT_EQ(lh_step_many_with_inputs(client_, mbs, in, 2, 2, results, &status), kInvalidArgument)
        << what;
    EXPECT_EQ(status.code, kInvalidArgument) << what;
    EXPECT_EQ(status.microbatch, 0) << what;
    EXPECT_NE(std::string(status.message).find("micro-batch 1"), std::string::npos)
        << what << ": " << status.message;
  };
  refused({.token_weights = values.data(), .token_weights_count = n + 1}, "one value too many");
  refused({.advantages = values.data(), .advantages_count = n - 1}, "one value short");
  refused({.old_logprob = nullptr, .old_logprob_count = n}, "null with a count");
  refused({.ref_logprob = values.data(), .ref_logprob_count = 0}, "values without a count");
  refused({.kind = 7}, "an unknown kind");

  lh_status status{};
  lh_microbatch_inputs none[2] = {};
  EXPECT_EQ(lh_step_many_with_inputs(nullptr, mbs, none, 2, 1, results, &status), kInvalidArgument);
  EXPECT_EQ(lh_step_many_with_inputs(client_, nullptr, none, 2, 1, results, &status),
            kInvalidArgument);
  EXPECT_EQ(lh_step_many_with_inputs(client_, mbs, none, 2, 1, nullptr, &status), kInvalidArgument);
  EXPECT_EQ(lh_step_many(client_, nullptr, 2, 1, results, &status), kInvalidArgument);
  EXPECT_EQ(lh_step_many(nullptr, mbs, 2, 1, results, &status), kInvalidArgument);
  EXPECT_EQ(status.code, kInvalidArgument);
  // Nothing of those reached the head; the same keys then run once each.
  lh_gradient_summary summary{};
  Pull(head, &summary);
  EXPECT_EQ(summary.microbatch_count, 0u);
  ASSERT_EQ(lh_step_many_with_inputs(client_, mbs, none, 2, 2, results, &status), 0)
      << status.message;
  EXPECT_EQ(results[0].status.code, 0) << results[0].status.message;
  EXPECT_EQ(results[1].status.code, 0) << results[1].status.message;
  EXPECT_EQ(results[0].replayed + results[1].replayed, 0);
  Pull(head, &summary);
  EXPECT_EQ(summary.microbatch_count, 2u);
  EXPECT_EQ(summary.token_count, 2u * n);
}

TEST_F(CapiTest, EmbeddingRowsAreWsRows) {
  const std::vector<float> w = Random(kV * kD, 11, -2.0f, 2.0f);
  const std::string head = Head(w);
  const std::vector<int64_t> ids = {3, 0, 3, kV - 1};
  std::vector<float> rows(ids.size() * kD, -7.0f);
  lh_embedding_rows_info info{};
  lh_status status{};
  ASSERT_EQ(lh_embedding_rows(client_, head.c_str(), ids.data(), ids.size(), 0, 1, 2, rows.data(),
                              rows.size() * sizeof(float), &info, &status),
            0)
      << status.message;
  EXPECT_EQ(info.num_rows, static_cast<int64_t>(ids.size()));
  EXPECT_EQ(info.hidden_size, kD);
  EXPECT_EQ(info.dtype, kFp32);
  EXPECT_EQ(info.weights_version, 2u);  // created at 1, pushed once
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t d = 0; d < kD; ++d) {
      EXPECT_EQ(rows[i * kD + d], w[ids[i] * kD + d]) << "row " << i << ", column " << d;
    }
  }

  // A buffer one value short: refused, left as it was.
  std::vector<float> small(ids.size() * kD - 1, -7.0f);
  info = lh_embedding_rows_info{};
  EXPECT_EQ(lh_embedding_rows(client_, head.c_str(), ids.data(), ids.size(), 0, 0, 0, small.data(),
                              small.size() * sizeof(float), &info, &status),
            kFailedPrecondition);
  EXPECT_TRUE(std::all_of(small.begin(), small.end(), [](float x) { return x == -7.0f; }));
  EXPECT_EQ(info.num_rows * info.hidden_size, static_cast<int64_t>(rows.size()));  // the need
  EXPECT_EQ(lh_embedding_rows(client_, head.c_str(), ids.data(), ids.size(), 0, 0, 0, nullptr,
                              rows.size() * sizeof(float), &info, &status),
            kFailedPrecondition);
  EXPECT_EQ(lh_embedding_rows(client_, head.c_str(), ids.data(), ids.size(), 0, 1, 5, rows.data(),
                              rows.size() * sizeof(float), &info, &status),
            kFailedPrecondition);  // W is at version 2
  EXPECT_EQ(lh_embedding_rows(client_, head.c_str(), nullptr, 3, 0, 0, 0, rows.data(),
                              rows.size() * sizeof(float), &info, &status),
            kInvalidArgument);
  EXPECT_EQ(lh_embedding_rows(client_, head.c_str(), ids.data(), 0, 0, 0, 0, rows.data(),
                              rows.size() * sizeof(float), &info, &status),
            kInvalidArgument);
  EXPECT_EQ(lh_embedding_rows(nullptr, head.c_str(), ids.data(), ids.size(), 0, 0, 0, rows.data(),
                              rows.size() * sizeof(float), &info, &status),
            kInvalidArgument);
  EXPECT_EQ(status.code, kInvalidArgument);
}

TEST_F(CapiTest, EmbeddingGradientsLandInDwOnce) {
  const std::vector<float> w = Random(kV * kD, 12, -2.0f, 2.0f);
  const std::string head = Head(w);
  const std::vector<int64_t> ids = {5, 1, 5};
  std::vector<float> grad(ids.size() * kD);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>(i % 7) - 3.0f;
  lh_microbatch mb{};
  mb.head = head.c_str();
  mb.client_id = "capi";
  mb.sequence = 40;
  mb.num_tokens = static_cast<int64_t>(ids.size());
  mb.hidden_dtype = kFp32;
  mb.hidden = grad.data();
  mb.hidden_bytes = grad.size() * sizeof(float);
  mb.target_dtype = kInt64;
  mb.targets = ids.data();
  mb.targets_bytes = ids.size() * sizeof(int64_t);
  const lh_microbatch_inputs embedding{.kind = 1};
  lh_step_result results[2] = {};
  lh_status status{};
  const lh_microbatch twice[2] = {mb, mb};  // the second repeats the first's key
  const lh_microbatch_inputs kinds[2] = {embedding, embedding};
  ASSERT_EQ(lh_step_many_with_inputs(client_, twice, kinds, 2, 1, results, &status), 0)
      << status.message;
  ASSERT_EQ(results[0].status.code, 0) << results[0].status.message;
  ASSERT_EQ(results[1].status.code, 0) << results[1].status.message;
  EXPECT_EQ(results[0].replayed, 0);
  EXPECT_EQ(results[1].replayed, 1);
  EXPECT_EQ(results[0].weights_version, 2u);
  lh_gradient_summary summary{};
  const std::vector<float> dw = Pull(head, &summary);
  EXPECT_EQ(summary.microbatch_count, 1u);
  EXPECT_EQ(summary.token_count, 0u);  // an embedding gradient carries no tokens
  std::vector<float> expected(kV * kD, 0.0f);
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t d = 0; d < kD; ++d) expected[ids[i] * kD + d] += grad[i * kD + d];
  }
  EXPECT_EQ(dw, expected);
}

}  // namespace
