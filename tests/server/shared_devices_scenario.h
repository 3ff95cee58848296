// Several placed heads on the same devices at once, the scenario shared by the CPU suite
// (tests/server/shared_devices_test.cc: host collectives) and the GPU suite
// (tests/cuda/shared_gpus_cuda_test.cc: NCCL, or the staged collective on one GPU). Two sharded
// heads and a replicated one, each stepped from two threads while another thread pulls the
// replicated head's window with reset; then an optimizer step on the replicated head beside steps
// on the sharded ones. Each head has its own collective, so their exchanges run side by side on
// the same devices. The scenario checks that everything finishes (a watchdog ends the process if
// it hangs, rather than stalling the suite), that every token is counted once, and that each
// head's dW (the sum of its windows) matches the same micro-batches on one device.
#ifndef LOSSHEAD_TESTS_SERVER_SHARED_DEVICES_SCENARIO_H_
#define LOSSHEAD_TESTS_SERVER_SHARED_DEVICES_SCENARIO_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/head.h"
#include "tests/server/bf16_microbatch.h"

namespace losshead::server::shared_devices {

inline constexpr int64_t kV = 1031, kD = 256;  // uneven row shards on 2 and 4 devices
inline constexpr int kThreadsPerHead = 2;
inline constexpr int kMicrobatchesPerThread = 6;

inline v1::HeadSpec Spec(const std::string& name, int devices, v1::PlacementKind kind,
                         uint64_t seed) {
  v1::HeadSpec spec;
  spec.set_name(name);
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(v1::DTYPE_BF16);
  spec.mutable_init()->mutable_normal()->set_std(0.05f);
  spec.mutable_init()->mutable_normal()->set_seed(seed);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  spec.mutable_placement()->set_kind(kind);
  spec.mutable_placement()->set_devices(devices);
  return spec;
}

// Micro-batch `i` of thread `thread` for `head`; its non-ignored tokens in *counted.
inline MicroBatch Batch(const std::string& head, int thread, int i, int64_t* counted) {
  const int64_t n = 64 + 29 * i + 7 * thread;
  std::mt19937_64 rng(std::hash<std::string>{}(head) + 1000 * thread + i);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> h(n * kD);
  for (float& x : h) x = normal(rng);
  std::vector<int32_t> y(n);
  std::uniform_int_distribution<int32_t> pick(0, kV - 1);
  *counted = 0;
  for (int64_t t = 0; t < n; ++t) {
    y[t] = t % 5 == 2 ? -100 : pick(rng);
    if (y[t] != -100) ++*counted;
  }
  return Bf16MicroBatch(head, absl::StrCat(head, "-", thread), i + 1, h, y);
}

inline std::vector<double> Floats(const std::string& fp32) {
  std::vector<float> f(fp32.size() / 4);
  kernels::ToFloat(kernels::DType::kFP32, fp32.data(), f.data(), f.size());
  return std::vector<double>(f.begin(), f.end());
}

// ||got - want|| / ||want||.
inline double RelativeError(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// Runs the scenario with heads placed over `devices`, against heads on `one_device` alone.
inline void RunHeadsSharingDevices(std::span<kernels::Backend* const> devices,
                                   kernels::Backend& one_device) {
  const int k = static_cast<int>(devices.size());
  const std::vector<std::pair<std::string, v1::PlacementKind>> placed = {
      {"sharded-a", v1::PLACEMENT_SHARDED},
      {"sharded-b", v1::PLACEMENT_SHARDED},
      {"replicated", v1::PLACEMENT_REPLICATED}};
  std::vector<std::shared_ptr<Head>> heads, references;
  for (size_t h = 0; h < placed.size(); ++h) {
    auto head = Head::Create(devices, Spec(placed[h].first, k, placed[h].second, 20 + h), {});
    auto reference = Head::Create(
        one_device, Spec(placed[h].first, 1, v1::PLACEMENT_SINGLE, 20 + h), HeadOptions{});
    ASSERT_TRUE(head.ok() && reference.ok()) << head.status() << reference.status();
    heads.push_back(std::move(*head));
    references.push_back(std::move(*reference));
  }
  Head& replicated = *heads[2];

  // Everything at once: kThreadsPerHead stepping threads per head, and one thread that pulls the
  // replicated head's window with reset three times. W stays fixed meanwhile, so the windows can
  // be checked against one device; the optimizer step comes after.
  std::vector<int64_t> sent_tokens(heads.size(), 0);
  std::vector<std::string> windows;  // the replicated head's, pulled with reset
  std::atomic<int> failures{0};
  auto everything = [&] {
    std::vector<std::thread> threads;
    std::vector<std::vector<int64_t>> counted(heads.size(), std::vector<int64_t>(kThreadsPerHead));
    for (size_t h = 0; h < heads.size(); ++h) {
      for (int t = 0; t < kThreadsPerHead; ++t) {
        threads.emplace_back([&, h, t] {
          for (int i = 0; i < kMicrobatchesPerThread; ++i) {
            int64_t tokens = 0;
            MicroBatch mb = Batch(placed[h].first, t, i, &tokens);
            StepStats stats;
            auto outcome = heads[h]->Step(mb, &stats);
            if (!outcome.ok() || (*outcome)->token_count != tokens) {
              std::fprintf(
                  stderr, "%s thread %d micro-batch %d: %s\n", placed[h].first.c_str(), t, i,
                  outcome.ok() ? "token count differs" : outcome.status().ToString().c_str());
              ++failures;
            }
            counted[h][t] += tokens;
          }
        });
      }
    }
    threads.emplace_back([&] {
      for (int p = 0; p < 3; ++p) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        auto window = replicated.PullGradient(v1::DTYPE_FP32, /*reset=*/true);
        if (!window.ok()) {
          std::fprintf(stderr, "pull: %s\n", window.status().ToString().c_str());
          ++failures;
          continue;
        }
        windows.push_back(window->data);
      }
    });
    for (std::thread& t : threads) t.join();
    for (size_t h = 0; h < heads.size(); ++h) {
      for (int64_t c : counted[h]) sent_tokens[h] += c;
    }
  };
  // A hang (collectives of two communicators waiting on each other) must fail, not stall the
  // suite: past the deadline the process ends with the reason.
  auto done = std::async(std::launch::async, everything);
  if (done.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: heads sharing the GPUs did not finish in 120 s (a hang)\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  done.get();
  EXPECT_EQ(failures.load(), 0);

  for (size_t h = 0; h < heads.size(); ++h) {
    SCOPED_TRACE(placed[h].first);
    EXPECT_EQ(heads[h]->Info().tokens_total(), static_cast<uint64_t>(sent_tokens[h]));
    // The same micro-batches on one GPU, one after another.
    for (int t = 0; t < kThreadsPerHead; ++t) {
      for (int i = 0; i < kMicrobatchesPerThread; ++i) {
        int64_t tokens = 0;
        MicroBatch mb = Batch(placed[h].first, t, i, &tokens);
        StepStats stats;
        ASSERT_TRUE(references[h]->Step(mb, &stats).ok());
      }
    }
    auto want = references[h]->PullGradient(v1::DTYPE_FP32, /*reset=*/true);
    auto last = heads[h]->PullGradient(v1::DTYPE_FP32, /*reset=*/true);
    ASSERT_TRUE(want.ok() && last.ok()) << want.status() << last.status();
    std::vector<double> got = Floats(last->data);
    if (placed[h].second == v1::PLACEMENT_REPLICATED) {
      for (const std::string& window : windows) {
        const std::vector<double> w = Floats(window);
        for (size_t e = 0; e < got.size(); ++e) got[e] += w[e];
      }
    }
    // Sums in another order; sharded, the gradient operand rounded from the shards' statistics.
    EXPECT_LT(RelativeError(got, Floats(want->data)),
              placed[h].second == v1::PLACEMENT_SHARDED ? 1e-2 : 1e-5);
  }

  // An optimizer step on the replicated head (a reduce-scatter of dW and an all-gather of W)
  // while both sharded heads step (their statistics and dH exchanges).
  auto second = std::async(std::launch::async, [&] {
    std::vector<std::thread> threads;
    for (size_t h = 0; h < 2; ++h) {
      threads.emplace_back([&, h] {
        for (int i = 0; i < kMicrobatchesPerThread; ++i) {
          int64_t tokens = 0;
          MicroBatch mb = Batch(placed[h].first, 7, i, &tokens);
          StepStats stats;
          if (!heads[h]->Step(mb, &stats).ok()) ++failures;
        }
      });
    }
    for (int i = 0; i < 2; ++i) {
      int64_t tokens = 0;
      MicroBatch mb = Batch("replicated", 7, i, &tokens);
      StepStats stats;
      if (!replicated.Step(mb, &stats).ok()) ++failures;
    }
    v1::ApplyOptimizerRequest apply;
    apply.set_client_id("opt");
    apply.set_step_key(1);
    apply.mutable_params()->set_lr(1e-2);
    apply.mutable_params()->set_beta1(0.9);
    apply.mutable_params()->set_beta2(0.95);
    apply.mutable_params()->set_eps(1e-8);
    if (!replicated.ApplyOptimizer(apply).ok()) ++failures;
    for (std::thread& t : threads) t.join();
  });
  if (second.wait_for(std::chrono::seconds(120)) != std::future_status::ready) {
    std::fprintf(stderr,
                 "FAILED: an optimizer step beside sharded steps did not finish in 120 s\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  second.get();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(replicated.Info().optimizer_step(), 1u);
}

}  // namespace losshead::server::shared_devices

#endif  // LOSSHEAD_TESTS_SERVER_SHARED_DEVICES_SCENARIO_H_
