// The C ABI's version 5 transfers of a head with an output bias (lh_push_weights_bias,
// lh_pull_gradient_bias, lh_download_weights_bias) against a real server: W and b round trip
// bit for bit, in buffers of their own or (the version 3 functions) b after W in one buffer;
// db matches a float64 reference; bad sizes and pointers are refused with their exact codes and
// change nothing.
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/capi.h"
#include "tests/capi/capi_fixture.h"

namespace {

constexpr int kInvalidArgument = 3;
constexpr int kFailedPrecondition = 9;
constexpr int kFp32 = 3;  // losshead.v1.DType
constexpr int kInt32 = 4;
constexpr int64_t kV = 11;
constexpr int64_t kD = 8;
constexpr size_t kWBytes = kV * kD * sizeof(float);
constexpr size_t kBBytes = kV * sizeof(float);

std::vector<float> Random(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

bool All(const std::vector<float>& v, float x) {
  return std::all_of(v.begin(), v.end(), [x](float y) { return y == x; });
}

class CapiBiasTest : public CapiServerTest {
 protected:
  // A fresh fp32 V x D head, with an output bias when `bias` (the `losshead` tool creates it:
  // this test links no protobuf code, as capi_test).
  std::string Head(bool bias, int64_t vocab_size = kV, int64_t hidden_size = kD) {
    return CreateHead(vocab_size, hidden_size, bias ? " --bias" : "");
  }

  uint64_t Push(const std::string& head, const std::vector<float>& w, const std::vector<float>& b,
                int add = 0) {
    uint64_t version = 0;
    lh_status status{};
    EXPECT_EQ(lh_push_weights_bias(client_, head.c_str(), kFp32, w.data(), w.size() * 4, b.data(),
                                   b.size() * 4, add, 0, 0, &version, &status),
              0)
        << status.message;
    return version;
  }

  // W and b of `head` (fp32), downloaded into buffers of their own.
  void Download(const std::string& head, std::vector<float>* w, std::vector<float>* b,
                lh_weights_info* info = nullptr) {
    w->assign(kV * kD, -9.0f);
    b->assign(kV, -9.0f);
    uint64_t bias_bytes = 0;
    lh_status status{};
    EXPECT_EQ(lh_download_weights_bias(client_, head.c_str(), kFp32, w->data(), kWBytes, b->data(),
                                       kBBytes, info, &bias_bytes, &status),
              0)
        << status.message;
    EXPECT_EQ(bias_bytes, kBBytes);
  }
};

TEST_F(CapiBiasTest, VersionFiveAddsTheBiasTransfersUnderItsOwnSymbolVersion) {
  EXPECT_GE(lh_capi_version(), 5);  // a later version only adds (capi_device_test: 6)
  EXPECT_GE(LH_CAPI_VERSION, 5);
  for (const char* name :
       {"lh_push_weights_bias", "lh_pull_gradient_bias", "lh_download_weights_bias"}) {
    EXPECT_NE(dlvsym(RTLD_DEFAULT, name, "LH_CAPI_5"), nullptr) << name;
    EXPECT_EQ(dlvsym(RTLD_DEFAULT, name, "LH_CAPI_4"), nullptr) << name;
  }
}

TEST_F(CapiBiasTest, WeightsAndBiasRoundTripBitForBit) {
  const std::string head = Head(true);
  const std::vector<float> w = Random(kV * kD, 1, -2.0f, 2.0f);
  const std::vector<float> b = Random(kV, 2, -3.0f, 3.0f);
  EXPECT_EQ(Push(head, w, b), 2u);  // created at 1
  std::vector<float> got_w, got_b;
  lh_weights_info info{};
  Download(head, &got_w, &got_b, &info);
  EXPECT_EQ(got_w, w);
  EXPECT_EQ(got_b, b);
  EXPECT_EQ(info.vocab_size, kV);
  EXPECT_EQ(info.hidden_size, kD);
  EXPECT_EQ(info.weights_version, 2u);

  // Version 3's download: b after W, the wire's layout, when the buffer holds both.
  std::vector<float> both(kV * kD + kV + 1, -9.0f);
  lh_status status{};
  ASSERT_EQ(lh_download_weights(client_, head.c_str(), kFp32, both.data(), both.size() * 4, nullptr,
                                &status),
            0)
      << status.message;
  EXPECT_TRUE(std::equal(w.begin(), w.end(), both.begin()));
  EXPECT_TRUE(std::equal(b.begin(), b.end(), both.begin() + kV * kD));
  EXPECT_EQ(both.back(), -9.0f);  // past them: untouched

  // ADD adds to both, in fp32 as the head keeps them.
  const std::vector<float> dw = Random(kV * kD, 3, -1.0f, 1.0f);
  const std::vector<float> db = Random(kV, 4, -1.0f, 1.0f);
  EXPECT_EQ(Push(head, dw, db, /*add=*/1), 3u);
  Download(head, &got_w, &got_b);
  for (int64_t i = 0; i < kV * kD; ++i) EXPECT_EQ(got_w[i], w[i] + dw[i]) << i;
  for (int64_t j = 0; j < kV; ++j) EXPECT_EQ(got_b[j], b[j] + db[j]) << j;
}

TEST_F(CapiBiasTest, PiecesThatStraddleWAndBArriveWhole) {
  // Messages of 1 KiB (the least a client takes): W's 2812 bytes, not a whole number of
  // pieces, end inside a piece whose rest is b's start.
  constexpr int64_t v = 37, d = 19;
  lh_client_options options{};
  options.max_message_bytes = 1024;
  options.max_receive_message_bytes = 4 << 20;
  lh_client* small = nullptr;
  lh_status status{};
  ASSERT_EQ(lh_client_connect(server_->target().c_str(), &options, &small, &status), 0)
      << status.message;
  const std::string head = Head(true, v, d);
  const std::vector<float> w = Random(v * d, 5, -2.0f, 2.0f);
  const std::vector<float> b = Random(v, 6, -3.0f, 3.0f);
  uint64_t version = 0;
  EXPECT_EQ(lh_push_weights_bias(small, head.c_str(), kFp32, w.data(), w.size() * 4, b.data(),
                                 b.size() * 4, 0, 1, 1, &version, &status),
            0)
      << status.message;
  EXPECT_EQ(version, 2u);
  // (The server's chunks follow its own limit: service_test's BiasTransfersTest cuts those.)
  std::vector<float> got_w(v * d), got_b(v);
  uint64_t bias_bytes = 0;
  lh_weights_info info{};
  EXPECT_EQ(lh_download_weights_bias(small, head.c_str(), kFp32, got_w.data(), got_w.size() * 4,
                                     got_b.data(), got_b.size() * 4, &info, &bias_bytes, &status),
            0)
      << status.message;
  lh_client_free(small);
  EXPECT_EQ(bias_bytes, b.size() * 4);
  EXPECT_EQ(got_w, w);
  EXPECT_EQ(got_b, b);
}

TEST_F(CapiBiasTest, DbIsPulledBesideDw) {
  const std::string head = Head(true);
  const std::vector<float> w = Random(kV * kD, 7, -0.8f, 0.8f);
  const std::vector<float> b = Random(kV, 8, -1.0f, 1.0f);
  Push(head, w, b);
  const int64_t n = 13;
  const std::vector<float> hidden = Random(n * kD, 9, -1.5f, 1.5f);
  std::vector<int32_t> targets;
  std::mt19937_64 rng(10);
  for (int64_t t = 0; t < n; ++t) targets.push_back(static_cast<int32_t>(rng() % kV));
  std::vector<float> dh(n * kD);
  const std::string sum = std::string("\x10\x02", 2);  // StepOptions.reduction = SUM
  lh_microbatch mb{};
  mb.head = head.c_str();
  mb.client_id = "capi-bias";
  mb.sequence = 1;
  mb.num_tokens = n;
  mb.hidden_dtype = kFp32;
  mb.hidden = hidden.data();
  mb.hidden_bytes = hidden.size() * 4;
  mb.target_dtype = kInt32;
  mb.targets = targets.data();
  mb.targets_bytes = targets.size() * 4;
  mb.options = sum.data();
  mb.options_bytes = sum.size();
  mb.grad_hidden_out = dh.data();
  mb.grad_hidden_capacity = dh.size() * 4;
  lh_step_result result{};
  lh_status status{};
  ASSERT_EQ(lh_step_many(client_, &mb, 1, 1, &result, &status), 0) << status.message;
  ASSERT_EQ(result.status.code, 0) << result.status.message;

  // float64 reference: softmax(h . w + b) - onehot, summed over the tokens.
  std::vector<double> ref_dw(kV * kD, 0.0), ref_db(kV, 0.0);
  double ref_loss = 0;
  for (int64_t t = 0; t < n; ++t) {
    std::vector<double> z(kV);
    for (int64_t v = 0; v < kV; ++v) {
      double s = b[v];
      for (int64_t d = 0; d < kD; ++d) s += static_cast<double>(hidden[t * kD + d]) * w[v * kD + d];
      z[v] = s;
    }
    const double m = *std::max_element(z.begin(), z.end());
    double den = 0;
    for (double x : z) den += std::exp(x - m);
    ref_loss += m + std::log(den) - z[targets[t]];
    for (int64_t v = 0; v < kV; ++v) {
      const double g = std::exp(z[v] - m) / den - (v == targets[t] ? 1.0 : 0.0);
      ref_db[v] += g;
      for (int64_t d = 0; d < kD; ++d) ref_dw[v * kD + d] += g * hidden[t * kD + d];
    }
  }
  EXPECT_NEAR(result.loss_sum, ref_loss, 1e-4 * n);

  // Without reset, into buffers of their own, then the version 3 way (b after W): the same bits.
  std::vector<float> dw(kV * kD, -9.0f), db(kV + 2, -9.0f);
  lh_gradient_summary summary{};
  uint64_t bias_bytes = 0;
  ASSERT_EQ(lh_pull_gradient_bias(client_, head.c_str(), kFp32, 0, dw.data(), kWBytes, db.data(),
                                  db.size() * 4, &summary, &bias_bytes, &status),
            0)
      << status.message;
  EXPECT_EQ(bias_bytes, kBBytes);
  EXPECT_EQ(summary.token_count, static_cast<uint64_t>(n));
  EXPECT_EQ(summary.total_bytes, kWBytes + kBBytes);
  EXPECT_EQ(db[kV], -9.0f);  // past db: untouched
  for (int64_t v = 0; v < kV; ++v) EXPECT_NEAR(db[v], ref_db[v], 1e-5 * n) << v;
  for (int64_t i = 0; i < kV * kD; ++i) EXPECT_NEAR(dw[i], ref_dw[i], 1e-5 * n) << i;
  std::vector<float> both(kV * kD + kV, -9.0f);
  ASSERT_EQ(lh_pull_gradient(client_, head.c_str(), kFp32, 0, both.data(), both.size() * 4,
                             &summary, &status),
            0)
      << status.message;
  EXPECT_TRUE(std::equal(dw.begin(), dw.end(), both.begin()));
  EXPECT_TRUE(std::equal(db.begin(), db.begin() + kV, both.begin() + kV * kD));

  // Buffers too small: FAILED_PRECONDITION naming the bias, nothing written (and, without
  // reset, the window still there).
  std::vector<float> short_w(kV * kD, -9.0f), short_b(kV - 1, -9.0f);
  EXPECT_EQ(
      lh_pull_gradient_bias(client_, head.c_str(), kFp32, 0, short_w.data(), kWBytes,
                            short_b.data(), short_b.size() * 4, &summary, &bias_bytes, &status),
      kFailedPrecondition);
  EXPECT_NE(std::string(status.message).find("bias"), std::string::npos) << status.message;
  EXPECT_TRUE(All(short_w, -9.0f) && All(short_b, -9.0f));
  EXPECT_EQ(
      lh_pull_gradient(client_, head.c_str(), kFp32, 0, short_w.data(), kWBytes, &summary, &status),
      kFailedPrecondition);
  EXPECT_NE(std::string(status.message).find("output bias"), std::string::npos) << status.message;
  EXPECT_TRUE(All(short_w, -9.0f));
  EXPECT_EQ(lh_pull_gradient_bias(client_, head.c_str(), kFp32, 0, dw.data(), kWBytes, nullptr,
                                  kBBytes, &summary, &bias_bytes, &status),
            kInvalidArgument);

  // With reset: the same window, then an empty one.
  std::vector<float> dw2(kV * kD), db2(kV);
  ASSERT_EQ(lh_pull_gradient_bias(client_, head.c_str(), kFp32, 1, dw2.data(), kWBytes, db2.data(),
                                  kBBytes, &summary, &bias_bytes, &status),
            0)
      << status.message;
  EXPECT_EQ(summary.was_reset, 1);
  EXPECT_EQ(summary.microbatch_count, 1u);
  EXPECT_TRUE(std::equal(dw.begin(), dw.end(), dw2.begin()));
  EXPECT_TRUE(std::equal(db2.begin(), db2.end(), db.begin()));
  ASSERT_EQ(lh_pull_gradient_bias(client_, head.c_str(), kFp32, 1, dw2.data(), kWBytes, db2.data(),
                                  kBBytes, &summary, &bias_bytes, &status),
            0)
      << status.message;
  EXPECT_EQ(summary.microbatch_count, 0u);
  EXPECT_TRUE(All(db2, 0.0f));
}

TEST_F(CapiBiasTest, BadSizesAreRefusedAndChangeNothing) {
  const std::string head = Head(true);
  const std::vector<float> w = Random(kV * kD, 11, -2.0f, 2.0f);
  const std::vector<float> b = Random(kV, 12, -3.0f, 3.0f);
  EXPECT_EQ(Push(head, w, b), 2u);
  const std::vector<float> other = Random(kV * kD + kV, 13, -1.0f, 1.0f);
  uint64_t version = 0;
  lh_status status{};
  // W alone, b one value short, b one value long: the server's INVALID_ARGUMENT.
  EXPECT_EQ(lh_push_weights(client_, head.c_str(), kFp32, other.data(), kWBytes, 0, 0, 0, &version,
                            &status),
            kInvalidArgument);
  EXPECT_EQ(lh_push_weights_bias(client_, head.c_str(), kFp32, other.data(), kWBytes, other.data(),
                                 kBBytes - 4, 0, 0, 0, &version, &status),
            kInvalidArgument);
  EXPECT_EQ(lh_push_weights_bias(client_, head.c_str(), kFp32, other.data(), kWBytes, other.data(),
                                 kBBytes + 4, 0, 0, 0, &version, &status),
            kInvalidArgument);
  // A null bias with a length: refused before sending.
  EXPECT_EQ(lh_push_weights_bias(client_, head.c_str(), kFp32, other.data(), kWBytes, nullptr,
                                 kBBytes, 0, 0, 0, &version, &status),
            kInvalidArgument);
  EXPECT_NE(std::string(status.message).find("bias is null"), std::string::npos) << status.message;
  EXPECT_EQ(lh_push_weights_bias(nullptr, head.c_str(), kFp32, other.data(), kWBytes, other.data(),
                                 kBBytes, 0, 0, 0, &version, &status),
            kInvalidArgument);
  // A stale expected version: FAILED_PRECONDITION.
  EXPECT_EQ(lh_push_weights_bias(client_, head.c_str(), kFp32, other.data(), kWBytes, other.data(),
                                 kBBytes, 0, 1, 1, &version, &status),
            kFailedPrecondition);
  std::vector<float> got_w, got_b;
  lh_weights_info info{};
  Download(head, &got_w, &got_b, &info);
  EXPECT_EQ(got_w, w);
  EXPECT_EQ(got_b, b);
  EXPECT_EQ(info.weights_version, 2u);

  // The one-buffer download of a bias head into W's size: refused, naming the bias.
  std::vector<float> only_w(kV * kD, -9.0f);
  EXPECT_EQ(
      lh_download_weights(client_, head.c_str(), kFp32, only_w.data(), kWBytes, &info, &status),
      kFailedPrecondition);
  EXPECT_NE(std::string(status.message).find("output bias"), std::string::npos) << status.message;
  EXPECT_TRUE(All(only_w, -9.0f));
  std::vector<float> short_b(kV - 1, -9.0f);
  uint64_t bias_bytes = 7;
  EXPECT_EQ(
      lh_download_weights_bias(client_, head.c_str(), kFp32, only_w.data(), kWBytes, short_b.data(),
                               short_b.size() * 4, &info, &bias_bytes, &status),
      kFailedPrecondition);
  EXPECT_TRUE(All(only_w, -9.0f) && All(short_b, -9.0f));
  EXPECT_EQ(lh_download_weights_bias(client_, head.c_str(), kFp32, only_w.data(), kWBytes, nullptr,
                                     kBBytes, &info, &bias_bytes, &status),
            kInvalidArgument);
}

TEST_F(CapiBiasTest, AHeadWithoutBiasRefusesOneAndLeavesTheBiasBufferAlone) {
  const std::string head = Head(false);
  const std::vector<float> w = Random(kV * kD, 14, -2.0f, 2.0f);
  const std::vector<float> b = Random(kV, 15, -3.0f, 3.0f);
  uint64_t version = 0;
  lh_status status{};
  EXPECT_EQ(lh_push_weights_bias(client_, head.c_str(), kFp32, w.data(), kWBytes, b.data(), kBBytes,
                                 0, 0, 0, &version, &status),
            kInvalidArgument);
  // No bias given (null, 0): the same as lh_push_weights.
  ASSERT_EQ(lh_push_weights_bias(client_, head.c_str(), kFp32, w.data(), kWBytes, nullptr, 0, 0, 0,
                                 0, &version, &status),
            0)
      << status.message;
  EXPECT_EQ(version, 2u);
  std::vector<float> got_w(kV * kD, -9.0f), got_b(kV, -9.0f);
  uint64_t bias_bytes = 7;
  lh_weights_info info{};
  ASSERT_EQ(lh_download_weights_bias(client_, head.c_str(), kFp32, got_w.data(), kWBytes,
                                     got_b.data(), kBBytes, &info, &bias_bytes, &status),
            0)
      << status.message;
  EXPECT_EQ(got_w, w);
  EXPECT_EQ(bias_bytes, 0u);
  EXPECT_TRUE(All(got_b, -9.0f));
  std::vector<float> dw(kV * kD, -9.0f);
  lh_gradient_summary summary{};
  ASSERT_EQ(lh_pull_gradient_bias(client_, head.c_str(), kFp32, 1, dw.data(), kWBytes, got_b.data(),
                                  kBBytes, &summary, &bias_bytes, &status),
            0)
      << status.message;
  EXPECT_EQ(bias_bytes, 0u);
  EXPECT_EQ(summary.total_bytes, kWBytes);
  EXPECT_TRUE(All(dw, 0.0f));
  EXPECT_TRUE(All(got_b, -9.0f));
}

}  // namespace
