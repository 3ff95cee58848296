// A head tied to its model's input embedding, sharded across 2 and 3 real server processes on
// loopback (CPU backend, Placement.across_processes), against a one-process server whose head is
// sharded over as many CPU devices (the same shards: the same bits) and against an independent
// float64 scatter-add:
// - EmbeddingRows through every process (each process sends the rows it owns to the one asked):
//   the one-process head's rows bit for bit, in its dtype and in bf16, with its version; the rows
//   of the downloaded W; after an optimizer step, the stepped W's rows;
// - EMBEDDING_GRAD micro-batches (keyed at their homes, elsewhere FAILED_PRECONDITION naming the
//   home; without a client id through every process; in fp32 and bf16) alone, then mixed with
//   LOSS micro-batches: every process counts each once (a replay at the home is answered again
//   and counted nowhere), and the pulled dW through every process is the one-process head's bit
//   for bit (and, for the gradients alone, the float64 scatter-add's within fp32 rounding);
// - refusals (an id outside the vocabulary, a version that is not the head's, dE of the wrong
//   size, a key reused with other rows): the one-process code through every process, nothing
//   counted anywhere.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <thread>
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

constexpr char kTied[] = "tied";
constexpr int64_t kV = 53;  // not a multiple of the shard counts: shards of unequal rows
constexpr int64_t kD = 20;
constexpr int64_t kRowsPerGrad = 17;
constexpr int kClients = 4;

// Sharded across every process of the group, `devices` shards on each.
v1::HeadSpec AcrossSpec(int devices) {
  return ShardedSpec(kTied, kV, kD, /*seed=*/9, devices, /*across=*/true);
}

// The same head on one process, sharded over `shards` devices.
v1::HeadSpec LocalSpec(int shards) {
  return ShardedSpec(kTied, kV, kD, /*seed=*/9, shards, /*across=*/false);
}

std::string Learner(int c) { return absl::StrCat("embedder-", c); }

// `count` ids over the whole vocabulary, in no order, with repeats.
std::vector<int64_t> Ids(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(count);
  for (int64_t& id : ids) id = static_cast<int64_t>(rng() % kV);
  ids[0] = 0;  // the first and last rows, which lie on the first and last process
  ids[count - 1] = kV - 1;
  if (count > 3) ids[2] = ids[1];  // an id repeated
  return ids;
}

// An EMBEDDING_GRAD micro-batch's rows (kRowsPerGrad x kD) and ids.
struct Grad {
  std::vector<int64_t> ids;
  std::vector<float> values;  // as decoded from `bytes`
  client::Bytes bytes;
  v1::DType dtype = v1::DTYPE_FP32;
};

Grad MakeGrad(uint64_t seed, v1::DType dtype = v1::DTYPE_FP32) {
  Grad g;
  g.ids = Ids(kRowsPerGrad, seed);
  g.dtype = dtype;
  g.bytes = Encode(RandomValues(kRowsPerGrad * kD, 0.5, dtype, seed + 1), dtype);
  g.values = Decode(g.bytes, dtype);
  return g;
}

std::span<const std::byte> View(const client::Bytes& bytes) {
  return std::span<const std::byte>(bytes.data(), bytes.size());
}

absl::StatusOr<client::StepResult> Send(client::Client& to, const std::string& id,
                                        uint64_t sequence, const Grad& g) {
  return to.EmbeddingGrad(kTied, id, sequence, g.ids, g.dtype, View(g.bytes));
}

// `got` and `want` are the same rows.
void ExpectSameRows(const absl::StatusOr<client::FetchedRows>& got,
                    const absl::StatusOr<client::FetchedRows>& want, const std::string& what) {
  ASSERT_TRUE(got.ok()) << what << ": " << got.status();
  ASSERT_TRUE(want.ok()) << what << ": " << want.status();
  EXPECT_EQ(got->num_rows, want->num_rows) << what;
  EXPECT_EQ(got->hidden_size, want->hidden_size) << what;
  EXPECT_EQ(got->dtype, want->dtype) << what;
  EXPECT_EQ(got->weights_version, want->weights_version) << what;
  EXPECT_TRUE(got->data == want->data) << what << ": other rows";
}

// Every process's window counts `microbatches` micro-batches and `tokens` tokens.
void ExpectCounted(Group& group, uint64_t microbatches, uint64_t tokens, const std::string& what) {
  for (size_t p = 0; p < group.clients.size(); ++p) {
    auto info = group.clients[p]->GetHead(kTied);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->microbatches_since_pull(), microbatches) << what << ", process " << p;
    EXPECT_EQ(info->tokens_since_pull(), tokens) << what << ", process " << p;
  }
}

class ShardedEmbeddingTest : public ::testing::TestWithParam<Layout> {};

TEST_P(ShardedEmbeddingTest, RowsAndGradientsEqualOneProcessShardedOverAsManyDevices) {
  const int n = GetParam().processes;
  const int devices = GetParam().devices;
  const std::string name = absl::StrCat("embedding", n, "x", devices);
  Group group(n, name, DeviceFlags(devices));
  ASSERT_TRUE(group.ok());
  Single one(name + "_one", DeviceFlags(n * devices));
  ASSERT_NE(one.client, nullptr);
  ASSERT_TRUE(group.clients[n - 1]->CreateHead(AcrossSpec(devices)).ok());
  ASSERT_TRUE(one.client->CreateHead(LocalSpec(n * devices)).ok());
  auto w = one.client->DownloadWeights(kTied);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::vector<float> weights = Floats(w->data);

  // EmbeddingRows through every process: the one-process rows, which are W's.
  const std::vector<int64_t> ids = Ids(41, 3);
  auto want_rows = one.client->EmbeddingRows(kTied, ids);
  ASSERT_TRUE(want_rows.ok()) << want_rows.status();
  const std::vector<float> rows = Floats(want_rows->data);
  ASSERT_EQ(rows.size(), ids.size() * kD);
  for (size_t i = 0; i < ids.size(); ++i) {
    for (int64_t j = 0; j < kD; ++j) {
      ASSERT_EQ(rows[i * kD + j], weights[ids[i] * kD + j]) << "id " << ids[i];
    }
  }
  auto want_bf16 = one.client->EmbeddingRows(kTied, ids, v1::DTYPE_BF16);
  for (int p = 0; p < n; ++p) {
    const std::string at = absl::StrCat("rows through process ", p);
    ExpectSameRows(group.clients[p]->EmbeddingRows(kTied, ids), want_rows, at);
    ExpectSameRows(group.clients[p]->EmbeddingRows(kTied, ids, v1::DTYPE_BF16), want_bf16,
                   at + " in bf16");
    // One id alone: the rows of one process alone.
    const int64_t last[] = {(kV * (p + 1)) / n - 1};
    ExpectSameRows(group.clients[p]->EmbeddingRows(kTied, last),
                   one.client->EmbeddingRows(kTied, last), at + ", one id");
  }

  // Refusals of EmbeddingRows: the one-process code through every process.
  const int64_t outside[] = {3, kV};
  const int64_t negative[] = {-1};
  for (int p = 0; p < n; ++p) {
    for (const auto& bad :
         {std::span<const int64_t>(outside), std::span<const int64_t>(negative)}) {
      auto got = group.clients[p]->EmbeddingRows(kTied, bad);
      ASSERT_FALSE(got.ok());
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
      EXPECT_EQ(got.status().code(), one.client->EmbeddingRows(kTied, bad).status().code());
    }
    auto stale = group.clients[p]->EmbeddingRows(kTied, ids, v1::DTYPE_UNSPECIFIED,
                                                 want_rows->weights_version + 1);
    ASSERT_FALSE(stale.ok());
    EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
    EXPECT_EQ(group.clients[p]->EmbeddingRows("nobody", ids).status().code(),
              absl::StatusCode::kNotFound);
  }

  // EMBEDDING_GRAD micro-batches alone: keyed at their homes, unkeyed through every process.
  uint64_t microbatches = 0;
  std::vector<double> reference(kV * kD, 0.0);
  auto add = [&](const Grad& g) {
    for (int64_t i = 0; i < kRowsPerGrad; ++i) {
      for (int64_t j = 0; j < kD; ++j) reference[g.ids[i] * kD + j] += g.values[i * kD + j];
    }
    ++microbatches;
  };
  for (int c = 0; c < kClients; ++c) {
    const std::string id = Learner(c);
    const int home = Home(id, n);
    const Grad g = MakeGrad(100 + c, c % 2 == 0 ? v1::DTYPE_FP32 : v1::DTYPE_BF16);
    auto elsewhere = Send(*group.clients[(home + 1) % n], id, 1, g);
    ASSERT_FALSE(elsewhere.ok());
    EXPECT_EQ(elsewhere.status().code(), absl::StatusCode::kFailedPrecondition)
        << elsewhere.status();
    EXPECT_NE(elsewhere.status().message().find(absl::StrCat("home=", group.addresses[home])),
              std::string::npos)
        << elsewhere.status();
    auto done = Send(*group.clients[home], id, 1, g);
    ASSERT_TRUE(done.ok()) << id << " at process " << home << ": " << done.status();
    EXPECT_FALSE(done->replayed);
    auto want = Send(*one.client, id, 1, g);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(done->weights_version, want->weights_version);
    EXPECT_EQ(done->token_count, want->token_count);
    add(g);
    // A replay at its home: answered again, counted nowhere.
    auto again = Send(*group.clients[home], id, 1, g);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->replayed);
  }
  for (int p = 0; p < n; ++p) {
    const Grad g = MakeGrad(200 + p);
    ASSERT_TRUE(Send(*group.clients[p], "", 0, g).ok()) << "process " << p;
    ASSERT_TRUE(Send(*one.client, "", 0, g).ok());
    add(g);
  }
  ExpectCounted(group, microbatches, 0, "embedding gradients alone");

  // Refused with the one-process code through the home, counted nowhere: an id outside, dE of
  // the wrong size, a key reused with other rows.
  {
    const std::string id = Learner(0);
    const int home = Home(id, n);
    Grad outside_id = MakeGrad(300);
    outside_id.ids[5] = kV;
    Grad short_rows = MakeGrad(301);
    short_rows.bytes.resize(short_rows.bytes.size() - sizeof(float));
    const Grad other = MakeGrad(302);
    const std::vector<std::pair<const Grad*, uint64_t>> refused = {
        {&outside_id, 2}, {&short_rows, 2}, {&other, 1}};
    for (const auto& [g, sequence] : refused) {
      auto got = Send(*group.clients[home], id, sequence, *g);
      ASSERT_FALSE(got.ok());
      auto want = Send(*one.client, id, sequence, *g);
      ASSERT_FALSE(want.ok());
      EXPECT_EQ(got.status().code(), want.status().code()) << got.status();
      EXPECT_NE(got.status().code(), absl::StatusCode::kUnimplemented) << got.status();
    }
    // Without a key, through every process.
    for (int p = 0; p < n; ++p) {
      auto got = Send(*group.clients[p], "", 0, outside_id);
      ASSERT_FALSE(got.ok());
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    }
  }
  ExpectCounted(group, microbatches, 0, "after the refusals");

  // dW through every process: the one-process head's bits, the float64 scatter-add's values.
  auto want_dw = one.client->PullGradient(kTied);
  ASSERT_TRUE(want_dw.ok()) << want_dw.status();
  EXPECT_EQ(want_dw->summary.microbatch_count(), microbatches);
  const std::vector<float> dw = Floats(want_dw->data);
  for (size_t i = 0; i < reference.size(); ++i) {
    ASSERT_NEAR(dw[i], reference[i], 1e-5 * (1 + std::abs(reference[i]))) << "element " << i;
  }
  for (int p = 0; p < n; ++p) {
    auto pulled = group.clients[p]->PullGradient(kTied);
    ASSERT_TRUE(pulled.ok()) << "process " << p << ": " << pulled.status();
    EXPECT_EQ(pulled->summary.microbatch_count(), microbatches) << "process " << p;
    EXPECT_EQ(pulled->summary.token_count(), 0u) << "process " << p;
    EXPECT_TRUE(pulled->data == want_dw->data) << "process " << p << ": another dW";
  }

  // Mixed with LOSS micro-batches, one after another through the homes and every process.
  uint64_t tokens = 0;
  for (int k = 0; k < 2; ++k) {
    for (int c = 0; c < kClients; ++c) {
      const std::string id = Learner(c);
      client::Client& home = *group.clients[Home(id, n)];
      const HostBatch batch = MakeBatch(12, kD, kV, v1::DTYPE_FP32, 700 + 13 * c + k, 5);
      const client::Microbatch mb = ToMicrobatch(kTied, id, 2 * k + 2, batch);
      auto loss = home.Step(mb);
      ASSERT_TRUE(loss.ok()) << loss.status();
      auto want_loss = one.client->Step(mb);
      ASSERT_TRUE(want_loss.ok()) << want_loss.status();
      EXPECT_EQ(loss->loss_sum, want_loss->loss_sum);
      EXPECT_TRUE(loss->grad_hidden == want_loss->grad_hidden) << id << ": dH differs";
      tokens += static_cast<uint64_t>(loss->token_count);
      ++microbatches;
      const Grad g = MakeGrad(400 + 7 * c + k, k == 0 ? v1::DTYPE_BF16 : v1::DTYPE_FP32);
      auto done = Send(home, id, 2 * k + 3, g);
      ASSERT_TRUE(done.ok()) << done.status();
      ASSERT_TRUE(Send(*one.client, id, 2 * k + 3, g).ok());
      ++microbatches;
      auto again = Send(home, id, 2 * k + 3, g);
      ASSERT_TRUE(again.ok()) << again.status();
      EXPECT_TRUE(again->replayed);
    }
    const int p = k % n;
    const Grad g = MakeGrad(500 + k);
    ASSERT_TRUE(Send(*group.clients[p], "", 0, g).ok());
    ASSERT_TRUE(Send(*one.client, "", 0, g).ok());
    ++microbatches;
  }
  ExpectCounted(group, microbatches, tokens, "mixed");
  auto want_mixed = one.client->PullGradient(kTied);
  ASSERT_TRUE(want_mixed.ok()) << want_mixed.status();
  for (int p = 0; p < n; ++p) {
    auto pulled = group.clients[p]->PullGradient(kTied);
    ASSERT_TRUE(pulled.ok()) << "process " << p << ": " << pulled.status();
    EXPECT_EQ(pulled->summary.microbatch_count(), microbatches) << "process " << p;
    EXPECT_EQ(pulled->summary.token_count(), tokens) << "process " << p;
    EXPECT_TRUE(pulled->data == want_mixed->data) << "process " << p << ": another dW";
  }

  // An optimizer step through a follower, then the stepped W's rows through every process.
  v1::ApplyOptimizerRequest apply;
  apply.set_head(kTied);
  apply.set_client_id("optimizer");
  apply.set_step_key(1);
  apply.mutable_params()->set_lr(0.05);
  apply.mutable_params()->set_beta1(0.9);
  apply.mutable_params()->set_beta2(0.999);
  apply.mutable_params()->set_eps(1e-8);
  auto applied = group.clients[n - 1]->ApplyOptimizer(apply);
  ASSERT_TRUE(applied.ok()) << applied.status();
  auto want_applied = one.client->ApplyOptimizer(apply);
  ASSERT_TRUE(want_applied.ok()) << want_applied.status();
  EXPECT_EQ(applied->head_grad_norm(), want_applied->head_grad_norm());
  auto stepped = one.client->EmbeddingRows(kTied, ids);
  ASSERT_TRUE(stepped.ok()) << stepped.status();
  EXPECT_FALSE(stepped->data == want_rows->data);
  for (int p = 0; p < n; ++p) {
    ExpectSameRows(group.clients[p]->EmbeddingRows(kTied, ids), stepped,
                   absl::StrCat("stepped rows through process ", p));
  }
}

// EMBEDDING_GRAD and LOSS micro-batches in flight at once (every client on a thread of its own
// through its home, unkeyed gradients through every process), beside EmbeddingRows and a pull
// (which wait for those in flight): every micro-batch counted once on every process, dW the
// one-process head's within fp32 rounding (its sums follow the turns' order), the rows W's.
TEST_P(ShardedEmbeddingTest, InFlightAtOnceWithLossMicroBatches) {
  const int n = GetParam().processes;
  const int devices = GetParam().devices;
  const std::string name = absl::StrCat("embedding_inflight", n, "x", devices);
  Group group(n, name, DeviceFlags(devices));
  ASSERT_TRUE(group.ok());
  Single one(name + "_one", DeviceFlags(n * devices));
  ASSERT_NE(one.client, nullptr);
  ASSERT_TRUE(group.clients[0]->CreateHead(AcrossSpec(devices)).ok());
  ASSERT_TRUE(one.client->CreateHead(LocalSpec(n * devices)).ok());
  const std::vector<int64_t> ids = Ids(29, 8);
  auto want_rows = one.client->EmbeddingRows(kTied, ids);
  ASSERT_TRUE(want_rows.ok()) << want_rows.status();

  constexpr int kRounds = 3;
  struct Sent {
    HostBatch batch;  // what mb points into
    client::Microbatch mb;
    Grad grad;
    absl::StatusOr<client::StepResult> loss = absl::UnknownError("not sent");
    absl::StatusOr<client::StepResult> added = absl::UnknownError("not sent");
  };
  std::vector<std::vector<Sent>> sent(kClients + n);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients + n; ++c) {
    const bool keyed = c < kClients;
    const std::string id = keyed ? Learner(c) : "";
    const int process = keyed ? Home(id, n) : c - kClients;
    sent[c].resize(kRounds);
    for (int k = 0; k < kRounds; ++k) {
      Sent& s = sent[c][k];
      s.batch = MakeBatch(12, kD, kV, v1::DTYPE_FP32, 900 + 17 * c + k, 5);
      s.mb = ToMicrobatch(kTied, id, keyed ? 2 * k + 1 : 0, s.batch);
      s.grad = MakeGrad(1000 + 17 * c + k, k % 2 == 0 ? v1::DTYPE_FP32 : v1::DTYPE_BF16);
    }
    threads.emplace_back([&, c, process, keyed, id] {
      std::unique_ptr<client::Client> client = Connect(group.addresses[process]);
      for (int k = 0; k < kRounds; ++k) {
        Sent& s = sent[c][k];
        if (keyed) s.loss = client->Step(s.mb);
        s.added = Send(*client, id, keyed ? 2 * k + 2 : 0, s.grad);
      }
    });
  }
  threads.emplace_back([&] {
    std::unique_ptr<client::Client> client = Connect(group.addresses[n - 1]);
    ExpectSameRows(client->EmbeddingRows(kTied, ids), want_rows, "rows among micro-batches");
    auto pulled = client->PullGradient(kTied);
    EXPECT_TRUE(pulled.ok()) << pulled.status();
  });
  for (std::thread& t : threads) t.join();

  uint64_t tokens = 0, microbatches = 0;
  for (int c = 0; c < kClients + n; ++c) {
    const bool keyed = c < kClients;
    for (int k = 0; k < kRounds; ++k) {
      const Sent& s = sent[c][k];
      if (keyed) {
        ASSERT_TRUE(s.loss.ok()) << "sender " << c << ": " << s.loss.status();
        auto want = one.client->Step(s.mb);
        ASSERT_TRUE(want.ok()) << want.status();
        EXPECT_EQ(s.loss->loss_sum, want->loss_sum);
        EXPECT_TRUE(s.loss->grad_hidden == want->grad_hidden) << "sender " << c << ": dH";
        tokens += static_cast<uint64_t>(s.loss->token_count);
        ++microbatches;
      }
      ASSERT_TRUE(s.added.ok()) << "sender " << c << ": " << s.added.status();
      ASSERT_TRUE(Send(*one.client, keyed ? Learner(c) : "", keyed ? 2 * k + 2 : 0, s.grad).ok());
      ++microbatches;
    }
  }
  ExpectCounted(group, microbatches, tokens, "in flight at once");
  auto reference = one.client->PullGradient(kTied);
  ASSERT_TRUE(reference.ok()) << reference.status();
  const std::vector<float> reference_dw = Floats(reference->data);
  const std::vector<double> want_dw(reference_dw.begin(), reference_dw.end());
  for (int p = 0; p < n; ++p) {
    auto pulled = group.clients[p]->PullGradient(kTied);
    ASSERT_TRUE(pulled.ok()) << "process " << p << ": " << pulled.status();
    EXPECT_EQ(pulled->summary.microbatch_count(), microbatches) << "process " << p;
    EXPECT_TRUE(AllClose(Floats(pulled->data), want_dw, 1e-5)) << "process " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ShardedEmbeddingTest,
                         ::testing::Values(Layout{2, 1}, Layout{3, 1}, Layout{2, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           return absl::StrCat(info.param.processes, "Processes",
                                               info.param.devices, "Devices");
                         });

// One of 3 processes killed: an EMBEDDING_GRAD micro-batch at a survivor's home and
// EmbeddingRows are UNAVAILABLE (the gradient's key keeps that answer), and every survivor
// counts the micro-batches before the kill and none after.
TEST(ShardedEmbeddingFailureTest, AKilledProcessMakesGradientsAndRowsUnavailable) {
  constexpr int n = 3;
  Group group(n, "embedding_killed");
  ASSERT_TRUE(group.ok());
  ASSERT_TRUE(group.clients[0]->CreateHead(AcrossSpec(1)).ok());
  int survivor = -1;
  for (int c = 0; c < 16 && survivor < 0; ++c) {
    if (Home(Learner(c), n) != 2) survivor = c;
  }
  ASSERT_GE(survivor, 0);
  const std::string id = Learner(survivor);
  client::Client& home = *group.clients[Home(id, n)];
  ASSERT_TRUE(Send(home, id, 1, MakeGrad(1)).ok());
  group.processes[2]->Kill();
  // Rows that process 2 owns none of: the group is still the whole group's to run it.
  Grad g = MakeGrad(2);
  for (int64_t& row : g.ids) row = row % 5;
  auto added = Send(home, id, 2, g);
  ASSERT_FALSE(added.ok());
  EXPECT_EQ(added.status().code(), absl::StatusCode::kUnavailable) << added.status();
  auto again = Send(home, id, 2, g);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  const int64_t ids[] = {0, 1};
  for (int p = 0; p < 2; ++p) {
    auto rows = group.clients[p]->EmbeddingRows(kTied, ids);
    ASSERT_FALSE(rows.ok());
    EXPECT_EQ(rows.status().code(), absl::StatusCode::kUnavailable) << rows.status();
    auto info = group.clients[p]->GetHead(kTied);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->microbatches_since_pull(), 1u) << "process " << p;
  }
}

}  // namespace
}  // namespace losshead::testing
