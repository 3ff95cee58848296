// Collectives across processes on loopback. Real processes (process_collective_helper, forked and
// exec'd here) run the shared call sequence over 2 and 3 processes with 1 and 2 CPU ranks each,
// and every result must equal, bit for bit, the one-process host collective's over the same global
// ranks on the same data; one of them is killed (SIGKILL) or stopped (SIGSTOP) mid-sequence and
// the others must answer UNAVAILABLE within the op timeout and exit. Groups whose processes are
// threads of this test check bootstrap failures, refusals and disagreements with exact codes.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/process_group.h"
#include "tests/common/loopback_ports.h"
#include "tests/kernels/process_sequence.h"

namespace losshead::kernels {
namespace {

using ::losshead::testing::FreeLoopbackAddresses;

using ::losshead::testing::ReadResults;
using ::losshead::testing::RunSequence;
using ::losshead::testing::SequenceLength;
using ::losshead::testing::SequenceResults;

void ExpectStatus(const absl::Status& status, absl::StatusCode code, const std::string& text) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(status.message().find(text), std::string::npos) << status;
}

std::string TempPath(const std::string& name) {
  static int counter = 0;
  return absl::StrCat(::testing::TempDir(), "/pc_", getpid(), "_", counter++, "_", name);
}

pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  std::string binary = LOSSHEAD_PROCESS_HELPER;
  argv.push_back(binary.data());
  std::vector<std::string> copy = args;
  for (std::string& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

// Waits for `*pid` until `timeout`: its exit code (128 for a signal), or -1 when it is still
// running then. A process waited for is reaped and *pid set to -1.
int WaitFor(pid_t* pid, std::chrono::milliseconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    int status = 0;
    if (waitpid(*pid, &status, WNOHANG) == *pid) {
      *pid = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

// SIGKILL and reap, unless already reaped.
void KillAndReap(pid_t* pid) {
  if (*pid <= 0) return;
  kill(*pid, SIGKILL);
  waitpid(*pid, nullptr, 0);
  *pid = -1;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// k CPU backends with a stream each, and the one-process host collective over them.
struct OneProcess {
  explicit OneProcess(int k) {
    std::vector<Backend*> pointers;
    for (int r = 0; r < k; ++r) {
      backends.push_back(CreateCpuBackend(1));
      pointers.push_back(backends.back().get());
      owned.push_back(*backends.back()->CreateStream());
      streams.push_back(owned.back().get());
    }
    collective = *CreateCollective(pointers);
  }
  std::vector<std::unique_ptr<Backend>> backends;
  std::vector<std::unique_ptr<Stream>> owned;
  std::vector<Stream*> streams;
  std::unique_ptr<Collective> collective;
};

// The helper processes of one test; whichever are still there when it ends (a failed assertion)
// are killed, so that none outlives it.
struct Helpers {
  Helpers() = default;
  Helpers(const Helpers&) = delete;
  Helpers& operator=(const Helpers&) = delete;
  ~Helpers() {
    for (pid_t& pid : pids) KillAndReap(&pid);
  }
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
};

// Starts one helper per entry of `locals` (its CPU ranks), all of one group.
void StartGroup(const std::vector<int>& locals, uint64_t seed, Helpers& helpers,
                const std::vector<std::string>& extra = {}) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(static_cast<int>(locals.size()));
  for (size_t p = 0; p < locals.size(); ++p) {
    helpers.outs.push_back(TempPath(absl::StrCat("p", p)));
    std::vector<std::string> args = {absl::StrCat("rank=", p),
                                     absl::StrCat("world=", locals.size()),
                                     "peers=" + absl::StrJoin(peers, ","),
                                     absl::StrCat("local=", locals[p]),
                                     absl::StrCat("seed=", seed),
                                     "out=" + helpers.outs.back()};
    args.insert(args.end(), extra.begin(), extra.end());
    helpers.pids.push_back(Spawn(args));
  }
}

class ProcessCollectiveTest : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(ProcessCollectiveTest, EveryCallEqualsTheOneProcessHostCollectiveBitForBit) {
  const std::vector<int>& locals = GetParam();
  int k = 0;
  for (int l : locals) k += l;
  const uint64_t seed = 0x5eed + k * 10 + locals.size();
  Helpers helpers;
  StartGroup(locals, seed, helpers);
  for (size_t p = 0; p < helpers.pids.size(); ++p) {
    const int code = WaitFor(&helpers.pids[p], std::chrono::seconds(60));
    ASSERT_EQ(code, 0) << "process " << p << " (-1: still running after 60 s)";
  }
  OneProcess reference_ranks(k);
  const SequenceResults reference =
      RunSequence(*reference_ranks.collective, reference_ranks.streams, seed);
  int first = 0;
  for (size_t p = 0; p < locals.size(); ++p) {
    ASSERT_EQ(ReadFile(helpers.outs[p] + ".status"), "0 \n") << "process " << p;
    absl::StatusOr<SequenceResults> got = ReadResults(helpers.outs[p] + ".results");
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), static_cast<size_t>(SequenceLength()));
    for (const auto& [index, result] : *got) {
      ASSERT_EQ(result.code, 0) << "process " << p << " call " << index;
      ASSERT_EQ(reference.at(index).code, 0);
      ASSERT_EQ(result.ranks.size(), static_cast<size_t>(locals[p]));
      for (int g = first; g < first + locals[p]; ++g) {
        ASSERT_TRUE(result.ranks.count(g)) << "process " << p << " lacks rank " << g;
        EXPECT_TRUE(result.ranks.at(g) == reference.at(index).ranks.at(g))
            << "call " << index << " rank " << g << " (process " << p << ") differs";
      }
    }
    first += locals[p];
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, ProcessCollectiveTest,
                         ::testing::Values(std::vector<int>{1, 1}, std::vector<int>{2, 2},
                                           std::vector<int>{1, 1, 1}, std::vector<int>{2, 2, 2},
                                           std::vector<int>{2, 1}, std::vector<int>{1, 2, 1}),
                         [](const ::testing::TestParamInfo<std::vector<int>>& info) {
                           return absl::StrCat(absl::StrJoin(info.param, "x"), "Ranks");
                         });

struct Failure {
  std::vector<int> locals;
  int signal;  // what the victim gets: SIGKILL (its sockets close) or SIGSTOP (they stay open)
  int op_timeout_ms;
};

class ProcessFailureTest : public ::testing::TestWithParam<Failure> {};

// The victim (process 1) stops calling after two calls and is killed or stopped; every survivor's
// next call must be UNAVAILABLE (at once for a kill, which closes the victim's connections; at the
// op timeout for a stop), the call after it UNAVAILABLE at once, and the survivors must exit.
TEST_P(ProcessFailureTest, SurvivorsGetUnavailableWithinTheTimeoutAndStayUnusable) {
  const Failure& failure = GetParam();
  const int kOpTimeoutMs = failure.op_timeout_ms;
  const std::string marker = TempPath("marker");
  Helpers helpers;
  StartGroup(failure.locals, 7, helpers,
             {"victim=1", "pause_after=2", "marker=" + marker,
              absl::StrCat("op_timeout_ms=", kOpTimeoutMs)});
  const auto marker_by = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  struct stat st;
  while (stat(marker.c_str(), &st) != 0 && std::chrono::steady_clock::now() < marker_by) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(stat(marker.c_str(), &st), 0) << "the victim never reached its stop";
  // Give the survivors time to enter the call the victim never makes.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  kill(helpers.pids[1], failure.signal);
  for (size_t p = 0; p < helpers.pids.size(); ++p) {
    if (p == 1) continue;
    const int code = WaitFor(&helpers.pids[p], std::chrono::seconds(20));
    ASSERT_EQ(code, 0) << "survivor " << p << " hung (-1) or failed";
    std::istringstream after(ReadFile(helpers.outs[p] + ".after"));
    int first_code = -1, second_code = -1;
    int64_t first_ms = -1, second_ms = -1;
    after >> first_code >> first_ms >> second_code >> second_ms;
    EXPECT_EQ(first_code, static_cast<int>(absl::StatusCode::kUnavailable)) << "survivor " << p;
    EXPECT_EQ(second_code, static_cast<int>(absl::StatusCode::kUnavailable)) << "survivor " << p;
    // The first call waited from before the signal; it ends within the op timeout after the
    // stop (plus scheduling), and the second does not wait at all.
    EXPECT_LE(first_ms, kOpTimeoutMs + 1500) << "survivor " << p;
    if (failure.signal == SIGSTOP) {
      EXPECT_GE(first_ms, kOpTimeoutMs - 50) << "survivor " << p << ": gave up before the timeout";
    } else {
      // A killed peer's connections close: no need to wait for the (long) timeout.
      EXPECT_LT(first_ms, kOpTimeoutMs / 2) << "survivor " << p << ": waited out the timeout";
    }
    EXPECT_LE(second_ms, 100) << "survivor " << p << ": a broken group must answer at once";
  }
  KillAndReap(&helpers.pids[1]);
}

INSTANTIATE_TEST_SUITE_P(Victims, ProcessFailureTest,
                         ::testing::Values(Failure{{1, 1}, SIGKILL, 8000},
                                           Failure{{1, 2, 1}, SIGKILL, 8000},
                                           Failure{{2, 2}, SIGSTOP, 1500},
                                           Failure{{1, 1, 1}, SIGSTOP, 1500}),
                         [](const ::testing::TestParamInfo<Failure>& info) {
                           return absl::StrCat(absl::StrJoin(info.param.locals, "x"),
                                               info.param.signal == SIGKILL ? "Killed" : "Stopped");
                         });

TEST(ProcessBootstrapTest, MismatchedWorldSizesAreFailedPreconditionOnBothEnds) {
  // Process 1 thinks the world has 3 processes; process 0 that it has 2.
  const std::vector<std::string> peers = FreeLoopbackAddresses(3);
  std::vector<std::string> args0 = {"rank=0", "world=2", "peers=" + peers[0] + "," + peers[1],
                                    "local=1", "bootstrap_timeout_ms=5000"};
  std::vector<std::string> args1 = {"rank=1", "world=3", "peers=" + absl::StrJoin(peers, ","),
                                    "local=1", "bootstrap_timeout_ms=5000"};
  const std::string out0 = TempPath("w0"), out1 = TempPath("w1");
  args0.push_back("out=" + out0);
  args1.push_back("out=" + out1);
  Helpers helpers;
  helpers.pids = {Spawn(args0), Spawn(args1)};
  EXPECT_EQ(WaitFor(&helpers.pids[0], std::chrono::seconds(20)), 0);
  EXPECT_EQ(WaitFor(&helpers.pids[1], std::chrono::seconds(20)), 0);
  const std::string code = absl::StrCat(static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(ReadFile(out0 + ".status").rfind(code + " ", 0), 0u) << ReadFile(out0 + ".status");
  EXPECT_NE(ReadFile(out0 + ".status").find("has a world of 3 processes, this process 2"),
            std::string::npos)
      << ReadFile(out0 + ".status");
  EXPECT_EQ(ReadFile(out1 + ".status").rfind(code + " ", 0), 0u) << ReadFile(out1 + ".status");
  EXPECT_NE(ReadFile(out1 + ".status").find("has a world of 2 processes, this process 3"),
            std::string::npos)
      << ReadFile(out1 + ".status");
}

ProcessGroupOptions Options(const std::vector<std::string>& peers, int rank) {
  ProcessGroupOptions options;
  options.rank = rank;
  options.world = static_cast<int>(peers.size());
  options.peers = peers;
  options.listen = peers[rank];
  options.bootstrap_timeout = absl::Seconds(10);
  options.op_timeout = absl::Seconds(10);
  return options;
}

TEST(ProcessBootstrapTest, AMissingPeerIsDeadlineExceededNamingIt) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(3);
  // Process 0 waits for 1 and 2 to connect; only 2 is missing... none comes here.
  ProcessGroupOptions lonely0 = Options(peers, 0);
  lonely0.bootstrap_timeout = absl::Milliseconds(300);
  ExpectStatus(ProcessGroup::Create(lonely0).status(), absl::StatusCode::kDeadlineExceeded,
               absl::StrCat("process(es) 1 (", peers[1], "), 2 (", peers[2],
                            ") never connected within 300ms"));
  // Process 2 connects to 0 and 1, which never listen.
  ProcessGroupOptions lonely2 = Options(peers, 2);
  lonely2.bootstrap_timeout = absl::Milliseconds(300);
  ExpectStatus(ProcessGroup::Create(lonely2).status(), absl::StatusCode::kDeadlineExceeded,
               absl::StrCat("process 0 at ", peers[0], " never came within 300ms"));
}

TEST(ProcessBootstrapTest, OtherGroupOrVersionIsFailedPrecondition) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(2);
  absl::Status status1;
  std::thread other([&] {
    ProcessGroupOptions options = Options(peers, 1);
    options.group_name = "head-b";
    status1 = ProcessGroup::Create(options).status();
  });
  ProcessGroupOptions options = Options(peers, 0);
  options.group_name = "head-a";
  ExpectStatus(ProcessGroup::Create(options).status(), absl::StatusCode::kFailedPrecondition,
               "is of group \"head-b\", this process of \"head-a\"");
  other.join();
  ExpectStatus(status1, absl::StatusCode::kFailedPrecondition,
               "is of group \"head-a\", this process of \"head-b\"");

  // A peer of another protocol version (its hello written by hand: magic, version, world, rank,
  // whether it seals the mesh, group name).
  const std::vector<std::string> peers2 = FreeLoopbackAddresses(2);
  std::thread stranger([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(std::stoi(peers2[0].substr(10))));
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      char hello[20 + 64] = {};
      const uint32_t fields[5] = {0x4c485047, kProcessGroupProtocolVersion + 1, 2, 1, 0};
      std::memcpy(hello, fields, sizeof(fields));
      std::memcpy(hello + 20, "losshead", 8);
      EXPECT_EQ(write(fd, hello, sizeof(hello)), static_cast<ssize_t>(sizeof(hello)));
      char reply[sizeof(hello)];
      EXPECT_EQ(read(fd, reply, sizeof(reply)), static_cast<ssize_t>(sizeof(reply)));
    }
    close(fd);
  });
  ExpectStatus(ProcessGroup::Create(Options(peers2, 0)).status(),
               absl::StatusCode::kFailedPrecondition,
               absl::StrCat("speaks protocol version ", kProcessGroupProtocolVersion + 1,
                            ", this process ", kProcessGroupProtocolVersion));
  stranger.join();
}

TEST(ProcessBootstrapTest, MalformedOptionsAreInvalidArgument) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(2);
  ProcessGroupOptions options = Options(peers, 0);
  options.world = 3;
  ExpectStatus(ProcessGroup::Create(options).status(), absl::StatusCode::kInvalidArgument,
               "2 peer addresses for a world of 3");
  options = Options(peers, 0);
  options.rank = 2;
  ExpectStatus(ProcessGroup::Create(options).status(), absl::StatusCode::kInvalidArgument,
               "rank 2 is outside [0, 2)");
  options = Options(peers, 0);
  options.peers[1] = "no-port";
  ExpectStatus(ProcessGroup::Create(options).status(), absl::StatusCode::kInvalidArgument,
               "peer 1: address \"no-port\" is not host:port");
  options = Options(peers, 0);
  options.peers[1] = "host:70000";
  ExpectStatus(ProcessGroup::Create(options).status(), absl::StatusCode::kInvalidArgument,
               "has no port in [1, 65535]");
  options = Options(peers, 0);
  options.op_timeout = absl::ZeroDuration();
  ExpectStatus(ProcessGroup::Create(options).status(), absl::StatusCode::kInvalidArgument,
               "timeouts must be positive");
}

TEST(ProcessBootstrapTest, PeerPatternsAndStatefulSetOrdinals) {
  absl::StatusOr<std::vector<std::string>> peers = ExpandPeerPattern("head-{}.head.ns.svc:7070", 3);
  ASSERT_TRUE(peers.ok()) << peers.status();
  EXPECT_EQ(*peers, (std::vector<std::string>{"head-0.head.ns.svc:7070", "head-1.head.ns.svc:7070",
                                              "head-2.head.ns.svc:7070"}));
  ExpectStatus(ExpandPeerPattern("head.svc:7070", 2).status(), absl::StatusCode::kInvalidArgument,
               "exactly one {}");
  ExpectStatus(ExpandPeerPattern("{}-{}:1", 2).status(), absl::StatusCode::kInvalidArgument,
               "exactly one {}");
  EXPECT_EQ(*RankFromHostname("losshead-12"), 12);
  EXPECT_EQ(*RankFromHostname("my-head-3.head.ns.svc.cluster.local"), 3);
  ExpectStatus(RankFromHostname("losshead").status(), absl::StatusCode::kInvalidArgument,
               "does not end in -<ordinal>");
  ExpectStatus(RankFromHostname("losshead-x1").status(), absl::StatusCode::kInvalidArgument,
               "does not end in -<ordinal>");
}

TEST(ProcessBootstrapTest, StatefulSetStylePeersShareOnePortOnDistinctHosts) {
  // As pods of a StatefulSet do: one port, a host per ordinal (here loopback addresses 127.0.1.p,
  // each process listening on its own).
  const std::string port = FreeLoopbackAddresses(1)[0].substr(std::string("127.0.0.1:").size());
  absl::StatusOr<std::vector<std::string>> peers = ExpandPeerPattern("127.0.1.{}:" + port, 3);
  ASSERT_TRUE(peers.ok()) << peers.status();
  std::vector<absl::Status> statuses(3);
  std::vector<std::vector<float>> data(3, std::vector<float>{1.0f, 2.0f});
  std::vector<std::thread> threads;
  for (int p = 0; p < 3; ++p) {
    threads.emplace_back([&, p] {
      absl::StatusOr<std::unique_ptr<ProcessGroup>> group =
          ProcessGroup::Create(Options(*peers, p));
      if (!group.ok()) {
        statuses[p] = group.status();
        return;
      }
      std::unique_ptr<Backend> cpu = CreateCpuBackend(1);
      std::unique_ptr<Stream> stream = *cpu->CreateStream();
      std::vector<Backend*> backends = {cpu.get()};
      absl::StatusOr<std::unique_ptr<Collective>> c =
          CreateProcessCollective(std::move(*group), backends);
      if (!c.ok()) {
        statuses[p] = c.status();
        return;
      }
      std::vector<void*> buffers = {data[p].data()};
      std::vector<Stream*> streams = {stream.get()};
      statuses[p] = (*c)->AllReduce(buffers, 2, DType::kFP32, ReduceOp::kSum, streams);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int p = 0; p < 3; ++p) {
    ASSERT_TRUE(statuses[p].ok()) << "process " << p << ": " << statuses[p];
    EXPECT_EQ(data[p], (std::vector<float>{3.0f, 6.0f})) << "process " << p;
  }
}

// A group of `world` processes that are threads of this test, each with `local` CPU ranks.
class ThreadGroup {
 public:
  ThreadGroup(int world, int local) : world_(world) {
    const std::vector<std::string> peers = FreeLoopbackAddresses(world);
    ranks_.resize(world);
    groups_.resize(world);
    collectives_.resize(world);
    std::vector<std::thread> threads;
    for (int p = 0; p < world; ++p) {
      for (int i = 0; i < local; ++i) {
        ranks_[p].backends.push_back(CreateCpuBackend(1));
        ranks_[p].owned.push_back(*ranks_[p].backends.back()->CreateStream());
        ranks_[p].streams.push_back(ranks_[p].owned.back().get());
      }
      threads.emplace_back([this, p, peers] {
        ProcessGroupOptions options = Options(peers, p);
        options.op_timeout = absl::Seconds(5);
        absl::StatusOr<std::unique_ptr<ProcessGroup>> group = ProcessGroup::Create(options);
        if (!group.ok()) return;
        groups_[p] = std::move(*group);
        std::vector<Backend*> backends;
        for (auto& b : ranks_[p].backends) backends.push_back(b.get());
        absl::StatusOr<std::unique_ptr<Collective>> c =
            CreateProcessCollective(groups_[p], backends);
        if (c.ok()) collectives_[p] = std::move(*c);
      });
    }
    for (std::thread& t : threads) t.join();
  }

  bool ok() const {
    for (const auto& c : collectives_) {
      if (c == nullptr) return false;
    }
    return true;
  }
  Collective& collective(int p) { return *collectives_[p]; }
  std::vector<Stream*>& streams(int p) { return ranks_[p].streams; }
  ProcessGroup& group(int p) { return *groups_[p]; }

  // Runs call(p) on every process at once; the statuses by process.
  std::vector<absl::Status> OnEvery(const std::function<absl::Status(int)>& call) {
    std::vector<absl::Status> statuses(world_);
    std::vector<std::thread> threads;
    for (int p = 0; p < world_; ++p) threads.emplace_back([&, p] { statuses[p] = call(p); });
    for (std::thread& t : threads) t.join();
    return statuses;
  }

 private:
  struct Ranks {
    std::vector<std::unique_ptr<Backend>> backends;
    std::vector<std::unique_ptr<Stream>> owned;
    std::vector<Stream*> streams;
  };
  const int world_;
  std::vector<Ranks> ranks_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_ =
      std::vector<std::shared_ptr<ProcessGroup>>(8);
  std::vector<std::unique_ptr<Collective>> collectives_;
};

constexpr float kPoison = 12345.0f;

// Each process's buffers (2 local ranks), poisoned.
struct Poisoned {
  explicit Poisoned(int n) {
    for (auto& d : data) d.assign(n, kPoison);
  }
  std::vector<void*> buffers() { return {data[0].data(), data[1].data()}; }
  bool untouched() const {
    for (const auto& d : data) {
      for (float x : d) {
        if (x != kPoison) return false;
      }
    }
    return true;
  }
  std::vector<float> data[2];
};

TEST(ProcessCollectiveErrorsTest, LocalRefusalsAreInvalidArgumentTouchNothingAndKeepTheGroup) {
  ThreadGroup tg(2, 2);
  ASSERT_TRUE(tg.ok());
  EXPECT_EQ(tg.collective(1).size(), 4);
  EXPECT_EQ(tg.collective(1).local_size(), 2);
  EXPECT_EQ(tg.collective(1).first_rank(), 2);
  std::vector<Poisoned> data(2, Poisoned(12));
  const std::vector<int64_t> local_counts = {6, 6};  // one per local rank, not per rank
  // Every process makes the same bad call; each refuses it before anything is sent.
  for (const auto& [call, text] :
       std::vector<std::pair<std::function<absl::Status(int)>, std::string>>{
           {[&](int p) {
              std::vector<void*> one = {data[p].buffers()[0]};
              return tg.collective(p).AllReduce(one, 12, DType::kFP32, ReduceOp::kSum,
                                                tg.streams(p));
            },
            "AllReduce: 1 buffers for 2 local ranks"},
           {[&](int p) {
              return tg.collective(p).ReduceScatter(data[p].buffers(), local_counts, DType::kFP32,
                                                    tg.streams(p));
            },
            "ReduceScatter: 2 counts for 4 ranks"},
           {[&](int p) {
              return tg.collective(p).Broadcast(data[p].buffers(), 12, DType::kFP32, 4,
                                                tg.streams(p));
            },
            "Broadcast: root 4 is outside [0, 4)"},
           {[&](int p) {
              return tg.collective(p).AllReduce(data[p].buffers(), 12, DType::kBF16, ReduceOp::kSum,
                                                tg.streams(p));
            },
            "AllReduce: reduces fp32 only, got bf16"},
           {[&](int p) {
              return tg.collective(p).AllGather(data[p].buffers(),
                                                std::vector<int64_t>{3, 3, -3, 9}, DType::kFP16,
                                                tg.streams(p));
            },
            "AllGather: counts[2] = -3 is negative"},
       }) {
    for (const absl::Status& status : tg.OnEvery(call)) {
      ExpectStatus(status, absl::StatusCode::kInvalidArgument, text);
    }
    EXPECT_TRUE(data[0].untouched() && data[1].untouched()) << text;
  }
  // Nothing was exchanged: the group still works.
  const std::vector<absl::Status> ok = tg.OnEvery([&](int p) {
    return tg.collective(p).AllReduce(data[p].buffers(), 12, DType::kFP32, ReduceOp::kSum,
                                      tg.streams(p));
  });
  for (const absl::Status& status : ok) EXPECT_TRUE(status.ok()) << status;
  EXPECT_EQ(data[1].data[1][5], 4 * kPoison);
}

TEST(ProcessCollectiveErrorsTest, ProcessesThatDisagreeGetFailedPreconditionAndKeepTheGroup) {
  ThreadGroup tg(2, 2);
  ASSERT_TRUE(tg.ok());
  std::vector<Poisoned> data(2, Poisoned(12));
  // Process 1 passes another count; then another call altogether.
  std::vector<absl::Status> statuses = tg.OnEvery([&](int p) {
    return tg.collective(p).AllReduce(data[p].buffers(), p == 0 ? 12 : 10, DType::kFP32,
                                      ReduceOp::kSum, tg.streams(p));
  });
  ExpectStatus(statuses[0], absl::StatusCode::kFailedPrecondition,
               "process 1 called AllReduce #0 (10 elements, op 0) where process 0 called "
               "AllReduce #0 (12 elements, op 0)");
  ExpectStatus(statuses[1], absl::StatusCode::kFailedPrecondition,
               "process 0 called AllReduce #0 (12 elements");
  statuses = tg.OnEvery([&](int p) {
    if (p == 0) {
      return tg.collective(p).Broadcast(data[p].buffers(), 12, DType::kFP32, 0, tg.streams(p));
    }
    return tg.collective(p).AllGather(data[p].buffers(), std::vector<int64_t>{3, 3, 3, 3},
                                      DType::kFP32, tg.streams(p));
  });
  ExpectStatus(statuses[0], absl::StatusCode::kFailedPrecondition, "process 1 called AllGather #1");
  ExpectStatus(statuses[1], absl::StatusCode::kFailedPrecondition, "process 0 called Broadcast #1");
  EXPECT_TRUE(data[0].untouched() && data[1].untouched());
  for (const absl::Status& status : tg.OnEvery([&](int p) {
         return tg.collective(p).Broadcast(data[p].buffers(), 12, DType::kFP32, 3, tg.streams(p));
       })) {
    EXPECT_TRUE(status.ok()) << status;
  }
  EXPECT_EQ(tg.group(0).health(), absl::OkStatus());
}

TEST(ProcessCollectiveErrorsTest, AfterShutdownEveryCallIsUnavailableOnEveryProcess) {
  ThreadGroup tg(2, 2);
  ASSERT_TRUE(tg.ok());
  std::vector<Poisoned> data(2, Poisoned(12));
  tg.group(1).Shutdown();
  std::vector<absl::Status> statuses = tg.OnEvery([&](int p) {
    return tg.collective(p).AllReduce(data[p].buffers(), 12, DType::kFP32, ReduceOp::kSum,
                                      tg.streams(p));
  });
  ExpectStatus(statuses[1], absl::StatusCode::kUnavailable, "shut down");
  ExpectStatus(statuses[0], absl::StatusCode::kUnavailable, "process 1 at 127.0.0.1");
  ExpectStatus(tg.group(0).health(), absl::StatusCode::kUnavailable, "AllReduce #0");
  // The survivor is broken for good: the next call fails at once, without waiting for anyone.
  ExpectStatus(tg.collective(0).Broadcast(data[0].buffers(), 12, DType::kFP32, 0, tg.streams(0)),
               absl::StatusCode::kUnavailable, "the process group is unusable");
  EXPECT_TRUE(data[0].untouched() && data[1].untouched());
}

// A backend whose kind has no collective: the process holding it refuses, the others learn it.
class TpuBackend final : public Backend {
 public:
  absl::string_view name() const override { return "tpu"; }
  std::string device_description() const override { return "tpu:0"; }
  int device_ordinal() const override { return 0; }
  MemoryInfo memory_info() const override { return {}; }
  absl::Status CanImplement(const Problem&) const override { return Unused(); }
  absl::StatusOr<size_t> WorkspaceBytes(const Problem&, size_t) const override { return Unused(); }
  absl::Status Run(const Problem&, const Arguments&, Stream&) override { return Unused(); }
  absl::Status SquaredNorm(const float*, int64_t, double*, Stream&) override { return Unused(); }
  absl::Status OptimizerStep(const OptimizerProblem&, const OptimizerTensors&, Stream&) override {
    return Unused();
  }
  absl::Status CheckOptimizerStep(const OptimizerProblem&, const OptimizerTensors&, OptimizerCheck*,
                                  Stream&) override {
    return Unused();
  }
  absl::StatusOr<DeviceBuffer> Allocate(size_t) override { return Unused(); }
  absl::StatusOr<std::unique_ptr<Stream>> CreateStream() override { return Unused(); }
  absl::Status CopyToDevice(void*, const void*, size_t, Stream&) override { return Unused(); }
  absl::Status CopyToHost(void*, const void*, size_t, Stream&) override { return Unused(); }
  absl::Status Memset(void*, int, size_t, Stream&) override { return Unused(); }

 protected:
  void Free(void*) override {}

 private:
  static absl::Status Unused() { return absl::UnimplementedError("not used by these tests"); }
};

TEST(ProcessCollectiveErrorsTest, AProcessThatRefusesItsBackendsFailsTheOthersAtOnce) {
  const std::vector<std::string> peers = FreeLoopbackAddresses(2);
  absl::Status status1;
  std::thread other([&] {
    absl::StatusOr<std::unique_ptr<ProcessGroup>> group = ProcessGroup::Create(Options(peers, 1));
    ASSERT_TRUE(group.ok()) << group.status();
    TpuBackend tpu;
    std::vector<Backend*> backends = {&tpu};
    status1 = CreateProcessCollective(std::move(*group), backends).status();
  });
  absl::StatusOr<std::unique_ptr<ProcessGroup>> group = ProcessGroup::Create(Options(peers, 0));
  ASSERT_TRUE(group.ok()) << group.status();
  std::unique_ptr<Backend> cpu = CreateCpuBackend(1);
  std::vector<Backend*> backends = {cpu.get()};
  ExpectStatus(CreateProcessCollective(std::move(*group), backends).status(),
               absl::StatusCode::kFailedPrecondition, "process 1 holds refused backends");
  other.join();
  ExpectStatus(status1, absl::StatusCode::kInvalidArgument,
               "backend of rank 0 is \"tpu\", which has no collective implementation");
}

}  // namespace
}  // namespace losshead::kernels
