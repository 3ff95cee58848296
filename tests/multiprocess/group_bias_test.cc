// A head with an output bias replicated across 2 real server processes (CPU backend), against
// one-process servers given the same micro-batches: a pull's db is the fp64 sum in process order
// of the processes' windows (rounded once), like dW beside it; an optimizer apply steps b the same
// bits on every process, within fp32 rounding of one process's; a push of W and b through a
// follower reaches every process, and a discard empties db everywhere.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/multiprocess/group_util.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {
namespace {

constexpr char kBiasedHead[] = "biased";
constexpr int64_t kBiasVocab = 40;
constexpr int64_t kBiasHidden = 16;
constexpr int64_t kBiasTokens = 12;
constexpr int kBiasClients = 5;
constexpr int kBiasPerClient = 2;
constexpr int kProcesses = 2;

v1::HeadSpec BiasedSpec() {
  v1::HeadSpec spec;
  spec.set_name(kBiasedHead);
  spec.set_vocab_size(kBiasVocab);
  spec.set_hidden_size(kBiasHidden);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.set_bias(true);
  spec.mutable_init()->mutable_normal()->set_std(0.3f);
  spec.mutable_init()->mutable_normal()->set_seed(23);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  return spec;
}

v1::ApplyOptimizerRequest BiasApply(uint64_t step_key) {
  v1::ApplyOptimizerRequest request;
  request.set_head(kBiasedHead);
  request.set_client_id("optimizer");
  request.set_step_key(step_key);
  request.mutable_params()->set_lr(0.05);
  request.mutable_params()->set_weight_decay(0.1);
  request.mutable_params()->set_beta1(0.9);
  request.mutable_params()->set_beta2(0.999);
  request.mutable_params()->set_eps(1e-8);
  request.mutable_params()->set_bias_weight_decay(0.0);
  return request;
}

std::vector<double> Wide(const std::vector<float>& values) {
  return std::vector<double>(values.begin(), values.end());
}

// The fp64 sum in process order, rounded once: what the group's cut promises.
std::vector<float> SumInOrder(const std::vector<std::vector<float>>& parts) {
  std::vector<double> sum(parts.front().size(), 0.0);
  for (const std::vector<float>& part : parts) {
    for (size_t i = 0; i < part.size(); ++i) sum[i] += part[i];
  }
  return std::vector<float>(sum.begin(), sum.end());
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(GroupBiasTest, DbIsSummedBesideDwAndBStepsAlikeOnEveryProcess) {
  Group group(kProcesses, "bias");
  ASSERT_TRUE(group.ok());
  // Created through the follower: every process holds the head with its bias.
  auto created = group.clients[1]->CreateHead(BiasedSpec());
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(created->spec().bias());
  Single all("bias_all");
  ASSERT_NE(all.client, nullptr);
  ASSERT_TRUE(all.client->CreateHead(BiasedSpec()).ok());
  std::vector<std::unique_ptr<Single>> per_process;
  for (int p = 0; p < kProcesses; ++p) {
    per_process.push_back(std::make_unique<Single>(absl::StrCat("bias_proc", p)));
    ASSERT_NE(per_process[p]->client, nullptr);
    ASSERT_TRUE(per_process[p]->client->CreateHead(BiasedSpec()).ok());
  }

  // Random non-zero b everywhere (pushed through the follower with W), so that the step's
  // arithmetic on b shows.
  const std::vector<float> w0 = RandomValues(kBiasVocab * kBiasHidden, 0.2, v1::DTYPE_FP32, 5);
  const std::vector<float> b0 = RandomValues(kBiasVocab, 0.5, v1::DTYPE_FP32, 6);
  const client::Bytes w0_bytes = Encode(w0, v1::DTYPE_FP32);
  const client::Bytes b0_bytes = Encode(b0, v1::DTYPE_FP32);
  client::PushRequest push{
      .head = kBiasedHead, .dtype = v1::DTYPE_FP32, .data = w0_bytes, .bias = b0_bytes};
  auto pushed = group.clients[1]->PushWeights(push);
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  ASSERT_TRUE(all.client->PushWeights(push).ok());
  for (auto& single : per_process) ASSERT_TRUE(single->client->PushWeights(push).ok());
  for (int p = 0; p < kProcesses; ++p) {
    auto w = group.clients[p]->DownloadWeights(kBiasedHead);
    ASSERT_TRUE(w.ok()) << w.status();
    ASSERT_TRUE(w->has_bias);
    EXPECT_EQ(w->weights_version, *pushed);
    EXPECT_TRUE(w->data == w0_bytes) << "process " << p;
    EXPECT_TRUE(w->bias == b0_bytes) << "process " << p << " did not take b";
  }

  // Micro-batches at their homes, and to the references.
  for (int k = 0; k < kBiasPerClient; ++k) {
    for (int c = 0; c < kBiasClients; ++c) {
      const std::string id = absl::StrCat("biased-", c);
      const int home = Home(id, kProcesses);
      const HostBatch batch =
          MakeBatch(kBiasTokens, kBiasHidden, kBiasVocab, v1::DTYPE_FP32, 500 + 31 * c + k);
      const client::Microbatch mb = ToMicrobatch(kBiasedHead, id, k + 1, batch);
      auto done = group.clients[home]->Step(mb);
      ASSERT_TRUE(done.ok()) << done.status();
      auto want = all.client->Step(mb);
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(done->loss_sum, want->loss_sum);
      ASSERT_TRUE(per_process[home]->client->Step(mb).ok());
    }
  }

  // A pull through either process: dW and db the fp64 sum of the processes' windows.
  std::vector<std::vector<float>> dw_parts, db_parts;
  for (auto& single : per_process) {
    auto local = single->client->PullGradient(kBiasedHead);
    ASSERT_TRUE(local.ok()) << local.status();
    dw_parts.push_back(Floats(local->data));
    db_parts.push_back(Floats(local->bias));
  }
  const std::vector<float> want_dw = SumInOrder(dw_parts);
  const std::vector<float> want_db = SumInOrder(db_parts);
  auto reference = all.client->PullGradient(kBiasedHead);
  ASSERT_TRUE(reference.ok()) << reference.status();
  ASSERT_EQ(reference->bias.size(), kBiasVocab * sizeof(float));
  for (int p = 0; p < kProcesses; ++p) {
    auto pulled = group.clients[p]->PullGradient(kBiasedHead);
    ASSERT_TRUE(pulled.ok()) << "process " << p << ": " << pulled.status();
    EXPECT_TRUE(pulled->summary.bias());
    EXPECT_EQ(pulled->summary.token_count(), reference->summary.token_count());
    EXPECT_TRUE(SameBits(Floats(pulled->data), want_dw)) << "process " << p << ": dW";
    EXPECT_TRUE(SameBits(Floats(pulled->bias), want_db))
        << "process " << p << ": db is not the fp64 sum of the processes' windows";
    EXPECT_TRUE(AllClose(Floats(pulled->bias), Wide(Floats(reference->bias)), 1e-5))
        << "process " << p;
  }

  // An apply through the follower: b (and W) the same bits on every process, one process's
  // within fp32 rounding; every window's db empty.
  auto applied = group.clients[1]->ApplyOptimizer(BiasApply(1));
  ASSERT_TRUE(applied.ok()) << applied.status();
  auto want_applied = all.client->ApplyOptimizer(BiasApply(1));
  ASSERT_TRUE(want_applied.ok()) << want_applied.status();
  EXPECT_NEAR(applied->head_grad_norm(), want_applied->head_grad_norm(),
              1e-5 * want_applied->head_grad_norm());
  auto want_w = all.client->DownloadWeights(kBiasedHead);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  auto leader_w = group.clients[0]->DownloadWeights(kBiasedHead);
  ASSERT_TRUE(leader_w.ok()) << leader_w.status();
  EXPECT_FALSE(leader_w->bias == b0_bytes) << "the apply did not step b";
  EXPECT_TRUE(AllClose(Floats(leader_w->bias), Wide(Floats(want_w->bias)), 1e-5));
  EXPECT_TRUE(AllClose(Floats(leader_w->data), Wide(Floats(want_w->data)), 1e-5));
  for (int p = 0; p < kProcesses; ++p) {
    auto w = group.clients[p]->DownloadWeights(kBiasedHead);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->weights_version, applied->weights_version());
    EXPECT_TRUE(w->bias == leader_w->bias) << "process " << p << " holds another b";
    EXPECT_TRUE(w->data == leader_w->data) << "process " << p << " holds another W";
    auto window = group.clients[p]->PullGradient(kBiasedHead);
    ASSERT_TRUE(window.ok()) << window.status();
    EXPECT_EQ(window->summary.token_count(), 0u);
    EXPECT_TRUE(SameBits(Floats(window->bias), std::vector<float>(kBiasVocab, 0.0f)))
        << "process " << p << " kept db after the apply";
  }

  // One more micro-batch, then a discard through the leader: db empty on every process.
  const std::string id = "biased-0";
  const HostBatch batch = MakeBatch(kBiasTokens, kBiasHidden, kBiasVocab, v1::DTYPE_FP32, 900);
  ASSERT_TRUE(group.clients[Home(id, kProcesses)]
                  ->Step(ToMicrobatch(kBiasedHead, id, kBiasPerClient + 1, batch))
                  .ok());
  auto discarded = group.clients[0]->DiscardGradient(kBiasedHead);
  ASSERT_TRUE(discarded.ok()) << discarded.status();
  EXPECT_EQ(discarded->token_count(), static_cast<uint64_t>(kBiasTokens));
  for (int p = 0; p < kProcesses; ++p) {
    auto window = group.clients[p]->PullGradient(kBiasedHead);
    ASSERT_TRUE(window.ok()) << window.status();
    EXPECT_TRUE(SameBits(Floats(window->bias), std::vector<float>(kBiasVocab, 0.0f)))
        << "process " << p << " kept db after the discard";
  }
}

}  // namespace
}  // namespace losshead::testing
