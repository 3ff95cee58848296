// The fuzzer's input format, shared by the target and the seed writer: a sequence of records,
// each a 2-byte little-endian length and that many bytes, parsed as one StepRequest. A record
// that does not parse ends the current stream (as a broken connection would).
#ifndef LOSSHEAD_TESTS_FUZZ_STEP_FUZZ_FORMAT_H_
#define LOSSHEAD_TESTS_FUZZ_STEP_FUZZ_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace losshead::fuzz {

inline void AppendRecord(std::string& out, const std::string& message) {
  const size_t n = message.size() > 0xffff ? 0xffff : message.size();
  out.push_back(static_cast<char>(n & 0xff));
  out.push_back(static_cast<char>(n >> 8));
  out.append(message, 0, n);
}

}  // namespace losshead::fuzz

#endif  // LOSSHEAD_TESTS_FUZZ_STEP_FUZZ_FORMAT_H_
