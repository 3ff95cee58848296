// losshead-server as a library: start a gRPC server (and its metrics endpoint) in this process.
#ifndef LOSSHEAD_SERVER_SERVER_H_
#define LOSSHEAD_SERVER_SERVER_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "losshead/kernels/backend.h"

namespace losshead::server {

struct ServerOptions {
  // host:port; port 0 picks a free one (see Server::port()).
  std::string listen_address = "0.0.0.0:50051";
  // host:port of the Prometheus /metrics endpoint; empty disables it; port 0 picks a free one.
  std::string metrics_address = "0.0.0.0:9464";
  kernels::BackendKind backend = kernels::BackendKind::kAuto;
  // The devices heads go on (CUDA ordinals); empty: every visible GPU, or one CPU device. A CPU
  // backend given k ordinals has k CPU devices (placements without a GPU).
  std::vector<int> devices;
  // Largest gRPC message either way; tensors are chunked below it.
  size_t max_message_bytes = size_t{4} << 20;
  // Threads that run micro-batches (0: one per hardware thread, at least 2).
  int worker_threads = 0;
  // Per-head workspace budget handed to Backend::WorkspaceBytes.
  size_t workspace_bytes = size_t{1} << 30;
  // Deferred dW: each device's gradient stash per head (0: off), and how long a device must be
  // idle before its stash is added to dW (see HeadOptions; infinite: only when full and at cuts).
  size_t grad_stash_bytes = size_t{4} << 30;
  absl::Duration grad_stash_idle = absl::Milliseconds(2);
  // Results remembered per (head, client id) for idempotent replay.
  size_t idempotency_window = 64;
  // ... and at most this many bytes of them (dH + per-token losses) per (head, client id); the
  // newest result is always kept. See server/engine/idempotency_cache.h.
  size_t idempotency_max_bytes = size_t{256} << 20;
  // Server-wide, over every head and client id: at most this many bytes of remembered results
  // (the oldest leave first), and none older than the ttl (server/engine/idempotency_budget.h).
  size_t idempotency_total_bytes = size_t{4} << 30;
  absl::Duration idempotency_ttl = absl::Hours(1);
  // A micro-batch whose hidden + target bytes exceed this is answered RESOURCE_EXHAUSTED.
  size_t max_microbatch_bytes = size_t{1} << 30;
  // Micro-batches one Step stream may have received and not yet had answered (pipelining depth).
  size_t max_inflight_per_stream = 4;
  // Server-wide backpressure: micro-batches admitted (header read, not yet answered) and the
  // bytes reserved for them: their requests, then, once computed, their answers until written.
  // Beyond either bound a micro-batch is answered RESOURCE_EXHAUSTED with retry_after_ms =
  // `retry_after` and the stream goes on. Bytes are reserved from the header's announced size
  // before they are buffered.
  size_t max_inflight_microbatches = 1024;
  size_t max_inflight_bytes = size_t{4} << 30;
  absl::Duration retry_after = absl::Milliseconds(50);
  // A micro-batch being received that makes no progress for this long while the server waits for
  // it (no message bringing another full message's payload, or its end: server/rpc/step_reactor.h)
  // is abandoned: its admission and reserved bytes are released and its stream ends ABORTED
  // (after the micro-batches it had fully sent are answered). Infinite: never.
  absl::Duration step_stall_timeout = absl::Seconds(15);
  // A Step stream whose answer waits this long to be written (its client does not read) is ended
  // ABORTED and its admissions are released; infinite: never.
  absl::Duration step_unread_timeout = absl::Seconds(15);
  // Checkpoints (server/durability/checkpointer.h): the directory (empty disables them), restored
  // at start, written every `checkpoint_interval` (0: only on demand and at shutdown) and after
  // the drain.
  std::string checkpoint_dir;
  absl::Duration checkpoint_interval = absl::Seconds(60);
  // Client connections on a TCP listen address (server/rpc/connection_guard.h): at most this many
  // open (0: DefaultMaxConnections of the descriptor limit at Start); one that has not made a
  // call the server accepted within `first_call_timeout` of its accept is closed, and so is the
  // oldest such one when a new connection needs its place. Connections with no call for
  // `max_connection_idle` are closed by gRPC (infinite: never).
  size_t max_connections = 0;
  absl::Duration first_call_timeout = absl::Seconds(10);
  absl::Duration max_connection_idle = absl::Minutes(15);
  // Bound on the wait for in-flight work at shutdown.
  absl::Duration drain_timeout = absl::Seconds(30);
  // Security (server/security/security.h, server/security/auth.h); the files are read at Start,
  // the token file again on Server::ReloadTokens (SIGHUP for losshead-server).
  // TLS with this PEM certificate chain and key; both empty: plaintext.
  std::string tls_cert_file;
  std::string tls_key_file;
  // With a CA: clients must present a certificate it signed (mTLS).
  std::string tls_client_ca_file;
  // `<role> <token>` lines; every RPC but health and reflection then needs a bearer token.
  std::string auth_tokens_file;
  // How often the token file is checked for a change (inode, size, modification time), which
  // reloads it as ReloadTokens does; 0: only on ReloadTokens (SIGHUP).
  absl::Duration auth_tokens_reload_interval = absl::Seconds(10);
  // One `user:password` line; /metrics then needs HTTP basic auth.
  std::string metrics_basic_auth_file;
  // CreateHead limits: heads on the server (RESOURCE_EXHAUSTED beyond) and W + dW bytes of one
  // head (INVALID_ARGUMENT beyond), checked before anything is allocated.
  size_t max_heads = 64;
  uint64_t max_head_bytes = uint64_t{16} << 30;
  // A head with a server-side optimizer whose gradient window passes this many micro-batches
  // without a cut is logged once per window (HeadOptions); 0: never.
  uint64_t unapplied_window_warn_microbatches = 10000;
  // A file to append one JSON line per answered micro-batch to, with the time of each of its
  // phases (server/observability/step_trace.h); empty: none.
  std::string step_trace_file;
  // A head replicated across server processes (docs/multi-process.md): the collective endpoint
  // ("host:port") of every process, by rank; empty: a server of one process. This process is
  // `group_rank` (-1: the ordinal its host name ends in, as a StatefulSet's pods are named),
  // listens for its peers on `group_listen` (empty: every address, on its own peer's port), waits
  // up to `group_bootstrap_timeout` for the group to form before it serves (Start fails
  // otherwise), and gives a peer `group_op_timeout` to do its part of a cut.
  std::vector<std::string> group_peers;
  int group_rank = -1;
  std::string group_listen;
  absl::Duration group_bootstrap_timeout = absl::Seconds(120);
  absl::Duration group_op_timeout = absl::Seconds(60);
  // Security between the processes of a group (docs/multi-process.md, "Security between
  // processes"): the secret every process must hold to join the group's mesh, and whose derived
  // credential the processes present to each other on ProcessControl (empty: none); the CA that
  // signed the processes' TLS certificates, to verify each other when they serve TLS (empty:
  // tls_client_ca_file).
  std::string group_secret_file;
  std::string group_tls_root_ca_file;
  // Seal the group's mesh (kernels/process_group.h, "encrypt"): needs group_secret_file, and every
  // process of the group must agree.
  bool group_mesh_encryption = false;
  // The same-node path (docs/same-node.md): clients on this host may register shared memory
  // regions on a Unix socket and step through them; Stats.same_node advertises it. Off: Stats
  // has no same_node and a header naming shared memory is FAILED_PRECONDITION.
  bool same_node = true;
};

class Server {
 public:
  virtual ~Server() = default;

  // Builds the backends, binds both ports and starts serving. Errors: the backend's status
  // (UNAVAILABLE for CUDA without a device), UNAVAILABLE when a port cannot be bound,
  // LoadServerSecurity's error for a bad TLS, token or basic-auth file, or the error opening
  // step_trace_file, or the group's when it does not form (with group_peers: DEADLINE_EXCEEDED
  // naming the processes that never came, FAILED_PRECONDITION for a peer of another group or
  // size, INVALID_ARGUMENT for options a group cannot take) (nothing is started then).
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);

  virtual int port() const = 0;          // the bound gRPC port
  virtual int metrics_port() const = 0;  // the bound metrics port, 0 when disabled
  // The server's devices, in --devices order (at least one).
  virtual std::vector<const kernels::Backend*> devices() const = 0;

  // Re-reads auth_tokens_file: calls that start afterwards are checked against the new tokens.
  // On error (NOT_FOUND, PERMISSION_DENIED, INVALID_ARGUMENT with the line number) the tokens in
  // force stay as they were. FAILED_PRECONDITION when the server was started without a token file
  // (authentication cannot be turned on while running). Logged to stderr and counted in
  // losshead_auth_token_reloads_total{result}.
  virtual absl::Status ReloadTokens() = 0;

  // Graceful stop: health turns NOT_SERVING, new calls are refused, in-flight micro-batches finish
  // and are answered, all within `deadline`; then the server stops. Idempotent.
  virtual void Shutdown(absl::Duration deadline) = 0;
  // Blocks until the server has stopped.
  virtual void Wait() = 0;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_SERVER_H_
