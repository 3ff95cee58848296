#include "server/flags.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "losshead/kernels/process_group.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:50051",
          "gRPC listen address (host:port, port 0 picks one; or unix:PATH, a Unix socket)");
ABSL_FLAG(std::string, metrics_listen, "0.0.0.0:9464",
          "Prometheus /metrics address (host:port; empty disables it)");
ABSL_FLAG(std::string, backend, "auto", "Kernel backend: cpu, cuda or auto (cuda if available)");
ABSL_FLAG(std::string, devices, "all",
          "Devices heads go on: CUDA ordinals separated by commas, or 'all' (every visible GPU; "
          "one device with --backend=cpu, where k ordinals give k CPU devices)");
ABSL_FLAG(uint64_t, max_message_bytes, uint64_t{4} << 20,
          "Largest gRPC message either way; tensors are chunked below it");
ABSL_FLAG(uint64_t, max_microbatch_bytes, uint64_t{1} << 30,
          "Largest micro-batch (hidden + target bytes); larger ones get RESOURCE_EXHAUSTED");
ABSL_FLAG(int, worker_threads, 0, "Worker threads for micro-batches and transfers (0: per core)");
ABSL_FLAG(uint64_t, workspace_bytes, uint64_t{1} << 30, "Per-head kernel workspace budget");
ABSL_FLAG(uint64_t, grad_stash_bytes, uint64_t{4} << 30,
          "Deferred dW: device memory per head and device where counted micro-batches leave their "
          "part of dW, answered without the dW GEMM and added to dW together later (when the "
          "stash is full, the device idle, or a pull, optimizer step or checkpoint reads dW). "
          "Allocated at the first micro-batch, and given back (added to dW first) when a new head, "
          "an optimizer or a micro-batch needs its memory; 0 or a device without the "
          "memory: each micro-batch adds to dW as it runs. On every device of a replicated or "
          "sharded head");
ABSL_FLAG(absl::Duration, grad_stash_idle, absl::Milliseconds(2),
          "A device with nothing queued for this long adds its stash to dW; 'inf': only when the "
          "stash is full or dW is read (dW then has the same bits on every rerun of one stream)");
ABSL_FLAG(uint64_t, idempotency_window, 64,
          "Completed micro-batch results remembered per (head, client id) for replay");
ABSL_FLAG(uint64_t, idempotency_max_bytes, uint64_t{256} << 20,
          "Byte cap of the remembered results per (head, client id)");
ABSL_FLAG(uint64_t, idempotency_total_bytes, uint64_t{4} << 30,
          "Server-wide byte cap of the remembered results, over every head and client id: beyond "
          "it the oldest are evicted (a repeat of one is FAILED_PRECONDITION, never recomputed)");
ABSL_FLAG(absl::Duration, idempotency_ttl, absl::Hours(1),
          "Remembered results older than this are evicted (a repeat of one is "
          "FAILED_PRECONDITION, never recomputed); 'inf': kept until another bound evicts them");
ABSL_FLAG(uint64_t, max_inflight_per_stream, 4,
          "Micro-batches a Step stream may have received and not yet had answered");
ABSL_FLAG(uint64_t, max_inflight_microbatches, 1024,
          "Server-wide bound on micro-batches read and not yet answered; beyond it a micro-batch "
          "is answered RESOURCE_EXHAUSTED with a retry hint");
ABSL_FLAG(uint64_t, max_inflight_bytes, uint64_t{4} << 30,
          "Server-wide bound on the bytes held for micro-batches: requests buffered (reserved from "
          "the header) and, once computed, their answers until written; must be >= "
          "--max_microbatch_bytes. Also the most each host buffer pool (page-locked "
          "receive buffers, dH results) keeps idle for reuse");
ABSL_FLAG(absl::Duration, retry_after, absl::Milliseconds(50),
          "Retry hint sent with a micro-batch refused under backpressure");
ABSL_FLAG(absl::Duration, step_stall_timeout, absl::Seconds(15),
          "A micro-batch being received must bring one full message's payload (--max_message_bytes "
          "less 1 KiB), or its end, within each such span of waiting for it, counted from its "
          "header: messages that bring less (empty ones, small pieces) do not count. One that "
          "does not is abandoned: its admission and reserved bytes are released and its stream "
          "ends ABORTED. A client sends a micro-batch's messages back to back: 15s is more than a "
          "4 MiB message needs even at 1 MB/s, yet a stalled or trickling micro-batch holds its "
          "reservation for no longer than 15s past its last such step (a micro-batch of B bytes "
          "for at most 15s x (1 + B / 4 MiB)). 'inf' disables it; > 0");
ABSL_FLAG(absl::Duration, step_unread_timeout, absl::Seconds(15),
          "A Step stream whose answer waits this long to be written (its client does not read) "
          "is ended ABORTED and everything it holds is released: admissions, reserved bytes and "
          "the answers themselves (what was computed stays counted; a client id and sequence "
          "replay it). 'inf' disables it; > 0");
ABSL_FLAG(uint64_t, max_connections, 0,
          "Most client connections open on the TCP port; beyond it a new connection takes the "
          "place of the oldest one that has made no call, or is closed at once when all have "
          "(0: from the descriptor limit, (limit - min(1024, limit / 4)) / 2)");
ABSL_FLAG(absl::Duration, first_call_timeout, absl::Seconds(10),
          "A connection that has not made a call the server accepted (with --auth_tokens_file: a "
          "losshead call with a valid token) within this long of its accept is closed; > 0");
ABSL_FLAG(absl::Duration, max_connection_idle, absl::Minutes(15),
          "A connection without a call for this long is closed (its client reconnects at its next "
          "call); 'inf': never");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Directory of head checkpoints: restored at start, written on demand, periodically and "
          "at shutdown; empty disables checkpoints");
ABSL_FLAG(absl::Duration, checkpoint_interval, absl::Seconds(60),
          "Period of automatic checkpoints (0: only on demand and at shutdown)");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "On SIGTERM/SIGINT: how long in-flight work may take to finish");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain: serve TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA: require client certificates it signed (mTLS; needs --tls_cert)");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "'<reader|writer> <token>' lines: every RPC but health/reflection needs a bearer token");
ABSL_FLAG(absl::Duration, auth_tokens_reload_interval, absl::Seconds(10),
          "How often --auth_tokens_file is checked for a change, which reloads it (0: only on "
          "SIGHUP)");
ABSL_FLAG(std::string, metrics_basic_auth_file, "",
          "One 'user:password' line: /metrics needs HTTP basic auth");
ABSL_FLAG(uint64_t, max_heads, 64, "Most heads on the server; CreateHead beyond is refused");
ABSL_FLAG(uint64_t, max_head_bytes, uint64_t{16} << 30,
          "Largest W + dW bytes of one head; CreateHead beyond is refused");
ABSL_FLAG(uint64_t, unapplied_window_warn_microbatches, 10000,
          "Log a warning, once per window, when a head with a server-side optimizer holds more "
          "than this many micro-batches in its gradient window without an optimizer apply, pull "
          "with reset or discard (a training loop that never steps the head); 0: never");
ABSL_FLAG(std::string, step_trace, "",
          "Append one JSON line per answered micro-batch, with the time of each phase, to this "
          "file (empty: none)");

ABSL_FLAG(std::string, group_peers, "",
          "A head replicated across server processes: every process's collective endpoint, "
          "host:port separated by commas, by rank, or a pattern with {} for the rank (with "
          "--group_size); empty: one process");
ABSL_FLAG(int, group_size, 0, "Processes of the group when --group_peers is a {} pattern");
ABSL_FLAG(int, group_rank, -1,
          "This process's rank in the group (-1: the ordinal its host name ends in, as a "
          "StatefulSet's pods are named)");
ABSL_FLAG(std::string, group_listen, "",
          "Where this process listens for its peers (empty: every address, on the port of its own "
          "entry of --group_peers)");
ABSL_FLAG(absl::Duration, group_bootstrap_timeout, absl::Seconds(120),
          "How long the group may take to form at start; a process whose group does not form "
          "exits");
ABSL_FLAG(absl::Duration, group_op_timeout, absl::Seconds(60),
          "How long a peer may take to do its part of a cut before the group is broken");
ABSL_FLAG(std::string, group_secret_file, "",
          "A file holding the secret every process of the group must hold (at least 16 bytes): "
          "checked when the group's connections form, and the processes' credential to each "
          "other on ProcessControl (needed for periodic checkpoint sets with --auth_tokens_file); "
          "empty: none");
ABSL_FLAG(bool, group_mesh_encryption, false,
          "Seal what the group's processes move between each other over their own connections "
          "(dW sums, pushed W, a sharded head's tensors) with AES-256-GCM under keys derived from "
          "--group_secret_file (needed), fresh for every connection: neither read nor altered on "
          "the network unnoticed; every process of the group must agree. NCCL's traffic is not "
          "covered");
ABSL_FLAG(std::string, group_tls_root_ca, "",
          "With --tls_cert in a group: the PEM CA that signed the processes' certificates, which "
          "they verify each other with (empty: --tls_client_ca)");
ABSL_FLAG(bool, same_node, true,
          "Offer the same-node path: clients on this host move hidden states, targets and dH "
          "through shared memory, with only control messages on gRPC (docs/same-node.md)");

namespace losshead::server {
namespace {

// The compiler names this file by the path it was given: "../server/flags.cc" from a build
// directory, or an absolute one.
constexpr absl::string_view kFlagsFile = "server/flags.cc";

std::string FromRepositoryRoot(absl::string_view path) {
  const size_t at = path.rfind(kFlagsFile);
  return std::string(at == absl::string_view::npos ? path : path.substr(at));
}

}  // namespace

void ConfigureFlagsUsage() {
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = [](absl::string_view file) {
    return absl::EndsWith(file, kFlagsFile);
  };
  config.contains_help_flags = config.contains_helpshort_flags;
  config.normalize_filename = FromRepositoryRoot;
  absl::SetFlagsUsageConfig(config);
}

absl::StatusOr<ServerOptions> OptionsFromFlags() {
  ServerOptions o;
  o.listen_address = absl::GetFlag(FLAGS_listen);
  o.metrics_address = absl::GetFlag(FLAGS_metrics_listen);
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend == "cpu") {
    o.backend = kernels::BackendKind::kCpu;
  } else if (backend == "cuda") {
    o.backend = kernels::BackendKind::kCuda;
  } else if (backend == "auto") {
    o.backend = kernels::BackendKind::kAuto;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend must be cpu, cuda or auto, got '", backend, "'"));
  }
  const std::string devices = absl::GetFlag(FLAGS_devices);
  if (devices != "all") {
    for (absl::string_view part : absl::StrSplit(devices, ',')) {
      int ordinal = -1;
      if (!absl::SimpleAtoi(part, &ordinal) || ordinal < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--devices must be 'all' or device ordinals separated by commas, got '", devices, "'"));
      }
      o.devices.push_back(ordinal);
    }
  }
  o.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  o.max_microbatch_bytes = absl::GetFlag(FLAGS_max_microbatch_bytes);
  o.worker_threads = absl::GetFlag(FLAGS_worker_threads);
  o.workspace_bytes = absl::GetFlag(FLAGS_workspace_bytes);
  o.grad_stash_bytes = absl::GetFlag(FLAGS_grad_stash_bytes);
  o.grad_stash_idle = absl::GetFlag(FLAGS_grad_stash_idle);
  if (o.grad_stash_idle <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--grad_stash_idle must be > 0 ('inf' for never)");
  }
  o.idempotency_window = absl::GetFlag(FLAGS_idempotency_window);
  o.idempotency_max_bytes = absl::GetFlag(FLAGS_idempotency_max_bytes);
  o.idempotency_total_bytes = absl::GetFlag(FLAGS_idempotency_total_bytes);
  o.idempotency_ttl = absl::GetFlag(FLAGS_idempotency_ttl);
  if (o.idempotency_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--idempotency_ttl must be > 0 ('inf' for none)");
  }
  o.max_inflight_per_stream = absl::GetFlag(FLAGS_max_inflight_per_stream);
  o.drain_timeout = absl::GetFlag(FLAGS_drain_timeout);
  o.max_connections = absl::GetFlag(FLAGS_max_connections);
  o.first_call_timeout = absl::GetFlag(FLAGS_first_call_timeout);
  if (o.first_call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--first_call_timeout must be > 0");
  }
  o.max_connection_idle = absl::GetFlag(FLAGS_max_connection_idle);
  if (o.max_connection_idle <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--max_connection_idle must be > 0 ('inf' for never)");
  }
  o.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  o.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  o.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca);
  o.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  o.auth_tokens_reload_interval = absl::GetFlag(FLAGS_auth_tokens_reload_interval);
  if (o.auth_tokens_reload_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--auth_tokens_reload_interval must be >= 0");
  }
  o.metrics_basic_auth_file = absl::GetFlag(FLAGS_metrics_basic_auth_file);
  o.max_heads = absl::GetFlag(FLAGS_max_heads);
  o.max_head_bytes = absl::GetFlag(FLAGS_max_head_bytes);
  o.step_trace_file = absl::GetFlag(FLAGS_step_trace);
  o.same_node = absl::GetFlag(FLAGS_same_node);
  o.unapplied_window_warn_microbatches = absl::GetFlag(FLAGS_unapplied_window_warn_microbatches);
  o.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  o.checkpoint_interval = absl::GetFlag(FLAGS_checkpoint_interval);
  if (o.checkpoint_interval < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--checkpoint_interval must be >= 0");
  }
  o.max_inflight_microbatches = absl::GetFlag(FLAGS_max_inflight_microbatches);
  o.max_inflight_bytes = absl::GetFlag(FLAGS_max_inflight_bytes);
  o.retry_after = absl::GetFlag(FLAGS_retry_after);
  if (o.max_inflight_microbatches == 0 || o.max_inflight_bytes < o.max_microbatch_bytes) {
    // A micro-batch larger than the whole byte bound could never be admitted: clients would
    // retry it forever.
    return absl::InvalidArgumentError(
        "--max_inflight_microbatches must be >= 1 and --max_inflight_bytes >= "
        "--max_microbatch_bytes");
  }
  if (o.retry_after < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--retry_after must be >= 0");
  }
  o.step_stall_timeout = absl::GetFlag(FLAGS_step_stall_timeout);
  if (o.step_stall_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--step_stall_timeout must be > 0 (inf disables it)");
  }
  o.step_unread_timeout = absl::GetFlag(FLAGS_step_unread_timeout);
  if (o.step_unread_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--step_unread_timeout must be > 0 (inf disables it)");
  }
  if (o.max_message_bytes < 4096) {
    return absl::InvalidArgumentError("--max_message_bytes must be >= 4096");
  }
  if (o.max_microbatch_bytes == 0 || o.max_inflight_per_stream == 0) {
    return absl::InvalidArgumentError(
        "--max_microbatch_bytes and --max_inflight_per_stream must be >= 1");
  }
  if (o.drain_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--drain_timeout must be >= 0");
  }
  const std::string peers = absl::GetFlag(FLAGS_group_peers);
  const int group_size = absl::GetFlag(FLAGS_group_size);
  if (absl::StrContains(peers, "{}")) {
    absl::StatusOr<std::vector<std::string>> expanded =
        kernels::ExpandPeerPattern(peers, group_size);
    if (!expanded.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--group_peers='", peers,
                                                     "' with --group_size=", group_size, ": ",
                                                     expanded.status().message()));
    }
    o.group_peers = *std::move(expanded);
  } else if (!peers.empty()) {
    o.group_peers = absl::StrSplit(peers, ',');
    if (group_size != 0 && group_size != static_cast<int>(o.group_peers.size())) {
      return absl::InvalidArgumentError(absl::StrCat("--group_size=", group_size,
                                                     " but --group_peers lists ",
                                                     o.group_peers.size(), " processes"));
    }
  }
  o.group_rank = absl::GetFlag(FLAGS_group_rank);
  o.group_listen = absl::GetFlag(FLAGS_group_listen);
  o.group_bootstrap_timeout = absl::GetFlag(FLAGS_group_bootstrap_timeout);
  o.group_op_timeout = absl::GetFlag(FLAGS_group_op_timeout);
  o.group_secret_file = absl::GetFlag(FLAGS_group_secret_file);
  o.group_mesh_encryption = absl::GetFlag(FLAGS_group_mesh_encryption);
  o.group_tls_root_ca_file = absl::GetFlag(FLAGS_group_tls_root_ca);
  if (o.group_bootstrap_timeout <= absl::ZeroDuration() ||
      o.group_op_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "--group_bootstrap_timeout and --group_op_timeout must be > 0");
  }
  return o;
}

}  // namespace losshead::server
