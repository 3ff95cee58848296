// Channel setup and the unary head-management calls.
#include "losshead/client/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "absl/strings/str_cat.h"
#include "channel_security.h"
#include "losshead/client/status.h"
#include "transport/channel_args.h"
#include "transport/fd_socket.h"

namespace losshead::client {

namespace {

constexpr int kInitialReconnectBackoffMs = 100;

}  // namespace

size_t PieceBytes(size_t max_message_bytes, size_t overhead) {
  // Each bytes field costs a tag and a length varint, each scalar a few bytes: 64 covers them.
  constexpr size_t kSlack = 64;
  if (max_message_bytes <= overhead + kSlack + 1) return 1;
  return max_message_bytes - overhead - kSlack;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target,
                                                        const ClientOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("empty server target");
  const size_t receive_bytes = options.max_receive_message_bytes != 0
                                   ? options.max_receive_message_bytes
                                   : options.max_message_bytes;
  constexpr size_t kMaxMessage = static_cast<size_t>(std::numeric_limits<int>::max());
  if (options.max_message_bytes < 1024 || options.max_message_bytes > kMaxMessage ||
      receive_bytes < 1024 || receive_bytes > kMaxMessage) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes and max_receive_message_bytes must be in [1024, 2^31): ",
                     options.max_message_bytes, ", ", options.max_receive_message_bytes));
  }
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(static_cast<int>(options.max_message_bytes));
  args.SetMaxReceiveMessageSize(static_cast<int>(receive_bytes));
  if (options.dedicated_connection) args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // After a failed connection attempt the channel tries again only after its reconnect backoff,
  // and until then every call fails at once with UNAVAILABLE. gRPC's first backoff (1 s) is longer
  // than the retry policy's waits together (50 + 100 + 200 + 400 ms by default), so one failed
  // attempt failed calls that the retries should have carried: a server still starting, or a
  // spurious failure of gRPC 1.51's connect, which reports an errno clobbered after connect()
  // (ENOENT; seen in up to a third of `losshead bench` runs opening 8-32 connections at once on
  // loopback). With 100 ms the retries find the channel connected again.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kInitialReconnectBackoffMs);
  if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
  // Plaintext only: see transport/channel_args.h for why not with TLS.
  if (options.credentials == nullptr && !internal::WantsTls(options)) {
    for (const auto& tuning : transport::kTensorTransportArgs) {
      const bool overridden =
          std::any_of(options.channel_args.begin(), options.channel_args.end(),
                      [&](const auto& arg) { return arg.first == tuning.first; });
      if (!overridden) args.SetInt(tuning.first, tuning.second);
    }
  }
  for (const auto& [key, value] : options.channel_args) args.SetInt(key, value);
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
      internal::ChannelCredentialsFor(options);
  if (!credentials.ok()) return credentials.status();
  auto channel = grpc::CreateCustomChannel(target, *credentials, args);
  if (channel == nullptr) return absl::InternalError("could not create a gRPC channel");
  return std::unique_ptr<Client>(new Client(std::move(channel), options));
}

Client::Client(std::shared_ptr<grpc::Channel> channel, const ClientOptions& options)
    : channel_(std::move(channel)),
      stub_(v1::LossHead::NewStub(channel_)),
      options_(options),
      bearer_token_(options.bearer_token) {}

Client::~Client() { CloseIdleStreams(); }

void Client::SetBearerToken(std::string token) {
  {
    absl::MutexLock lock(&token_mu_);
    bearer_token_ = std::move(token);
  }
  // A kept stream carries the old token: the next steps open theirs with the new one.
  CloseIdleStreams();
}

std::unique_ptr<grpc::ClientContext> Client::NewContext(absl::Duration deadline) const {
  auto context = std::make_unique<grpc::ClientContext>();
  // Per call rather than as call credentials: gRPC sends call credentials only over TLS, and a
  // token on a plaintext loopback or proxied connection is a supported setup.
  {
    absl::MutexLock lock(&token_mu_);
    if (!bearer_token_.empty()) context->AddMetadata("authorization", "Bearer " + bearer_token_);
  }
  for (const auto& [key, value] : options_.metadata) context->AddMetadata(key, value);
  if (deadline != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  }
  return context;
}

absl::Status Client::WaitForReady(absl::Duration timeout) {
  if (channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::OkStatus();
  }
  return absl::DeadlineExceededError("server not reachable within the timeout");
}

absl::StatusOr<v1::HeadInfo> Client::CreateHeadOnce(const v1::HeadSpec& spec) {
  v1::CreateHeadRequest request;
  *request.mutable_spec() = spec;
  v1::HeadInfo info;
  auto context = NewContext(options_.deadline);
  grpc::Status status = stub_->CreateHead(context.get(), request, &info);
  if (!status.ok()) return FromGrpcStatus(status);
  return info;
}

absl::StatusOr<v1::HeadInfo> Client::GetHeadOnce(const std::string& name) {
  v1::GetHeadRequest request;
  request.set_name(name);
  v1::HeadInfo info;
  auto context = NewContext(options_.deadline);
  grpc::Status status = stub_->GetHead(context.get(), request, &info);
  if (!status.ok()) return FromGrpcStatus(status);
  return info;
}

absl::StatusOr<std::vector<v1::HeadInfo>> Client::ListHeadsOnce() {
  v1::ListHeadsResponse response;
  auto context = NewContext(options_.deadline);
  grpc::Status status = stub_->ListHeads(context.get(), v1::ListHeadsRequest(), &response);
  if (!status.ok()) return FromGrpcStatus(status);
  return std::vector<v1::HeadInfo>(response.heads().begin(), response.heads().end());
}

absl::Status Client::DeleteHeadOnce(const std::string& name) {
  v1::DeleteHeadRequest request;
  request.set_name(name);
  v1::DeleteHeadResponse response;
  auto context = NewContext(options_.deadline);
  return FromGrpcStatus(stub_->DeleteHead(context.get(), request, &response));
}

absl::StatusOr<v1::HeadInfo> Client::SetLossOptionsOnce(const std::string& name,
                                                        const v1::LossOptions& default_options) {
  v1::SetLossOptionsRequest request;
  request.set_name(name);
  *request.mutable_default_options() = default_options;
  v1::HeadInfo info;
  auto context = NewContext(options_.deadline);
  grpc::Status status = stub_->SetLossOptions(context.get(), request, &info);
  if (!status.ok()) return FromGrpcStatus(status);
  return info;
}

absl::StatusOr<v1::Stats> Client::GetStatsOnce() {
  v1::Stats stats;
  auto context = NewContext(options_.deadline);
  grpc::Status status = stub_->GetStats(context.get(), v1::GetStatsRequest(), &stats);
  if (!status.ok()) return FromGrpcStatus(status);
  return stats;
}

std::shared_ptr<const SameNodeLink> Client::SameNode() {
  if (!options_.same_node) return nullptr;
  std::string socket;
  {
    absl::MutexLock lock(&same_node_mu_);
    if (!same_node_probed_) {
      absl::StatusOr<v1::Stats> stats = GetStatsOnce();
      if (stats.ok()) {
        same_node_probed_ = true;
        // The same boot id: the same kernel, so a memfd can travel between the processes. The
        // socket may still be out of reach (another network namespace): registering then fails
        // and the stream stays on the network path.
        const std::string here = transport::HostId();
        if (stats->has_same_node() && !here.empty() && stats->same_node().host_id() == here) {
          same_node_socket_ = stats->same_node().socket();
          for (const v1::SameNodeDevice& d : stats->same_node().devices()) {
            same_node_devices_.push_back({d.index(), d.pci_bus_id()});
          }
        }
      }
    }
    socket = same_node_socket_;
  }
  if (socket.empty()) return nullptr;
  auto link = std::make_shared<SameNodeLink>();
  link->socket = std::move(socket);
  absl::MutexLock lock(&token_mu_);
  if (!bearer_token_.empty()) link->authorization = "Bearer " + bearer_token_;
  return link;
}

std::string Client::data_path() { return SameNode() != nullptr ? "shared_memory" : "network"; }

std::vector<SameNodeDevice> Client::SameNodeDevices() {
  if (SameNode() == nullptr) return {};
  absl::MutexLock lock(&same_node_mu_);
  return same_node_devices_;
}

absl::StatusOr<std::shared_ptr<DeviceRegion>> Client::RegisterDeviceRegion(
    std::string_view ipc_handle, uint64_t offset, uint64_t bytes, const std::string& pci_bus_id) {
  std::shared_ptr<const SameNodeLink> link = SameNode();
  if (link == nullptr) {
    return absl::FailedPreconditionError(
        "no same-node path to this server (another host, --same_node=false on either side, or "
        "GetStats failed)");
  }
  return DeviceRegion::Register(link->socket, link->authorization, ipc_handle, offset, bytes,
                                pci_bus_id);
}

absl::StatusOr<std::unique_ptr<StepStream>> Client::OpenStepStream() {
  return std::make_unique<StepStream>(NewContext(options_.stream_deadline), channel_.get(),
                                      options_.max_message_bytes, SameNode());
}

absl::StatusOr<std::unique_ptr<StepStream>> Client::TakeStepStream() {
  {
    absl::MutexLock lock(&streams_mu_);
    while (!idle_streams_.empty()) {
      std::unique_ptr<StepStream> stream = std::move(idle_streams_.back());
      idle_streams_.pop_back();
      // Ended while idle (server drained or restarted, connection lost): not worth an attempt.
      if (!stream->ended()) return stream;
    }
  }
  return OpenStepStream();
}

void Client::ReturnStepStream(std::unique_ptr<StepStream> stream) {
  // More idle streams than this are more than any caller keeps busy at once.
  constexpr size_t kMaxIdleStreams = 16;
  if (options_.stream_deadline == absl::InfiniteDuration() && stream->outstanding() == 0 &&
      !stream->ended()) {
    absl::MutexLock lock(&streams_mu_);
    if (idle_streams_.size() < kMaxIdleStreams) {
      idle_streams_.push_back(std::move(stream));
      return;
    }
  }
  stream->Finish().IgnoreError();
}

void Client::CloseIdleStreams() {
  std::vector<std::unique_ptr<StepStream>> idle;
  {
    absl::MutexLock lock(&streams_mu_);
    idle.swap(idle_streams_);
  }
  // A short grace: a server that does not answer the half-close is cancelled instead.
  for (auto& stream : idle) stream->Close(absl::Seconds(1));
}

absl::StatusOr<StepResult> Client::StepOnce(const Microbatch& microbatch) {
  auto stream = TakeStepStream();
  if (!stream.ok()) return stream.status();
  absl::Status sent = (*stream)->Send(microbatch);
  if (!sent.ok()) return sent;
  absl::StatusOr<StepResult> result = (*stream)->Receive();
  // A per-micro-batch error is the interesting status; the call's own comes second (a stream
  // that ended unexpectedly answers the micro-batch with the call's status).
  if (!result.ok()) {
    if (IsMicrobatchError(result.status())) ReturnStepStream(std::move(*stream));
    return result.status();
  }
  ReturnStepStream(std::move(*stream));
  return result;
}

}  // namespace losshead::client
