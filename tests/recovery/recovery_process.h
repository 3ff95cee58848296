// What the kill -9 tests share: a fresh checkpoint directory per run, a client with the deadlines
// a restarting server needs, and kills at seeded random moments.
#ifndef LOSSHEAD_TESTS_RECOVERY_RECOVERY_PROCESS_H_
#define LOSSHEAD_TESTS_RECOVERY_RECOVERY_PROCESS_H_

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "losshead/client/client.h"
#include "tests/common/server_process.h"

namespace losshead::testing {

// Added to every kill test's server flags. Deferred dW groups dW's fp32 additions by when the
// stash fills, idles and is cut (a checkpoint, a restart), so a run cut by kills would equal the
// fault-free one only up to summation order. Without the stash it equals it bit for bit, which is
// what these tests compare. (Exactly-once with the stash: tests/server/deferred_grad_test.cc.)
inline constexpr char kBitExactFlag[] = "--grad_stash_bytes=0";

// A new directory under the system's temporary directory ("" when none can be made).
std::string RecoveryTempDir();
// A client of `process` (unary calls 30 s, streams 120 s); null when it cannot connect.
std::unique_ptr<client::Client> ConnectToServer(const ServerProcess& process);

// Three kills at seeded random moments: after a random event in each of three consecutive windows
// of `window` events, and then after a random delay of up to `max_delay_us` while the run goes
// on, so that a kill lands anywhere (inside a step, a pull, an apply or a checkpoint write).
class RandomKills {
 public:
  RandomKills(uint32_t seed, int window, int max_delay_us);
  // Call at every event of the run. When a kill is due and `killer` is idle, starts it there (the
  // caller joins it before restarting the server) and returns true.
  bool MaybeKill(ServerProcess* victim, std::thread& killer);

 private:
  std::mt19937 rng_;
  std::vector<int> at_;
  const int max_delay_us_;
  int events_ = 0;
  size_t next_ = 0;
};

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_RECOVERY_RECOVERY_PROCESS_H_
