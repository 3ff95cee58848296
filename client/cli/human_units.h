// Byte counts as people read them, for the tool's human-readable output (never for anything a
// program parses). Binary units, one decimal, rounded to nearest; a count that rounds up to 1024
// of a unit is shown in the next one ("1.0 MiB", not "1024.0 KiB").
#ifndef LOSSHEAD_CLIENT_CLI_HUMAN_UNITS_H_
#define LOSSHEAD_CLIENT_CLI_HUMAN_UNITS_H_

#include <cstdint>
#include <string>

namespace losshead::cli {

// "1.9 GiB"; under 1 KiB the count itself: "512 B".
std::string ShortBytes(uint64_t bytes);

// "1.9 GiB (2,038,431,744 bytes)", for a size that must be matched exactly (a message limit);
// under 1 KiB "512 B".
std::string ExactBytes(uint64_t bytes);

}  // namespace losshead::cli

#endif  // LOSSHEAD_CLIENT_CLI_HUMAN_UNITS_H_
