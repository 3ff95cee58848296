// A head replicated over k devices answers as the one-device head of the same spec: a micro-batch
// runs whole on one replica, all of which hold the same W, so its loss and dH are the one-device
// head's bit for bit; the gradient window, reduced across replicas, is the one-device window up to
// summation order, however the micro-batches were spread; pushes reach every replica, optimizer
// steps (each replica stepping its own rows) leave them all equal, and a checkpoint restores on
// any number of devices. Placements that do not fit the devices are refused. CPU backends stand
// in for the devices: separate ones, and one backend passed for several ranks.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "server/engine/head_registry.h"
#include "server/engine/replica_group.h"
#include "tests/server/placed_head_util.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Bytes;
using testing::Decode;
using testing::Encode;
using testing::ExpectClose;
using testing::FromBytes;
using testing::kD;
using testing::KernelDType;
using testing::MakeSample;
using testing::Pull;
using testing::Pulled;
using testing::RandomFloats;
using testing::ReferenceMean;
using testing::Sample;
using testing::Weights;

// k CPU devices: k backends, or one backend passed k times.
struct Devices {
  std::vector<std::unique_ptr<kernels::Backend>> owned;
  std::vector<kernels::Backend*> list;
};

Devices MakeDevices(int k, bool shared = false) {
  Devices devices;
  for (int r = 0; r < (shared ? 1 : k); ++r) {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
    EXPECT_TRUE(backend.ok()) << backend.status();
    if (!backend.ok()) return devices;
    devices.owned.push_back(std::move(*backend));
  }
  for (int r = 0; r < k; ++r) devices.list.push_back(devices.owned[shared ? 0 : r].get());
  return devices;
}

// The spec of both heads of a comparison: only the placement differs.
v1::HeadSpec Spec(int64_t v, v1::DType dtype, int replicas,
                  v1::OptimizerKind optimizer = v1::OPTIMIZER_NONE, bool momentum_buffer = false) {
  v1::HeadSpec spec;
  spec.set_name("h");
  spec.set_vocab_size(v);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(dtype);
  spec.mutable_init()->mutable_normal()->set_std(0.5f);
  spec.mutable_init()->mutable_normal()->set_seed(11);
  spec.mutable_optimizer()->set_kind(optimizer);
  spec.mutable_optimizer()->set_momentum_buffer(momentum_buffer);
  if (replicas > 1) {
    spec.mutable_placement()->set_kind(v1::PLACEMENT_REPLICATED);
    spec.mutable_placement()->set_devices(replicas);
  }
  return spec;
}


// The fp64 window of `samples` against W (what the one-device kernel approximates in fp32).
std::vector<double> ReferenceWindow(const std::vector<const Sample*>& samples,
                                    const std::vector<float>& w, int64_t v) {
  std::vector<double> window(static_cast<size_t>(v * kD), 0.0);
  for (const Sample* s : samples) {
    const auto r = ReferenceMean(s->hidden, w, s->targets, s->mb.header.num_tokens(), kD, v);
    for (size_t i = 0; i < window.size(); ++i) window[i] += r.grad_weight[i];
  }
  return window;
}


// Equal as values (a reduction may turn -0 into +0, which is no change of the window).
void ExpectSameValues(const std::vector<float>& got, const std::vector<float>& want,
                      const std::string& what) {
  ExpectClose(got, want, 0.0, what);
}

// |got - want| <= tol * max|want|: for tensors whose small elements carry no relative precision
// (optimizer moments).
void ExpectCloseToScale(const std::vector<float>& got, const std::vector<float>& want, double tol,
                        const std::string& what) {
  double scale = 0;
  for (float x : want) scale = std::max(scale, static_cast<double>(std::abs(x)));
  ExpectClose(got, want, tol * scale, what, 1.0);
}

// Within one bf16 ulp of each other (2^-7 relative at most): W rounded from masters that agree
// up to summation order may still round apart.
void ExpectWithinBf16Ulp(const std::vector<float>& got, const std::vector<float>& want,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - want[i]) <= std::ldexp(std::abs(want[i]), -7) + 1e-6) continue;
    ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << want[i];
    if (++reported == 5) return;
  }
}

void ExpectNear(double got, double want, double rel, const std::string& what) {
  EXPECT_LE(std::abs(got - want), rel * std::max(1e-30, std::abs(want)))
      << what << ": " << got << " vs " << want;
}

// Each replica has run a micro-batch: its I/O buffers are allocated by the first one it runs.
void ExpectEveryReplicaRan(const Head& head) {
  const v1::HeadInfo info = head.Info();
  ASSERT_EQ(info.device_memory_size(), head.device_count());
  for (int r = 0; r < info.device_memory_size(); ++r) {
    EXPECT_GT(info.device_memory(r).workspace_bytes(), 0u) << "replica " << r << " never ran";
  }
}

std::shared_ptr<const StepOutcome> StepOk(Head& head, const MicroBatch& mb,
                                          StepStats* stats = nullptr) {
  StepStats own;
  auto out = head.Step(mb, stats != nullptr ? stats : &own);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : nullptr;
}

// Two answers to one micro-batch from heads (or replicas) holding the same W: the same bits.
void ExpectSameOutcome(const std::shared_ptr<const StepOutcome>& got,
                       const std::shared_ptr<const StepOutcome>& want, const std::string& what) {
  ASSERT_NE(got, nullptr) << what;
  ASSERT_NE(want, nullptr) << what;
  EXPECT_EQ(got->loss, want->loss) << what;
  EXPECT_EQ(got->loss_sum, want->loss_sum) << what;
  EXPECT_EQ(got->token_count, want->token_count) << what;
  EXPECT_EQ(got->weights_version, want->weights_version) << what;
  EXPECT_EQ(got->grad_hidden_dtype, want->grad_hidden_dtype) << what;
  EXPECT_FALSE(got->grad_hidden.empty()) << what;
  EXPECT_TRUE(got->grad_hidden == want->grad_hidden) << what << ": dH differs";
}


void ExpectSameCounters(const v1::GradientSummary& got, const v1::GradientSummary& want,
                        const std::string& what) {
  EXPECT_EQ(got.token_count(), want.token_count()) << what;
  EXPECT_EQ(got.microbatch_count(), want.microbatch_count()) << what;
  EXPECT_EQ(got.min_weights_version(), want.min_weights_version()) << what;
  EXPECT_EQ(got.max_weights_version(), want.max_weights_version()) << what;
}


std::vector<float> WeightsFp32(Head& head) {
  return FromBytes<float>(Weights(head, v1::DTYPE_FP32));
}

using Outcomes = std::vector<std::vector<std::shared_ptr<const StepOutcome>>>;

// Stream t of `streams` sent by thread t, each micro-batch to `a` then to `b`.
std::pair<Outcomes, Outcomes> SendConcurrently(Head& a, Head& b,
                                               const std::vector<std::vector<Sample>>& streams) {
  Outcomes out_a(streams.size()), out_b(streams.size());
  std::vector<std::thread> threads;
  for (size_t t = 0; t < streams.size(); ++t) {
    out_a[t].resize(streams[t].size());
    out_b[t].resize(streams[t].size());
    threads.emplace_back([&, t] {
      for (size_t i = 0; i < streams[t].size(); ++i) {
        out_a[t][i] = StepOk(a, streams[t][i].mb);
        out_b[t][i] = StepOk(b, streams[t][i].mb);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  return {std::move(out_a), std::move(out_b)};
}

// A replicated head beside a one-device head of the same spec (its own backend).
struct Pair {
  Devices devices;
  std::unique_ptr<kernels::Backend> single_backend;
  std::shared_ptr<Head> replicated;
  std::shared_ptr<Head> single;
};

void MakePair(int k, bool shared, int64_t v, v1::DType dtype, v1::OptimizerKind optimizer,
              bool momentum_buffer, Pair* pair) {
  pair->devices = MakeDevices(k, shared);
  ASSERT_EQ(pair->devices.list.size(), static_cast<size_t>(k));
  auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
  ASSERT_TRUE(backend.ok()) << backend.status();
  pair->single_backend = std::move(*backend);
  auto replicated = Head::Create(pair->devices.list, Spec(v, dtype, k, optimizer, momentum_buffer),
                                 HeadOptions{});
  ASSERT_TRUE(replicated.ok()) << replicated.status();
  pair->replicated = *replicated;
  auto single = Head::Create(*pair->single_backend, Spec(v, dtype, 1, optimizer, momentum_buffer),
                             HeadOptions{});
  ASSERT_TRUE(single.ok()) << single.status();
  pair->single = *single;
  // The same seed gives both the same W, on every replica (checked through dH below).
  ASSERT_EQ(Weights(*pair->replicated), Weights(*pair->single));
}

// ---------------------------------------------------------------------------------------------
// Parameterised over k, V (never a multiple of k: the row shards are uneven), the head's dtype
// and whether one backend serves every rank.

struct Case {
  int k;
  int64_t v;
  v1::DType dtype;
  bool shared;
};

std::string Name(const Case& c) {
  return absl::StrCat("k", c.k, "_v", c.v, c.dtype == v1::DTYPE_BF16 ? "_bf16" : "_fp32",
                      c.shared ? "_one_backend" : "");
}
std::string CaseName(const ::testing::TestParamInfo<Case>& info) { return Name(info.param); }
void PrintTo(const Case& c, std::ostream* os) { *os << Name(c); }

class ReplicatedHeadTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = GetParam();
    ASSERT_NO_FATAL_FAILURE(
        MakePair(c.k, c.shared, c.v, c.dtype, v1::OPTIMIZER_NONE, false, &pair_));
  }

  Head& replicated() { return *pair_.replicated; }
  Head& single() { return *pair_.single; }

  // k micro-batches sent one at a time: the replicas take them in turn, so each runs one.
  std::vector<Sample> OnePerReplica(uint64_t seed, const std::string& client, uint64_t first_seq) {
    const Case& c = GetParam();
    std::vector<Sample> samples;
    for (int r = 0; r < c.k; ++r) {
      samples.push_back(MakeSample(5 + 3 * r, c.v, c.dtype, seed + r, client, first_seq + r));
    }
    return samples;
  }

  void SendOneAtATime(const std::vector<Sample>& samples, const std::string& what) {
    for (size_t i = 0; i < samples.size(); ++i) {
      auto got = StepOk(replicated(), samples[i].mb);
      auto want = StepOk(single(), samples[i].mb);
      ExpectSameOutcome(got, want, absl::StrCat(what, ", micro-batch ", i));
    }
  }

  Pair pair_;
};

TEST_P(ReplicatedHeadTest, ConcurrentStreamsMatchTheOneDeviceHead) {
  const Case& c = GetParam();
  const std::vector<float> w = WeightsFp32(single());

  // 4 streams of 6 micro-batches of 1 to 29 tokens, about a fifth of the targets ignored, one
  // micro-batch ignored whole (counted, without tokens).
  std::vector<std::vector<Sample>> window1(4);
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < 6; ++i) {
      window1[t].push_back(MakeSample(1 + (t * 11 + i * 7) % 29, c.v, c.dtype, 1000 + 100 * t + i,
                                      absl::StrCat("c", t), i + 1, t == 1 && i == 2));
    }
  }
  auto [rep1, one1] = SendConcurrently(replicated(), single(), window1);
  std::vector<const Sample*> all1;
  uint64_t tokens1 = 0;
  for (size_t t = 0; t < window1.size(); ++t) {
    for (size_t i = 0; i < window1[t].size(); ++i) {
      ExpectSameOutcome(rep1[t][i], one1[t][i], absl::StrCat("stream ", t, ", micro-batch ", i));
      all1.push_back(&window1[t][i]);
      tokens1 += window1[t][i].tokens;
    }
  }

  // Every replica ran micro-batches: the first k choices go to each in turn, whatever the
  // timing, and a replica's I/O buffers are allocated by the first micro-batch it runs.
  const v1::HeadInfo info = replicated().Info();
  ASSERT_EQ(info.devices_size(), c.k);
  ASSERT_EQ(info.device_memory_size(), c.k);
  EXPECT_EQ(info.spec().placement().kind(), v1::PLACEMENT_REPLICATED);
  EXPECT_EQ(info.spec().placement().devices(), static_cast<uint32_t>(c.k));
  uint64_t workspace = 0;
  for (int r = 0; r < c.k; ++r) {
    const v1::HeadMemory& m = info.device_memory(r);
    EXPECT_GT(m.workspace_bytes(), 0u) << "replica " << r << " never ran a micro-batch";
    EXPECT_EQ(m.weights_bytes(), c.v * kD * kernels::DTypeSize(KernelDType(c.dtype)));
    EXPECT_EQ(m.gradient_bytes(), c.v * kD * sizeof(float));
    workspace += m.workspace_bytes();
  }
  EXPECT_EQ(info.memory().workspace_bytes(), workspace);
  EXPECT_EQ(info.memory().weights_bytes(),
            c.k * c.v * kD * kernels::DTypeSize(KernelDType(c.dtype)));

  // The window: the counters exactly, dW up to summation order (against the one-device head
  // and an fp64 reference).
  const Pulled first = Pull(replicated(), false);
  const Pulled want1 = Pull(single(), false);
  EXPECT_EQ(first.summary.token_count(), tokens1);
  EXPECT_EQ(first.summary.microbatch_count(), 24u);
  EXPECT_FALSE(first.summary.was_reset());
  ExpectSameCounters(first.summary, want1.summary, "first pull");
  ExpectClose(first.values, want1.values, 1e-5, "dW vs one device");
  ExpectClose(first.values, ReferenceWindow(all1, w, c.v), 1e-5, "dW vs fp64");

  // Pulling again reduces again: nothing may be counted twice.
  const Pulled again = Pull(replicated(), false);
  ExpectSameCounters(again.summary, first.summary, "second pull");
  ExpectSameValues(again.values, first.values, "dW pulled again");
  const Pulled reset = Pull(replicated(), true);
  ExpectSameCounters(reset.summary, first.summary, "pull with reset");
  ExpectSameValues(reset.values, first.values, "dW pulled with reset");
  EXPECT_TRUE(reset.summary.was_reset());
  ASSERT_TRUE(single().PullGradient(v1::DTYPE_FP32, true).ok());
  EXPECT_EQ(replicated().Info().tokens_since_pull(), 0u);

  // The next window holds only what came after the reset, on every replica.
  std::vector<std::vector<Sample>> window2(2);
  for (int t = 0; t < 2; ++t) {
    for (int i = 0; i < 3; ++i) {
      window2[t].push_back(MakeSample(2 + (t * 5 + i * 9) % 23, c.v, c.dtype, 5000 + 100 * t + i,
                                      absl::StrCat("c", t), 10 + i));
    }
  }
  auto [rep2, one2] = SendConcurrently(replicated(), single(), window2);
  std::vector<const Sample*> all2;
  uint64_t tokens2 = 0;
  for (size_t t = 0; t < window2.size(); ++t) {
    for (size_t i = 0; i < window2[t].size(); ++i) {
      ExpectSameOutcome(rep2[t][i], one2[t][i], absl::StrCat("window 2, stream ", t, ", ", i));
      all2.push_back(&window2[t][i]);
      tokens2 += window2[t][i].tokens;
    }
  }
  const Pulled second = Pull(replicated(), false);
  const Pulled want2 = Pull(single(), false);
  EXPECT_EQ(second.summary.token_count(), tokens2);
  EXPECT_EQ(second.summary.microbatch_count(), 6u);
  ExpectSameCounters(second.summary, want2.summary, "second window");
  ExpectClose(second.values, want2.values, 1e-5, "second window dW vs one device");
  ExpectClose(second.values, ReferenceWindow(all2, w, c.v), 1e-5, "second window dW vs fp64");
  EXPECT_EQ(replicated().Info().tokens_total(), tokens1 + tokens2);
  EXPECT_EQ(replicated().Info().microbatches_total(), single().Info().microbatches_total());
}

TEST_P(ReplicatedHeadTest, PushedWeightsReachEveryReplica) {
  const Case& c = GetParam();
  const size_t count = static_cast<size_t>(c.v * kD);
  // dH depends on W: one micro-batch per replica, each bit-identical to the one-device head's,
  // shows that every replica holds the pushed W.
  const std::vector<float> pushed = RandomFloats(count, 77, 0.3f);
  auto vr = replicated().PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(pushed), 1);
  auto vs = single().PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(pushed), 1);
  ASSERT_TRUE(vr.ok()) << vr.status();
  ASSERT_TRUE(vs.ok()) << vs.status();
  EXPECT_EQ(*vr, 2u);
  EXPECT_EQ(*vr, *vs);
  SendOneAtATime(OnePerReplica(200, "p", 1), "after REPLACE");
  ExpectEveryReplicaRan(replicated());
  EXPECT_EQ(Weights(replicated()), Weights(single()));
  EXPECT_EQ(Weights(replicated()), Encode(pushed, c.dtype));

  const std::string delta = Encode(RandomFloats(count, 78, 0.05f), v1::DTYPE_BF16);
  vr = replicated().PushWeights(v1::DTYPE_BF16, v1::PUSH_MODE_ADD, delta, std::nullopt);
  vs = single().PushWeights(v1::DTYPE_BF16, v1::PUSH_MODE_ADD, delta, std::nullopt);
  ASSERT_TRUE(vr.ok()) << vr.status();
  ASSERT_TRUE(vs.ok()) << vs.status();
  EXPECT_EQ(*vr, 3u);
  SendOneAtATime(OnePerReplica(300, "p", 1 + c.k), "after ADD");
  EXPECT_EQ(Weights(replicated()), Weights(single()));

  // Refused pushes reach no replica.
  EXPECT_EQ(replicated()
                .PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_REPLACE, Bytes(pushed), 2)
                .status()
                .code(),
            absl::StatusCode::kFailedPrecondition);
  std::vector<float> poisoned = pushed;
  poisoned[count - 1] = std::nanf("");
  EXPECT_EQ(replicated()
                .PushWeights(v1::DTYPE_FP32, v1::PUSH_MODE_ADD, Bytes(poisoned), std::nullopt)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(replicated().weights_version(), 3u);
  SendOneAtATime(OnePerReplica(400, "p", 1 + 2 * c.k), "after refused pushes");

  // The window saw both versions, as on one device.
  const Pulled got = Pull(replicated(), false);
  const Pulled want = Pull(single(), false);
  ExpectSameCounters(got.summary, want.summary, "window across pushes");
  EXPECT_EQ(got.summary.min_weights_version(), 2u);
  EXPECT_EQ(got.summary.max_weights_version(), 3u);
  ExpectClose(got.values, want.values, 1e-5, "dW across pushes");
}

TEST_P(ReplicatedHeadTest, ForwardOnlyMicroBatchesCountNothing) {
  const Case& c = GetParam();
  const std::vector<Sample> counted = OnePerReplica(600, "f", 1);
  std::vector<std::shared_ptr<const StepOutcome>> counted_out;
  for (const Sample& s : counted) {
    counted_out.push_back(StepOk(replicated(), s.mb));
    StepOk(single(), s.mb);
  }
  const Pulled before = Pull(replicated(), false);
  const v1::HeadInfo info_before = replicated().Info();

  // Each counted micro-batch again, forward-only (the same key: the cache is bypassed), twice
  // round the replicas, then one never counted: the same loss and dH, nothing added.
  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i < counted.size(); ++i) {
      MicroBatch forward = counted[i].mb;
      forward.header.mutable_options()->set_forward_only(true);
      auto got = StepOk(replicated(), forward);
      auto want = StepOk(single(), forward);
      const std::string what = absl::StrCat("forward-only ", round, ", ", i);
      ExpectSameOutcome(got, want, what);
      ExpectSameOutcome(got, counted_out[i], what + " vs counted");
      ASSERT_NE(got, nullptr);
      EXPECT_TRUE(got->forward_only);
    }
  }
  Sample fresh = MakeSample(17, c.v, c.dtype, 700, "", 0);
  fresh.mb.header.mutable_options()->set_forward_only(true);
  ExpectSameOutcome(StepOk(replicated(), fresh.mb), StepOk(single(), fresh.mb), "fresh");

  const v1::HeadInfo info_after = replicated().Info();
  EXPECT_EQ(info_after.tokens_since_pull(), info_before.tokens_since_pull());
  EXPECT_EQ(info_after.microbatches_since_pull(), info_before.microbatches_since_pull());
  EXPECT_EQ(info_after.tokens_total(), info_before.tokens_total());
  EXPECT_EQ(info_after.microbatches_total(), static_cast<uint64_t>(c.k));
  const Pulled after = Pull(replicated(), false);
  ExpectSameCounters(after.summary, before.summary, "after forward-only");
  ExpectSameValues(after.values, before.values, "dW after forward-only");
  ExpectClose(after.values, Pull(single(), false).values, 1e-5, "dW vs one device");
}

INSTANTIATE_TEST_SUITE_P(ReplicatedOver, ReplicatedHeadTest,
                         ::testing::Values(Case{2, 37, v1::DTYPE_BF16, false},
                                           Case{3, 41, v1::DTYPE_FP32, false},
                                           Case{2, 41, v1::DTYPE_FP32, true},
                                           Case{3, 37, v1::DTYPE_BF16, true}),
                         CaseName);

// ---------------------------------------------------------------------------------------------
// The server-side optimizer (ZeRO-1): each replica steps the rows it owns, then W is gathered.

struct OptimizerCase {
  int k;
  int64_t v;
  v1::DType dtype;
  v1::OptimizerKind kind;
  bool momentum_buffer;
  v1::OptimizerHyperParams params;
  int state_buffers;  // fp32 buffers per weight besides the master copy
};

// A replicated head and a one-device head stepped together three times (the second clipped),
// compared after each step.
void StepBothAndCompare(const OptimizerCase& c) {
  Pair pair;
  ASSERT_NO_FATAL_FAILURE(MakePair(c.k, false, c.v, c.dtype, c.kind, c.momentum_buffer, &pair));
  Head& rep = *pair.replicated;
  Head& one = *pair.single;
  const bool bf16 = c.dtype == v1::DTYPE_BF16;
  uint64_t sequence = 0;
  for (uint64_t key = 1; key <= 3; ++key) {
    for (int i = 0; i < 4; ++i) {
      ++sequence;
      const Sample s = MakeSample(3 + 5 * i, c.v, c.dtype, 900 + sequence, "c", sequence);
      auto got = StepOk(rep, s.mb);
      auto want = StepOk(one, s.mb);
      ASSERT_NE(got, nullptr);
      ASSERT_NE(want, nullptr);
      // Before the first step W is the same bits; after it, the same up to rounding.
      if (key == 1) {
        ExpectSameOutcome(got, want, absl::StrCat("micro-batch ", sequence));
      } else {
        ExpectNear(got->loss, want->loss, 1e-3, absl::StrCat("loss ", sequence));
      }
    }
    v1::ApplyOptimizerRequest request;
    request.set_client_id("opt");
    request.set_step_key(key);
    *request.mutable_params() = c.params;
    if (key == 2) {
      request.set_max_norm(0.05);  // well under the gradient's norm: clipped
      request.set_trunk_grad_sq_norm(0.01);
    }
    auto r = rep.ApplyOptimizer(request);
    auto w = one.ApplyOptimizer(request);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(w.ok()) << w.status();
    const std::string what = absl::StrCat("step ", key);
    ExpectNear(r->head_grad_norm(), w->head_grad_norm(), 1e-5, what + " head_grad_norm");
    ExpectNear(r->total_grad_norm(), w->total_grad_norm(), 1e-5, what + " total_grad_norm");
    ExpectNear(r->clip_coefficient(), w->clip_coefficient(), 1e-5, what + " clip_coefficient");
    if (key == 2) EXPECT_LT(r->clip_coefficient(), 1.0) << what;
    EXPECT_GT(r->head_grad_norm(), 0.0) << what;
    EXPECT_EQ(r->window().token_count(), w->window().token_count()) << what;
    EXPECT_EQ(r->window().microbatch_count(), 4u) << what;
    EXPECT_EQ(r->weights_version(), w->weights_version()) << what;
    EXPECT_EQ(r->optimizer_step(), key) << what;
    EXPECT_EQ(w->optimizer_step(), key) << what;

    // W after the step, and the optimizer's own tensors (each replica's rows, laid out whole by
    // the snapshot), agree with the one-device head's up to rounding.
    const std::vector<float> w_rep = WeightsFp32(rep);
    const std::vector<float> w_one = WeightsFp32(one);
    if (bf16) {
      ExpectWithinBf16Ulp(w_rep, w_one, what + " W");
    } else {
      ExpectClose(w_rep, w_one, 1e-5, what + " W");
    }
    auto snap_rep = rep.Snapshot();
    auto snap_one = one.Snapshot();
    ASSERT_TRUE(snap_rep.ok()) << snap_rep.status();
    ASSERT_TRUE(snap_one.ok()) << snap_one.status();
    ASSERT_EQ(snap_rep->master.size(), snap_one->master.size());
    if (bf16) {
      ASSERT_EQ(snap_rep->master.size(), c.v * kD * sizeof(float));
      ExpectClose(FromBytes<float>(snap_rep->master), FromBytes<float>(snap_one->master), 1e-5,
                  what + " master");
    }
    ASSERT_EQ(snap_rep->optimizer_state.size(), static_cast<size_t>(c.state_buffers));
    ASSERT_EQ(snap_one->optimizer_state.size(), static_cast<size_t>(c.state_buffers));
    for (int b = 0; b < c.state_buffers; ++b) {
      ExpectCloseToScale(FromBytes<float>(snap_rep->optimizer_state[b]),
                         FromBytes<float>(snap_one->optimizer_state[b]), 1e-5,
                         absl::StrCat(what, " optimizer state ", b));
    }
    EXPECT_EQ(snap_rep->optimizer_step, key);
    EXPECT_EQ(snap_rep->momentum_started, snap_one->momentum_started);

    // The step took the whole window, on every replica.
    const Pulled left = Pull(rep, false);
    EXPECT_EQ(left.summary.microbatch_count(), 0u) << what;
    ExpectSameValues(left.values, std::vector<float>(left.values.size(), 0.0f), what + " dW");

    // Every replica holds the same W: one micro-batch, forward-only, sent once per replica.
    Sample probe = MakeSample(9, c.v, c.dtype, 4000 + key, "", 0);
    probe.mb.header.mutable_options()->set_forward_only(true);
    auto first = StepOk(rep, probe.mb);
    ASSERT_NE(first, nullptr);
    for (int r2 = 1; r2 < c.k; ++r2) {
      ExpectSameOutcome(StepOk(rep, probe.mb), first, absl::StrCat(what, " probe ", r2));
    }
    ExpectEveryReplicaRan(rep);

    const v1::HeadInfo info = rep.Info();
    EXPECT_EQ(info.optimizer_step(), one.Info().optimizer_step()) << what;
    EXPECT_EQ(info.optimizer_step(), key) << what;
    ASSERT_EQ(info.device_memory_size(), c.k);
    uint64_t state = 0, master = 0;
    for (int r2 = 0; r2 < c.k; ++r2) {
      const uint64_t rows = kernels::ShardRange(c.v, c.k, r2).size();
      const v1::HeadMemory& m = info.device_memory(r2);
      EXPECT_EQ(m.optimizer_state_bytes(), rows * kD * 4 * c.state_buffers) << "replica " << r2;
      EXPECT_EQ(m.master_weights_bytes(), bf16 ? rows * kD * 4 : 0) << "replica " << r2;
      state += m.optimizer_state_bytes();
      master += m.master_weights_bytes();
    }
    EXPECT_EQ(info.memory().optimizer_state_bytes(), state);
    EXPECT_EQ(info.memory().optimizer_state_bytes(),
              static_cast<uint64_t>(c.v * kD * 4 * c.state_buffers));
    EXPECT_EQ(info.memory().master_weights_bytes(), master);
    EXPECT_EQ(info.memory().optimizer_state_bytes(), one.Info().memory().optimizer_state_bytes());
  }
}

TEST(ReplicatedHeadOptimizerTest, AdamWOnABf16HeadStepsLikeOneDevice) {
  OptimizerCase c{.k = 3,
                  .v = 37,
                  .dtype = v1::DTYPE_BF16,
                  .kind = v1::OPTIMIZER_ADAMW,
                  .momentum_buffer = false,
                  .params = {},
                  .state_buffers = 2};
  c.params.set_lr(0.02);
  c.params.set_beta1(0.9);
  c.params.set_beta2(0.999);
  c.params.set_eps(1e-8);
  c.params.set_weight_decay(0.01);
  StepBothAndCompare(c);
}

TEST(ReplicatedHeadOptimizerTest, SgdWithMomentumOnAnFp32HeadStepsLikeOneDevice) {
  OptimizerCase c{.k = 2,
                  .v = 41,
                  .dtype = v1::DTYPE_FP32,
                  .kind = v1::OPTIMIZER_SGD,
                  .momentum_buffer = true,
                  .params = {},
                  .state_buffers = 1};
  c.params.set_lr(0.5);
  c.params.set_momentum(0.9);
  c.params.set_nesterov(true);
  c.params.set_weight_decay(0.001);
  StepBothAndCompare(c);
}

// ---------------------------------------------------------------------------------------------
// Checkpoints: the file is the one-device head's whatever the placement, so it restores on any
// number of devices with the same window, W and optimizer.

TEST(ReplicatedHeadCheckpointTest, RestoresOnOneAndOnThreeDevices) {
  constexpr int64_t kV = 37;
  Devices two = MakeDevices(2);
  auto created =
      Head::Create(two.list, Spec(kV, v1::DTYPE_BF16, 2, v1::OPTIMIZER_ADAMW), HeadOptions{});
  ASSERT_TRUE(created.ok()) << created.status();
  Head& original = **created;
  v1::ApplyOptimizerRequest apply;
  apply.set_client_id("opt");
  apply.set_step_key(1);
  apply.mutable_params()->set_lr(0.02);
  apply.mutable_params()->set_beta1(0.9);
  apply.mutable_params()->set_beta2(0.999);
  apply.mutable_params()->set_eps(1e-8);

  std::vector<Sample> samples;
  std::vector<std::shared_ptr<const StepOutcome>> outcomes;
  for (uint64_t seq = 1; seq <= 7; ++seq) {
    samples.push_back(MakeSample(4 + 3 * seq, kV, v1::DTYPE_BF16, 3000 + seq, "c", seq));
    outcomes.push_back(StepOk(original, samples.back().mb));
    if (seq == 4) ASSERT_TRUE(original.ApplyOptimizer(apply).ok());
  }
  auto snap = original.Snapshot();
  ASSERT_TRUE(snap.ok()) << snap.status();
  EXPECT_EQ(snap->spec.placement().kind(), v1::PLACEMENT_REPLICATED);
  EXPECT_EQ(snap->spec.placement().devices(), 2u);
  const Pulled window = Pull(original, false);
  ASSERT_EQ(window.summary.microbatch_count(), 3u);
  const std::string weights = Weights(original);
  const v1::HeadInfo info = original.Info();

  auto one_backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
  ASSERT_TRUE(one_backend.ok()) << one_backend.status();
  auto on_one = Head::Restore(**one_backend, *snap, HeadOptions{});
  ASSERT_TRUE(on_one.ok()) << on_one.status();
  Devices three = MakeDevices(3);
  auto on_three = Head::Restore(three.list, *snap, HeadOptions{});
  ASSERT_TRUE(on_three.ok()) << on_three.status();

  for (const auto& [restored, k] : {std::pair{*on_one, 1}, std::pair{*on_three, 3}}) {
    const std::string what = absl::StrCat("restored on ", k);
    const v1::HeadInfo got = restored->Info();
    EXPECT_EQ(got.devices_size(), k) << what;
    EXPECT_EQ(got.device_memory_size(), k) << what;
    EXPECT_EQ(restored->device_count(), k) << what;
    // Restore names the devices the head got; a replicated head's spec stays replicated (on one).
    EXPECT_EQ(got.spec().placement().kind(), v1::PLACEMENT_REPLICATED) << what;
    EXPECT_EQ(got.spec().placement().devices(), static_cast<uint32_t>(k)) << what;
    EXPECT_EQ(got.optimizer_step(), 1u) << what;
    EXPECT_EQ(got.weights_version(), info.weights_version()) << what;
    EXPECT_EQ(got.tokens_total(), info.tokens_total()) << what;
    EXPECT_EQ(got.microbatches_total(), info.microbatches_total()) << what;
    EXPECT_EQ(got.memory().optimizer_state_bytes(), info.memory().optimizer_state_bytes()) << what;
    for (int r = 0; r < k; ++r) {
      EXPECT_EQ(got.device_memory(r).optimizer_state_bytes(),
                kernels::ShardRange(kV, k, r).size() * kD * 4 * 2)
          << what << ", replica " << r;
    }

    const Pulled pulled = Pull(*restored, false);
    ExpectSameCounters(pulled.summary, window.summary, what);
    ExpectSameValues(pulled.values, window.values, what + " dW");
    EXPECT_EQ(Weights(*restored), weights) << what;

    // The optimizer's tensors went to the replicas owning their rows, and come back whole.
    auto again = restored->Snapshot();
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->master == snap->master) << what << ": master differs";
    ASSERT_EQ(again->optimizer_state.size(), 2u);
    for (size_t b = 0; b < 2; ++b) {
      EXPECT_TRUE(again->optimizer_state[b] == snap->optimizer_state[b])
          << what << ": optimizer state " << b << " differs";
    }
    EXPECT_EQ(again->optimizer_step, snap->optimizer_step) << what;
    EXPECT_EQ(again->master_version, snap->master_version) << what;

    // Every replica holds the saved W: a micro-batch, forward-only, once per replica, answers
    // what the original answers.
    Sample probe = MakeSample(10, kV, v1::DTYPE_BF16, 3100, "", 0);
    probe.mb.header.mutable_options()->set_forward_only(true);
    auto want_probe = StepOk(original, probe.mb);
    for (int r = 0; r < k; ++r) {
      ExpectSameOutcome(StepOk(*restored, probe.mb), want_probe, absl::StrCat(what, " probe ", r));
    }
    ExpectEveryReplicaRan(*restored);

    // Remembered micro-batches replay, wherever they now run.
    StepStats stats;
    auto replay = StepOk(*restored, samples[5].mb, &stats);
    EXPECT_TRUE(stats.replayed) << what;
    ExpectSameOutcome(replay, outcomes[5], what + " replay");
    EXPECT_EQ(restored->Progress("c").acknowledged_sequence(), 7u) << what;
  }

  // The next step from the restored state is the original's next step.
  apply.set_step_key(2);
  auto want = original.ApplyOptimizer(apply);
  ASSERT_TRUE(want.ok()) << want.status();
  const std::vector<float> w_want = WeightsFp32(original);
  for (const auto& [restored, k] : {std::pair{*on_one, 1}, std::pair{*on_three, 3}}) {
    const std::string what = absl::StrCat("restored on ", k, ", stepped");
    auto got = restored->ApplyOptimizer(apply);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_FALSE(got->replayed()) << what;
    EXPECT_EQ(got->optimizer_step(), 2u) << what;
    EXPECT_EQ(got->window().token_count(), want->window().token_count()) << what;
    ExpectNear(got->head_grad_norm(), want->head_grad_norm(), 1e-6, what);
    ExpectWithinBf16Ulp(WeightsFp32(*restored), w_want, what + " W");
  }
}

// ---------------------------------------------------------------------------------------------
// Placement errors: refused with INVALID_ARGUMENT, the registry's name left free.

TEST(ReplicatedHeadPlacementTest, CreateRefusesPlacementsThatDoNotFitItsDevices) {
  Devices two = MakeDevices(2);
  Devices three = MakeDevices(3);
  auto code = [](std::span<kernels::Backend* const> devices, const v1::HeadSpec& spec) {
    return Head::Create(devices, spec, HeadOptions{}).status().code();
  };
  EXPECT_EQ(code(two.list, Spec(37, v1::DTYPE_FP32, 3)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(three.list, Spec(37, v1::DTYPE_FP32, 2)), absl::StatusCode::kInvalidArgument);
  v1::HeadSpec single = Spec(37, v1::DTYPE_FP32, 1);
  EXPECT_EQ(code(two.list, single), absl::StatusCode::kInvalidArgument);  // one device, two given
  single.mutable_placement()->set_kind(v1::PLACEMENT_SINGLE);
  single.mutable_placement()->set_devices(2);
  EXPECT_EQ(code(two.list, single), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(std::span(two.list).first(1), single), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Head::ValidateSpec(single).code(), absl::StatusCode::kInvalidArgument);
  v1::HeadSpec unknown = Spec(37, v1::DTYPE_FP32, 2);
  unknown.mutable_placement()->set_kind(static_cast<v1::PlacementKind>(9));
  EXPECT_EQ(code(two.list, unknown), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Head::ValidateSpec(unknown).code(), absl::StatusCode::kInvalidArgument);
  // Every replica owns at least one row.
  EXPECT_EQ(code(three.list, Spec(2, v1::DTYPE_FP32, 3)), absl::StatusCode::kInvalidArgument);

  // Zero devices means all those given; the spec then says how many.
  v1::HeadSpec all = Spec(3, v1::DTYPE_FP32, 3);
  all.mutable_placement()->set_devices(0);
  auto head = Head::Create(three.list, all, HeadOptions{});
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ((*head)->device_count(), 3);
  EXPECT_EQ((*head)->Info().spec().placement().devices(), 3u);
}

TEST(ReplicatedHeadPlacementTest, RegistryPlacesHeadsOnItsDevices) {
  Devices two = MakeDevices(2);
  HeadRegistry registry(two.list, HeadOptions{});
  v1::HeadSpec spec = Spec(37, v1::DTYPE_FP32, 4);
  spec.set_name("r");
  EXPECT_EQ(registry.Create(spec).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.size(), 0u);
  EXPECT_EQ(registry.Get("r").status().code(), absl::StatusCode::kNotFound);

  // The name is free again: every device of the server.
  spec.mutable_placement()->set_devices(0);
  auto all = registry.Create(spec);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ((*all)->Info().devices_size(), 2);
  EXPECT_EQ((*all)->Info().spec().placement().kind(), v1::PLACEMENT_REPLICATED);
  EXPECT_EQ((*all)->Info().spec().placement().devices(), 2u);
  EXPECT_EQ(registry.Create(spec).status().code(), absl::StatusCode::kAlreadyExists);

  v1::HeadSpec single = Spec(37, v1::DTYPE_FP32, 1);
  single.set_name("s");
  single.mutable_placement()->set_kind(v1::PLACEMENT_SINGLE);
  auto one = registry.Create(single);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ((*one)->Info().devices_size(), 1);
  single.set_name("u");
  single.clear_placement();
  auto unplaced = registry.Create(single);
  ASSERT_TRUE(unplaced.ok()) << unplaced.status();
  EXPECT_EQ((*unplaced)->Info().devices_size(), 1);
  EXPECT_EQ(registry.size(), 3u);

  // A restore takes what the server has.
  v1::Placement four;
  four.set_kind(v1::PLACEMENT_REPLICATED);
  four.set_devices(4);
  EXPECT_EQ(registry.Place(four).status().code(), absl::StatusCode::kInvalidArgument);
  auto placed = registry.Place(four, /*at_most=*/true);
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ(placed->size(), 2u);
}

// placement.devices is a uint32: a count past what an int holds is one the server does not have
// either, refused like 4 of 2 (a restore, which takes what there is, takes both devices).
TEST(ReplicatedHeadPlacementTest, RegistryRefusesADeviceCountBeyondInt) {
  Devices two = MakeDevices(2);
  HeadRegistry registry(two.list, HeadOptions{});
  v1::HeadSpec spec = Spec(37, v1::DTYPE_FP32, 2);
  spec.mutable_placement()->set_devices(uint32_t{1} << 31);
  EXPECT_EQ(Head::Create(two.list, spec, HeadOptions{}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.Create(spec).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry.size(), 0u);
}

// A restore places with at_most (all devices when too few): a count no server has is still an
// invalid spec, never a crash.
TEST(ReplicatedHeadPlacementTest, RestorePlacementOfADeviceCountBeyondIntIsRefused) {
  Devices two = MakeDevices(2);
  HeadRegistry registry(two.list, HeadOptions{});
  v1::Placement placement;
  placement.set_kind(v1::PLACEMENT_REPLICATED);
  placement.set_devices(~uint32_t{0});
  auto placed = registry.Place(placement, /*at_most=*/true);
  EXPECT_EQ(placed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(placed.status().message(), "placement.devices must be at most 65536, got 4294967295");
  placement.set_devices(65536);  // allowed, and more than there are: all of them
  placed = registry.Place(placement, /*at_most=*/true);
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_EQ(placed->size(), 2u);
}

// ---------------------------------------------------------------------------------------------
// The group itself.

TEST(ReplicaGroupTest, ChoosesTheLeastQueuedReplicaWithTiesInTurn) {
  Devices three = MakeDevices(3);
  auto group = ReplicaGroup::Create(three.list, 10, 4, kernels::DType::kFP32);
  ASSERT_TRUE(group.ok()) << group.status();
  ReplicaGroup& g = **group;
  ASSERT_EQ(g.size(), 3);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(g[r].rank, r);
    EXPECT_EQ(g[r].rows.begin, kernels::ShardRange(10, 3, r).begin);
    EXPECT_EQ(g[r].rows.end, kernels::ShardRange(10, 3, r).end);
  }
  // All idle: in turn.
  for (int i = 0; i < 4; ++i) {
    ReplicaGroup::Assignment a = g.Choose(5);
    EXPECT_EQ(a.replica().rank, i % 3) << "choice " << i;
    EXPECT_EQ(a.replica().queued_tokens.load(), 5);
  }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(g[r].queued_tokens.load(), 0);
  {
    // Rank 1 is next in turn; while its tokens are queued the others take the work.
    ReplicaGroup::Assignment held = g.Choose(100);
    ASSERT_EQ(held.replica().rank, 1);
    for (int i = 0; i < 6; ++i) {
      ReplicaGroup::Assignment a = g.Choose(1);
      EXPECT_NE(a.replica().rank, 1) << "choice " << i;
    }
    // Two held: the third replica, whose turn it is not, is the least queued.
    ReplicaGroup::Assignment also = g.Choose(50);
    ASSERT_NE(also.replica().rank, 1);
    const int free_rank = 3 - 1 - also.replica().rank;
    for (int i = 0; i < 3; ++i) {
      ReplicaGroup::Assignment a = g.Choose(1);
      EXPECT_EQ(a.replica().rank, free_rank) << "choice " << i;
    }
    held.Release();
    EXPECT_EQ(g[1].queued_tokens.load(), 0);
  }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(g[r].queued_tokens.load(), 0);
}

TEST(ReplicaGroupTest, CreateRefusesWhatItCannotPlace) {
  Devices three = MakeDevices(3);
  EXPECT_EQ(ReplicaGroup::Create(three.list, 2, 4, kernels::DType::kFP32).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReplicaGroup::Create({}, 10, 4, kernels::DType::kFP32).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<kernels::Backend*> with_null = {three.list[0], nullptr};
  EXPECT_EQ(ReplicaGroup::Create(with_null, 10, 4, kernels::DType::kFP32).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReplicaGroupTest, ReducesEachRowToItsOwnerOnOneBackendPassedThrice) {
  constexpr int64_t kRows = 7, kCols = 3;
  Devices shared = MakeDevices(3, /*shared=*/true);
  auto group = ReplicaGroup::Create(shared.list, kRows, kCols, kernels::DType::kFP32);
  ASSERT_TRUE(group.ok()) << group.status();
  ReplicaGroup& g = **group;
  // Replica r's accumulator: r + 1 + element / 8, so that every sum is exact.
  for (int r = 0; r < 3; ++r) {
    Replica& replica = g[r];
    auto stream = replica.backend.CreateStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    replica.stream = std::move(*stream);
    auto grad = replica.backend.Allocate(kRows * kCols * sizeof(float));
    ASSERT_TRUE(grad.ok()) << grad.status();
    replica.grad = std::move(*grad);
    for (int64_t j = 0; j < kRows * kCols; ++j) replica.grad.as<float>()[j] = r + 1 + j / 8.0f;
  }
  for (int round = 0; round < 2; ++round) {  // a second reduction adds nothing
    {
      ReplicaGroup::Cut cut(g);
      ASSERT_TRUE(g.ReduceGradientToOwners().ok());
      ASSERT_TRUE(g.Synchronize().ok());
    }
    for (int r = 0; r < 3; ++r) {
      const kernels::Shard rows = kernels::ShardRange(kRows, 3, r);
      for (int64_t j = 0; j < kRows * kCols; ++j) {
        const bool owned = j >= rows.begin * kCols && j < rows.end * kCols;
        EXPECT_EQ(g[r].grad.as<float>()[j], owned ? 6 + 3 * (j / 8.0f) : 0.0f)
            << "round " << round << ", replica " << r << ", element " << j;
      }
    }
  }
}

}  // namespace
}  // namespace losshead::server
