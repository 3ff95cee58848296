// Collectives across processes over NCCL: 2 processes x 1 GPU (a 2-GPU host) and 2 x 2 (a 4-GPU
// host), each a process_collective_helper running the shared call sequence on its devices, against
// the one-process host collective on the same data: copies (AllGather, Broadcast) and maxima bit
// for bit, sums within the rounding of k fp32 terms in NCCL's order. Skips without enough GPUs.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "tests/common/loopback_ports.h"
#include "tests/kernels/process_sequence.h"

namespace losshead::kernels {
namespace {

using ::losshead::testing::FreeLoopbackAddresses;

using ::losshead::testing::ReadResults;
using ::losshead::testing::SequenceResults;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct GpuLayout {
  int processes;
  int per_process;
};

class ProcessNcclTest : public ::testing::TestWithParam<GpuLayout> {};

TEST_P(ProcessNcclTest, EveryCallAgreesWithTheOneProcessHostCollective) {
  const GpuLayout layout = GetParam();
  const int k = layout.processes * layout.per_process;
  if (CudaDevices() < k) {
    GTEST_SKIP() << CudaDevices() << " CUDA devices visible, " << k << " needed";
  }
  const uint64_t seed = 0xc0ffee + k;
  const std::vector<std::string> peers = FreeLoopbackAddresses(layout.processes);
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (int p = 0; p < layout.processes; ++p) {
    std::vector<std::string> ordinals;
    for (int i = 0; i < layout.per_process; ++i) {
      ordinals.push_back(absl::StrCat(p * layout.per_process + i));
    }
    outs.push_back(absl::StrCat(::testing::TempDir(), "/pnccl_", getpid(), "_", k, "_", p));
    std::vector<std::string> args = {LOSSHEAD_PROCESS_HELPER,
                                     absl::StrCat("rank=", p),
                                     absl::StrCat("world=", layout.processes),
                                     "peers=" + absl::StrJoin(peers, ","),
                                     "cuda=" + absl::StrJoin(ordinals, ","),
                                     absl::StrCat("seed=", seed),
                                     "out=" + outs.back(),
                                     "op_timeout_ms=120000",
                                     "bootstrap_timeout_ms=60000"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    if (pid == 0) {
      execv(argv[0], argv.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  // Every helper ends within 5 minutes, or all are killed: a hung NCCL call must not hang the
  // suite.
  const auto end = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  std::vector<int> statuses(pids.size(), -1);
  for (size_t p = 0; p < pids.size(); ++p) {
    while (statuses[p] == -1 && std::chrono::steady_clock::now() < end) {
      int status = 0;
      if (waitpid(pids[p], &status, WNOHANG) == pids[p]) {
        statuses[p] = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  }
  for (size_t p = 0; p < pids.size(); ++p) {
    if (statuses[p] == -1) {
      kill(pids[p], SIGKILL);
      waitpid(pids[p], nullptr, 0);
    }
  }
  for (size_t p = 0; p < pids.size(); ++p) {
    ASSERT_EQ(statuses[p], 0) << "process " << p << " (-1: still running after 5 minutes)";
  }
  // The reference: k CPU ranks in this process.
  std::vector<std::unique_ptr<Backend>> cpus;
  std::vector<Backend*> pointers;
  std::vector<std::unique_ptr<Stream>> owned;
  std::vector<Stream*> streams;
  for (int r = 0; r < k; ++r) {
    cpus.push_back(CreateCpuBackend(1));
    pointers.push_back(cpus.back().get());
    owned.push_back(*cpus.back()->CreateStream());
    streams.push_back(owned.back().get());
  }
  std::unique_ptr<Collective> host = *CreateCollective(pointers);
  const SequenceResults reference = testing::RunSequence(*host, streams, seed);
  for (int p = 0; p < layout.processes; ++p) {
    ASSERT_EQ(ReadFile(outs[p] + ".status"), "0 \n") << "process " << p;
    absl::StatusOr<SequenceResults> got = ReadResults(outs[p] + ".results");
    ASSERT_TRUE(got.ok()) << got.status();
    for (const auto& [index, result] : *got) {
      ASSERT_EQ(result.code, 0) << "process " << p << " call " << index;
      const std::vector<double> bounds = testing::SequenceCallSums(index)
                                             ? testing::SequenceAbsSums(seed, index, k)
                                             : std::vector<double>();
      for (const auto& [g, bytes] : result.ranks) {
        const std::vector<std::byte>& want = reference.at(index).ranks.at(g);
        ASSERT_EQ(bytes.size(), want.size());
        if (!testing::SequenceCallSums(index)) {
          if (testing::SequenceCallTakesMax(index)) {
            // NaN's place in a max is NCCL's to choose; every other element is exact.
            for (size_t j = 0; j < bytes.size() / 4; ++j) {
              float x, y;
              std::memcpy(&x, bytes.data() + 4 * j, 4);
              std::memcpy(&y, want.data() + 4 * j, 4);
              if (!std::isnan(y)) ASSERT_EQ(x, y) << "call " << index << " rank " << g;
            }
          } else {
            EXPECT_TRUE(bytes == want) << "call " << index << " rank " << g;
          }
          continue;
        }
        for (size_t j = 0; j < bytes.size() / 4; ++j) {
          float x, y;
          std::memcpy(&x, bytes.data() + 4 * j, 4);
          std::memcpy(&y, want.data() + 4 * j, 4);
          const double tolerance = (k - 1) * std::ldexp(1.0, -24) * bounds[j] + 1e-45;
          ASSERT_LE(std::fabs(double{x} - double{y}), 2 * tolerance)
              << "call " << index << " rank " << g << " element " << j;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Gpus, ProcessNcclTest, ::testing::Values(GpuLayout{2, 1}, GpuLayout{2, 2}),
                         [](const ::testing::TestParamInfo<GpuLayout>& info) {
                           return absl::StrCat(info.param.processes, "Processes",
                                               info.param.per_process, "Gpus");
                         });

}  // namespace
}  // namespace losshead::kernels
