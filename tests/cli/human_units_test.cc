// The byte counts the tool prints, at the edges of each unit.
#include "client/cli/human_units.h"

#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace losshead::cli {
namespace {

TEST(ShortBytes, BelowOneKibibyteIsTheCount) {
  EXPECT_EQ(ShortBytes(0), "0 B");
  EXPECT_EQ(ShortBytes(1), "1 B");
  EXPECT_EQ(ShortBytes(1023), "1023 B");
}

TEST(ShortBytes, OneDecimalOfTheLargestUnitBelow1024) {
  EXPECT_EQ(ShortBytes(1024), "1.0 KiB");
  EXPECT_EQ(ShortBytes(1536), "1.5 KiB");
  EXPECT_EQ(ShortBytes(1075), "1.0 KiB");  // 1.0498 KiB rounds down
  EXPECT_EQ(ShortBytes(1076), "1.1 KiB");  // 1.0508 KiB rounds up
  EXPECT_EQ(ShortBytes(uint64_t{1} << 20), "1.0 MiB");
  EXPECT_EQ(ShortBytes(uint64_t{4} << 20), "4.0 MiB");
  EXPECT_EQ(ShortBytes(2038431744), "1.9 GiB");
  EXPECT_EQ(ShortBytes(uint64_t{1} << 40), "1.0 TiB");
  EXPECT_EQ(ShortBytes(uint64_t{1} << 50), "1.0 PiB");
  EXPECT_EQ(ShortBytes(uint64_t{1} << 60), "1.0 EiB");
}

TEST(ShortBytes, WhatRoundsTo1024OfAUnitIsOneOfTheNext) {
  EXPECT_EQ(ShortBytes(1048524), "1023.9 KiB");  // 1023.949 KiB
  EXPECT_EQ(ShortBytes(1048525), "1.0 MiB");     // 1023.950 KiB would print 1024.0
  EXPECT_EQ(ShortBytes((uint64_t{1} << 20) - 1), "1.0 MiB");
  EXPECT_EQ(ShortBytes((uint64_t{1} << 30) - 1), "1.0 GiB");
  EXPECT_EQ(ShortBytes(std::numeric_limits<uint64_t>::max()), "16.0 EiB");
}

TEST(ExactBytes, AddsTheGroupedCountFromOneKibibyte) {
  EXPECT_EQ(ExactBytes(0), "0 B");
  EXPECT_EQ(ExactBytes(1023), "1023 B");
  EXPECT_EQ(ExactBytes(1024), "1.0 KiB (1,024 bytes)");
  EXPECT_EQ(ExactBytes(999999), "976.6 KiB (999,999 bytes)");
  EXPECT_EQ(ExactBytes(uint64_t{4} << 20), "4.0 MiB (4,194,304 bytes)");
  EXPECT_EQ(ExactBytes(2038431744), "1.9 GiB (2,038,431,744 bytes)");
  EXPECT_EQ(ExactBytes(std::numeric_limits<uint64_t>::max()),
            "16.0 EiB (18,446,744,073,709,551,615 bytes)");
}

}  // namespace
}  // namespace losshead::cli
