// A head with an output bias, tied to its model's input embedding, sharded across two real server
// processes of one GPU each (process p on GPU p of this host), so that every exchange between the
// shards goes over NCCL, against one process sharded over both GPUs (its shards exchange within
// the process). The CPU suites (sharded_bias_test.cc, sharded_embedding_test.cc) check the same
// protocol bit for bit over the host collective; here the device code and NCCL take part:
// - W and b pushed through the follower: W, b and EmbeddingRows through both processes are the
//   one-process head's bit for bit (nothing is summed);
// - loss and dH of micro-batches keyed at their homes and unkeyed through both processes, and
//   EMBEDDING_GRAD micro-batches among them: within fp32 rounding of the one-process head's
//   (NCCL adds in an order of its own), every one counted once on both processes;
// - pulls of dW and db through both processes, a clipped AdamW apply through the follower with a
//   bias weight decay of its own, and EmbeddingRows of the stepped W: within fp32 rounding.
// Skipped where a server cannot start on two CUDA devices (no GPU, one, or a build without CUDA).
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/server_process.h"
#include "tests/multiprocess/group_util.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {
namespace {

constexpr char kTiedBiased[] = "tied_biased";
constexpr int64_t kV = 1031;  // odd: the two shards hold unequal rows
constexpr int64_t kD = 64;
constexpr int64_t kN = 48;
constexpr int64_t kGradRows = 37;
constexpr int kLearners = 4;
constexpr int kProcesses = 2;
constexpr double kTol = 1e-5;

v1::HeadSpec TiedBiased(int devices, bool across) {
  v1::HeadSpec spec = ShardedSpec(kTiedBiased, kV, kD, /*seed=*/29, devices, across);
  spec.set_bias(true);
  return spec;
}

std::string Learner(int c) { return absl::StrCat("nccl-learner-", c); }

HostBatch LearnerBatch(int c, int k) {
  return MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 7000 + 53 * c + k, /*ignore_every=*/7);
}

// `count` ids over the whole vocabulary with a repeat, the first and last rows among them (they
// lie on different processes).
std::vector<int64_t> Ids(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(count);
  for (int64_t& id : ids) id = static_cast<int64_t>(rng() % kV);
  ids[0] = 0;
  ids[count - 1] = kV - 1;
  ids[2] = ids[1];
  return ids;
}

std::vector<double> Doubles(const client::Bytes& bytes) {
  const std::vector<float> f = Floats(bytes);
  return std::vector<double>(f.begin(), f.end());
}

v1::ApplyOptimizerRequest ClippedApply(uint64_t step_key) {
  v1::ApplyOptimizerRequest request;
  request.set_head(kTiedBiased);
  request.set_client_id("optimizer");
  request.set_step_key(step_key);
  request.mutable_params()->set_lr(0.01);
  request.mutable_params()->set_weight_decay(0.01);
  request.mutable_params()->set_bias_weight_decay(0.05);
  request.mutable_params()->set_beta1(0.9);
  request.mutable_params()->set_beta2(0.999);
  request.mutable_params()->set_eps(1e-8);
  request.set_max_norm(0.05);
  return request;
}

// EmbeddingRows of `ids` through both processes against the one-process head's: bit for bit
// when `exact`, else within fp32 rounding.
void ExpectRows(Group& group, client::Client& one, const std::vector<int64_t>& ids, bool exact,
                const std::string& what) {
  auto want = one.EmbeddingRows(kTiedBiased, ids);
  ASSERT_TRUE(want.ok()) << what << ": " << want.status();
  ASSERT_EQ(want->data.size(), ids.size() * kD * sizeof(float));
  for (int p = 0; p < kProcesses; ++p) {
    auto got = group.clients[p]->EmbeddingRows(kTiedBiased, ids);
    ASSERT_TRUE(got.ok()) << what << ", process " << p << ": " << got.status();
    EXPECT_EQ(got->weights_version, want->weights_version) << what << ", process " << p;
    if (exact) {
      EXPECT_TRUE(got->data == want->data) << what << ": process " << p << " answers other rows";
    } else {
      EXPECT_TRUE(AllClose(Floats(got->data), Doubles(want->data), kTol))
          << what << ", process " << p;
    }
  }
}

// One round: each learner's LOSS micro-batch at its home (sequence 2k + 1) and its
// EMBEDDING_GRAD micro-batch there (sequence 2k + 2), then an unkeyed LOSS micro-batch through
// each process; each against the one-process head. `counted` grows by the micro-batches counted.
void Round(Group& group, client::Client& one, int k, uint64_t& counted) {
  auto step = [&](client::Client& to, const client::Microbatch& mb, const std::string& what) {
    auto got = to.Step(mb);
    auto want = one.Step(mb);
    ASSERT_TRUE(got.ok()) << what << ": " << got.status();
    ASSERT_TRUE(want.ok()) << what << ": " << want.status();
    ++counted;
    EXPECT_EQ(got->token_count, want->token_count) << what;
    EXPECT_NEAR(got->loss_sum, want->loss_sum, kTol * std::abs(want->loss_sum)) << what;
    EXPECT_TRUE(AllClose(Floats(got->grad_hidden), Doubles(want->grad_hidden), kTol)) << what;
  };
  for (int c = 0; c < kLearners; ++c) {
    const std::string id = Learner(c);
    const int home = Home(id, kProcesses);
    const HostBatch batch = LearnerBatch(c, k);
    step(*group.clients[home], ToMicrobatch(kTiedBiased, id, 2 * k + 1, batch),
         absl::StrCat(id, " round ", k));
    const std::vector<int64_t> ids = Ids(kGradRows, 500 + 10 * c + k);
    const client::Bytes grad =
        Encode(RandomValues(kGradRows * kD, 0.5, v1::DTYPE_FP32, 900 + 10 * c + k), v1::DTYPE_FP32);
    const std::span<const std::byte> view(grad.data(), grad.size());
    auto got =
        group.clients[home]->EmbeddingGrad(kTiedBiased, id, 2 * k + 2, ids, v1::DTYPE_FP32, view);
    auto want = one.EmbeddingGrad(kTiedBiased, id, 2 * k + 2, ids, v1::DTYPE_FP32, view);
    ASSERT_TRUE(got.ok()) << id << " dE round " << k << ": " << got.status();
    ASSERT_TRUE(want.ok()) << want.status();
    ++counted;
  }
  for (int p = 0; p < kProcesses; ++p) {
    step(*group.clients[p], ToMicrobatch(kTiedBiased, "", 0, LearnerBatch(100 + p, k)),
         absl::StrCat("unkeyed through process ", p, " round ", k));
  }
}

// dW and db through both processes within fp32 rounding of the one-process head's, counting
// `microbatches`.
void ExpectWindow(Group& group, client::Client& one, uint64_t microbatches,
                  const std::string& what) {
  auto want = one.PullGradient(kTiedBiased);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(want->summary.microbatch_count(), microbatches) << what;
  for (int p = 0; p < kProcesses; ++p) {
    auto got = group.clients[p]->PullGradient(kTiedBiased);
    ASSERT_TRUE(got.ok()) << what << ", process " << p << ": " << got.status();
    EXPECT_EQ(got->summary.microbatch_count(), microbatches) << what << ", process " << p;
    EXPECT_EQ(got->summary.token_count(), want->summary.token_count()) << what;
    EXPECT_TRUE(AllClose(Floats(got->data), Doubles(want->data), kTol))
        << what << ": dW through process " << p;
    EXPECT_TRUE(AllClose(Floats(got->bias), Doubles(want->bias), kTol))
        << what << ": db through process " << p;
  }
}

// W and b through both processes within fp32 rounding of the one-process head's.
void ExpectWeights(Group& group, client::Client& one, const std::string& what) {
  auto want = one.DownloadWeights(kTiedBiased);
  ASSERT_TRUE(want.ok()) << want.status();
  for (int p = 0; p < kProcesses; ++p) {
    auto got = group.clients[p]->DownloadWeights(kTiedBiased);
    ASSERT_TRUE(got.ok()) << what << ", process " << p << ": " << got.status();
    EXPECT_EQ(got->weights_version, want->weights_version) << what;
    EXPECT_TRUE(AllClose(Floats(got->data), Doubles(want->data), kTol))
        << what << ": W through process " << p;
    EXPECT_TRUE(AllClose(Floats(got->bias), Doubles(want->bias), kTol))
        << what << ": b through process " << p;
  }
}

TEST(ShardedNcclCudaTest, BiasAndTiedEmbeddingOfTwoGpuProcessesAsOneProcessOverTwoGpus) {
  auto probe = ServerProcess::Start(LOSSHEAD_SERVER_BINARY,
                                    {"--backend=cuda", "--devices=0,1", "--grad_stash_bytes=0"},
                                    LogPath("sharded_nccl_one"));
  if (!probe.ok()) {
    GTEST_SKIP() << "a server cannot start on two CUDA devices here: " << probe.status();
  }
  std::unique_ptr<client::Client> one = Connect((*probe)->target());
  ASSERT_NE(one, nullptr);
  Group group(GroupAddresses(kProcesses), "sharded_nccl", [](int p) {
    return std::vector<std::string>{"--backend=cuda", absl::StrCat("--devices=", p),
                                    "--grad_stash_bytes=0"};
  });
  ASSERT_TRUE(group.ok());
  auto created = group.clients[1]->CreateHead(TiedBiased(1, /*across=*/true));
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_TRUE(one->CreateHead(TiedBiased(kProcesses, /*across=*/false)).ok());

  // Random W and b through the follower: every row and every logit's b shows.
  const client::Bytes w = Encode(RandomValues(kV * kD, 0.1, v1::DTYPE_FP32, 31), v1::DTYPE_FP32);
  const client::Bytes b = Encode(RandomValues(kV, 0.5, v1::DTYPE_FP32, 32), v1::DTYPE_FP32);
  const client::PushRequest push{
      .head = kTiedBiased, .dtype = v1::DTYPE_FP32, .data = w, .bias = b};
  ASSERT_TRUE(group.clients[1]->PushWeights(push).ok());
  ASSERT_TRUE(one->PushWeights(push).ok());
  for (int p = 0; p < kProcesses; ++p) {
    auto got = group.clients[p]->DownloadWeights(kTiedBiased);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(got->data == w) << "process " << p << " holds another W";
    EXPECT_TRUE(got->bias == b) << "process " << p << " holds another b";
  }
  const std::vector<int64_t> ids = Ids(101, 5);
  ExpectRows(group, *one, ids, /*exact=*/true, "as pushed");

  uint64_t counted = 0;
  Round(group, *one, 0, counted);
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_EQ(counted, static_cast<uint64_t>(2 * kLearners + kProcesses));
  ExpectWindow(group, *one, counted, "round 0");

  auto applied = group.clients[1]->ApplyOptimizer(ClippedApply(1));
  ASSERT_TRUE(applied.ok()) << applied.status();
  auto want_applied = one->ApplyOptimizer(ClippedApply(1));
  ASSERT_TRUE(want_applied.ok()) << want_applied.status();
  EXPECT_LT(want_applied->clip_coefficient(), 1.0) << "the apply should clip";
  EXPECT_NEAR(applied->head_grad_norm(), want_applied->head_grad_norm(),
              kTol * want_applied->head_grad_norm());
  EXPECT_NEAR(applied->clip_coefficient(), want_applied->clip_coefficient(),
              kTol * want_applied->clip_coefficient());
  ExpectWeights(group, *one, "after the apply");
  ExpectRows(group, *one, ids, /*exact=*/false, "after the apply");

  // Against the stepped W and b, and a replay of round 1's first micro-batch counted nowhere.
  counted = 0;
  Round(group, *one, 1, counted);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::string id = Learner(0);
  auto replay = group.clients[Home(id, kProcesses)]->Step(
      ToMicrobatch(kTiedBiased, id, 3, LearnerBatch(0, 1)));
  ASSERT_TRUE(replay.ok()) << replay.status();
  ExpectWindow(group, *one, counted, "round 1");
}

}  // namespace
}  // namespace losshead::testing
