#include "tests/service/test_server.h"

#include "absl/strings/str_cat.h"

namespace losshead::testing {

server::ServerOptions TestServer::Options(size_t max_message_bytes, bool metrics) {
  server::ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = metrics ? "127.0.0.1:0" : "";
  options.backend = kernels::BackendKind::kCpu;
  options.max_message_bytes = max_message_bytes;
  options.worker_threads = 2;
  options.workspace_bytes = size_t{64} << 20;
  return options;
}

absl::StatusOr<std::unique_ptr<TestServer>> TestServer::Start(size_t max_message_bytes,
                                                              bool metrics) {
  return StartWith(Options(max_message_bytes, metrics));
}

absl::StatusOr<std::unique_ptr<TestServer>> TestServer::StartWith(
    const server::ServerOptions& options) {
  auto server = server::Server::Start(options);
  if (!server.ok()) return server.status();
  auto test_server = std::unique_ptr<TestServer>(new TestServer());
  test_server->server_ = std::move(*server);
  test_server->max_message_bytes_ = options.max_message_bytes;
  return test_server;
}

TestServer::~TestServer() {
  if (server_ != nullptr) {
    server_->Shutdown(absl::Seconds(5));
    server_->Wait();
  }
}

std::string TestServer::target() const { return absl::StrCat("127.0.0.1:", server_->port()); }

std::unique_ptr<client::Client> TestServer::NewClient(size_t max_message_bytes,
                                                      bool same_node) const {
  client::ClientOptions options;
  options.same_node = same_node;
  options.max_message_bytes = max_message_bytes > 0 ? max_message_bytes : max_message_bytes_;
  options.deadline = absl::Seconds(30);
  options.stream_deadline = absl::Seconds(60);
  auto c = client::Client::Connect(target(), options);
  return c.ok() ? std::move(*c) : nullptr;
}

absl::StatusOr<KnownHead> CreateKnownHead(client::Client& client, const std::string& name,
                                          int64_t v, int64_t d, v1::DType dtype, uint64_t seed,
                                          double std, const v1::Placement& placement) {
  KnownHead head{.name = name, .v = v, .d = d, .dtype = dtype};
  v1::HeadSpec spec;
  spec.set_name(name);
  spec.set_vocab_size(v);
  spec.set_hidden_size(d);
  spec.set_weight_dtype(dtype);
  *spec.mutable_placement() = placement;
  auto info = client.CreateHead(spec);
  if (!info.ok()) return info.status();
  head.weight = RandomValues(static_cast<size_t>(v * d), std, dtype, seed);
  const client::Bytes bytes = Encode(head.weight, dtype);
  auto version = client.UploadWeights(name, dtype, bytes);
  if (!version.ok()) return version.status();
  head.version = *version;
  return head;
}

}  // namespace losshead::testing
