// Small administrative subcommands: create, list, delete, stats, health, progress.
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "client/cli/command_line.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "client/cli/human_units.h"

namespace losshead::cli {
namespace {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "error: %s\n", status.ToString().c_str());
  return 1;
}

// "high" for MATMUL_PRECISION_HIGH; unset reads as what it means, highest.
std::string PrecisionName(v1::MatmulPrecision precision) {
  if (precision == v1::MATMUL_PRECISION_UNSPECIFIED) precision = v1::MATMUL_PRECISION_HIGHEST;
  constexpr absl::string_view kPrefix = "MATMUL_PRECISION_";
  return absl::AsciiStrToLower(absl::StripPrefix(v1::MatmulPrecision_Name(precision), kPrefix));
}

void PrintHead(const v1::HeadInfo& h) {
  // Only an fp32 head has a precision to choose: the others' lines stay as they were.
  std::string dtype = v1::DType_Name(h.spec().weight_dtype()).substr(6);
  if (h.spec().weight_dtype() == v1::DTYPE_FP32) {
    absl::StrAppend(&dtype, " matmul_precision=", PrecisionName(h.spec().matmul_precision()));
  }
  if (h.spec().bias()) absl::StrAppend(&dtype, " bias");
  std::printf(
      "%-24s V=%-8lld D=%-6lld %-5s version=%llu tokens_since_pull=%llu "
      "microbatches_since_pull=%llu tokens_total=%llu weights %s, gradient %s, workspace %s; "
      "devices=%s\n",
      h.spec().name().c_str(), static_cast<long long>(h.spec().vocab_size()),
      static_cast<long long>(h.spec().hidden_size()), dtype.c_str(),
      static_cast<unsigned long long>(h.weights_version()),
      static_cast<unsigned long long>(h.tokens_since_pull()),
      static_cast<unsigned long long>(h.microbatches_since_pull()),
      static_cast<unsigned long long>(h.tokens_total()),
      ShortBytes(h.memory().weights_bytes()).c_str(),
      ShortBytes(h.memory().gradient_bytes()).c_str(),
      ShortBytes(h.memory().workspace_bytes()).c_str(), absl::StrJoin(h.devices(), ", ").c_str());
  if (h.devices_size() < 2) return;
  const char* part = h.spec().placement().kind() == v1::PLACEMENT_SHARDED ? "shard" : "replica";
  for (int i = 0; i < h.device_memory_size() && i < h.devices_size(); ++i) {
    const v1::HeadMemory& m = h.device_memory(i);
    std::printf(
        "  %s %d on %s: weights %s, gradient %s, workspace %s, master weights %s, optimizer "
        "state %s\n",
        part, i, h.devices(i).c_str(), ShortBytes(m.weights_bytes()).c_str(),
        ShortBytes(m.gradient_bytes()).c_str(), ShortBytes(m.workspace_bytes()).c_str(),
        ShortBytes(m.master_weights_bytes()).c_str(),
        ShortBytes(m.optimizer_state_bytes()).c_str());
  }
}

}  // namespace

absl::StatusOr<v1::DType> WeightDTypeFromFlags() {
  const std::string name = absl::GetFlag(FLAGS_weight_dtype);
  if (name == "bf16") return v1::DTYPE_BF16;
  if (name == "fp16") return v1::DTYPE_FP16;
  if (name == "fp32") return v1::DTYPE_FP32;
  return absl::InvalidArgumentError("--weight_dtype must be bf16, fp16 or fp32");
}

absl::StatusOr<v1::MatmulPrecision> MatmulPrecisionFromFlags() {
  const std::string name = absl::GetFlag(FLAGS_matmul_precision);
  if (name.empty()) return v1::MATMUL_PRECISION_UNSPECIFIED;
  if (name == "highest") return v1::MATMUL_PRECISION_HIGHEST;
  if (name == "high") return v1::MATMUL_PRECISION_HIGH;
  if (name == "medium") return v1::MATMUL_PRECISION_MEDIUM;
  return absl::InvalidArgumentError(absl::StrCat(
      "--matmul_precision must be highest, high or medium (or empty: unset), got '", name, "'"));
}

std::string DescribeNumerics(const v1::HeadSpec& spec) {
  std::string dtype = absl::AsciiStrToLower(v1::DType_Name(spec.weight_dtype()).substr(6));
  if (spec.weight_dtype() != v1::DTYPE_FP32) return dtype;
  return absl::StrCat(dtype, " (matmul precision ", PrecisionName(spec.matmul_precision()), ")");
}

absl::StatusOr<v1::Placement> PlacementFromFlags() {
  v1::Placement placement;
  const int replicas = absl::GetFlag(FLAGS_replicas);
  std::optional<int> shards = absl::GetFlag(FLAGS_shards);
  if (replicas < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--replicas must be >= 0 (0: every device), got ", replicas));
  }
  if (shards == -1) shards = 0;  // the deprecated spelling of every device
  if (shards.has_value() && *shards < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--shards must be >= 0 (0: every device; unset: not sharded), got ", *shards));
  }
  if (shards.has_value()) {
    if (replicas != 1) {
      return absl::InvalidArgumentError("--shards and --replicas cannot both be given");
    }
    placement.set_kind(v1::PLACEMENT_SHARDED);
    placement.set_devices(static_cast<uint32_t>(*shards));  // 0: every device
    placement.set_across_processes(absl::GetFlag(FLAGS_across_processes));
  } else if (absl::GetFlag(FLAGS_across_processes)) {
    return absl::InvalidArgumentError("--across_processes needs --shards");
  } else if (replicas != 1) {
    placement.set_kind(v1::PLACEMENT_REPLICATED);
    placement.set_devices(static_cast<uint32_t>(replicas));
  }
  return placement;
}

int RunCreate() {
  // 0 means zeros, so a negative or NaN std must not quietly become a zero head.
  const double init_std = absl::GetFlag(FLAGS_init_std);
  if (!(init_std >= 0) || !std::isfinite(init_std)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--init_std must be finite and >= 0 (0: zeros), got ", init_std)));
  }
  absl::StatusOr<v1::DType> dtype = WeightDTypeFromFlags();
  if (!dtype.ok()) return Fail(dtype.status());
  absl::StatusOr<v1::MatmulPrecision> precision = MatmulPrecisionFromFlags();
  if (!precision.ok()) return Fail(precision.status());
  absl::StatusOr<v1::Placement> placement = PlacementFromFlags();
  if (!placement.ok()) return Fail(placement.status());
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  v1::HeadSpec spec;
  spec.set_name(absl::GetFlag(FLAGS_head));
  spec.set_vocab_size(SizeFlag(FLAGS_vocab_size, "create"));
  spec.set_hidden_size(SizeFlag(FLAGS_hidden_size, "create"));
  spec.set_weight_dtype(*dtype);
  spec.set_matmul_precision(*precision);
  spec.set_bias(absl::GetFlag(FLAGS_bias));
  *spec.mutable_placement() = *placement;
  if (init_std > 0) {
    spec.mutable_init()->mutable_normal()->set_std(static_cast<float>(init_std));
    spec.mutable_init()->mutable_normal()->set_seed(absl::GetFlag(FLAGS_seed));
  } else {
    spec.mutable_init()->set_zeros(true);
  }
  auto info = (*client)->CreateHead(spec);
  if (!info.ok()) return Fail(info.status());
  PrintHead(*info);
  return 0;
}

int RunList() {
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  auto heads = (*client)->ListHeads();
  if (!heads.ok()) return Fail(heads.status());
  for (const v1::HeadInfo& h : *heads) PrintHead(h);
  return 0;
}

int RunDelete() {
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  absl::Status status = (*client)->DeleteHead(absl::GetFlag(FLAGS_head));
  if (!status.ok()) return Fail(status);
  std::printf("deleted %s\n", absl::GetFlag(FLAGS_head).c_str());
  return 0;
}

int RunStats() {
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  auto stats = (*client)->GetStats();
  if (!stats.ok()) return Fail(stats.status());
  const v1::Stats& s = *stats;
  std::printf(
      "version %s, backend %s (%s), memory free %s / %s, uptime %.1f s, in flight %llu, max "
      "message %s\n",
      s.version().c_str(), s.device().backend().c_str(), s.device().name().c_str(),
      ShortBytes(s.device().memory_free_bytes()).c_str(),
      ShortBytes(s.device().memory_total_bytes()).c_str(), s.uptime_seconds(),
      static_cast<unsigned long long>(s.inflight_microbatches()),
      ExactBytes(s.max_message_bytes()).c_str());
  // The line above shows the first device; a server of several lists each.
  if (s.devices_size() > 1) {
    for (int i = 0; i < s.devices_size(); ++i) {
      const v1::DeviceStats& d = s.devices(i);
      std::printf("  device %d: %s, memory free %s / %s\n", i, d.name().c_str(),
                  ShortBytes(d.memory_free_bytes()).c_str(),
                  ShortBytes(d.memory_total_bytes()).c_str());
    }
  }
  for (const v1::HeadInfo& h : s.heads()) PrintHead(h);
  return 0;
}

int RunHealth() {
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  auto status = (*client)->Health();
  if (!status.ok()) return Fail(status.status());
  constexpr const char* kNames[] = {"UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"};
  std::printf("%s\n", kNames[static_cast<int>(*status)]);
  return *status == client::ServingStatus::kServing ? 0 : 1;
}

int RunProgress() {
  const std::string head = absl::GetFlag(FLAGS_head);
  const std::string client_id = absl::GetFlag(FLAGS_client_id);
  if (head.empty() || client_id.empty()) {
    return Fail(absl::InvalidArgumentError("progress needs --head and --client_id"));
  }
  auto client = ConnectFromFlags();
  if (!client.ok()) return Fail(client.status());
  auto progress = (*client)->GetClientProgress(head, client_id);
  if (!progress.ok()) return Fail(progress.status());
  // "none": nothing of the client id applied (acknowledged) or in the last checkpoint (persisted).
  auto show = [](bool has, uint64_t v) { return has ? absl::StrCat(v) : std::string("none"); };
  std::printf(
      "head=%s client_id=%s acknowledged=%s persisted=%s\n", head.c_str(), client_id.c_str(),
      show(progress->has_acknowledged_sequence(), progress->acknowledged_sequence()).c_str(),
      show(progress->has_persisted_sequence(), progress->persisted_sequence()).c_str());
  return 0;
}

}  // namespace losshead::cli
