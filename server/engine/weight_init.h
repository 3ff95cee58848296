// The normal init of a head's W, drawn on the host by every core.
//
// W (V x D, row-major) is cut into blocks of kNormalInitBlock elements. Block b's values come in
// order from std::normal_distribution<float>(0, std) over a std::mt19937_64 seeded with the
// std::seed_seq of (seed, b). So any whole run of blocks can be drawn on its own, by any number of
// threads, and W depends on the spec alone: never on the head's placement or the machine's cores.
// (One generator for all of W took 16-19 s for a 128256 x 4096 head and 75 s for 256000 x 8192;
// drawn this way on 16 cores, 1.6 s and 5.7 s: BENCHMARKS.md.)
#ifndef LOSSHEAD_SERVER_ENGINE_WEIGHT_INIT_H_
#define LOSSHEAD_SERVER_ENGINE_WEIGHT_INIT_H_

#include <cstdint>

#include "losshead/kernels/problem.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::server {

inline constexpr int64_t kNormalInitBlock = int64_t{1} << 20;

// Writes elements [first, first + count) of W as `dtype` into `out` (count * DTypeSize(dtype)
// bytes). `first` must be a multiple of kNormalInitBlock. The blocks are spread over up to
// `threads` threads, the calling one included. Returns false when a drawn value is not finite in
// `dtype` (a std too large for fp16's range, or for fp32's), true otherwise.
bool DrawNormalInit(const v1::NormalInit& init, kernels::DType dtype, int64_t first, int64_t count,
                    int threads, char* out);

// The threads a head's init draws on: one per hardware thread.
int NormalInitThreads();

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_WEIGHT_INIT_H_
