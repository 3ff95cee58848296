// The group secret at a process group's bootstrap (process_group.h, group_auth.h), with processes
// that are threads of this test: processes that hold the same secret form the group and exchange;
// one that holds another secret, or none where its peer holds one (or one where its peer holds
// none), is PERMISSION_DENIED on both ends; a stranger speaking the protocol by hand without the
// secret gets one byte, the refusal, and nothing else.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
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
                            const std::string& secret) {
  ProcessGroupOptions options;
  options.rank = rank;
  options.world = static_cast<int>(peers.size());
  options.peers = peers;
  options.listen = peers[rank];
  options.bootstrap_timeout = absl::Seconds(10);
  options.op_timeout = absl::Seconds(10);
  options.secret = secret;
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
    // A hello as process 1 would send it (magic, version, world, rank, group name), then an offer
    // claiming a secret (1, 7 zero bytes, a nonce) and a made-up proof.
    char hello[16 + 64] = {};
    const uint32_t fields[4] = {0x4c485047, kProcessGroupProtocolVersion, 2, 1};
    std::memcpy(hello, fields, sizeof(fields));
    std::memcpy(hello + 16, "losshead", 8);
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

}  // namespace
}  // namespace losshead::kernels
