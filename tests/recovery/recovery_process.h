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

// How the server under test adds each micro-batch to dW.
enum class DwAccumulation {
  // --grad_stash_bytes=0: each micro-batch straight into dW, in sequence order, so a run cut by
  // kills equals the fault-free one bit for bit.
  kDirect,
  // The server's default path, deferred dW, with a stash of a few micro-batches that fills, idles
  // and is cut (a pull, a checkpoint, a kill) in mid-step. dW's fp32 additions are grouped by when
  // that happens, so a run cut by kills equals the fault-free one up to summation order.
  kDeferred,
};
// The server flags for `mode`, for a V x D head stepped with micro-batches of `tokens` tokens. A
// deferred stash holds two and a half of them (the CPU backend's fp32 G and H), so that it fills
// and is flushed twice per step of six, besides the idle flushes and the cuts.
std::vector<std::string> AccumulationFlags(DwAccumulation mode, int64_t vocab, int64_t hidden,
                                           int64_t tokens);
const char* AccumulationName(DwAccumulation mode);

// The direct accumulation's flag, for the tests that compare with one fault-free run.
inline constexpr char kBitExactFlag[] = "--grad_stash_bytes=0";

// A new directory under the system's temporary directory ("" when none can be made).
std::string RecoveryTempDir();
// A client of `process` (unary calls 30 s, streams 120 s); null when it cannot connect.
std::unique_ptr<client::Client> ConnectToServer(const ServerProcess& process);

// The workspace bytes of `head`, on one device (kernel workspace, micro-batch buffers and any
// stash); 0 and a test failure when they cannot be read.
uint64_t HeadWorkspaceBytes(client::Client& client, const std::string& head);

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
