#include "server/engine/step_turns.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace losshead::server {
namespace {

// Turns arriving in a random order on their own threads, each recording when it takes and when it
// runs: both in turn order, whatever the arrival.
TEST(StepTurnsTest, TurnsTakeAndRunInOrderWhateverTheirArrival) {
  StepTurns turns(absl::Seconds(30));
  constexpr int kTurns = 24;
  std::vector<uint64_t> arrival(kTurns);
  for (int i = 0; i < kTurns; ++i) arrival[i] = i + 1;
  std::shuffle(arrival.begin(), arrival.end(), std::mt19937(std::random_device()()));
  absl::Mutex mu;
  std::vector<uint64_t> taken, ran;
  std::vector<std::thread> threads;
  for (uint64_t t : arrival) {
    threads.emplace_back([&, t] {
      StepTurn turn(turns, t);
      ASSERT_TRUE(turn.AwaitTake().ok());
      {
        absl::MutexLock lock(&mu);
        taken.push_back(t);
      }
      turn.Taken();
      ASSERT_TRUE(turn.AwaitRun().ok());
      {
        absl::MutexLock lock(&mu);
        ran.push_back(t);
      }
      turn.Ran();
    });
  }
  for (std::thread& thread : threads) thread.join();
  std::vector<uint64_t> expected(kTurns);
  for (int i = 0; i < kTurns; ++i) expected[i] = i + 1;
  EXPECT_EQ(taken, expected);
  EXPECT_EQ(ran, expected);
}

// A turn that ends before its run (its micro-batch failed) lets the next one run.
TEST(StepTurnsTest, ATurnThatEndsEarlyPassesItsGates) {
  StepTurns turns(absl::Seconds(30));
  {
    StepTurn first(turns, 1);
    ASSERT_TRUE(first.AwaitTake().ok());
  }  // never taken, never ran
  StepTurn second(turns, 2);
  EXPECT_TRUE(second.AwaitTake().ok());
  second.Taken();
  EXPECT_TRUE(second.AwaitRun().ok());
}

// The next turn may take its slots while the one ahead runs, but not run before it has.
TEST(StepTurnsTest, TheNextTurnTakesWhileTheOneAheadRuns) {
  StepTurns turns(absl::Seconds(30));
  StepTurn first(turns, 1);
  ASSERT_TRUE(first.AwaitTake().ok());
  first.Taken();
  ASSERT_TRUE(first.AwaitRun().ok());
  StepTurn second(turns, 2);
  EXPECT_TRUE(second.AwaitTake().ok());
  second.Taken();
  absl::Mutex mu;
  bool second_ran = false;
  std::thread run([&] {
    ASSERT_TRUE(second.AwaitRun().ok());
    absl::MutexLock lock(&mu);
    second_ran = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  {
    absl::MutexLock lock(&mu);
    EXPECT_FALSE(second_ran);
  }
  first.Ran();
  run.join();
  EXPECT_TRUE(second_ran);
}

// A turn whose predecessor never comes (its order lost with a process) gives up: UNAVAILABLE.
TEST(StepTurnsTest, AMissingEarlierTurnIsUnavailableAfterTheTimeout) {
  StepTurns turns(absl::Milliseconds(100));
  StepTurn third(turns, 3);
  const absl::Time start = absl::Now();
  const absl::Status waited = third.AwaitTake();
  EXPECT_EQ(waited.code(), absl::StatusCode::kUnavailable) << waited;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(100));
  EXPECT_NE(waited.message().find("(1) never came"), std::string::npos) << waited;
}

}  // namespace
}  // namespace losshead::server
