#include "tests/recovery/recovery_process.h"

#include <stdlib.h>

#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace losshead::testing {

std::string RecoveryTempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "losshead-recovery-XXXXXX");
  char* dir = mkdtemp(pattern.data());
  return dir == nullptr ? "" : std::string(dir);
}

std::vector<std::string> AccumulationFlags(DwAccumulation mode, int64_t vocab, int64_t hidden,
                                           int64_t tokens) {
  if (mode == DwAccumulation::kDirect) return {kBitExactFlag};
  const int64_t stash_bytes =
      (vocab + hidden) * static_cast<int64_t>(sizeof(float)) * tokens * 5 / 2;
  return {absl::StrCat("--grad_stash_bytes=", stash_bytes), "--grad_stash_idle=2ms"};
}

const char* AccumulationName(DwAccumulation mode) {
  return mode == DwAccumulation::kDirect ? "Direct" : "Deferred";
}

std::unique_ptr<client::Client> ConnectToServer(const ServerProcess& process) {
  client::ClientOptions options;
  options.deadline = absl::Seconds(30);
  options.stream_deadline = absl::Seconds(120);
  auto c = client::Client::Connect(process.target(), options);
  return c.ok() ? std::move(*c) : nullptr;
}

uint64_t HeadWorkspaceBytes(client::Client& client, const std::string& head) {
  absl::StatusOr<v1::HeadInfo> info = client.GetHead(head);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return 0;
  EXPECT_EQ(info->device_memory_size(), 1);
  return info->device_memory_size() == 1 ? info->device_memory(0).workspace_bytes() : 0;
}

RandomKills::RandomKills(uint32_t seed, int window, int max_delay_us)
    : rng_(seed), max_delay_us_(max_delay_us) {
  for (int k = 0; k < 3; ++k) at_.push_back(k * window + static_cast<int>(rng_() % window));
}

bool RandomKills::MaybeKill(ServerProcess* victim, std::thread& killer) {
  ++events_;
  if (next_ >= at_.size() || events_ <= at_[next_] || killer.joinable()) return false;
  ++next_;
  const int delay_us = static_cast<int>(rng_() % max_delay_us_);
  killer = std::thread([victim, delay_us] {
    absl::SleepFor(absl::Microseconds(delay_us));
    victim->Kill();
  });
  return true;
}

}  // namespace losshead::testing
