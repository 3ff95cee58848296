// The group secret at a process group's bootstrap (process_group.h, group_auth.h), with processes
// that are threads of this test: processes that hold the same secret form the group and exchange;
// one that holds another secret, or none where its peer holds one (or one where its peer holds
// none), is PERMISSION_DENIED on both ends; a stranger speaking the protocol by hand without the
// secret gets one byte, the refusal, and nothing else. And the sealed mesh (mesh_cipher.h):
// exchanges of every size around a record's carry every byte; through a relay that records and
// then alters the bytes, the sealed wire shows none of the plaintext and the altered record breaks
// the group (UNAVAILABLE naming its authentication), where the plain wire shows the plaintext and
// delivers the altered byte; a process sealing beside one that does not is FAILED_PRECONDITION on
// both ends; sealing without a secret is INVALID_ARGUMENT.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/collective/mesh_cipher.h"
#include "losshead/kernels/process_group.h"
#include "tests/common/loopback_ports.h"

namespace losshead::kernels {
namespace {

using ::losshead::testing::FreeLoopbackAddresses;

constexpr char kSecret[] = "0123456789abcdef-the-group-secret";
constexpr char kOtherSecret[] = "fedcba9876543210-another-secret!";

void ExpectStatus(const absl::Status& status, absl::StatusCode code, const std::string& text) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(status.message().find(text), std::string::npos) << status;
}

ProcessGroupOptions Options(const std::vector<std::string>& peers, int rank,
                            const std::string& secret, bool encrypt = false) {
  ProcessGroupOptions options;
  options.rank = rank;
  options.world = static_cast<int>(peers.size());
  options.peers = peers;
  options.listen = peers[rank];
  options.bootstrap_timeout = absl::Seconds(10);
  options.op_timeout = absl::Seconds(10);
  options.secret = secret;
  options.encrypt = encrypt;
  return options;
}

// Every process's bootstrap at once, each with its secret; their statuses by rank.
std::vector<absl::Status> Bootstrap(const std::vector<std::string>& secrets) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(static_cast<int>(secrets.size()));
  std::vector<absl::Status> statuses(secrets.size());
  std::vector<std::thread> threads;
  for (size_t p = 0; p < secrets.size(); ++p) {
    threads.emplace_back([&, p] {
      statuses[p] = ProcessGroup::Create(Options(peers, static_cast<int>(p), secrets[p])).status();
    });
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

TEST(ProcessGroupSecretTest, ProcessesHoldingTheSameSecretFormTheGroupAndExchange) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(3);
  std::vector<std::vector<std::vector<std::byte>>> gathered(3);
  std::vector<std::thread> threads;
  for (int p = 0; p < 3; ++p) {
    threads.emplace_back([&, p] {
      auto group = ProcessGroup::Create(Options(peers, p, kSecret));
      ASSERT_TRUE(group.ok()) << group.status();
      const std::vector<std::byte> mine(8, std::byte(p + 1));
      auto all = (*group)->AllGather("check", mine);
      ASSERT_TRUE(all.ok()) << all.status();
      gathered[p] = *all;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < 3; ++p) {
    ASSERT_EQ(gathered[p].size(), 3u);
    for (int q = 0; q < 3; ++q) {
      EXPECT_EQ(gathered[p][q], std::vector<std::byte>(8, std::byte(q + 1)));
    }
  }
}

TEST(ProcessGroupSecretTest, AnotherSecretIsPermissionDeniedOnBothEnds) {
  const std::vector<absl::Status> statuses = Bootstrap({kSecret, kOtherSecret});
  ExpectStatus(statuses[0], absl::StatusCode::kPermissionDenied,
               "does not hold this group's secret");
  ExpectStatus(statuses[1], absl::StatusCode::kPermissionDenied,
               "refused this process's group secret");
  // Neither message holds either secret.
  for (const absl::Status& s : statuses) {
    EXPECT_EQ(s.message().find(kSecret), std::string::npos);
    EXPECT_EQ(s.message().find(kOtherSecret), std::string::npos);
  }
}

TEST(ProcessGroupSecretTest, NoSecretBesideOneIsPermissionDeniedOnBothEnds) {
  std::vector<absl::Status> statuses = Bootstrap({kSecret, ""});
  ExpectStatus(statuses[0], absl::StatusCode::kPermissionDenied,
               "holds no group secret and this process requires one");
  ExpectStatus(statuses[1], absl::StatusCode::kPermissionDenied,
               "requires a group secret (--group_secret_file) and this process holds none");
  statuses = Bootstrap({"", kSecret});
  ExpectStatus(statuses[0], absl::StatusCode::kPermissionDenied,
               "requires a group secret (--group_secret_file) and this process holds none");
  ExpectStatus(statuses[1], absl::StatusCode::kPermissionDenied,
               "holds no group secret and this process requires one");
  // Neither holding one: the group forms as before.
  statuses = Bootstrap({"", ""});
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_TRUE(statuses[1].ok()) << statuses[1];
}

TEST(ProcessGroupSecretTest, AStrangerWithoutTheSecretLearnsOnlyItsRefusal) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(2);
  std::vector<unsigned char> after_offer;
  bool closed = false;
  std::thread stranger([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(peers[0].substr(10))));
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    // A hello as process 1 would send it (magic, version, world, rank, not sealed, group name),
    // then an offer claiming a secret (1, 7 zero bytes, a nonce) and a made-up proof.
    char hello[20 + 64] = {};
    const uint32_t fields[5] = {0x4c485047, kProcessGroupProtocolVersion, 2, 1, 0};
    std::memcpy(hello, fields, sizeof(fields));
    std::memcpy(hello + 20, "losshead", 8);
    unsigned char offer[40] = {1};
    for (int i = 8; i < 40; ++i) offer[i] = static_cast<unsigned char>(i * 7);
    unsigned char proof[32];
    std::memset(proof, 0x5a, sizeof(proof));
    ASSERT_EQ(write(fd, hello, sizeof(hello)), static_cast<ssize_t>(sizeof(hello)));
    ASSERT_EQ(write(fd, offer, sizeof(offer)), static_cast<ssize_t>(sizeof(offer)));
    ASSERT_EQ(write(fd, proof, sizeof(proof)), static_cast<ssize_t>(sizeof(proof)));
    // Its hello and its offer (both public: a version, a name, a nonce), then whatever else comes
    // until the connection closes.
    unsigned char reply[sizeof(hello) + sizeof(offer)];
    size_t got = 0;
    while (got < sizeof(reply)) {
      const ssize_t n = read(fd, reply + got, sizeof(reply) - got);
      ASSERT_GT(n, 0);
      got += static_cast<size_t>(n);
    }
    unsigned char rest[256];
    while (true) {
      const ssize_t n = read(fd, rest, sizeof(rest));
      if (n <= 0) {
        closed = n == 0;
        break;
      }
      after_offer.insert(after_offer.end(), rest, rest + n);
    }
    close(fd);
  });
  ExpectStatus(ProcessGroup::Create(Options(peers, 0, kSecret)).status(),
               absl::StatusCode::kPermissionDenied, "does not hold this group's secret");
  stranger.join();
  EXPECT_TRUE(closed);
  EXPECT_EQ(after_offer, std::vector<unsigned char>{0}) << "the refusal, one byte, and no proof";
}

TEST(ProcessGroupSecretTest, AShortSecretIsInvalidArgument) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(2);
  ExpectStatus(ProcessGroup::Create(Options(peers, 0, "short")).status(),
               absl::StatusCode::kInvalidArgument, "a secret of 5 bytes (at least 16)");
}

// Byte i of what process `from` sends process `to` in exchange `round`.
std::byte Pattern(int from, int to, int round, size_t i) {
  return std::byte(static_cast<unsigned char>((i * 131 + 17 * from + 5 * to + 3 * round) & 0xff));
}

TEST(ProcessGroupSealedTest, SealedExchangesOfEverySizeCarryEveryByte) {
  // Around a record's size, so that records whole, partial and empty all go.
  const std::vector<size_t> sizes = {
      0, 1, kMeshRecordBytes - 1, kMeshRecordBytes, kMeshRecordBytes + 1, 3 * kMeshRecordBytes + 7};
  constexpr int kWorld = 3;
  const std::vector<std::string> peers = FreeLoopbackAddresses(kWorld);
  std::vector<std::thread> threads;
  for (int p = 0; p < kWorld; ++p) {
    threads.emplace_back([&, p] {
      auto group = ProcessGroup::Create(Options(peers, p, kSecret, /*encrypt=*/true));
      ASSERT_TRUE(group.ok()) << group.status();
      for (int round = 0; round < static_cast<int>(sizes.size()); ++round) {
        // The size between p and q in this round: each pair and direction its own.
        const auto size = [&](int from, int to) {
          return sizes[(round + from * kWorld + to) % sizes.size()];
        };
        std::vector<std::vector<std::byte>> out(kWorld), in(kWorld);
        std::vector<std::span<const std::byte>> sends(kWorld);
        std::vector<std::span<std::byte>> recvs(kWorld);
        for (int q = 0; q < kWorld; ++q) {
          if (q == p) continue;
          out[q].resize(size(p, q));
          for (size_t i = 0; i < out[q].size(); ++i) out[q][i] = Pattern(p, q, round, i);
          in[q].assign(size(q, p), std::byte{0});
          sends[q] = out[q];
          recvs[q] = in[q];
        }
        ASSERT_TRUE((*group)->Exchange("sealed", sends, recvs).ok()) << "round " << round;
        for (int q = 0; q < kWorld; ++q) {
          if (q == p) continue;
          for (size_t i = 0; i < in[q].size(); ++i) {
            ASSERT_EQ(in[q][i], Pattern(q, p, round, i))
                << "process " << p << " from " << q << ", round " << round << ", byte " << i;
          }
        }
      }
      const std::vector<std::byte> mine(100, std::byte(p + 1));
      auto all = (*group)->AllGather("sealed gather", mine);
      ASSERT_TRUE(all.ok()) << all.status();
      for (int q = 0; q < kWorld; ++q) {
        EXPECT_EQ((*all)[q], std::vector<std::byte>(100, std::byte(q + 1)));
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

// A TCP relay between process 1 and process 0 that keeps every byte going from 1 to 0 and, once
// `tamper` is set, flips the next such byte it forwards.
class Relay {
 public:
  Relay(const std::string& listen, const std::string& to) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr = Loopback(listen);
    EXPECT_EQ(bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(listener_, 1), 0);
    thread_ = std::thread([this, to] { Run(to); });
  }
  ~Relay() {
    Join();
    close(listener_);
  }
  // Waits for the relay to end (with its connection); `seen` is whole afterwards.
  void Join() {
    if (thread_.joinable()) thread_.join();
  }
  std::atomic<bool> tamper{false};
  std::atomic<bool> tampered{false};
  std::vector<std::byte> seen;  // read after Join()

 private:
  static sockaddr_in Loopback(const std::string& address) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(address.find(':') + 1))));
    return addr;
  }
  void Run(const std::string& to) {
    const int from = accept(listener_, nullptr, nullptr);
    ASSERT_GE(from, 0);
    // Process 0 may not listen yet: tried again, as the group's own connections are.
    int onward = -1;
    const sockaddr_in addr = Loopback(to);
    for (int attempt = 0; attempt < 200 && onward < 0; ++attempt) {
      onward = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(onward, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
        close(onward);
        onward = -1;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    ASSERT_GE(onward, 0) << "process 0 never listened";
    std::vector<std::byte> buffer(1 << 16);
    while (true) {
      pollfd polls[2] = {{from, POLLIN, 0}, {onward, POLLIN, 0}};
      if (poll(polls, 2, 30000) <= 0) break;
      bool ended = false;
      for (int i = 0; i < 2 && !ended; ++i) {
        if (polls[i].revents == 0) continue;
        const ssize_t n = read(polls[i].fd, buffer.data(), buffer.size());
        if (n <= 0) {
          ended = true;
          break;
        }
        if (i == 0) {
          if (tamper && !tampered) {
            buffer[0] ^= std::byte{0x01};
            tampered = true;
          }
          seen.insert(seen.end(), buffer.begin(), buffer.begin() + n);
        }
        const int dst = i == 0 ? onward : from;
        for (ssize_t done = 0; done < n;) {
          const ssize_t put =
              send(dst, buffer.data() + done, static_cast<size_t>(n - done), MSG_NOSIGNAL);
          if (put <= 0) {
            ended = true;
            break;
          }
          done += put;
        }
      }
      if (ended) break;
    }
    close(from);
    close(onward);
  }
  int listener_ = -1;
  std::thread thread_;
};

class ProcessGroupRelayTest : public ::testing::TestWithParam<bool> {};

TEST_P(ProcessGroupRelayTest, ARelayReadsAndAltersThePlainMeshButNotTheSealedOne) {
  const bool sealed = GetParam();
  // Process 0 listens at real[0]; process 1 reaches it through the relay at relay[0].
  const std::vector<std::string> real = FreeLoopbackAddresses(2);
  const std::vector<std::string> relay_at = FreeLoopbackAddresses(1);
  const std::vector<std::string> peers = {relay_at[0], real[1]};
  auto relay = std::make_unique<Relay>(relay_at[0], real[0]);
  constexpr size_t kBytes = 2 * kMeshRecordBytes + 123;
  std::vector<std::byte> sent(kBytes);
  for (size_t i = 0; i < kBytes; ++i) sent[i] = Pattern(1, 0, 0, i);
  std::vector<std::byte> first(kBytes), second(kBytes);
  absl::Status first_status, second_status;
  std::latch exchanged(2), go(1);
  std::vector<std::thread> threads;
  for (int p = 0; p < 2; ++p) {
    threads.emplace_back([&, p] {
      ProcessGroupOptions options = Options(peers, p, kSecret, sealed);
      options.listen = real[p];
      auto group = ProcessGroup::Create(options);
      EXPECT_TRUE(group.ok()) << group.status();
      if (!group.ok()) {
        exchanged.count_down();
        return;
      }
      std::vector<std::span<const std::byte>> sends(2);
      std::vector<std::span<std::byte>> recvs(2);
      if (p == 1) sends[0] = sent;
      if (p == 0) recvs[1] = first;
      const absl::Status a = (*group)->Exchange("first", sends, recvs);
      if (p == 0) first_status = a;
      exchanged.count_down();
      go.wait();
      if (p == 0) recvs[1] = second;
      const absl::Status b = (*group)->Exchange("second", sends, recvs);
      if (p == 0) second_status = b;
    });
  }
  exchanged.wait();
  relay->tamper = true;
  go.count_down();
  for (std::thread& t : threads) t.join();
  relay->Join();

  ASSERT_TRUE(first_status.ok()) << first_status;
  EXPECT_EQ(first, sent);
  EXPECT_TRUE(relay->tampered);
  // A window of the plaintext, looked for in what crossed the relay.
  const std::span<const std::byte> window(sent.data() + 5000, 64);
  const bool plaintext_seen = std::search(relay->seen.begin(), relay->seen.end(), window.begin(),
                                          window.end()) != relay->seen.end();
  if (sealed) {
    EXPECT_FALSE(plaintext_seen) << "the sealed mesh's wire carries the plaintext";
    EXPECT_EQ(second_status.code(), absl::StatusCode::kUnavailable) << second_status;
    EXPECT_NE(second_status.message().find("failed its authentication"), std::string::npos)
        << second_status;
  } else {
    EXPECT_TRUE(plaintext_seen) << "the relay should read the plain mesh";
    ASSERT_TRUE(second_status.ok()) << second_status;
    size_t altered = 0;
    for (size_t i = 0; i < kBytes; ++i) altered += second[i] != sent[i];
    EXPECT_EQ(altered, 1u) << "the plain mesh delivers the altered byte unnoticed";
  }
}

INSTANTIATE_TEST_SUITE_P(Mesh, ProcessGroupRelayTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "Sealed" : "Plain";
                         });

TEST(ProcessGroupSealedTest, SealingBesideAProcessThatDoesNotIsRefusedOnBothEnds) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(2);
  std::vector<absl::Status> statuses(2);
  std::vector<std::thread> threads;
  for (int p = 0; p < 2; ++p) {
    threads.emplace_back([&, p] {
      statuses[p] = ProcessGroup::Create(Options(peers, p, kSecret, /*encrypt=*/p == 0)).status();
    });
  }
  for (std::thread& t : threads) t.join();
  ExpectStatus(statuses[0], absl::StatusCode::kFailedPrecondition,
               "does not seal the group's mesh (--group_mesh_encryption), this process does");
  ExpectStatus(statuses[1], absl::StatusCode::kFailedPrecondition,
               "seals the group's mesh (--group_mesh_encryption), this process does not");
}

TEST(ProcessGroupSealedTest, SealingWithoutASecretIsInvalidArgument) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(2);
  ExpectStatus(ProcessGroup::Create(Options(peers, 0, "", /*encrypt=*/true)).status(),
               absl::StatusCode::kInvalidArgument, "needs the group secret");
}

}  // namespace
}  // namespace losshead::kernels
