// The C++ client against a head replicated across 2 real server processes (CPU backend): StepMany
// and a Step stream opened for a client id reach each client id's home from any process, with no
// argument beyond the target; every micro-batch is counted once, as on a one-process server; a
// client that does not follow redirects gets the refusal as it is; `losshead bench` through a
// follower runs every stream at its client id's home.
#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/server_process.h"
#include "tests/multiprocess/group_util.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {
namespace {

constexpr char kRoutedHead[] = "routed";
constexpr int64_t kRoutedVocab = 32;
constexpr int64_t kRoutedHidden = 16;
constexpr int64_t kRoutedTokens = 8;
constexpr int kProcesses = 2;

v1::HeadSpec RoutedSpec() {
  v1::HeadSpec spec;
  spec.set_name(kRoutedHead);
  spec.set_vocab_size(kRoutedVocab);
  spec.set_hidden_size(kRoutedHidden);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.3f);
  spec.mutable_init()->mutable_normal()->set_seed(3);
  return spec;
}

// A client id whose home is process `home` of kProcesses (the `k`-th such id).
std::string IdAt(int home, int k) {
  for (int i = 0;; ++i) {
    const std::string id = absl::StrCat("routed-", i);
    if (Home(id, kProcesses) == home && k-- == 0) return id;
  }
}

HostBatch RoutedBatch(int seed) {
  return MakeBatch(kRoutedTokens, kRoutedHidden, kRoutedVocab, v1::DTYPE_FP32, seed);
}

class GroupClientsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    group_ = std::make_unique<Group>(kProcesses, "clients");
    ASSERT_TRUE(group_->ok());
    ASSERT_TRUE(group_->clients[0]->CreateHead(RoutedSpec()).ok());
    single_ = std::make_unique<Single>("clients_all");
    ASSERT_NE(single_->client, nullptr);
    ASSERT_TRUE(single_->client->CreateHead(RoutedSpec()).ok());
  }

  // The group's window equals the one-process server's: the same counts, dW within fp32
  // rounding (the processes' windows are added in another order).
  void ExpectSameWindow() {
    auto want = single_->client->PullGradient(kRoutedHead);
    ASSERT_TRUE(want.ok()) << want.status();
    const std::vector<float> want_floats = Floats(want->data);
    auto got = group_->clients[1]->PullGradient(kRoutedHead);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->summary.microbatch_count(), want->summary.microbatch_count());
    EXPECT_EQ(got->summary.token_count(), want->summary.token_count());
    EXPECT_TRUE(AllClose(Floats(got->data),
                         std::vector<double>(want_floats.begin(), want_floats.end()), 1e-5));
  }

  std::unique_ptr<Group> group_;
  std::unique_ptr<Single> single_;
};

TEST_F(GroupClientsTest, StepManyFollowsEachClientIdToItsHome) {
  // Client ids of both homes, interleaved, through each process in turn.
  for (int entry = 0; entry < kProcesses; ++entry) {
    std::unique_ptr<client::Client> client = Connect(group_->addresses[entry], /*follow=*/true);
    ASSERT_NE(client, nullptr);
    for (int round = 0; round < 2; ++round) {
      std::vector<HostBatch> batches;
      std::vector<client::Microbatch> mbs;
      for (int k = 0; k < 3; ++k) {
        for (int home = 0; home < kProcesses; ++home) {
          batches.push_back(RoutedBatch(100 * entry + 10 * round + 2 * k + home));
        }
      }
      size_t b = 0;
      for (int k = 0; k < 3; ++k) {
        for (int home = 0; home < kProcesses; ++home) {
          mbs.push_back(
              ToMicrobatch(kRoutedHead, IdAt(home, entry), 3 * round + k + 1, batches[b++]));
        }
      }
      const std::vector<absl::StatusOr<client::StepResult>> answers = client->StepMany(mbs, 4);
      ASSERT_EQ(answers.size(), mbs.size());
      for (size_t i = 0; i < mbs.size(); ++i) {
        ASSERT_TRUE(answers[i].ok()) << "micro-batch " << i << ": " << answers[i].status();
        EXPECT_FALSE(answers[i]->replayed);
        EXPECT_EQ(answers[i]->client_id, mbs[i].client_id);
        EXPECT_EQ(answers[i]->sequence, mbs[i].sequence);
        auto want = single_->client->Step(mbs[i]);
        ASSERT_TRUE(want.ok()) << want.status();
        EXPECT_EQ(answers[i]->loss_sum, want->loss_sum) << "micro-batch " << i;
      }
    }
  }
  ExpectSameWindow();
}

TEST_F(GroupClientsTest, AStepStreamForAClientIdOpensAtItsHome) {
  std::unique_ptr<client::Client> client = Connect(group_->addresses[0], /*follow=*/true);
  ASSERT_NE(client, nullptr);
  for (int home = 0; home < kProcesses; ++home) {
    const std::string id = IdAt(home, 0);
    auto stream = client->OpenStepStream(id);
    ASSERT_TRUE(stream.ok()) << stream.status();
    std::vector<HostBatch> batches;
    for (int k = 0; k < 3; ++k) batches.push_back(RoutedBatch(40 + 3 * home + k));
    for (int k = 0; k < 3; ++k) {
      ASSERT_TRUE((*stream)->Send(ToMicrobatch(kRoutedHead, id, k + 1, batches[k])).ok());
    }
    for (int k = 0; k < 3; ++k) {
      auto answer = (*stream)->Receive();
      ASSERT_TRUE(answer.ok()) << "home " << home << ": " << answer.status();
      auto want = single_->client->Step(ToMicrobatch(kRoutedHead, id, k + 1, batches[k]));
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(answer->loss_sum, want->loss_sum);
    }
    EXPECT_TRUE((*stream)->Finish().ok());
  }
  ExpectSameWindow();
  // A one-process server is its own home for every client id.
  std::unique_ptr<client::Client> plain = Connect(single_->process->target(), /*follow=*/true);
  ASSERT_NE(plain, nullptr);
  auto stream = plain->OpenStepStream(IdAt(1, 0));
  ASSERT_TRUE(stream.ok()) << stream.status();
  const HostBatch batch = RoutedBatch(77);
  ASSERT_TRUE((*stream)->Send(ToMicrobatch(kRoutedHead, "elsewhere", 1, batch)).ok());
  auto answer = (*stream)->Receive();
  EXPECT_TRUE(answer.ok()) << answer.status();
}

TEST_F(GroupClientsTest, WithoutFollowingTheRefusalIsReturnedAndCountsNothing) {
  std::unique_ptr<client::Client> client = Connect(group_->addresses[0], /*follow=*/false);
  ASSERT_NE(client, nullptr);
  const std::string id = IdAt(1, 0);
  const HostBatch batch = RoutedBatch(5);
  const client::Microbatch mbs[] = {ToMicrobatch(kRoutedHead, id, 1, batch)};
  const auto answers = client->StepMany(mbs, 1);
  ASSERT_EQ(answers.size(), 1u);
  ASSERT_FALSE(answers[0].ok());
  EXPECT_EQ(answers[0].status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(answers[0].status().message().find(absl::StrCat("home=", group_->addresses[1])),
            std::string::npos)
      << answers[0].status();
  auto stream = client->OpenStepStream(id);
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->Send(mbs[0]).ok());
  auto refused = (*stream)->Receive();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  auto window = group_->clients[0]->WindowSummary(kRoutedHead);
  ASSERT_TRUE(window.ok()) << window.status();
  EXPECT_EQ(window->microbatch_count(), 0u);
}

TEST(GroupBenchTest, BenchThroughAFollowerRunsEveryStreamAtItsHome) {
  Group group(kProcesses, "bench");
  ASSERT_TRUE(group.ok());
  // Eight streams, eight client ids (bench-<pid>-<stream>): the home of some is the leader, whose
  // micro-batches the follower refuses (all eight at the follower: 1 run in 256).
  const std::string log = LogPath("bench_cli");
  const int status =
      std::system(absl::StrCat(LOSSHEAD_CLI_BINARY, " bench --server=", group.addresses[1],
                               " --vocab_size=64 --hidden_size=32 --chunk_tokens=16",
                               " --streams=8 --iterations=3 > ", log, " 2>&1")
                      .c_str());
  const std::string text = ReadText(log);
  ASSERT_TRUE(WIFEXITED(status)) << text;
  EXPECT_EQ(WEXITSTATUS(status), 0) << text;
  EXPECT_NE(text.find("24 micro-batches"), std::string::npos) << text;
}

}  // namespace
}  // namespace losshead::testing
