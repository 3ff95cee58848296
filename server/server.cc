#include "server/server.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/durability/checkpointer.h"
#include "server/durability/group_checkpoint.h"
#include "server/durability/group_snapshots.h"
#include "server/engine/head_registry.h"
#include "server/engine/idempotency_budget.h"
#include "server/engine/pinned_pool.h"
#include "server/engine/process_window.h"
#include "server/engine/result_pool.h"
#include "server/engine/thread_pool.h"
#include "server/observability/metrics.h"
#include "server/observability/metrics_endpoint.h"
#include "server/observability/step_trace.h"
#include "server/rpc/connection_guard.h"
#include "server/rpc/control_service.h"
#include "server/rpc/group_control.h"
#include "server/rpc/group_watch.h"
#include "server/rpc/live_calls.h"
#include "server/rpc/same_node_listener.h"
#include "server/rpc/service.h"
#include "server/rpc/service_context.h"
#include "server/rpc/shared_regions.h"
#include "server/security/file_watcher.h"
#include "server/security/security.h"
#include "transport/channel_args.h"
#include "transport/fd_socket.h"

namespace losshead::server {
namespace {

constexpr char kServiceName[] = "losshead.v1.LossHead";
// How long connections left open at shutdown, once no call of ours runs, may stay before they
// are closed (see Shutdown); never past the caller's deadline.
constexpr absl::Duration kConnectionGrace = absl::Milliseconds(500);
// Keepalive pings without data a client may send (see the channel arguments in Init).
constexpr absl::Duration kMinPingInterval = absl::Seconds(10);
constexpr int kMaxStreamsPerConnection = 1000;
// The exit code of a process of a group with checkpoints whose group broke (a peer died, stopped
// or left): its supervisor restarts it, and every process restores the last checkpoint set.
constexpr int kExitGroupBroken = 3;
// How often such a process probes its peers (GroupWatch).
constexpr absl::Duration kGroupWatchInterval = absl::Seconds(1);

// A duration as a channel argument: milliseconds, at most INT_MAX.
int MillisecondsArg(absl::Duration d) {
  return static_cast<int>(
      std::clamp<int64_t>(absl::ToInt64Milliseconds(d), 1, std::numeric_limits<int>::max()));
}

// Checkpoint writes and restores as metrics (the age, duration, size and failures of checkpoints).
CheckpointObserver CheckpointMetrics(Metrics* metrics) {
  return [metrics](const CheckpointEvent& e) {
    switch (e.kind) {
      case CheckpointEvent::Kind::kWritten:
        metrics->CheckpointWritten(e.head, e.bytes, e.duration, e.persisted_at);
        break;
      case CheckpointEvent::Kind::kFailed:
        metrics->CheckpointFailed(e.head, e.duration);
        break;
      case CheckpointEvent::Kind::kRestored:
        metrics->CheckpointRestored(e.head, e.bytes, e.persisted_at);
        break;
    }
  };
}

// The port of a "host:port" address (0 when it has none).
int PortOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) return 0;
  return port;
}

// The host of a "host:port" address.
std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

// The gRPC address clients and peers reach each process at, by rank: each process's peer host
// with its own gRPC port, gathered from every process.
absl::StatusOr<std::vector<std::string>> GatherAddresses(kernels::ProcessGroup& group,
                                                         const std::string& mine) {
  constexpr size_t kAddressBytes = 256;
  if (mine.size() >= kAddressBytes) {
    return absl::InvalidArgumentError(absl::StrCat("address '", mine, "' is too long"));
  }
  std::vector<std::byte> padded(kAddressBytes, std::byte{0});
  std::memcpy(padded.data(), mine.data(), mine.size());
  absl::StatusOr<std::vector<std::vector<std::byte>>> all =
      group.AllGather("the processes' gRPC addresses", padded);
  if (!all.ok()) return all.status();
  std::vector<std::string> addresses;
  for (const std::vector<std::byte>& bytes : *all) {
    const char* text = reinterpret_cast<const char*>(bytes.data());
    addresses.emplace_back(text, strnlen(text, bytes.size()));
  }
  return addresses;
}

SecurityOptions SecurityOf(const ServerOptions& options) {
  return SecurityOptions{.tls_cert_file = options.tls_cert_file,
                         .tls_key_file = options.tls_key_file,
                         .tls_client_ca_file = options.tls_client_ca_file,
                         .auth_tokens_file = options.auth_tokens_file,
                         .metrics_basic_auth_file = options.metrics_basic_auth_file,
                         .group = !options.group_peers.empty(),
                         .group_secret_file = options.group_secret_file,
                         .group_tls_root_ca_file = options.group_tls_root_ca_file,
                         .group_mesh_encryption = options.group_mesh_encryption};
}

class ServerImpl final : public Server {
 public:
  explicit ServerImpl(const ServerOptions& options) : options_(options) {}
  ~ServerImpl() override {
    Shutdown(absl::ZeroDuration());
    Wait();
  }

  absl::Status Init() {
    metrics_ = std::make_unique<Metrics>();
    // Stamped before it is read, so that a change while the server starts is reloaded.
    const FileStamp tokens_stamp = StampOf(options_.auth_tokens_file);
    // Security files first: a server that cannot enforce what it was told to must not start.
    absl::StatusOr<ServerSecurity> security =
        LoadServerSecurity(SecurityOf(options_), metrics_.get());
    if (!security.ok()) return security.status();
    security_ = std::move(*security);
    if (!options_.step_trace_file.empty()) {
      absl::StatusOr<std::unique_ptr<StepTrace>> trace = StepTrace::Open(options_.step_trace_file);
      if (!trace.ok()) return trace.status();
      step_trace_ = std::move(*trace);
      ctx_.step_trace = step_trace_.get();
    }
    auto backends = kernels::CreateBackends(options_.backend, options_.devices);
    if (!backends.ok()) return backends.status();
    backends_ = std::move(*backends);
    std::vector<kernels::Backend*> devices;
    for (const auto& backend : backends_) devices.push_back(backend.get());
    pool_ = std::make_unique<ThreadPool>(options_.worker_threads);
    // Host buffers for every head's dH, kept for reuse while up to --max_inflight_bytes of them
    // are idle: the dH of as many micro-batches as admission lets in at once. A result allocated
    // afresh (64 MiB for 8192 x 4096 bf16) costs 16,384 page faults; with 256 MiB kept per head,
    // half of the results of 32 streams were allocated afresh (BENCHMARKS.md).
    auto results = std::make_shared<ResultPool>(options_.max_inflight_bytes);
    ctx_.results = results;
    // Remembered results over every head: bounded in bytes and age. Results past the ttl also leave
    // an idle server, within a tenth of the ttl (at least every second, at most every minute).
    auto remembered = std::make_shared<IdempotencyBudget>(IdempotencyBudget::Limits{
        .total_bytes = options_.idempotency_total_bytes, .ttl = options_.idempotency_ttl});
    if (options_.idempotency_ttl != absl::InfiniteDuration()) {
      remembered->StartExpiry(
          std::clamp(options_.idempotency_ttl / 10, absl::Seconds(1), absl::Minutes(1)));
    }
    ctx_.remembered = remembered;
    if (!options_.group_peers.empty()) {
      if (absl::Status formed = FormGroup(); !formed.ok()) {
        return absl::Status(formed.code(),
                            absl::StrCat("the process group did not form: ", formed.message()));
      }
    }
    registry_ = std::make_unique<HeadRegistry>(
        devices,
        HeadOptions{.workspace_budget_bytes = options_.workspace_bytes,
                    .idempotency_window = options_.idempotency_window,
                    .idempotency_max_bytes_per_client = options_.idempotency_max_bytes,
                    .idempotency_budget = remembered,
                    .grad_stash_bytes = options_.grad_stash_bytes,
                    .grad_stash_idle = options_.grad_stash_idle,
                    .results = results,
                    .window_warn_microbatches = options_.unapplied_window_warn_microbatches,
                    .process_window = process_window_},
        HeadLimits{.max_heads = options_.max_heads, .max_head_bytes = options_.max_head_bytes});
    metrics_->BuildInfo(LOSSHEAD_VERSION, std::string(backends_.front()->name()),
                        LOSSHEAD_CUDA_VERSION);
    if (!options_.checkpoint_dir.empty() && group_control_ != nullptr) {
      // One global cut per set, each process its part (server/durability/group_checkpoint.h):
      // the processes agree on the leader's newest set and restore it, or all fail to start.
      checkpoint_sets_ = std::make_unique<CheckpointSets>(
          options_.checkpoint_dir, group_control_->rank(), group_control_->size(), registry_.get(),
          CheckpointMetrics(metrics_.get()));
      const absl::Time restore_start = absl::Now();
      absl::StatusOr<uint64_t> restored = RestoreAgreedSet(*process_group_, *checkpoint_sets_);
      if (!restored.ok()) return restored.status();
      metrics_->CheckpointRestoreDuration(absl::Now() - restore_start);
      metrics_->CheckpointInterval(options_.checkpoint_interval);
      group_control_->EnableCheckpoints(checkpoint_sets_.get(), *restored);
      // Named snapshots of one head, each process's part beside its sets.
      group_snapshots_ = std::make_unique<GroupSnapshots>(
          options_.checkpoint_dir, group_control_->rank(), group_control_->size(), registry_.get(),
          CheckpointMetrics(metrics_.get()));
      group_control_->EnableSnapshots(group_snapshots_.get());
      std::fprintf(stderr, "losshead-server: checkpoint set %llu restored on every process%s\n",
                   static_cast<unsigned long long>(*restored),
                   *restored == 0 ? " (none: a fresh start)" : "");
    } else if (!options_.checkpoint_dir.empty()) {
      checkpointer_ = std::make_unique<Checkpointer>(options_.checkpoint_dir, registry_.get(),
                                                     CheckpointMetrics(metrics_.get()));
      // Every head is back before the port is bound, so health (and a readiness probe) can only
      // say SERVING for a server that holds all of its checkpointed heads.
      const absl::Time restore_start = absl::Now();
      absl::Status restored = checkpointer_->RestoreAll();
      if (!restored.ok()) return restored;
      metrics_->CheckpointRestoreDuration(absl::Now() - restore_start);
      metrics_->CheckpointInterval(options_.checkpoint_interval);
      ctx_.checkpointer = checkpointer_.get();
    }
    ctx_.devices = devices;
    for (size_t i = 0; i < devices.size(); ++i) {
      metrics_->DeviceBusy(DeviceLabel(*devices[i], i), absl::ZeroDuration());  // present from 0
    }
    {
      // Page-locked memory for micro-batches being received (portable: any device copies from
      // it at the bus rate). Admission bounds the bytes in use (--max_inflight_bytes); idle
      // buffers are kept up to the same bound, so that the pool ends up holding what the busiest
      // moment needed and stops allocating. Page-locking a 64 MiB buffer and freeing it again
      // costs more than the micro-batch's copy: with 1 GiB kept, a quarter of the micro-batches
      // of 32 streams allocated one (BENCHMARKS.md).
      kernels::Backend* backend_ptr = backends_.front().get();
      ctx_.pinned = PinnedPool::Create(
          [backend_ptr](size_t bytes) { return backend_ptr->AllocateHost(bytes); },
          options_.max_inflight_bytes);
    }
    ctx_.registry = registry_.get();
    ctx_.pool = pool_.get();
    ctx_.metrics = metrics_.get();
    ctx_.tokens = security_.tokens.get();
    if (security_.tokens != nullptr) metrics_->AuthTokens(security_.tokens->Current()->size());
    if (options_.same_node) {
      // Device regions open on the CUDA devices the server computes on (none: refused).
      std::vector<int> cuda_devices;
      for (const auto& backend : backends_) {
        if (backend->name() == "cuda") cuda_devices.push_back(backend->device_ordinal());
      }
      shared_regions_ = std::make_unique<SharedRegions>(DescribeIpcDevices(cuda_devices));
      auto listener = SameNodeListener::Start(shared_regions_.get(), security_.tokens.get());
      if (listener.ok()) {
        same_node_ = std::move(*listener);
        ctx_.shared_regions = shared_regions_.get();
        ctx_.same_node_socket = same_node_->socket_name();
        ctx_.host_id = transport::HostId();
      } else {
        // The network path serves everyone; only the shortcut is missing.
        std::fprintf(stderr, "losshead-server: no same-node path: %s\n",
                     listener.status().ToString().c_str());
      }
    }
    ctx_.max_message_bytes = options_.max_message_bytes;
    ctx_.max_microbatch_bytes = options_.max_microbatch_bytes;
    ctx_.max_inflight_per_stream = std::max<size_t>(1, options_.max_inflight_per_stream);
    admission_ = std::make_unique<Admission>(
        std::max<size_t>(1, options_.max_inflight_microbatches), options_.max_inflight_bytes,
        options_.retry_after, options_.step_stall_timeout, options_.step_unread_timeout);
    ctx_.admission = admission_.get();
    ctx_.start_time = absl::Now();
    service_ = std::make_unique<LossHeadService>(&ctx_);
    service_->RefreshMemoryMetrics();

    if (!options_.metrics_address.empty()) {
      const LossHeadService* service = service_.get();
      const Metrics* metrics = metrics_.get();
      auto endpoint = MetricsEndpoint::Start(
          options_.metrics_address,
          [service, metrics] {
            // Device memory gauges are read on demand so that every scrape sees current values.
            service->RefreshMemoryMetrics();
            return metrics->RenderText();
          },
          security_.metrics_basic_auth);
      if (!endpoint.ok()) return endpoint.status();
      metrics_endpoint_ = std::move(*endpoint);
      metrics_port_ = metrics_endpoint_->port();
    }

    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
        interceptors;
    interceptors.push_back(live_calls_.CountingFactory());
    if (absl::StartsWith(options_.listen_address, "unix:") ||
        absl::StartsWith(options_.listen_address, "unix-abstract:")) {
      builder.AddListeningPort(options_.listen_address, security_.credentials, &port_);
    } else {
      // TCP: the guard accepts, bounds and reaps the connections (connection_guard.h).
      const size_t descriptors = DescriptorLimit();
      const size_t max_connections = options_.max_connections != 0
                                         ? options_.max_connections
                                         : DefaultMaxConnections(descriptors);
      auto guard = ConnectionGuard::Listen(
          options_.listen_address,
          ConnectionGuard::Options{.max_connections = max_connections,
                                   .first_call_timeout = options_.first_call_timeout,
                                   .tokens_required = security_.tokens != nullptr},
          metrics_.get());
      if (!guard.ok()) return guard.status();
      connection_guard_ = std::move(*guard);
      port_ = connection_guard_->port();
      interceptors.push_back(connection_guard_->AddTo(builder, security_.credentials));
      std::fprintf(stderr,
                   "losshead-server: at most %zu client connections (descriptor limit %zu)\n",
                   max_connections, descriptors);
    }
    // The rest of the connection limits, gRPC's own: a handshake (TLS, the HTTP/2 preface and
    // settings) must end within the first-call timeout; a connection without calls is closed
    // after max_connection_idle (a long Step stream is a call: its connection is never idle);
    // pings without data are allowed every 10 s (clients that keep connections alive through a
    // proxy ping every 20-60 s), and a peer pinging faster is told to go away at the second
    // offence. Streams per connection are bounded; a client needs a handful (one Step stream and
    // its unary calls per connection in this project's clients). There is no maximum connection
    // age: it would end long Step streams.
    builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                               MillisecondsArg(options_.first_call_timeout));
    if (options_.max_connection_idle != absl::InfiniteDuration()) {
      builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                                 MillisecondsArg(options_.max_connection_idle));
    }
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                               MillisecondsArg(kMinPingInterval));
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, kMaxStreamsPerConnection);
    const int max_message = static_cast<int>(
        std::min<size_t>(options_.max_message_bytes, std::numeric_limits<int>::max()));
    builder.SetMaxReceiveMessageSize(max_message);
    builder.SetMaxSendMessageSize(max_message);
    // Without this, Linux lets a second server bind the same port and silently share traffic.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    if (!security_.tls) {  // see transport/channel_args.h for why not with TLS
      for (const auto& [key, value] : transport::kTensorTransportArgs) {
        builder.AddChannelArgument(key, value);
      }
    }
    builder.RegisterService(service_.get());
    if (group_control_ != nullptr) {
      control_service_ = std::make_unique<ProcessControlService>(&ctx_);
      builder.RegisterService(control_service_.get());
    }
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port_ == 0) {
      server_.reset();
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options_.listen_address));
    }
    if (connection_guard_ != nullptr) connection_guard_->Start();
    if (auto* health = server_->GetHealthCheckService()) {
      health->SetServingStatus(true);
      health->SetServingStatus(kServiceName, true);
    }
    if (checkpointer_ != nullptr) checkpointer_->StartPeriodic(options_.checkpoint_interval);
    if (checkpoint_sets_ != nullptr) StartGroupCheckpoints();
    if (security_.tokens != nullptr &&
        options_.auth_tokens_reload_interval > absl::ZeroDuration()) {
      token_watcher_ = std::make_unique<FileWatcher>(
          options_.auth_tokens_file, tokens_stamp, options_.auth_tokens_reload_interval,
          [this] { ReloadTokens().IgnoreError(); });  // logged and counted by ReloadTokens
    }
    return absl::OkStatus();
  }

  // The group of --group_peers: bootstrapped (every process at once), the gRPC addresses
  // exchanged, the cross-process window sum created (a collective call), the control plane set.
  absl::Status FormGroup() {
    if (absl::StartsWith(options_.listen_address, "unix")) {
      return absl::InvalidArgumentError(
          "a process of a group needs a TCP --listen address: its peers and clients reach it "
          "there");
    }
    const int port = PortOf(options_.listen_address);
    if (port == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a process of a group needs a fixed --listen port (its peers are told it), got '",
          options_.listen_address, "'"));
    }
    if (!options_.checkpoint_dir.empty() && !options_.auth_tokens_file.empty() &&
        options_.checkpoint_interval > absl::ZeroDuration() && security_.group_secret == nullptr) {
      return absl::InvalidArgumentError(
          "periodic checkpoint sets of a group whose processes require tokens need "
          "--group_secret_file (the leader's credential to its followers; it has no client's "
          "token to send them): give one, or pass --checkpoint_interval=0 and call Checkpoint");
    }
    kernels::ProcessGroupOptions group;
    group.rank = options_.group_rank;
    if (group.rank < 0) {
      char host[256] = {};
      gethostname(host, sizeof(host) - 1);
      absl::StatusOr<int> rank = kernels::RankFromHostname(host);
      if (!rank.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--group_rank is not given and ", rank.status().message()));
      }
      group.rank = *rank;
    }
    group.world = static_cast<int>(options_.group_peers.size());
    group.peers = options_.group_peers;
    group.listen = options_.group_listen;
    group.bootstrap_timeout = options_.group_bootstrap_timeout;
    group.op_timeout = options_.group_op_timeout;
    if (security_.group_secret != nullptr) group.secret = security_.group_secret->secret();
    group.encrypt = options_.group_mesh_encryption;
    absl::StatusOr<std::unique_ptr<kernels::ProcessGroup>> created =
        kernels::ProcessGroup::Create(group);
    if (!created.ok()) return created.status();
    std::shared_ptr<kernels::ProcessGroup> formed = std::move(*created);
    process_group_ = formed;
    if (group.rank >= group.world) return absl::InvalidArgumentError("rank outside the group");
    absl::StatusOr<std::vector<std::string>> addresses =
        GatherAddresses(*formed, absl::StrCat(HostOf(options_.group_peers[group.rank]), ":", port));
    if (!addresses.ok()) return addresses.status();
    if (absl::Status agreed = AgreeOnCheckpoints(*formed, !options_.checkpoint_dir.empty());
        !agreed.ok()) {
      return agreed;
    }
    absl::StatusOr<std::shared_ptr<ProcessWindow>> window = ProcessWindow::Create(formed);
    if (!window.ok()) return window.status();
    process_window_ = *window;
    group_control_ = std::make_unique<GroupControl>(process_window_, *addresses,
                                                    options_.group_op_timeout, &ctx_);
    // Its peers are reached as its clients reach it (TLS when it serves TLS), and with a group
    // secret each ProcessControl call carries the group's credential rather than a client's token.
    group_control_->SetPeerSecurity(
        security_.group_channel,
        security_.group_secret != nullptr ? security_.group_secret->authorization() : "");
    ctx_.group_secret = security_.group_secret.get();
    ctx_.group = group_control_.get();
    std::fprintf(stderr, "losshead-server: process %d of a group of %d (leader: %s; mesh %s)\n",
                 group.rank, group.world, (*addresses)[0].c_str(),
                 group.encrypt ? "sealed, AES-256-GCM" : "in the clear");
    return absl::OkStatus();
  }

  // With checkpoints in a group: the leader's periodic sets, and every process's watch, which
  // ends the process when its group breaks (the set then restarts from the last complete set).
  void StartGroupCheckpoints() {
    if (group_control_->leader() && options_.checkpoint_interval > absl::ZeroDuration()) {
      group_periodic_stop_ = std::make_unique<absl::Notification>();
      group_periodic_ = std::thread(
          [this, stop = group_periodic_stop_.get(), interval = options_.checkpoint_interval] {
            while (!stop->WaitForNotificationWithTimeout(interval)) {
              absl::StatusOr<v1::CheckpointResponse> written =
                  group_control_->Checkpoint("", /*authorization=*/"");
              if (!written.ok()) {
                std::fprintf(stderr, "losshead-server: periodic checkpoint failed: %s\n",
                             written.status().ToString().c_str());
              }
            }
          });
    }
    group_watch_ = std::make_unique<GroupWatch>(
        // Every process serves moments after the last one restored its part (the restore ends in
        // an exchange), so a peer not serving within the op timeout is as good as gone.
        group_control_.get(), kGroupWatchInterval, options_.group_op_timeout,
        options_.group_op_timeout, [](const absl::Status& reason) {
          std::fprintf(stderr,
                       "losshead-server: the process group is broken (%s): exiting (code %d) so "
                       "that every process restarts from the last complete checkpoint set\n",
                       reason.ToString().c_str(), kExitGroupBroken);
          std::fflush(stderr);
          std::_Exit(kExitGroupBroken);
        });
  }

  int port() const override { return port_; }
  int metrics_port() const override { return metrics_port_; }
  std::vector<const kernels::Backend*> devices() const override {
    return {ctx_.devices.begin(), ctx_.devices.end()};
  }

  absl::Status ReloadTokens() override {
    if (security_.tokens == nullptr) {
      return absl::FailedPreconditionError(
          "the server was started without --auth_tokens_file; there are no tokens to reload");
    }
    // One reload at a time (SIGHUP and the watcher may coincide): the file read last wins.
    absl::MutexLock lock(&reload_mu_);
    absl::StatusOr<size_t> count =
        ::losshead::server::ReloadTokens(options_.auth_tokens_file, *security_.tokens);
    metrics_->TokenReload(count.ok(), count.value_or(security_.tokens->Current()->size()));
    if (count.ok()) {
      std::fprintf(stderr, "losshead-server: token file reloaded (%zu tokens)\n", *count);
    } else {
      std::fprintf(stderr, "losshead-server: token file not reloaded (tokens unchanged): %s\n",
                   count.status().ToString().c_str());
    }
    return count.status();
  }

  void Shutdown(absl::Duration deadline) override {
    {
      absl::MutexLock lock(&mu_);
      if (shutting_down_) return;
      shutting_down_ = true;
    }
    token_watcher_.reset();
    // A process of a group leaving breaks the group: its peers' watches end them, unless they
    // stop too (the final set below, once every process is stopping).
    group_watch_.reset();
    if (group_periodic_.joinable()) {
      group_periodic_stop_->Notify();
      group_periodic_.join();
    }
    if (server_ != nullptr) {
      // Probes first, so that load balancers stop sending before calls are refused.
      if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus(false);
      const absl::Time until = absl::Now() + deadline;
      // From here new calls are answered UNAVAILABLE; Step streams stop reading and finish once
      // the micro-batches they hold are answered. gRPC keeps serving meanwhile, so those answers
      // and the refusals travel on a healthy transport.
      ctx_.draining.store(true);
      ctx_.streams.DrainAll();
      ctx_.streams.WaitUntilNone(until);
      live_calls_.WaitUntilNone(until);
      if (checkpoint_sets_ != nullptr) {
        // A group with checkpoints: the final set, once every process has drained (Leave), while
        // the gRPC port still serves the leader's requests; a process stopping alone takes none.
        const absl::Status final_set = group_control_->Leave(until);
        if (final_set.ok()) {
          std::fprintf(stderr, "losshead-server: final checkpoint set taken on every process\n");
        } else {
          std::fprintf(stderr, "losshead-server: no final checkpoint set: %s\n",
                       final_set.ToString().c_str());
        }
      }
      // Nothing of ours runs any more (or the deadline passed): gRPC refuses new calls and sends
      // every connection its GOAWAY; gRPC clients hang up at once. After a short grace, it cancels
      // what still runs (health watches, reflection, calls past the deadline) and closes the
      // connections that stayed, rather than waiting for their clients to hang up. The grace lets
      // a finished call's last bytes, still in the socket buffers, reach its client: closing a
      // socket with unread input resets it, and the peer's kernel drops what it had not read.
      if (connection_guard_ != nullptr) connection_guard_->StopAccepting();
      server_->Shutdown(absl::ToChronoTime(std::min(until, absl::Now() + kConnectionGrace)));
    }
    if (pool_ != nullptr) pool_->Shutdown();
    if (checkpointer_ != nullptr && server_ != nullptr) {
      // After the drain: every micro-batch that was answered is in the final checkpoint.
      checkpointer_->StopPeriodic();
      absl::StatusOr<v1::CheckpointResponse> written = checkpointer_->Write("");
      if (!written.ok()) {
        std::fprintf(stderr, "losshead-server: final checkpoint failed: %s\n",
                     written.status().ToString().c_str());
      }
    }
    metrics_endpoint_.reset();
    stopped_.Notify();
  }

  void Wait() override { stopped_.WaitForNotification(); }

 private:
  const ServerOptions options_;
  ServerSecurity security_;
  std::vector<std::unique_ptr<kernels::Backend>> backends_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<HeadRegistry> registry_;
  std::unique_ptr<Checkpointer> checkpointer_;
  // With --group_peers: the cross-process window sum and the control plane (null otherwise).
  std::shared_ptr<ProcessWindow> process_window_;
  std::unique_ptr<GroupControl> group_control_;
  std::shared_ptr<kernels::ProcessGroup> process_group_;
  // With --group_peers and --checkpoint_dir (checkpointer_ stays null then).
  std::unique_ptr<CheckpointSets> checkpoint_sets_;
  std::unique_ptr<GroupSnapshots> group_snapshots_;  // beside checkpoint_sets_
  std::unique_ptr<absl::Notification> group_periodic_stop_;
  std::thread group_periodic_;
  std::unique_ptr<GroupWatch> group_watch_;
  std::unique_ptr<ProcessControlService> control_service_;
  std::unique_ptr<Admission> admission_;
  std::unique_ptr<StepTrace> step_trace_;
  // Outlive the gRPC server (calls resolve regions); the listener goes first, unregistering.
  std::unique_ptr<SharedRegions> shared_regions_;
  std::unique_ptr<SameNodeListener> same_node_;
  LiveCalls live_calls_;
  absl::Mutex reload_mu_;
  ServiceContext ctx_;
  std::unique_ptr<LossHeadService> service_;
  std::unique_ptr<MetricsEndpoint> metrics_endpoint_;
  // Before server_: it outlives the calls whose interceptor factory it is.
  std::unique_ptr<ConnectionGuard> connection_guard_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  int metrics_port_ = 0;
  // After what its thread uses (ReloadTokens), so that it is destroyed, its thread joined, first.
  std::unique_ptr<FileWatcher> token_watcher_;
  absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Notification stopped_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  auto server = std::make_unique<ServerImpl>(options);
  absl::Status status = server->Init();
  if (!status.ok()) return status;
  return server;
}

}  // namespace losshead::server
