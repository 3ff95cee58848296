// Security between the processes of a group (docs/multi-process.md, "Security between processes"),
// with real server processes on loopback (CPU backend):
// - a group of 2 serving TLS (mTLS with bearer tokens and a group secret; server TLS only with
//   --group_tls_root_ca) forms, serves TLS clients, and cuts as a one-process plaintext server
//   given the same micro-batches (loss, the pull's counters and gradient, W after an apply
//   through a follower), the control between its processes over TLS; a checkpoint set through the
//   follower is complete on both, and each process's watch, probing its peer over TLS, keeps it
//   running past the op timeout;
// - a process holding another group secret, or none beside one that holds one, is refused at
//   bootstrap with PERMISSION_DENIED on both ends, and neither starts;
// - with bearer tokens and a group secret, the leader's periodic checkpoint sets are written on
//   every process; a client's token is checked by the process it calls only (each process here
//   knows a different client's token, and neither knows the processes' credential); the
//   processes' credential, derived here from its definition, opens ProcessControl and no LossHead
//   method; a client's writer token cannot drive ProcessControl.Apply;
// - the start refusals: TLS in a group without a root CA for the peers, a certificate that may not
//   be a client's under mTLS, periodic sets with tokens and no group secret.
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "losshead/v1/process_control.grpc.pb.h"
#include "tests/common/server_process.h"
#include "tests/multiprocess/group_util.h"
#include "tests/security/certs.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {
namespace {

namespace fs = std::filesystem;

constexpr char kSecret[] = "k3Jq8vX2pL9mN4tR7wY1zA6bC0dE5fG8hI2jK4lM";
constexpr char kOtherSecret[] = "another-group-secret-0123456789abcdefgh";
constexpr char kWriterA[] = "writer-token-of-client-a-0123456789";
constexpr char kWriterB[] = "writer-token-of-client-b-0123456789";
constexpr char kReaderB[] = "reader-token-of-client-b-0123456789";

std::string Temp(const std::string& name) {
  return absl::StrCat(::testing::TempDir(), "/gs_", getpid(), "_", name);
}

std::string WriteText(const std::string& name, const std::string& text) {
  const std::string path = Temp(name);
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
  return path;
}

// The processes' credential on ProcessControl, from its definition (server/security/
// group_secret.h): "Bearer " + hex(HMAC-SHA256(secret, "losshead ProcessControl credential v1")).
std::string ProcessCredential(const std::string& secret) {
  constexpr char kLabel[] = "losshead ProcessControl credential v1";
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(kLabel), sizeof(kLabel) - 1, mac, &length);
  return absl::StrCat("Bearer ", absl::BytesToHexString(absl::string_view(
                                     reinterpret_cast<const char*>(mac), length)));
}

std::map<uint64_t, std::set<std::string>> Sets(const std::string& dir) {
  std::map<uint64_t, std::set<std::string>> sets;
  std::error_code ec;
  for (const auto& set : fs::directory_iterator(dir + "/sets", ec)) {
    std::set<std::string>& files = sets[std::stoull(set.path().filename().string())];
    for (const auto& f : fs::directory_iterator(set.path())) {
      files.insert(f.path().filename().string());
    }
  }
  return sets;
}

class GroupSecurityTest : public ::testing::Test {
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

  static client::ClientOptions TlsOptions(bool client_cert, const std::string& token) {
    client::ClientOptions options;
    options.deadline = absl::Seconds(30);
    options.stream_deadline = absl::Seconds(60);
    options.retry.max_attempts = 1;
    options.tls_root_ca_file = pki_->ca_cert;
    if (client_cert) {
      options.tls_cert_file = pki_->client_cert;
      options.tls_key_file = pki_->client_key;
    }
    options.bearer_token = token;
    return options;
  }

  static TestPki* pki_;
};

TestPki* GroupSecurityTest::pki_ = nullptr;

// What each kind of TLS group is given beyond the group's flags, and how its clients connect.
struct TlsSetup {
  std::string name;
  bool mtls;                 // --tls_client_ca: clients (and the processes) present certificates
  bool tokens_and_secret;    // --auth_tokens_file and --group_secret_file
  bool sealed_mesh = false;  // --group_mesh_encryption (with the secret)
};

void PrintTo(const TlsSetup& setup, std::ostream* os) { *os << setup.name; }

class TlsGroupTest : public GroupSecurityTest, public ::testing::WithParamInterface<TlsSetup> {};

TEST_P(TlsGroupTest, FormsServesTlsClientsAndCutsAsWithoutTls) {
  const TlsSetup setup = GetParam();
  constexpr int n = 2;
  std::vector<std::string> extra;
  std::string token;
  if (setup.mtls) {
    extra = {"--tls_cert=" + pki_->peer_cert, "--tls_key=" + pki_->peer_key,
             "--tls_client_ca=" + pki_->ca_cert};
  } else {
    extra = {"--tls_cert=" + pki_->server_cert, "--tls_key=" + pki_->server_key,
             "--group_tls_root_ca=" + pki_->ca_cert};
  }
  if (setup.tokens_and_secret) {
    token = kWriterA;
    extra.push_back("--auth_tokens_file=" +
                    WriteText(setup.name + "_tokens", absl::StrCat("writer ", kWriterA, "\n")));
    extra.push_back("--group_secret_file=" +
                    WriteText(setup.name + "_secret", absl::StrCat(kSecret, "\n")));
    // The cut's sums, the pushes and the checkpoint set's agreement then go sealed.
    if (setup.sealed_mesh) extra.push_back("--group_mesh_encryption");
  }
  // With a checkpoint directory each process watches its peers (ProcessControl.Members every
  // second, over TLS here), and exits should a peer not answer within the op timeout.
  std::vector<std::string> dirs;
  for (int p = 0; p < n; ++p) {
    dirs.push_back(Temp(absl::StrCat(setup.name, "_ckpt_", p)));
    fs::remove_all(dirs.back());
    fs::create_directories(dirs.back());
  }
  Group group(GroupAddresses(n), setup.name, [&](int p) {
    std::vector<std::string> flags = extra;
    flags.push_back("--checkpoint_dir=" + dirs[p]);
    flags.push_back("--checkpoint_interval=0");
    return flags;
  });
  for (int p = 0; p < n; ++p) ASSERT_NE(group.processes[p], nullptr) << "process " << p;
  for (int p = 0; p < n; ++p) {
    const std::string log = ReadText(LogPath(absl::StrCat(setup.name, "_p", p)));
    EXPECT_NE(log.find(setup.sealed_mesh ? "mesh sealed, AES-256-GCM" : "mesh in the clear"),
              std::string::npos)
        << "process " << p << ": " << log;
  }
  // The clients speak TLS (the plaintext ones the group made would not get in).
  for (int p = 0; p < n; ++p) {
    auto c = client::Client::Connect(group.addresses[p], TlsOptions(setup.mtls, token));
    ASSERT_TRUE(c.ok()) << c.status();
    group.clients[p] = std::move(*c);
  }
  client::ClientOptions follow = TlsOptions(setup.mtls, token);
  follow.follow_home_redirect = true;
  auto redirected = client::Client::Connect(group.addresses[0], follow);
  ASSERT_TRUE(redirected.ok()) << redirected.status();
  // A plaintext client is not served.
  auto plain = Connect(group.addresses[1]);
  ASSERT_NE(plain, nullptr);
  auto refused = plain->GetHead(kHead);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();

  // Created through the follower: the leader runs it on both, over TLS between them.
  ASSERT_TRUE(group.clients[1]->CreateHead(Spec()).ok());
  Single all(setup.name + "_ref");
  ASSERT_NE(all.client, nullptr);
  ASSERT_TRUE(all.client->CreateHead(Spec()).ok());
  uint64_t tokens = 0, microbatches = 0;
  for (int k = 0; k < kPerClient; ++k) {
    for (int c = 0; c < kClients; ++c) {
      const std::string id = ClientId(c);
      const HostBatch batch = Batch(c, k);
      const client::Microbatch mb = ToMicrobatch(kHead, id, k + 1, batch);
      auto done = (k == kPerClient - 1 ? **redirected : *group.clients[Home(id, n)]).Step(mb);
      ASSERT_TRUE(done.ok()) << "client " << id << ": " << done.status();
      auto want = all.client->Step(mb);
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(done->loss_sum, want->loss_sum) << "client " << id << " k " << k;
      tokens += static_cast<uint64_t>(done->token_count);
      ++microbatches;
    }
  }
  auto reference = all.client->PullGradient(kHead);
  ASSERT_TRUE(reference.ok()) << reference.status();
  const std::vector<float> want = Floats(reference->data);
  const std::vector<double> want_wide(want.begin(), want.end());
  for (int p = 0; p < n; ++p) {
    auto pulled = group.clients[p]->PullGradient(kHead);
    ASSERT_TRUE(pulled.ok()) << "process " << p << ": " << pulled.status();
    EXPECT_EQ(pulled->summary.token_count(), tokens);
    EXPECT_EQ(pulled->summary.microbatch_count(), microbatches);
    EXPECT_TRUE(AllClose(Floats(pulled->data), want_wide, 1e-5)) << "process " << p;
  }
  auto applied = group.clients[1]->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(applied.ok()) << applied.status();
  auto want_applied = all.client->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(want_applied.ok()) << want_applied.status();
  EXPECT_EQ(applied->window().token_count(), tokens);
  EXPECT_EQ(applied->weights_version(), want_applied->weights_version());
  auto want_w = all.client->DownloadWeights(kHead);
  ASSERT_TRUE(want_w.ok()) << want_w.status();
  const std::vector<float> want_floats = Floats(want_w->data);
  const std::vector<double> want_w_wide(want_floats.begin(), want_floats.end());
  auto w0 = group.clients[0]->DownloadWeights(kHead);
  ASSERT_TRUE(w0.ok()) << w0.status();
  EXPECT_TRUE(AllClose(Floats(w0->data), want_w_wide, 1e-5));
  auto w1 = group.clients[1]->DownloadWeights(kHead);
  ASSERT_TRUE(w1.ok()) << w1.status();
  EXPECT_TRUE(w1->data == w0->data) << "the processes hold different W after the apply";
  // A checkpoint set through the follower, over TLS between them.
  auto set = group.clients[1]->Checkpoint();
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_TRUE(fs::exists(absl::StrFormat("%s/sets/%020d/MANIFEST", dirs[0], 1)));
  EXPECT_TRUE(fs::exists(absl::StrFormat("%s/sets/%020d/COMMITTED", dirs[1], 1)));
  // The watches' probes have been answered over TLS past the op timeout (5 s): both still run.
  absl::SleepFor(absl::Seconds(7));
  for (int p = 0; p < n; ++p) EXPECT_TRUE(group.processes[p]->Running()) << "process " << p;
}

INSTANTIATE_TEST_SUITE_P(
    Setups, TlsGroupTest,
    ::testing::Values(TlsSetup{"mtls_tokens", /*mtls=*/true, /*tokens_and_secret=*/true},
                      TlsSetup{"tls_root_ca", /*mtls=*/false, /*tokens_and_secret=*/false},
                      TlsSetup{"mtls_sealed", /*mtls=*/true, /*tokens_and_secret=*/true,
                               /*sealed_mesh=*/true}),
    [](const ::testing::TestParamInfo<TlsSetup>& info) {
      if (info.param.sealed_mesh) return std::string("MutualTlsTokensSecretAndSealedMesh");
      return std::string(info.param.mtls ? "MutualTlsTokensAndSecret" : "ServerTlsWithGroupRootCa");
    });

TEST_F(GroupSecurityTest, APeerWithAnotherSecretOrNoneIsRefusedAtBootstrapOnBothEnds) {
  const std::string mine = WriteText("secret_mine", kSecret);
  const std::string other = WriteText("secret_other", kOtherSecret);
  const auto another = StartExpectingExit(GroupAddresses(2), "another", [&](int p) {
    return std::vector<std::string>{"--group_secret_file=" + (p == 0 ? mine : other)};
  });
  EXPECT_EQ(another[0].first, 1) << another[0].second;
  EXPECT_NE(another[0].second.find("PERMISSION_DENIED"), std::string::npos) << another[0].second;
  EXPECT_NE(another[0].second.find("does not hold this group's secret"), std::string::npos)
      << another[0].second;
  EXPECT_EQ(another[1].first, 1) << another[1].second;
  EXPECT_NE(another[1].second.find("PERMISSION_DENIED"), std::string::npos) << another[1].second;
  EXPECT_NE(another[1].second.find("refused this process's group secret"), std::string::npos)
      << another[1].second;
  for (const auto& [code, log] : another) {
    EXPECT_EQ(log.find(kSecret), std::string::npos) << "a secret in a log";
    EXPECT_EQ(log.find(kOtherSecret), std::string::npos) << "a secret in a log";
  }

  const auto none = StartExpectingExit(GroupAddresses(2), "none", [&](int p) {
    return p == 0 ? std::vector<std::string>{"--group_secret_file=" + mine}
                  : std::vector<std::string>{};
  });
  EXPECT_EQ(none[0].first, 1) << none[0].second;
  EXPECT_NE(none[0].second.find("PERMISSION_DENIED"), std::string::npos) << none[0].second;
  EXPECT_NE(none[0].second.find("holds no group secret and this process requires one"),
            std::string::npos)
      << none[0].second;
  EXPECT_EQ(none[1].first, 1) << none[1].second;
  EXPECT_NE(none[1].second.find("PERMISSION_DENIED"), std::string::npos) << none[1].second;
  EXPECT_NE(none[1].second.find("requires a group secret (--group_secret_file)"), std::string::npos)
      << none[1].second;
}

TEST_F(GroupSecurityTest, PeriodicSetsWithTokensAndTheProcessesCredentialStaysOnProcessControl) {
  constexpr int n = 2;
  std::vector<std::string> dirs;
  for (int p = 0; p < n; ++p) {
    dirs.push_back(Temp(absl::StrCat("periodic_", p)));
    fs::remove_all(dirs.back());
    fs::create_directories(dirs.back());
  }
  // Each process knows its own clients' tokens only; neither knows the processes' credential.
  const std::vector<std::string> token_files = {
      WriteText("tokens_0", absl::StrCat("writer ", kWriterA, "\n")),
      WriteText("tokens_1", absl::StrCat("writer ", kWriterB, "\nreader ", kReaderB, "\n"))};
  const std::string secret = WriteText("secret_periodic", absl::StrCat(kSecret, "\n"));
  const GroupAddresses at(n);
  Group group(at, "periodic", [&](int p) {
    return std::vector<std::string>{"--checkpoint_dir=" + dirs[p], "--checkpoint_interval=200ms",
                                    "--auth_tokens_file=" + token_files[p],
                                    "--group_secret_file=" + secret};
  });
  for (int p = 0; p < n; ++p) ASSERT_NE(group.processes[p], nullptr) << "process " << p;
  client::ClientOptions options;
  options.deadline = absl::Seconds(30);
  options.retry.max_attempts = 1;
  options.bearer_token = kWriterB;
  auto writer = client::Client::Connect(group.addresses[1], options);
  ASSERT_TRUE(writer.ok()) << writer.status();
  options.bearer_token = kReaderB;
  auto reader = client::Client::Connect(group.addresses[1], options);
  ASSERT_TRUE(reader.ok()) << reader.status();

  // Client B's token is known to process 1 only: its control reaches every process all the same.
  ASSERT_TRUE((*writer)->CreateHead(Spec()).ok());
  int stepped = 0;
  for (int c = 0; c < kClients; ++c) {
    const std::string id = ClientId(c);
    if (Home(id, n) != 1) continue;
    auto done = (*writer)->Step(ToMicrobatch(kHead, id, 1, Batch(c, 0)));
    ASSERT_TRUE(done.ok()) << done.status();
    ++stepped;
  }
  ASSERT_GT(stepped, 0);
  auto applied = (*writer)->ApplyOptimizer(Apply(1));
  ASSERT_TRUE(applied.ok()) << applied.status();
  // The reader's role is checked where it calls: a pull with reset is refused there.
  auto reset = (*reader)->PullGradient(kHead, v1::DTYPE_FP32, /*reset=*/true);
  ASSERT_FALSE(reset.ok());
  EXPECT_EQ(reset.status().code(), absl::StatusCode::kPermissionDenied) << reset.status();

  // The leader's periodic sets: complete on every process (its manifest, the follower's marker).
  const absl::Time until = absl::Now() + absl::Seconds(20);
  auto complete = [&] {
    for (const auto& [cut, files] : Sets(dirs[0])) {
      if (files.contains("MANIFEST") && Sets(dirs[1])[cut].contains("COMMITTED")) return true;
    }
    return false;
  };
  while (absl::Now() < until && !complete()) absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(complete()) << "no periodic set completed on every process";

  // The processes' credential: ProcessControl.Members takes it; no LossHead method does.
  const std::string credential = ProcessCredential(kSecret);
  for (int p = 0; p < n; ++p) {
    auto channel = grpc::CreateChannel(group.addresses[p], grpc::InsecureChannelCredentials());
    {
      auto stub = v1::ProcessControl::NewStub(channel);
      grpc::ClientContext context;
      context.AddMetadata("authorization", credential);
      v1::MembersResponse members;
      const grpc::Status status = stub->Members(&context, v1::MembersRequest(), &members);
      EXPECT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(members.rank(), p);
    }
    {
      auto stub = v1::LossHead::NewStub(channel);
      grpc::ClientContext context;
      context.AddMetadata("authorization", credential);
      v1::GetHeadRequest request;
      request.set_name(kHead);
      v1::HeadInfo info;
      const grpc::Status status = stub->GetHead(&context, request, &info);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
    }
    // A client's writer token cannot drive ProcessControl.Apply (nor can no token): the head
    // stays.
    for (const std::string& authorization :
         {absl::StrCat("Bearer ", p == 0 ? kWriterA : kWriterB), std::string()}) {
      auto stub = v1::ProcessControl::NewStub(channel);
      grpc::ClientContext context;
      if (!authorization.empty()) context.AddMetadata("authorization", authorization);
      v1::ControlRequest request;
      request.set_sequence(1000000);
      request.mutable_delete_head()->set_name(kHead);
      v1::ControlResponse response;
      const grpc::Status status = stub->Apply(&context, request, &response);
      EXPECT_EQ(status.error_code(), authorization.empty() ? grpc::StatusCode::UNAUTHENTICATED
                                                           : grpc::StatusCode::PERMISSION_DENIED)
          << "process " << p << ": " << status.error_message();
    }
  }
  auto head = (*writer)->GetHead(kHead);
  ASSERT_TRUE(head.ok()) << head.status();
  EXPECT_EQ(head->optimizer_step(), 1u);
}

TEST_F(GroupSecurityTest, StartRefusalsNameTheMissingPiece) {
  struct Case {
    std::string name;
    std::vector<std::string> flags;
    std::string code;
    std::string text;
  };
  const std::string tokens = WriteText("tokens_refusal", absl::StrCat("writer ", kWriterA, "\n"));
  const std::vector<Case> cases = {
      {"no_root_ca",
       {"--tls_cert=" + pki_->server_cert, "--tls_key=" + pki_->server_key},
       "INVALID_ARGUMENT",
       "give --group_tls_root_ca"},
      {"server_only_cert",
       {"--tls_cert=" + pki_->server_cert, "--tls_key=" + pki_->server_key,
        "--tls_client_ca=" + pki_->ca_cert},
       "INVALID_ARGUMENT",
       "is not a client certificate"},
      {"periodic_tokens_no_secret",
       {"--checkpoint_dir=" + Temp("refusal_dir"), "--checkpoint_interval=1s",
        "--auth_tokens_file=" + tokens},
       "INVALID_ARGUMENT",
       "need --group_secret_file"},
      {"short_secret",
       {"--group_secret_file=" + WriteText("short_secret", "too-short\n")},
       "INVALID_ARGUMENT",
       "a group secret of 9 bytes (at least 16"},
      {"sealed_mesh_no_secret",
       {"--group_mesh_encryption"},
       "INVALID_ARGUMENT",
       "--group_mesh_encryption needs --group_secret_file"},
  };
  for (const Case& c : cases) {
    const GroupAddresses lonely(2);
    std::vector<std::string> flags = lonely.Flags(0);
    flags.insert(flags.end(), c.flags.begin(), c.flags.end());
    const std::string log = LogPath("refusal_" + c.name);
    auto code = ServerProcess::RunToExit(LOSSHEAD_SERVER_BINARY, flags, log, absl::Seconds(30));
    ASSERT_TRUE(code.ok()) << c.name << ": " << code.status();
    EXPECT_EQ(*code, 1) << c.name;
    const std::string text = ReadText(log);
    EXPECT_NE(text.find(c.code), std::string::npos) << c.name << ": " << text;
    EXPECT_NE(text.find(c.text), std::string::npos) << c.name << ": " << text;
  }
  // The group flags without a group.
  const std::string log = LogPath("refusal_no_group");
  auto code = ServerProcess::RunToExit(LOSSHEAD_SERVER_BINARY,
                                       {"--backend=cpu", "--group_secret_file=" + tokens}, log,
                                       absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 1);
  EXPECT_NE(ReadText(log).find("are for a process of a group (--group_peers)"), std::string::npos)
      << ReadText(log);
  const std::string sealed_log = LogPath("refusal_sealed_no_group");
  code =
      ServerProcess::RunToExit(LOSSHEAD_SERVER_BINARY, {"--backend=cpu", "--group_mesh_encryption"},
                               sealed_log, absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 1);
  EXPECT_NE(ReadText(sealed_log).find("are for a process of a group (--group_peers)"),
            std::string::npos)
      << ReadText(sealed_log);
}

}  // namespace
}  // namespace losshead::testing
