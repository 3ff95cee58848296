#include "client/cli/human_units.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace losshead::cli {
namespace {

// "2,038,431,744".
std::string Grouped(uint64_t n) {
  std::string digits = absl::StrCat(n);
  for (int i = static_cast<int>(digits.size()) - 3; i > 0; i -= 3) digits.insert(i, ",");
  return digits;
}

}  // namespace

std::string ShortBytes(uint64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes) / 1024;
  size_t unit = 0;
  // Compared after rounding to the decimal shown: 1023.96 KiB is "1.0 MiB".
  while (unit + 1 < std::size(kUnits) && std::round(value * 10) >= 1024 * 10) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

std::string ExactBytes(uint64_t bytes) {
  if (bytes < 1024) return ShortBytes(bytes);
  return absl::StrCat(ShortBytes(bytes), " (", Grouped(bytes), " bytes)");
}

}  // namespace losshead::cli
