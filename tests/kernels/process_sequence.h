// The fixed sequence of collective calls that the cross-process suites run on every process and,
// for the reference, on one process holding every rank: the same calls on the same data, so that
// each process's results must equal, bit for bit, the reference's for its ranks. The data of call
// i on global rank g comes from (seed, i, g) alone, wherever that rank lives.
#ifndef LOSSHEAD_TESTS_KERNELS_PROCESS_SEQUENCE_H_
#define LOSSHEAD_TESTS_KERNELS_PROCESS_SEQUENCE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "losshead/kernels/collective.h"

namespace losshead::testing {

// What a call left: its status code, and each of the caller's ranks' buffer afterwards.
struct CallResult {
  int code = 0;
  std::map<int, std::vector<std::byte>> ranks;  // by global rank
};

// Results by call index.
using SequenceResults = std::map<int, CallResult>;

// The number of calls in the sequence.
int SequenceLength();

// Runs call `index` of the sequence on `collective` (its local ranks' streams given) and records
// it. With `devices` (one backend per local rank, the streams' own), the data is staged through
// memory each allocates, and read back once its stream has passed the call; without, the buffers
// are host memory (CPU ranks).
void RunSequenceCall(kernels::Collective& collective, std::vector<kernels::Stream*>& streams,
                     uint64_t seed, int index, SequenceResults* results,
                     const std::vector<kernels::Backend*>& devices = {});

// Every call of the sequence, in order.
SequenceResults RunSequence(kernels::Collective& collective, std::vector<kernels::Stream*>& streams,
                            uint64_t seed, const std::vector<kernels::Backend*>& devices = {});

// What a call reduces, for comparisons that allow another summation order: whether call `index`
// sums (AllReduce sum, ReduceScatter), and per element the sum over k ranks of |input| (which
// bounds the rounding error of any order of fp32 additions: (k - 1) 2^-24 times it).
bool SequenceCallSums(int index);
bool SequenceCallTakesMax(int index);
std::vector<double> SequenceAbsSums(uint64_t seed, int index, int k);

// A binary file of results, as the helper processes write them.
absl::Status WriteResults(const std::string& path, const SequenceResults& results);
absl::StatusOr<SequenceResults> ReadResults(const std::string& path);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_KERNELS_PROCESS_SEQUENCE_H_
