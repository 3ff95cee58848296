// What the multi-process tests share: a group of real losshead-server processes on loopback (CPU
// backend), started at once and restartable at the same addresses, one-process reference
// servers, and the head, micro-batches and applies they are given.
#ifndef LOSSHEAD_TESTS_MULTIPROCESS_GROUP_UTIL_H_
#define LOSSHEAD_TESTS_MULTIPROCESS_GROUP_UTIL_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/loopback_ports.h"
#include "tests/common/server_process.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {

inline constexpr char kHead[] = "lm";
inline constexpr int64_t kVocab = 48;
inline constexpr int64_t kHidden = 24;
inline constexpr int64_t kTokens = 16;
inline constexpr int kClients = 6;
inline constexpr int kPerClient = 3;
// The exit code of a process whose group broke (server/server.cc).
inline constexpr int kExitGroupBroken = 3;

inline std::string LogPath(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/mp_", getpid(), "_", name, ".log");
}

// The home rule, written here from its definition: FNV-1a 64 of the id's bytes, mod N.
inline int Home(const std::string& client_id, int n) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : client_id) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return static_cast<int>(hash % static_cast<uint64_t>(n));
}

inline std::unique_ptr<client::Client> Connect(const std::string& target, bool follow = false) {
  client::ClientOptions options;
  options.deadline = absl::Seconds(30);
  options.stream_deadline = absl::Seconds(60);
  options.retry.max_attempts = 1;  // errors are what these tests look at
  options.follow_home_redirect = follow;
  auto c = client::Client::Connect(target, options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

// Where the processes of a group of n listen, by rank: their gRPC addresses and their peers'
// endpoints. Kept to restart a group at the same addresses.
struct GroupAddresses {
  explicit GroupAddresses(int n) {
    const std::vector<int> ports = FreeLoopbackPorts(2 * n);
    for (int p = 0; p < n; ++p) {
      peers.push_back(absl::StrCat("127.0.0.1:", ports[n + p]));
      grpc.push_back(absl::StrCat("127.0.0.1:", ports[p]));
    }
  }
  int size() const { return static_cast<int>(grpc.size()); }
  // The flags of process p.
  std::vector<std::string> Flags(int p) const {
    return {"--backend=cpu",
            "--grad_stash_bytes=0",
            absl::StrCat("--listen=", grpc[p]),
            "--group_peers=" + absl::StrJoin(peers, ","),
            absl::StrCat("--group_rank=", p),
            "--group_bootstrap_timeout=30s",
            "--group_op_timeout=5s"};
  }
  std::vector<std::string> grpc;
  std::vector<std::string> peers;
};

// Every process of a group started at `at` at once (process p given `extra(p)` beyond
// GroupAddresses::Flags(p)), each expected to exit by itself (a start that fails): (exit code,
// log) by rank.
inline std::vector<std::pair<int, std::string>> StartExpectingExit(
    const GroupAddresses& at, const std::string& name,
    const std::function<std::vector<std::string>(int)>& extra) {
  std::vector<std::pair<int, std::string>> results(at.size());
  std::vector<std::thread> starts;
  for (int p = 0; p < at.size(); ++p) {
    starts.emplace_back([&, p] {
      std::vector<std::string> flags = at.Flags(p);
      const std::vector<std::string> more = extra(p);
      flags.insert(flags.end(), more.begin(), more.end());
      const std::string log = LogPath(absl::StrCat(name, "_p", p));
      auto code = ServerProcess::RunToExit(LOSSHEAD_SERVER_BINARY, flags, log, absl::Seconds(60));
      EXPECT_TRUE(code.ok()) << code.status();
      results[p] = {code.value_or(-1), ReadText(log)};
    });
  }
  for (std::thread& t : starts) t.join();
  return results;
}

// N processes of one group, started at once (each waits for the others before serving).
struct Group {
  Group(int n, const std::string& name, std::vector<std::string> extra = {})
      : Group(GroupAddresses(n), name, [extra](int) { return extra; }) {}
  // At `at`, process p given `extra(p)` beyond GroupAddresses::Flags(p).
  Group(const GroupAddresses& at, const std::string& name,
        const std::function<std::vector<std::string>(int)>& extra)
      : addresses(at.grpc) {
    const int n = at.size();
    processes.resize(n);
    std::vector<std::thread> starts;
    for (int p = 0; p < n; ++p) {
      starts.emplace_back([&, p] {
        std::vector<std::string> flags = at.Flags(p);
        const std::vector<std::string> more = extra(p);
        flags.insert(flags.end(), more.begin(), more.end());
        auto started = ServerProcess::Start(LOSSHEAD_SERVER_BINARY, flags,
                                            LogPath(absl::StrCat(name, "_p", p)));
        EXPECT_TRUE(started.ok()) << "process " << p << ": " << started.status();
        if (started.ok()) processes[p] = std::move(*started);
      });
    }
    for (std::thread& t : starts) t.join();
    for (int p = 0; p < n; ++p) {
      clients.push_back(processes[p] != nullptr ? Connect(addresses[p]) : nullptr);
    }
  }
  bool ok() const {
    for (const auto& c : clients) {
      if (c == nullptr) return false;
    }
    return true;
  }
  std::vector<std::string> addresses;
  std::vector<std::unique_ptr<ServerProcess>> processes;
  std::vector<std::unique_ptr<client::Client>> clients;
};

// Kills the group's process `victim` (kill -9); every other one exits within `within`, its group
// broken.
inline void KillAndExpectTheOthersExit(Group& group, int victim,
                                       absl::Duration within = absl::Seconds(30)) {
  group.processes[victim]->Kill();
  for (int p = 0; p < static_cast<int>(group.processes.size()); ++p) {
    if (p == victim) continue;
    const std::optional<int> code = group.processes[p]->WaitForExit(within);
    ASSERT_TRUE(code.has_value()) << "process " << p << " still runs with its group broken";
    EXPECT_EQ(*code, kExitGroupBroken) << "process " << p;
  }
}

// A one-process server, as today (no group flags).
struct Single {
  // Given `extra` beyond the CPU backend's flags.
  explicit Single(const std::string& name, std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {"--backend=cpu", "--grad_stash_bytes=0"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    auto started = ServerProcess::Start(LOSSHEAD_SERVER_BINARY, flags, LogPath(name));
    EXPECT_TRUE(started.ok()) << started.status();
    if (started.ok()) {
      process = std::move(*started);
      client = Connect(process->target());
    }
  }
  std::unique_ptr<ServerProcess> process;
  std::unique_ptr<client::Client> client;
};

inline v1::HeadSpec Spec() {
  v1::HeadSpec spec;
  spec.set_name(kHead);
  spec.set_vocab_size(kVocab);
  spec.set_hidden_size(kHidden);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.3f);
  spec.mutable_init()->mutable_normal()->set_seed(11);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
  return spec;
}

// A head sharded across a group: its processes and each one's devices.
struct Layout {
  int processes;
  int devices;  // per process
};

// The flag of a server on CPU devices 0, ..., devices - 1.
inline std::vector<std::string> DeviceFlags(int devices) {
  std::string list = "--devices=0";
  for (int d = 1; d < devices; ++d) absl::StrAppend(&list, ",", d);
  return {list};
}

// A V x D fp32 head with AdamW and a normal init from `seed`, sharded over `devices` devices of
// every process of a group (`across`), or of one process.
inline v1::HeadSpec ShardedSpec(const std::string& name, int64_t vocab, int64_t hidden,
                                uint64_t seed, int devices, bool across) {
  v1::HeadSpec spec;
  spec.set_name(name);
  spec.set_vocab_size(vocab);
  spec.set_hidden_size(hidden);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_init()->mutable_normal()->set_std(0.3f);
  spec.mutable_init()->mutable_normal()->set_seed(seed);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  spec.mutable_placement()->set_kind(v1::PLACEMENT_SHARDED);
  spec.mutable_placement()->set_devices(devices);
  spec.mutable_placement()->set_across_processes(across);
  return spec;
}

inline std::string ClientId(int c) { return absl::StrCat("trainer-", c); }

// Client c's micro-batch k (sequence k + 1).
inline HostBatch Batch(int c, int k) {
  return MakeBatch(kTokens, kHidden, kVocab, v1::DTYPE_FP32, 1000 + 97 * c + k);
}

inline std::vector<float> Floats(const client::Bytes& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

inline v1::ApplyOptimizerRequest Apply(uint64_t step_key) {
  v1::ApplyOptimizerRequest request;
  request.set_head(kHead);
  request.set_client_id("optimizer");
  request.set_step_key(step_key);
  request.mutable_params()->set_lr(0.5);
  return request;
}

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_MULTIPROCESS_GROUP_UTIL_H_
