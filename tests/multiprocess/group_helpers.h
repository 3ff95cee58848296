// What the tests of heads across real losshead-server processes share (replicated_group_test.cc,
// sharded_group_test.cc): free loopback ports, N processes of one group started at once, a
// one-process server for reference, the home rule written from its definition, and clients.
// The including test target defines LOSSHEAD_SERVER_BINARY.
#ifndef LOSSHEAD_TESTS_MULTIPROCESS_GROUP_HELPERS_H_
#define LOSSHEAD_TESTS_MULTIPROCESS_GROUP_HELPERS_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/server_process.h"

namespace losshead::testing {

// `n` loopback ports that were free a moment ago (the kernel's choice).
inline std::vector<int> FreePorts(int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    socklen_t length = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
    ports.push_back(ntohs(addr.sin_port));
    fds.push_back(fd);
  }
  for (int fd : fds) close(fd);
  return ports;
}

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

// N processes of one group, started at once (each waits for the others before serving), each
// given `extra` and then its own `per_process[p]` flags (when there are any).
struct Group {
  Group(int n, const std::string& name, std::vector<std::string> extra = {},
        std::vector<std::vector<std::string>> per_process = {}) {
    const std::vector<int> ports = FreePorts(2 * n);
    std::vector<std::string> peers;
    for (int p = 0; p < n; ++p) {
      peers.push_back(absl::StrCat("127.0.0.1:", ports[n + p]));
      addresses.push_back(absl::StrCat("127.0.0.1:", ports[p]));
    }
    processes.resize(n);
    std::vector<std::thread> starts;
    for (int p = 0; p < n; ++p) {
      starts.emplace_back([&, p] {
        std::vector<std::string> flags = {"--backend=cpu",
                                          "--grad_stash_bytes=0",
                                          absl::StrCat("--listen=", addresses[p]),
                                          "--group_peers=" + absl::StrJoin(peers, ","),
                                          absl::StrCat("--group_rank=", p),
                                          "--group_bootstrap_timeout=30s",
                                          "--group_op_timeout=5s"};
        flags.insert(flags.end(), extra.begin(), extra.end());
        if (p < static_cast<int>(per_process.size())) {
          flags.insert(flags.end(), per_process[p].begin(), per_process[p].end());
        }
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

// A one-process server, as today (no group flags).
struct Single {
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

// A tensor of fp32 bytes as floats.
inline std::vector<float> Floats(const client::Bytes& bytes) {
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_MULTIPROCESS_GROUP_HELPERS_H_
