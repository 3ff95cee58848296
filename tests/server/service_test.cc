// The service through raw gRPC stubs: Step framing, ordering and chunking, pull/push streams,
// metrics and shutdown.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "server/server.h"
#include "tests/server/test_util.h"

namespace losshead::server {
namespace {

using testing::Bytes;
using testing::RandomFloats;

constexpr int64_t kV = 64;
constexpr int64_t kD = 32;
constexpr size_t kMaxMessage = 8192;  // small, so that dH and dW travel in several chunks

class ServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ServerOptions o;
    o.listen_address = "127.0.0.1:0";
    o.metrics_address = WithMetrics() ? "127.0.0.1:0" : "";
    o.backend = kernels::BackendKind::kCpu;
    o.worker_threads = 2;
    o.max_message_bytes = kMaxMessage;
    o.max_microbatch_bytes = MaxMicrobatchBytes();
    o.drain_timeout = absl::Seconds(5);
    // The stash reaches dW only when full or read, never on a timer: dW's bits then depend only on
    // what was sent, in which order (OneStreamAddsItsMicroBatchesToDwInOrder compares them).
    o.grad_stash_idle = absl::InfiniteDuration();
    auto server = Server::Start(o);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                       grpc::InsecureChannelCredentials());
    stub_ = v1::LossHead::NewStub(channel);
    CreateHead("h");
  }

  // A kV x kD fp32 head with normal(0, 0.1) weights from the default seed.
  void CreateHead(const std::string& name) {
    v1::CreateHeadRequest req;
    req.mutable_spec()->set_name(name);
    req.mutable_spec()->set_vocab_size(kV);
    req.mutable_spec()->set_hidden_size(kD);
    req.mutable_spec()->set_weight_dtype(v1::DTYPE_FP32);
    req.mutable_spec()->mutable_init()->mutable_normal()->set_std(0.1f);
    grpc::ClientContext ctx;
    v1::HeadInfo info;
    ASSERT_TRUE(stub_->CreateHead(&ctx, req, &info).ok());
  }

  virtual bool WithMetrics() const { return false; }
  virtual size_t MaxMicrobatchBytes() const { return 64 * 1024; }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown(absl::Seconds(5));
  }

  static v1::StepRequest Header(const std::string& head, int64_t n, uint64_t seq) {
    v1::StepRequest r;
    v1::StepHeader* h = r.mutable_header();
    h->set_head(head);
    h->set_client_id("c");
    h->set_sequence(seq);
    h->set_num_tokens(n);
    h->set_hidden_dtype(v1::DTYPE_FP32);
    h->set_target_dtype(v1::DTYPE_INT32);
    return r;
  }

  // One micro-batch as header, then hidden in 3 pieces, then targets with last.
  static std::vector<v1::StepRequest> MicroBatchMessages(const std::string& head, int64_t n,
                                                         uint64_t seq) {
    std::string hidden = Bytes(RandomFloats(n * kD, seq));
    std::vector<int32_t> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = static_cast<int32_t>((i * 7 + seq) % kV);
    std::vector<v1::StepRequest> out;
    out.push_back(Header(head, n, seq));
    const size_t third = hidden.size() / 3;
    out.emplace_back().set_hidden(hidden.substr(0, third));
    out.emplace_back().set_hidden(hidden.substr(third));
    v1::StepRequest& last = out.emplace_back();
    last.set_targets(Bytes(y));
    last.set_last(true);
    return out;
  }

  struct Answer {
    v1::StepResponse first;
    std::string grad_hidden;
    int messages = 0;
  };

  static bool ReadAnswer(grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>* stream,
                         Answer* a) {
    v1::StepResponse r;
    while (stream->Read(&r)) {
      EXPECT_LE(r.ByteSizeLong(), kMaxMessage);
      if (a->messages++ == 0) a->first = r;
      a->grad_hidden += r.grad_hidden();
      if (r.last()) return true;
    }
    return false;
  }

  std::unique_ptr<Server> server_;
  std::unique_ptr<v1::LossHead::Stub> stub_;
};

TEST_F(ServiceTest, PipelinedMicroBatchesAreAnsweredInOrderAndChunked) {
  grpc::ClientContext ctx;
  auto stream = stub_->Step(&ctx);
  constexpr int kBatches = 6;
  for (int s = 1; s <= kBatches; ++s) {
    for (auto& m : MicroBatchMessages("h", 40, s)) ASSERT_TRUE(stream->Write(m));
  }
  stream->WritesDone();
  for (int s = 1; s <= kBatches; ++s) {
    Answer a;
    ASSERT_TRUE(ReadAnswer(stream.get(), &a));
    EXPECT_EQ(a.first.sequence(), static_cast<uint64_t>(s));
    ASSERT_TRUE(a.first.has_result()) << a.first.DebugString();
    EXPECT_EQ(a.first.result().token_count(), 40);
    EXPECT_EQ(a.grad_hidden.size(), 40u * kD * 4);
    EXPECT_EQ(a.first.result().grad_hidden_bytes(), a.grad_hidden.size());
    EXPECT_GE(a.messages, 2);  // the result, then dH
  }
  EXPECT_TRUE(stream->Finish().ok());
}

// A stream's next micro-batch starts while the one before still copies its results back, and
// staged micro-batches take the device largest first; still, one stream's micro-batches reach dW
// in the order sent: dW is bit for bit that of sending them one at a time (fp32 sums depend on
// their order).
TEST_F(ServiceTest, OneStreamAddsItsMicroBatchesToDwInOrder) {
  CreateHead("one-by-one");
  // Small and large alternate: largest-first would reorder them if a stream's next one could
  // overtake the one before.
  const int64_t sizes[] = {1, 60, 2, 50, 3, 40, 4, 30};
  auto messages = [&](const std::string& head, size_t k) {
    return MicroBatchMessages(head, sizes[k], 100 + k);
  };
  {
    grpc::ClientContext ctx;
    auto stream = stub_->Step(&ctx);
    for (size_t k = 0; k < std::size(sizes); ++k) {
      for (auto& m : messages("h", k)) ASSERT_TRUE(stream->Write(m));
    }
    stream->WritesDone();
    for (size_t k = 0; k < std::size(sizes); ++k) {
      Answer a;
      ASSERT_TRUE(ReadAnswer(stream.get(), &a));
      ASSERT_TRUE(a.first.has_result()) << a.first.DebugString();
      EXPECT_EQ(a.first.sequence(), 100 + k);
    }
    EXPECT_TRUE(stream->Finish().ok());
  }
  for (size_t k = 0; k < std::size(sizes); ++k) {
    grpc::ClientContext ctx;
    auto stream = stub_->Step(&ctx);
    for (auto& m : messages("one-by-one", k)) ASSERT_TRUE(stream->Write(m));
    stream->WritesDone();
    Answer a;
    ASSERT_TRUE(ReadAnswer(stream.get(), &a));
    ASSERT_TRUE(a.first.has_result()) << a.first.DebugString();
    EXPECT_TRUE(stream->Finish().ok());
  }
  auto pull = [&](const std::string& head) {
    grpc::ClientContext ctx;
    v1::PullGradientRequest req;
    req.set_head(head);
    auto reader = stub_->PullGradient(&ctx, req);
    v1::GradientChunk chunk;
    std::string data;
    while (reader->Read(&chunk)) data += chunk.data();
    EXPECT_TRUE(reader->Finish().ok());
    return data;
  };
  const std::string pipelined = pull("h");
  ASSERT_EQ(pipelined.size(), kV * kD * 4u);
  EXPECT_TRUE(pipelined == pull("one-by-one"));
}

TEST_F(ServiceTest, MicroBatchErrorsKeepTheStreamGoing) {
  grpc::ClientContext ctx;
  auto stream = stub_->Step(&ctx);
  for (auto& m : MicroBatchMessages("missing", 4, 1)) ASSERT_TRUE(stream->Write(m));
  auto bad = MicroBatchMessages("h", 4, 2);
  bad[0].mutable_header()->set_num_tokens(5);  // byte count mismatch
  for (auto& m : bad) ASSERT_TRUE(stream->Write(m));
  // 128 KiB in 4 KiB pieces: over the 64 KiB micro-batch limit, each message under the gRPC one.
  ASSERT_TRUE(stream->Write(Header("h", 1024, 3)));
  for (int i = 0; i < 32; ++i) {
    v1::StepRequest piece;
    piece.set_hidden(std::string(4096, '\0'));
    ASSERT_TRUE(stream->Write(piece));
  }
  v1::StepRequest end;
  end.set_targets(std::string(1024 * 4, '\0'));
  end.set_last(true);
  ASSERT_TRUE(stream->Write(end));
  for (auto& m : MicroBatchMessages("h", 4, 4)) ASSERT_TRUE(stream->Write(m));
  stream->WritesDone();
  const grpc::StatusCode want[] = {grpc::StatusCode::NOT_FOUND, grpc::StatusCode::INVALID_ARGUMENT,
                                   grpc::StatusCode::RESOURCE_EXHAUSTED};
  for (grpc::StatusCode code : want) {
    Answer a;
    ASSERT_TRUE(ReadAnswer(stream.get(), &a));
    ASSERT_TRUE(a.first.has_error());
    EXPECT_EQ(a.first.error().code(), code) << a.first.error().message();
    EXPECT_EQ(a.messages, 1);
  }
  Answer ok;
  ASSERT_TRUE(ReadAnswer(stream.get(), &ok));
  EXPECT_TRUE(ok.first.has_result());
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServiceTest, DataOutsideAMicroBatchEndsTheCall) {
  grpc::ClientContext ctx;
  auto stream = stub_->Step(&ctx);
  v1::StepRequest orphan;
  orphan.set_hidden("abcd");
  stream->Write(orphan);
  stream->WritesDone();
  v1::StepResponse r;
  while (stream->Read(&r)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(ServiceTest, HeaderInsideAMicroBatchEndsTheCall) {
  grpc::ClientContext ctx;
  auto stream = stub_->Step(&ctx);
  stream->Write(Header("h", 1, 1));
  stream->Write(Header("h", 1, 2));
  stream->WritesDone();
  v1::StepResponse r;
  while (stream->Read(&r)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(ServiceTest, StreamEndingInsideAMicroBatchEndsTheCall) {
  grpc::ClientContext ctx;
  auto stream = stub_->Step(&ctx);
  auto msgs = MicroBatchMessages("h", 2, 1);
  stream->Write(msgs[0]);
  stream->WritesDone();
  v1::StepResponse r;
  while (stream->Read(&r)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(ServiceTest, PullStreamsChunksBelowTheLimitAndResets) {
  {
    grpc::ClientContext ctx;
    auto stream = stub_->Step(&ctx);
    for (auto& m : MicroBatchMessages("h", 8, 1)) stream->Write(m);
    stream->WritesDone();
    Answer a;
    ASSERT_TRUE(ReadAnswer(stream.get(), &a));
    ASSERT_TRUE(stream->Finish().ok());
  }
  for (int round = 0; round < 2; ++round) {
    grpc::ClientContext ctx;
    v1::PullGradientRequest req;
    req.set_head("h");
    req.set_reset(true);
    auto reader = stub_->PullGradient(&ctx, req);
    v1::GradientChunk chunk;
    std::string data;
    v1::GradientSummary summary;
    int messages = 0;
    while (reader->Read(&chunk)) {
      EXPECT_LE(chunk.ByteSizeLong(), kMaxMessage);
      if (messages++ == 0) summary = chunk.summary();
      EXPECT_EQ(chunk.offset(), data.size());
      data += chunk.data();
    }
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(summary.total_bytes(), kV * kD * 4u);
    EXPECT_EQ(data.size(), summary.total_bytes());
    EXPECT_GT(messages, 1);
    EXPECT_EQ(summary.token_count(), round == 0 ? 8u : 0u);
  }
  grpc::ClientContext ctx;
  v1::PullGradientRequest req;
  req.set_head("nope");
  auto reader = stub_->PullGradient(&ctx, req);
  v1::GradientChunk chunk;
  EXPECT_FALSE(reader->Read(&chunk));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, PushAppliesOnlyACompleteTensor) {
  const std::string w = Bytes(RandomFloats(kV * kD, 5));
  auto push = [&](size_t bytes, uint64_t gap) {
    grpc::ClientContext ctx;
    v1::PushWeightsResponse resp;
    auto writer = stub_->PushWeights(&ctx, &resp);
    v1::PushWeightsRequest first;
    first.mutable_header()->set_head("h");
    first.mutable_header()->set_dtype(v1::DTYPE_FP32);
    writer->Write(first);
    for (size_t off = 0; off < bytes; off += 4096) {
      v1::PushWeightsRequest piece;
      piece.set_offset(off + (off > 0 ? gap : 0));
      piece.set_data(w.substr(off, std::min<size_t>(4096, bytes - off)));
      if (!writer->Write(piece)) break;
    }
    writer->WritesDone();
    grpc::Status s = writer->Finish();
    return std::make_pair(s.error_code(), resp.weights_version());
  };
  EXPECT_EQ(push(w.size() - 4, 0).first, grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(push(w.size(), 4).first, grpc::StatusCode::INVALID_ARGUMENT);
  auto ok = push(w.size(), 0);
  EXPECT_EQ(ok.first, grpc::StatusCode::OK);
  EXPECT_EQ(ok.second, 2u);

  grpc::ClientContext ctx;
  v1::DownloadWeightsRequest req;
  req.set_head("h");
  auto reader = stub_->DownloadWeights(&ctx, req);
  v1::WeightsChunk chunk;
  std::string data;
  uint64_t version = 0;
  while (reader->Read(&chunk)) {
    if (data.empty()) version = chunk.weights_version();
    data += chunk.data();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(version, 2u);
  EXPECT_EQ(data, w);
}

std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return "";
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: localhost\r\n\r\n");
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, n);
  close(fd);
  return out;
}

TEST_F(ServiceTest, TakenPortIsUnavailable) {
  ServerOptions o;
  o.listen_address = absl::StrCat("127.0.0.1:", server_->port());
  o.metrics_address = "";
  o.backend = kernels::BackendKind::kCpu;
  EXPECT_EQ(Server::Start(o).status().code(), absl::StatusCode::kUnavailable);
}

// grpc.health.v1.Health/Check without its generated code: the request is field 1 (service name),
// the response field 1 (1 = SERVING).
TEST_F(ServiceTest, HealthIsServing) {
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  for (std::string service : {std::string(), std::string("losshead.v1.LossHead")}) {
    std::string request;
    if (!service.empty())
      request = absl::StrCat("\x0a", std::string(1, static_cast<char>(service.size())), service);
    grpc::Slice slice(request);
    grpc::ByteBuffer req(&slice, 1);
    grpc::ByteBuffer resp;
    grpc::ClientContext ctx;
    grpc::Status status;
    absl::Notification done;
    stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                   [&](grpc::Status s) {
                     status = s;
                     done.Notify();
                   });
    done.WaitForNotification();
    ASSERT_TRUE(status.ok()) << status.error_message();
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(resp.Dump(&slices).ok());
    std::string body;
    for (const auto& sl : slices) body += std::string(sl.begin(), sl.end());
    EXPECT_EQ(body, std::string("\x08\x01", 2)) << service;
  }
}

// Step messages are parsed without copying their hidden states out of gRPC's slices; a message
// that does not parse (a truncated tag or field) ends the call INVALID_ARGUMENT all the same.
TEST_F(ServiceTest, UnparsableStepMessageEndsTheCall) {
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  const std::string truncated_field = std::string("\x12\x64", 2) + std::string(10, 'x');
  for (const std::string& garbage : {std::string("\xff\xff\xff", 3), truncated_field}) {
    grpc::CompletionQueue cq;
    grpc::ClientContext ctx;
    auto call = stub.PrepareCall(&ctx, "/losshead.v1.LossHead/Step", &cq);
    void* tag;
    bool ok;
    call->StartCall(reinterpret_cast<void*>(1));
    ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
    grpc::Slice slice(garbage);
    grpc::ByteBuffer message(&slice, 1);
    call->Write(message, reinterpret_cast<void*>(2));
    ASSERT_TRUE(cq.Next(&tag, &ok));
    grpc::Status status;
    call->Finish(&status, reinterpret_cast<void*>(3));
    ASSERT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(status.error_message(), "malformed Step stream: a message is not a StepRequest");
    cq.Shutdown();
    while (cq.Next(&tag, &ok)) {
    }
  }
}

class MetricsTest : public ServiceTest {
 protected:
  bool WithMetrics() const override { return true; }
  size_t MaxMicrobatchBytes() const override { return size_t{2} << 20; }
};

TEST_F(MetricsTest, MetricsAreExported) {
  {
    grpc::ClientContext ctx;
    auto stream = stub_->Step(&ctx);
    for (auto& m : MicroBatchMessages("h", 8, 1)) stream->Write(m);
    stream->WritesDone();
    Answer a;
    ASSERT_TRUE(ReadAnswer(stream.get(), &a));
    ASSERT_TRUE(stream->Finish().ok());
  }
  ASSERT_GT(server_->metrics_port(), 0);
  const std::vector<std::string> wanted = {
      "losshead_rpc_duration_seconds_bucket{method=\"Step\"",
      "losshead_rpcs_total{code=\"ok\",method=\"CreateHead\"}",
      "losshead_step_phase_duration_seconds_count{head=\"h\",phase=\"compute\"} 1",
      "losshead_microbatches_total{head=\"h\",outcome=\"ok\"} 1",
      "losshead_tokens_total{head=\"h\"} 8",
      "losshead_bytes_total{direction=\"in\",method=\"Step\"}", "losshead_inflight_microbatches 0",
      "losshead_head_memory_bytes{head=\"h\",kind=\"weights\"} 8192",
      "losshead_device_memory_bytes{device=\"cpu:0\",kind=\"gradient\"} 8192",
      // The CPU backend has no page-locked memory.
      "losshead_host_buffer_bytes{pool=\"page_locked\",state=\"held\"} 0", "losshead_heads 1"};
  // The server records a call's duration and its last phases when it finishes the call, which
  // may be just after the client has read the answer: scrape until everything is there (bounded).
  std::string body;
  for (int attempt = 0; attempt < 100; ++attempt) {
    body = HttpGet(server_->metrics_port(), "/metrics");
    bool all = true;
    for (const std::string& want : wanted) all = all && body.find(want) != std::string::npos;
    if (all) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  for (const std::string& want : wanted) {
    EXPECT_NE(body.find(want), std::string::npos) << want << "\n" << body;
  }

  // Deleting the head drops every series that names it, phases included.
  grpc::ClientContext ctx;
  v1::DeleteHeadRequest del;
  del.set_name("h");
  v1::DeleteHeadResponse deleted;
  ASSERT_TRUE(stub_->DeleteHead(&ctx, del, &deleted).ok());
  body = HttpGet(server_->metrics_port(), "/metrics");
  EXPECT_NE(body.find("losshead_heads 0"), std::string::npos) << body;
  EXPECT_EQ(body.find("head=\"h\""), std::string::npos) << body;
}

// A micro-batch without a client id is not remembered: once answered, its dH buffer goes back to
// the server's pool, which the gauge shows (the pool keeps buffers of 1 MiB and more).
TEST_F(MetricsTest, IdleDHBuffersAreExported) {
  constexpr int64_t kTokens = (int64_t{1} << 20) / (kD * 4);  // 1 MiB of fp32 dH
  {
    grpc::ClientContext ctx;
    auto stream = stub_->Step(&ctx);
    v1::StepRequest header = Header("h", kTokens, 1);
    header.mutable_header()->clear_client_id();
    stream->Write(header);
    // In pieces under the server's message limit (kMaxMessage).
    const std::string hidden = Bytes(RandomFloats(kTokens * kD, 3));
    std::vector<int32_t> y(kTokens);
    for (int64_t i = 0; i < kTokens; ++i) y[i] = static_cast<int32_t>((i * 5 + 1) % kV);
    const std::string targets = Bytes(y);
    constexpr size_t kPiece = 4096;
    for (size_t at = 0; at < hidden.size(); at += kPiece) {
      v1::StepRequest m;
      m.set_hidden(hidden.substr(at, kPiece));
      stream->Write(m);
    }
    for (size_t at = 0; at < targets.size(); at += kPiece) {
      v1::StepRequest m;
      m.set_targets(targets.substr(at, kPiece));
      m.set_last(at + kPiece >= targets.size());
      stream->Write(m);
    }
    stream->WritesDone();
    Answer a;
    ASSERT_TRUE(ReadAnswer(stream.get(), &a));
    ASSERT_EQ(a.grad_hidden.size(), size_t{1} << 20) << a.first.DebugString();
    ASSERT_TRUE(stream->Finish().ok());
  }
  // The server lets go of the outcome once gRPC has sent its last piece: scrape until then.
  const std::string want = "losshead_host_buffer_bytes{pool=\"dh\",state=\"idle\"} 1048576";
  std::string body;
  for (int attempt = 0; attempt < 100; ++attempt) {
    body = HttpGet(server_->metrics_port(), "/metrics");
    if (body.find(want) != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_NE(body.find(want), std::string::npos) << body;
}

TEST_F(ServiceTest, ShutdownEndsIdleStreamsPromptly) {
  grpc::ClientContext ctx;
  auto stream = stub_->Step(&ctx);
  for (auto& m : MicroBatchMessages("h", 4, 1)) stream->Write(m);
  Answer a;
  ASSERT_TRUE(ReadAnswer(stream.get(), &a));  // answered; the stream stays open and idle
  const absl::Time start = absl::Now();
  // An idle stream must not hold shutdown until the deadline: well under it is prompt.
  server_->Shutdown(absl::Seconds(60));
  server_->Wait();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  v1::StepResponse r;
  EXPECT_FALSE(stream->Read(&r));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
}

// A client that opened an HTTP/2 connection and never hangs up: gRPC's own Shutdown would wait for
// it until the deadline; the server closes it once its calls are done.
TEST_F(ServiceTest, ShutdownClosesIdleConnectionsPromptly) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(server_->port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // The client connection preface, then an empty SETTINGS frame (9-byte header, type 4).
  const std::string preface =
      std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + std::string("\0\0\0\4\0\0\0\0\0", 9);
  ASSERT_EQ(write(fd, preface.data(), preface.size()), static_cast<ssize_t>(preface.size()));
  // The server's SETTINGS: the connection is up on its side.
  char buf[4096];
  ASSERT_GT(read(fd, buf, sizeof(buf)), 0);

  // A pull that is still streaming when shutdown starts is not cut short by it: 32 MiB in 8 KiB
  // messages is more than gRPC's flow-control windows let the server send before it is read.
  constexpr int64_t kBigV = 32768, kBigD = 256;
  {
    v1::CreateHeadRequest req;
    req.mutable_spec()->set_name("big");
    req.mutable_spec()->set_vocab_size(kBigV);
    req.mutable_spec()->set_hidden_size(kBigD);
    req.mutable_spec()->set_weight_dtype(v1::DTYPE_BF16);
    grpc::ClientContext ctx;
    v1::HeadInfo info;
    ASSERT_TRUE(stub_->CreateHead(&ctx, req, &info).ok());
  }
  grpc::ClientContext pull_ctx;
  v1::PullGradientRequest pull;
  pull.set_head("big");
  auto reader = stub_->PullGradient(&pull_ctx, pull);
  v1::GradientChunk first;
  ASSERT_TRUE(reader->Read(&first));  // the call is running; the rest waits in flow control

  const absl::Time start = absl::Now();
  std::thread stopper([&] {
    server_->Shutdown(absl::Seconds(60));
    server_->Wait();
  });
  int64_t pulled = first.data().size();
  v1::GradientChunk chunk;
  while (reader->Read(&chunk)) pulled += chunk.data().size();
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(pulled, kBigV * kBigD * 4);
  stopper.join();
  // gRPC's own Shutdown gives such a connection 20 s (its GOAWAY ping timeout) before closing it.
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // The idle connection was closed by the server: reading reaches its end (after its GOAWAY), or
  // a reset if the server closed with bytes of ours unread.
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) {
  }
  EXPECT_TRUE(n == 0 || (n < 0 && errno == ECONNRESET)) << std::strerror(errno);
  close(fd);
}

}  // namespace
}  // namespace losshead::server
