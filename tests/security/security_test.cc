// A real server (CPU backend) on loopback with TLS, mTLS, bearer tokens, metrics basic auth and
// head limits, exercised with the real client; and the losshead-server binary refusing to start
// with bad security files.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "server/server.h"
#include "tests/common/http_exchange.h"
#include "tests/common/server_process.h"
#include "tests/security/certs.h"

namespace losshead::testing {
namespace {

using absl::StatusCode;

constexpr char kReaderToken[] = "reader-token-0123456789abcdef";
constexpr char kWriterToken[] = "writer-token-0123456789abcdef";
constexpr int64_t kV = 16, kD = 8;

server::ServerOptions BaseOptions() {
  server::ServerOptions options;
  options.listen_address = "127.0.0.1:0";
  options.metrics_address = "";
  options.backend = kernels::BackendKind::kCpu;
  options.worker_threads = 2;
  options.workspace_bytes = size_t{16} << 20;
  return options;
}

client::ClientOptions ClientOpts(const std::string& token = "") {
  client::ClientOptions options;
  options.deadline = absl::Seconds(10);
  options.stream_deadline = absl::Seconds(10);
  options.bearer_token = token;
  return options;
}

std::unique_ptr<client::Client> Connect(int port, const client::ClientOptions& options) {
  auto c = client::Client::Connect(absl::StrCat("127.0.0.1:", port), options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

v1::HeadSpec Spec(const std::string& name, int64_t v = kV, int64_t d = kD) {
  v1::HeadSpec spec;
  spec.set_name(name);
  spec.set_vocab_size(v);
  spec.set_hidden_size(d);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  return spec;
}

// A tiny micro-batch with fp32 hidden states; the vectors back the spans.
struct TinyBatch {
  std::vector<float> hidden = std::vector<float>(4 * kD, 0.25f);
  std::vector<int32_t> targets = {1, 2, 3, 4};
  client::Microbatch Microbatch(const std::string& head, uint64_t sequence) const {
    client::Microbatch mb;
    mb.head = head;
    mb.client_id = "security-test";
    mb.sequence = sequence;
    mb.num_tokens = 4;
    mb.hidden_dtype = v1::DTYPE_FP32;
    mb.hidden = client::AsBytes(hidden);
    mb.target_dtype = v1::DTYPE_INT32;
    mb.targets = client::AsBytes(targets);
    return mb;
  }
};

std::string MetricsGet(int port, const std::string& credentials) {
  std::string request = "GET /metrics HTTP/1.1\r\nHost: x\r\n";
  if (!credentials.empty()) {
    absl::StrAppend(&request, "Authorization: Basic ", absl::Base64Escape(credentials), "\r\n");
  }
  return HttpExchange(port, request + "\r\n").value_or("");
}

// ---------------------------------------------------------------------------------------------
// Plaintext with bearer tokens, metrics basic auth and head limits.

class TokenTest : public ::testing::Test {
 protected:
  static constexpr size_t kMaxHeads = 3;

  void SetUp() override {
    auto pki = MakeTestPki();  // only for its temporary directory
    ASSERT_TRUE(pki.ok()) << pki.status();
    pki_ = std::move(*pki);
    server::ServerOptions options = BaseOptions();
    options.metrics_address = "127.0.0.1:0";
    options.auth_tokens_file =
        WriteFile(pki_->dir, "tokens",
                  absl::StrCat("# roles\nreader ", kReaderToken, "\nwriter ", kWriterToken, "\n"));
    tokens_file_ = options.auth_tokens_file;
    // These tests reload only when they say so (and count the reloads).
    options.auth_tokens_reload_interval = absl::ZeroDuration();
    options.metrics_basic_auth_file = WriteFile(pki_->dir, "metrics-auth", "prom:s3cret-pw\n");
    options.max_heads = kMaxHeads;
    options.max_head_bytes = kV * kD * 8 * 4;  // fp32 W + dW of a head 4x as large as Spec()
    options.checkpoint_dir = pki_->dir + "/checkpoints";  // for the snapshot calls
    options.checkpoint_interval = absl::ZeroDuration();
    auto server = server::Server::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    writer_ = Connect(server_->port(), ClientOpts(kWriterToken));
    reader_ = Connect(server_->port(), ClientOpts(kReaderToken));
    anonymous_ = Connect(server_->port(), ClientOpts());
    wrong_ = Connect(server_->port(), ClientOpts("wrong-token-0123456789abcdef"));
    ASSERT_TRUE(writer_->CreateHead(Spec("h")).ok());
    ASSERT_TRUE(writer_->Step(batch_.Microbatch("h", 1)).ok());
  }

  std::unique_ptr<TestPki> pki_;
  std::string tokens_file_;
  std::unique_ptr<server::Server> server_;
  std::unique_ptr<client::Client> writer_, reader_, anonymous_, wrong_;
  TinyBatch batch_;
};

TEST_F(TokenTest, NoOrWrongTokenIsUnauthenticatedOnEveryMethod) {
  for (client::Client* c : {anonymous_.get(), wrong_.get()}) {
    EXPECT_EQ(c->GetStats().status().code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(c->ListHeads().status().code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(c->GetHead("h").status().code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(c->PullGradient("h").status().code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(c->DownloadWeights("h").status().code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(c->CreateHead(Spec("x")).status().code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(c->DeleteHead("h").code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(c->Step(batch_.Microbatch("h", 7)).status().code(), StatusCode::kUnauthenticated);
  }
}

TEST_F(TokenTest, HealthNeedsNoToken) {
  auto health = anonymous_->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, client::ServingStatus::kServing);
  auto service = anonymous_->Health("losshead.v1.LossHead");
  ASSERT_TRUE(service.ok()) << service.status();
  EXPECT_EQ(*service, client::ServingStatus::kServing);
}

TEST_F(TokenTest, ReaderReadsButCannotChangeAnything) {
  const auto before = writer_->GetHead("h");
  ASSERT_TRUE(before.ok());
  ASSERT_EQ(before->tokens_total(), 4u);

  EXPECT_TRUE(reader_->GetStats().ok());
  EXPECT_TRUE(reader_->ListHeads().ok());
  EXPECT_TRUE(reader_->GetHead("h").ok());
  auto pulled = reader_->PullGradient("h", v1::DTYPE_FP32, /*reset=*/false);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.token_count(), 4);
  auto weights = reader_->DownloadWeights("h");
  ASSERT_TRUE(weights.ok()) << weights.status();

  EXPECT_EQ(reader_->Step(batch_.Microbatch("h", 2)).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(reader_->UploadWeights("h", v1::DTYPE_FP32, weights->data).status().code(),
            StatusCode::kPermissionDenied);
  EXPECT_EQ(reader_->CreateHead(Spec("r")).status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reader_->DeleteHead("h").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reader_->SetLossOptions("h", v1::LossOptions()).status().code(),
            StatusCode::kPermissionDenied);
  // Reset empties what writers accumulate: a writer's call.
  EXPECT_EQ(reader_->PullGradient("h", v1::DTYPE_FP32, /*reset=*/true).status().code(),
            StatusCode::kPermissionDenied);

  const auto after = writer_->GetHead("h");
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->tokens_total(), before->tokens_total());
  EXPECT_EQ(after->tokens_since_pull(), before->tokens_since_pull());
  EXPECT_EQ(after->weights_version(), before->weights_version());
  auto heads = writer_->ListHeads();
  ASSERT_TRUE(heads.ok());
  EXPECT_EQ(heads->size(), 1u);
}

TEST_F(TokenTest, OnlyAWriterDiscardsTheWindowOrWritesRestoresAndDeletesSnapshots) {
  ASSERT_TRUE(writer_->SnapshotHead("h", "s").ok());
  // A reader looks: the window's summary and the snapshots.
  auto summary = reader_->WindowSummary("h");
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->token_count(), 4u);
  auto listed = reader_->ListSnapshots("h");
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  // Everything that changes the head or the snapshots is a writer's.
  EXPECT_EQ(reader_->DiscardGradient("h").status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reader_->SnapshotHead("h", "r").status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reader_->RestoreHead("h", "s").status().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(reader_->DeleteSnapshot("h", "s").code(), StatusCode::kPermissionDenied);
  for (client::Client* c : {anonymous_.get(), wrong_.get()}) {
    EXPECT_EQ(c->WindowSummary("h").status().code(), StatusCode::kUnauthenticated);
    EXPECT_EQ(c->ListSnapshots("h").status().code(), StatusCode::kUnauthenticated);
  }
  auto info = writer_->GetHead("h");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens_since_pull(), 4u);
  listed = writer_->ListSnapshots("h");
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->size(), 1u);

  auto discarded = writer_->DiscardGradient("h");
  ASSERT_TRUE(discarded.ok()) << discarded.status();
  EXPECT_EQ(discarded->token_count(), 4u);
  auto restored = writer_->RestoreHead("h", "s");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->tokens_since_pull(), 4u);
  EXPECT_TRUE(writer_->DeleteSnapshot("h", "s").ok());
}

TEST_F(TokenTest, WriterDoesEverything) {
  ASSERT_TRUE(writer_->CreateHead(Spec("w")).ok());
  auto weights = writer_->DownloadWeights("w");
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto version = writer_->UploadWeights("w", v1::DTYPE_FP32, weights->data);
  ASSERT_TRUE(version.ok()) << version.status();
  EXPECT_EQ(*version, 2u);
  EXPECT_TRUE(writer_->SetLossOptions("w", v1::LossOptions()).ok());
  auto step = writer_->Step(batch_.Microbatch("w", 1));
  ASSERT_TRUE(step.ok()) << step.status();
  auto pulled = writer_->PullGradient("w", v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.token_count(), 4);
  auto info = writer_->GetHead("w");
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens_since_pull(), 0u);
  EXPECT_TRUE(writer_->GetStats().ok());
  EXPECT_TRUE(writer_->DeleteHead("w").ok());
}

TEST_F(TokenTest, MethodWithoutARoleIsDeniedEvenToWriters) {
  // A method the role table does not list: refused before gRPC would answer UNIMPLEMENTED.
  grpc::GenericStub stub(writer_->channel()->shared_from_this());
  for (const std::string& token : {std::string(kWriterToken), std::string()}) {
    grpc::ClientContext context;
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1), response;
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(&context, "/losshead.v1.LossHead/NoSuchMethod", grpc::StubOptions(), &request,
                   &response, [&](grpc::Status s) {
                     status = std::move(s);
                     done.Notify();
                   });
    done.WaitForNotification();
    EXPECT_EQ(status.error_code(), token.empty() ? grpc::StatusCode::UNAUTHENTICATED
                                                 : grpc::StatusCode::PERMISSION_DENIED);
  }
}

// Refusals never reach a handler; the token check counts them. Method names outside the role
// table are one label value, whatever the caller sends.
TEST_F(TokenTest, RefusalsAreCountedByMethodAndReason) {
  EXPECT_EQ(anonymous_->GetStats().status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(wrong_->GetStats().status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(reader_->Step(batch_.Microbatch("h", 9)).status().code(),
            StatusCode::kPermissionDenied);
  grpc::GenericStub stub(writer_->channel()->shared_from_this());
  for (const std::string method : {"NoSuchMethod", "AnotherOne"}) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", absl::StrCat("Bearer ", kWriterToken));
    grpc::Slice empty("");
    grpc::ByteBuffer request(&empty, 1), response;
    absl::Notification done;
    stub.UnaryCall(&context, "/losshead.v1.LossHead/" + method, grpc::StubOptions(), &request,
                   &response, [&](grpc::Status) { done.Notify(); });
    done.WaitForNotification();
  }
  const std::string metrics = MetricsGet(server_->metrics_port(), "prom:s3cret-pw");
  EXPECT_TRUE(absl::StrContains(
      metrics, "losshead_failures_total{method=\"GetStats\",reason=\"unauthenticated\"} 2"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(
      metrics, "losshead_failures_total{method=\"Step\",reason=\"permission_denied\"} 1"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(
      metrics, "losshead_failures_total{method=\"other\",reason=\"permission_denied\"} 2"))
      << metrics;
  EXPECT_FALSE(absl::StrContains(metrics, "NoSuchMethod")) << metrics;
}

TEST_F(TokenTest, MetricsNeedBasicAuth) {
  const int port = server_->metrics_port();
  ASSERT_GT(port, 0);
  const std::string none = MetricsGet(port, "");
  EXPECT_TRUE(absl::StartsWith(none, "HTTP/1.1 401")) << none;
  EXPECT_TRUE(absl::StrContains(none, "WWW-Authenticate: Basic")) << none;
  EXPECT_TRUE(absl::StartsWith(MetricsGet(port, "prom:wrong"), "HTTP/1.1 401"));
  EXPECT_TRUE(absl::StartsWith(MetricsGet(port, "prom:s3cret-pw-and-more"), "HTTP/1.1 401"));
  EXPECT_TRUE(absl::StartsWith(MetricsGet(port, "other:s3cret-pw"), "HTTP/1.1 401"));
  const std::string ok = MetricsGet(port, "prom:s3cret-pw");
  EXPECT_TRUE(absl::StartsWith(ok, "HTTP/1.1 200 OK")) << ok.substr(0, 200);
  EXPECT_TRUE(absl::StrContains(ok, "losshead_")) << ok.substr(0, 200);
}

TEST_F(TokenTest, HeadLimitsRefuseBeforeAllocating) {
  // 4 x as many rows as Spec() fits exactly; one more row does not.
  EXPECT_TRUE(writer_->CreateHead(Spec("fits", 4 * kV)).ok());
  EXPECT_EQ(writer_->CreateHead(Spec("too-big", 4 * kV + 1)).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(writer_->CreateHead(Spec("third")).ok());
  ASSERT_EQ(writer_->ListHeads()->size(), kMaxHeads);
  EXPECT_EQ(writer_->CreateHead(Spec("fourth")).status().code(), StatusCode::kResourceExhausted);
  auto heads = writer_->ListHeads();
  ASSERT_TRUE(heads.ok());
  EXPECT_EQ(heads->size(), kMaxHeads);
  // Deleting one makes room.
  ASSERT_TRUE(writer_->DeleteHead("third").ok());
  EXPECT_TRUE(writer_->CreateHead(Spec("fourth")).ok());
}

// Rotation in place: the writer's token is replaced, the reader's kept. Existing connections keep
// working for tokens still in the file; a removed token is refused on its very next call.
TEST_F(TokenTest, ReloadRotatesTokensAndABadFileChangesNothing) {
  constexpr char kNewWriterToken[] = "rotated-writer-0123456789abcdef";
  WriteFile(pki_->dir, "tokens",
            absl::StrCat("reader ", kReaderToken, "\nwriter ", kNewWriterToken, "\n"));
  ASSERT_TRUE(server_->ReloadTokens().ok());
  auto rotated = Connect(server_->port(), ClientOpts(kNewWriterToken));
  EXPECT_EQ(writer_->Step(batch_.Microbatch("h", 2)).status().code(), StatusCode::kUnauthenticated);
  EXPECT_EQ(writer_->GetStats().status().code(), StatusCode::kUnauthenticated);
  ASSERT_TRUE(rotated->Step(batch_.Microbatch("h", 2)).ok());
  EXPECT_TRUE(reader_->GetHead("h").ok());
  EXPECT_EQ(reader_->PullGradient("h", v1::DTYPE_FP32, /*reset=*/true).status().code(),
            StatusCode::kPermissionDenied);
  auto pulled = rotated->PullGradient("h", v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.token_count(), 8u);  // SetUp's micro-batch and the rotated one

  // A bad file and a missing one: refused with the reason, the rotated tokens stay in force.
  WriteFile(pki_->dir, "tokens", absl::StrCat("writer ", kWriterToken, "\nwriter short\n"));
  const absl::Status bad = server_->ReloadTokens();
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument) << bad;
  EXPECT_TRUE(absl::StrContains(bad.message(), "line 2")) << bad;
  EXPECT_FALSE(absl::StrContains(bad.message(), kWriterToken)) << "tokens never appear in errors";
  ASSERT_EQ(std::remove(tokens_file_.c_str()), 0);
  EXPECT_EQ(server_->ReloadTokens().code(), StatusCode::kNotFound);
  EXPECT_TRUE(rotated->Step(batch_.Microbatch("h", 3)).ok());
  EXPECT_EQ(writer_->Step(batch_.Microbatch("h", 3)).status().code(), StatusCode::kUnauthenticated);
  // The old writer's client switches to the new token without reconnecting.
  writer_->SetBearerToken(kNewWriterToken);
  EXPECT_TRUE(writer_->Step(batch_.Microbatch("h", 4)).ok());

  const std::string metrics = MetricsGet(server_->metrics_port(), "prom:s3cret-pw");
  EXPECT_TRUE(absl::StrContains(metrics, "losshead_auth_token_reloads_total{result=\"ok\"} 1"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "losshead_auth_token_reloads_total{result=\"error\"} 2"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "losshead_auth_tokens 2")) << metrics;
}

// Step streams live long (clients keep them open between steps): a token removed by a reload stops
// working on a stream opened before the reload, at its next micro-batch, which counts nothing.
TEST_F(TokenTest, RevokedTokenIsRefusedOnAStreamAlreadyOpen) {
  auto stream = writer_->OpenStepStream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  ASSERT_TRUE((*stream)->Send(batch_.Microbatch("h", 2)).ok());
  ASSERT_TRUE((*stream)->Receive().ok());
  WriteFile(pki_->dir, "tokens", absl::StrCat("writer rotated-writer-0123456789abcdef\n"));
  ASSERT_TRUE(server_->ReloadTokens().ok());
  ASSERT_TRUE((*stream)->Send(batch_.Microbatch("h", 3)).ok());
  absl::StatusOr<client::StepResult> refused = (*stream)->Receive();
  EXPECT_EQ(refused.status().code(), StatusCode::kUnauthenticated) << refused.status();
  EXPECT_TRUE(client::IsMicrobatchError(refused.status())) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "reloaded")) << refused.status();
  (*stream)->Cancel();
  auto rotated = Connect(server_->port(), ClientOpts("rotated-writer-0123456789abcdef"));
  auto pulled = rotated->PullGradient("h", v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->summary.microbatch_count(), 2u);  // SetUp's and sequence 2, not sequence 3
}

// Without a signal: a new file renamed into place is picked up by the watcher; a bad one is refused
// and the tokens in force stay; so does a file that goes missing.
TEST(TokenWatchTest, ChangedFileIsReloadedWithoutASignal) {
  auto pki = MakeTestPki();  // only for its temporary directory
  ASSERT_TRUE(pki.ok()) << pki.status();
  const std::string dir = (*pki)->dir;
  // Written next to the file and renamed over it, as an operator (or a Secret volume) does.
  auto replace = [&dir](const std::string& text) {
    const std::string staged = WriteFile(dir, "watched.new", text);
    ASSERT_EQ(std::rename(staged.c_str(), (dir + "/watched").c_str()), 0);
  };
  server::ServerOptions options = BaseOptions();
  options.metrics_address = "127.0.0.1:0";
  options.auth_tokens_file = WriteFile(dir, "watched", absl::StrCat("writer ", kWriterToken, "\n"));
  options.auth_tokens_reload_interval = absl::Milliseconds(20);
  auto server = server::Server::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto old_writer = Connect((*server)->port(), ClientOpts(kWriterToken));
  auto new_writer = Connect((*server)->port(), ClientOpts(kReaderToken));
  ASSERT_TRUE(old_writer->GetStats().ok());
  // Polls `call` until it gives `code` (the watcher runs every 20 ms).
  auto eventually = [](auto call, StatusCode code) {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (call().status().code() != code) {
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return true;
  };
  auto reloads = [&](const std::string& result) {
    const std::string text = MetricsGet((*server)->metrics_port(), "");
    return absl::StrContains(
        text, absl::StrCat("losshead_auth_token_reloads_total{result=\"", result, "\"}"));
  };

  replace(absl::StrCat("writer ", kReaderToken, "\n"));
  ASSERT_TRUE(eventually([&] { return old_writer->GetStats(); }, StatusCode::kUnauthenticated));
  EXPECT_TRUE(new_writer->GetStats().ok());
  EXPECT_TRUE(reloads("ok"));

  replace("writer short\n");
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (!reloads("error")) {
    ASSERT_LT(absl::Now(), give_up) << "the bad file was never tried";
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(new_writer->GetStats().ok());
  EXPECT_EQ(old_writer->GetStats().status().code(), StatusCode::kUnauthenticated);
  ASSERT_EQ(std::remove((dir + "/watched").c_str()), 0);
  absl::SleepFor(absl::Milliseconds(100));  // several watcher rounds
  EXPECT_TRUE(new_writer->GetStats().ok());
}

TEST(TokenReloadTest, ServerWithoutTokensCannotTurnThemOn) {
  auto server = server::Server::Start(BaseOptions());
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ((*server)->ReloadTokens().code(), StatusCode::kFailedPrecondition);
  auto anyone = Connect((*server)->port(), ClientOpts());
  EXPECT_TRUE(anyone->GetStats().ok());
}

// The binary re-reads its token file on SIGHUP, and keeps serving with the old tokens when the
// new file is bad.
TEST_F(TokenTest, ServerBinaryReloadsTokensOnSighup) {
  const std::string file =
      WriteFile(pki_->dir, "binary-tokens", absl::StrCat("writer ", kWriterToken, "\n"));
  const std::string log = pki_->dir + "/sighup.log";
  auto process = ServerProcess::Start(LOSSHEAD_SERVER_BIN,
                                      {"--backend=cpu", absl::StrCat("--auth_tokens_file=", file),
                                       "--auth_tokens_reload_interval=0"},
                                      log);
  ASSERT_TRUE(process.ok()) << process.status();
  auto old_writer = Connect((*process)->port(), ClientOpts(kWriterToken));
  auto new_writer = Connect((*process)->port(), ClientOpts(kReaderToken));
  ASSERT_TRUE(old_writer->GetStats().ok());
  EXPECT_EQ(new_writer->GetStats().status().code(), StatusCode::kUnauthenticated);

  // Waits for the server to log `line` for the n-th time.
  auto await_log = [&log](const std::string& line, int n) {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (absl::Now() < give_up) {
      const std::string text = ReadText(log);
      int seen = 0;
      for (size_t at = text.find(line); at != std::string::npos; at = text.find(line, at + 1)) {
        ++seen;
      }
      if (seen >= n) return true;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return false;
  };
  WriteFile(pki_->dir, "binary-tokens", absl::StrCat("writer ", kReaderToken, "\n"));
  (*process)->Signal(SIGHUP);
  ASSERT_TRUE(await_log("token file reloaded", 1)) << ReadText(log);
  EXPECT_EQ(old_writer->GetStats().status().code(), StatusCode::kUnauthenticated);
  EXPECT_TRUE(new_writer->GetStats().ok());

  WriteFile(pki_->dir, "binary-tokens", "writer short\n");
  (*process)->Signal(SIGHUP);
  ASSERT_TRUE(await_log("token file not reloaded (tokens unchanged)", 1)) << ReadText(log);
  EXPECT_TRUE(new_writer->GetStats().ok());
  EXPECT_TRUE((*process)->Running());
  EXPECT_EQ((*process)->Terminate(), 0) << ReadText(log);
}

// ---------------------------------------------------------------------------------------------
// TLS and mTLS.

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto pki = MakeTestPki();
    ASSERT_TRUE(pki.ok()) << pki.status();
    pki_ = pki->release();
  }
  static void TearDownTestSuite() {
    delete pki_;
    pki_ = nullptr;
  }

  std::unique_ptr<server::Server> StartServer(bool mtls, bool tokens) {
    server::ServerOptions options = BaseOptions();
    options.tls_cert_file = pki_->server_cert;
    options.tls_key_file = pki_->server_key;
    if (mtls) options.tls_client_ca_file = pki_->ca_cert;
    if (tokens) {
      options.auth_tokens_file =
          WriteFile(pki_->dir, "tls-tokens", absl::StrCat("writer ", kWriterToken, "\n"));
    }
    auto server = server::Server::Start(options);
    EXPECT_TRUE(server.ok()) << server.status();
    return server.ok() ? std::move(*server) : nullptr;
  }

  static client::ClientOptions TlsClient(bool with_cert, bool rogue = false) {
    client::ClientOptions options = ClientOpts();
    options.deadline = absl::Seconds(3);
    options.tls_root_ca_file = pki_->ca_cert;
    if (with_cert) {
      options.tls_cert_file = rogue ? pki_->rogue_cert : pki_->client_cert;
      options.tls_key_file = rogue ? pki_->rogue_key : pki_->client_key;
    }
    return options;
  }

  static TestPki* pki_;
};

TestPki* TlsTest::pki_ = nullptr;

TEST_F(TlsTest, TlsClientWithTheRightCaWorksAndPlaintextFails) {
  auto server = StartServer(/*mtls=*/false, /*tokens=*/false);
  ASSERT_NE(server, nullptr);
  auto tls = Connect(server->port(), TlsClient(false));
  auto stats = tls->GetStats();
  EXPECT_TRUE(stats.ok()) << stats.status();
  // The certificate names localhost too.
  client::ClientOptions by_name = TlsClient(false);
  auto named = client::Client::Connect(absl::StrCat("localhost:", server->port()), by_name);
  ASSERT_TRUE(named.ok());
  EXPECT_TRUE((*named)->ListHeads().ok());

  client::ClientOptions plain_options = ClientOpts();
  plain_options.deadline = absl::Seconds(3);
  auto plain = Connect(server->port(), plain_options);
  EXPECT_EQ(plain->GetStats().status().code(), StatusCode::kUnavailable);

  // A client that trusts another CA refuses the server.
  client::ClientOptions other_ca = TlsClient(false);
  other_ca.tls_root_ca_file = pki_->dir + "/rogue-ca.crt";
  EXPECT_EQ(Connect(server->port(), other_ca)->GetStats().status().code(),
            StatusCode::kUnavailable);
}

TEST_F(TlsTest, MutualTlsNeedsAClientCertificateFromTheTrustedCa) {
  auto server = StartServer(/*mtls=*/true, /*tokens=*/false);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(Connect(server->port(), TlsClient(false))->GetStats().status().code(),
            StatusCode::kUnavailable);
  EXPECT_EQ(Connect(server->port(), TlsClient(true, /*rogue=*/true))->GetStats().status().code(),
            StatusCode::kUnavailable);
  auto ok = Connect(server->port(), TlsClient(true))->GetStats();
  EXPECT_TRUE(ok.ok()) << ok.status();
}

TEST_F(TlsTest, TokensOverTls) {
  auto server = StartServer(/*mtls=*/true, /*tokens=*/true);
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(Connect(server->port(), TlsClient(true))->GetStats().status().code(),
            StatusCode::kUnauthenticated);
  client::ClientOptions with_token = TlsClient(true);
  with_token.bearer_token = kWriterToken;
  auto c = Connect(server->port(), with_token);
  EXPECT_TRUE(c->CreateHead(Spec("tls-head")).ok());
  EXPECT_TRUE(c->Step(TinyBatch().Microbatch("tls-head", 1)).ok());
  auto health = Connect(server->port(), TlsClient(true))->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, client::ServingStatus::kServing);
}

TEST_F(TlsTest, StartRefusesBadSecurityFiles) {
  auto start = [](server::ServerOptions options) {
    return server::Server::Start(options).status().code();
  };
  server::ServerOptions o = BaseOptions();
  o.tls_cert_file = pki_->server_cert;
  EXPECT_EQ(start(o), StatusCode::kInvalidArgument);  // cert without key
  o.tls_key_file = pki_->client_key;                  // someone else's key
  EXPECT_EQ(start(o), StatusCode::kInvalidArgument);
  o.tls_key_file = pki_->dir + "/missing.key";
  EXPECT_EQ(start(o), StatusCode::kNotFound);
  o.tls_key_file = pki_->server_key;
  o.tls_client_ca_file = pki_->dir + "/tokens-not-a-ca";
  WriteFile(pki_->dir, "tokens-not-a-ca", "not a certificate\n");
  EXPECT_EQ(start(o), StatusCode::kInvalidArgument);
  server::ServerOptions t = BaseOptions();
  t.auth_tokens_file = WriteFile(pki_->dir, "short-tokens", "writer short\n");
  EXPECT_EQ(start(t), StatusCode::kInvalidArgument);
  t.auth_tokens_file = pki_->dir + "/missing-tokens";
  EXPECT_EQ(start(t), StatusCode::kNotFound);
  server::ServerOptions m = BaseOptions();
  m.metrics_basic_auth_file = WriteFile(pki_->dir, "bad-basic", "no-colon-here\n");
  EXPECT_EQ(start(m), StatusCode::kInvalidArgument);
}

// The binary: a bad TLS file is a clear error at start and a non-zero exit.
TEST_F(TlsTest, ServerBinaryRefusesToStartWithBadTlsFiles) {
  struct Case {
    std::string flags;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {absl::StrCat("--tls_cert=", pki_->dir, "/nope.crt --tls_key=", pki_->server_key),
       "nope.crt"},
      {absl::StrCat("--tls_cert=", pki_->server_cert, " --tls_key=", pki_->client_key),
       "is not the key"},
      {absl::StrCat("--tls_cert=", pki_->server_cert), "must be given together"},
  };
  for (const Case& c : cases) {
    const std::string command =
        absl::StrCat("timeout 30 ", LOSSHEAD_SERVER_BIN,
                     " --listen=127.0.0.1:0 --metrics_listen= --backend=cpu ", c.flags, " 2>&1");
    FILE* pipe = ::popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    std::string output;
    char buffer[512];
    while (size_t n = std::fread(buffer, 1, sizeof(buffer), pipe)) output.append(buffer, n);
    const int status = ::pclose(pipe);
    ASSERT_TRUE(WIFEXITED(status)) << output;
    EXPECT_NE(WEXITSTATUS(status), 0) << output;
    EXPECT_NE(WEXITSTATUS(status), 124) << "the server started: " << output;
    EXPECT_TRUE(absl::StrContains(output, c.expected)) << output;
    EXPECT_FALSE(absl::StrContains(output, "serving gRPC")) << output;
  }
}

}  // namespace
}  // namespace losshead::testing
