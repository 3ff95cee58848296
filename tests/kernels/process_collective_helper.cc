// One process of a process group, for process_collective_test: bootstraps its group, builds the
// collective over its CPU ranks and runs the shared call sequence (process_sequence.h), writing
// what it saw to files the test reads. Arguments are name=value:
//   rank, world, peers (comma-separated host:port), local (CPU ranks here) or cuda (the CUDA
//   device ordinals of this process's ranks, comma-separated), seed, out (path prefix), group,
//   op_timeout_ms, bootstrap_timeout_ms, and for the failure scenario
//   victim (process rank), pause_after (calls before the victim stops), marker (a file the victim
//   creates once it has stopped calling).
// Files: <out>.status holds "<code> <message>" of bootstrap and creation; <out>.results the
// results (scenario "sequence"); <out>.after, for a survivor of the failure scenario, one line
// "<code> <milliseconds>" per call made after the victim stopped.
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/cpu/cpu_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "losshead/kernels/process_group.h"
#include "tests/kernels/process_sequence.h"

namespace losshead::testing {
namespace {

int Int(const std::map<std::string, std::string>& args, const std::string& name, int otherwise) {
  auto it = args.find(name);
  int value = otherwise;
  if (it != args.end() && !absl::SimpleAtoi(it->second, &value)) std::exit(2);
  return value;
}

void WriteStatus(const std::string& path, const absl::Status& status) {
  std::ofstream(path) << static_cast<int>(status.code()) << " " << status.message() << "\n";
}

int Main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::vector<std::string> kv = absl::StrSplit(argv[i], absl::MaxSplits('=', 1));
    if (kv.size() != 2) return 2;
    args[kv[0]] = kv[1];
  }
  const std::string out = args["out"];
  kernels::ProcessGroupOptions options;
  options.rank = Int(args, "rank", 0);
  options.world = Int(args, "world", 1);
  options.peers = absl::StrSplit(args["peers"], ',');
  options.listen =
      options.peers.size() > static_cast<size_t>(options.rank) ? options.peers[options.rank] : "";
  if (args.count("group")) options.group_name = args["group"];
  options.op_timeout = absl::Milliseconds(Int(args, "op_timeout_ms", 10000));
  options.bootstrap_timeout = absl::Milliseconds(Int(args, "bootstrap_timeout_ms", 10000));
  absl::StatusOr<std::unique_ptr<kernels::ProcessGroup>> group =
      kernels::ProcessGroup::Create(options);
  if (!group.ok()) {
    WriteStatus(out + ".status", group.status());
    return 0;
  }
  std::vector<std::unique_ptr<kernels::Backend>> backends;
  std::vector<kernels::Backend*> pointers;
  std::vector<std::unique_ptr<kernels::Stream>> owned_streams;
  std::vector<kernels::Stream*> streams;
  std::vector<kernels::Backend*> devices;  // staging through device memory: CUDA ranks only
  if (args.count("cuda")) {
    for (absl::string_view ordinal : absl::StrSplit(args["cuda"], ',')) {
      int device = 0;
      if (!absl::SimpleAtoi(ordinal, &device)) return 2;
      absl::StatusOr<std::unique_ptr<kernels::Backend>> backend =
          kernels::CreateBackend(kernels::BackendKind::kCuda, device);
      if (!backend.ok()) {
        WriteStatus(out + ".status", backend.status());
        return 0;
      }
      backends.push_back(std::move(*backend));
      devices.push_back(backends.back().get());
    }
  } else {
    for (int i = 0; i < Int(args, "local", 1); ++i)
      backends.push_back(kernels::CreateCpuBackend(1));
  }
  for (std::unique_ptr<kernels::Backend>& backend : backends) {
    pointers.push_back(backend.get());
    absl::StatusOr<std::unique_ptr<kernels::Stream>> stream = backend->CreateStream();
    if (!stream.ok()) {
      WriteStatus(out + ".status", stream.status());
      return 0;
    }
    owned_streams.push_back(std::move(*stream));
    streams.push_back(owned_streams.back().get());
  }
  absl::StatusOr<std::unique_ptr<kernels::Collective>> collective =
      kernels::CreateProcessCollective(std::shared_ptr<kernels::ProcessGroup>(std::move(*group)),
                                       pointers);
  WriteStatus(out + ".status", collective.status());
  if (!collective.ok()) return 0;
  const uint64_t seed = static_cast<uint64_t>(Int(args, "seed", 1));
  if (!args.count("victim")) {
    const absl::Status written =
        WriteResults(out + ".results", RunSequence(**collective, streams, seed, devices));
    return written.ok() ? 0 : 1;
  }
  const int pause_after = Int(args, "pause_after", 2);
  SequenceResults results;
  for (int i = 0; i < pause_after; ++i) RunSequenceCall(**collective, streams, seed, i, &results);
  if (options.rank == Int(args, "victim", 0)) {
    std::ofstream(args["marker"]) << "stopped calling\n";
    sleep(120);  // the test kills or stops this process long before
    return 0;
  }
  std::ofstream after(out + ".after");
  for (int i = 0; i < 2; ++i) {
    const auto start = std::chrono::steady_clock::now();
    RunSequenceCall(**collective, streams, seed, i, &results);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - start)
                        .count();
    after << results[i].code << " " << ms << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace losshead::testing

int main(int argc, char** argv) { return losshead::testing::Main(argc, argv); }
