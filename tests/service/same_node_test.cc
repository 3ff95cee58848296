// The same-node path (docs/same-node.md): a client on the server's host moves hidden states,
// targets and dH through shared memory. Its answers and dW are the network path's bit for bit;
// bad handles and ranges are refused with their exact codes and change nothing; a client that
// dies with regions open leaves nothing mapped; replays are exactly-once across both paths; a
// server with the path off is reached over the network.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/src/shared_region.h"
#include "gtest/gtest.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/raw_step_stream.h"
#include "tests/service/test_server.h"

namespace losshead::testing {
namespace {

constexpr int64_t kD = 48, kV = 211;

std::unique_ptr<client::Client> Connect(const std::string& target, bool same_node) {
  client::ClientOptions options;
  options.max_message_bytes = kTestServerMessageBytes;
  options.deadline = absl::Seconds(30);
  options.stream_deadline = absl::Seconds(60);
  options.same_node = same_node;
  auto c = client::Client::Connect(target, options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

void ExpectSameBits(const client::StepResult& a, const client::StepResult& b) {
  EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof(double)), 0) << a.loss << " vs " << b.loss;
  EXPECT_EQ(std::memcmp(&a.loss_sum, &b.loss_sum, sizeof(double)), 0);
  EXPECT_EQ(a.token_count, b.token_count);
  EXPECT_EQ(a.weights_version, b.weights_version);
  EXPECT_EQ(a.grad_hidden_dtype, b.grad_hidden_dtype);
  EXPECT_EQ(a.grad_hidden_bytes, b.grad_hidden_bytes);
  EXPECT_TRUE(SameBits(a.grad_hidden, b.grad_hidden));
  EXPECT_TRUE(SameBits(a.per_token_loss, b.per_token_loss));
  EXPECT_TRUE(SameBits(a.per_token_logprob, b.per_token_logprob));
  EXPECT_TRUE(SameBits(a.per_token_entropy, b.per_token_entropy));
  EXPECT_TRUE(SameBits(a.top_k_ids, b.top_k_ids));
  EXPECT_TRUE(SameBits(a.top_k_logprobs, b.top_k_logprobs));
}

// Sends `ms` through shared memory on `shm` and `mn` over the network on `net`, and expects the
// same answer bit for bit; the shared-memory answer goes to `out`.
void StepBothPaths(client::StepStream& shm, client::StepStream& net, const client::Microbatch& ms,
                   const client::Microbatch& mn, client::StepResult* out) {
  ASSERT_TRUE(shm.Send(ms).ok());
  ASSERT_TRUE(net.Send(mn).ok());
  auto rs = shm.Receive();
  auto rn = net.Receive();
  ASSERT_TRUE(rs.ok()) << rs.status();
  ASSERT_TRUE(rn.ok()) << rn.status();
  EXPECT_TRUE(rs->shared_memory);
  EXPECT_FALSE(rn->shared_memory);
  ExpectSameBits(*rs, *rn);
  *out = *std::move(rs);
}

// Mappings of memfds named `name` in this process (the in-process server's among them).
int MappingsNamed(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  int count = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:" + name) != std::string::npos) ++count;
  }
  return count;
}

class SameNodeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server::ServerOptions options = TestServer::Options(kTestServerMessageBytes, /*metrics=*/true);
    // dW's stash is added only when read: the two heads' dW then sum in the same order (an idle
    // flush between micro-batches would round differently), so they can be compared bit for bit.
    options.grad_stash_idle = absl::InfiniteDuration();
    auto s = TestServer::StartWith(options);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = s->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    client_ = server_->NewClient();
    ASSERT_NE(client_, nullptr);
    shm_ = Connect(server_->target(), true);
    net_ = Connect(server_->target(), false);
    ASSERT_NE(shm_, nullptr);
    ASSERT_NE(net_, nullptr);
    auto stats = client_->GetStats();
    ASSERT_TRUE(stats.ok()) << stats.status();
    ASSERT_TRUE(stats->has_same_node());
    socket_ = stats->same_node().socket();
  }

  v1::HeadInfo Info(const std::string& head) {
    auto info = client_->GetHead(head);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? *info : v1::HeadInfo();
  }

  static inline TestServer* server_ = nullptr;
  std::unique_ptr<client::Client> client_;
  std::unique_ptr<client::Client> shm_;
  std::unique_ptr<client::Client> net_;
  std::string socket_;
};

TEST_F(SameNodeTest, AnswersAndGradientMatchTheNetworkPathBitForBit) {
  EXPECT_EQ(shm_->data_path(), "shared_memory");
  EXPECT_EQ(net_->data_path(), "network");
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP32, v1::DTYPE_FP16}) {
    const std::string suffix = v1::DType_Name(dtype);
    // Two heads with the same W: one fed through shared memory, one over the network.
    auto a = CreateKnownHead(*client_, "shm-" + suffix, kV, kD, dtype, 7);
    auto b = CreateKnownHead(*client_, "net-" + suffix, kV, kD, dtype, 7);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    auto shm_stream = shm_->OpenStepStream();
    auto net_stream = net_->OpenStepStream();
    ASSERT_TRUE(shm_stream.ok() && net_stream.ok());
    EXPECT_STREQ((*shm_stream)->data_path(), "shared_memory");
    uint64_t seq = 0;
    for (int64_t n : {1, 37, 300, 5}) {
      for (int variant = 0; variant < 3; ++variant) {
        ++seq;
        const HostBatch batch = MakeBatch(n, kD, kV, dtype, 1000 * seq + n, /*ignore_every=*/4);
        client::Microbatch ms = ToMicrobatch(a->name, "shm", seq, batch);
        client::Microbatch mn = ToMicrobatch(b->name, "net", seq, batch);
        std::vector<std::byte> out_s, out_n;
        if (variant == 1) {
          // Every output, dH in fp32 into the caller's buffers.
          for (client::Microbatch* mb : {&ms, &mn}) {
            mb->options.set_return_per_token_loss(true);
            mb->options.add_token_outputs(v1::TOKEN_OUTPUT_LOGPROB);
            mb->options.add_token_outputs(v1::TOKEN_OUTPUT_ENTROPY);
            mb->options.set_top_k(3);
            mb->options.set_grad_hidden_dtype(v1::DTYPE_FP32);
          }
          out_s.resize(n * kD * 4);
          out_n.resize(n * kD * 4);
          ms.grad_hidden_out = std::span<std::byte>(out_s);
          mn.grad_hidden_out = std::span<std::byte>(out_n);
        } else if (variant == 2) {
          ms.options.set_skip_grad_hidden(true);
          mn.options.set_skip_grad_hidden(true);
        }
        client::StepResult rs;
        StepBothPaths(**shm_stream, **net_stream, ms, mn, &rs);
        if (HasFatalFailure()) return;
        EXPECT_EQ(out_s, out_n);
        if (variant == 1) EXPECT_GT(rs.grad_hidden_bytes, 0u);
      }
    }
    ASSERT_TRUE((*shm_stream)->Finish().ok());
    ASSERT_TRUE((*net_stream)->Finish().ok());
    auto ga = client_->PullGradient(a->name);
    auto gb = client_->PullGradient(b->name);
    ASSERT_TRUE(ga.ok() && gb.ok());
    EXPECT_EQ(ga->summary.token_count(), gb->summary.token_count());
    EXPECT_EQ(ga->summary.microbatch_count(), gb->summary.microbatch_count());
    EXPECT_EQ(ga->data, gb->data) << suffix << ": dW differs between the paths";
  }
}

// Hidden states and dH of 8 MiB and more go through the region on several threads at both ends
// (common/parallel_copy.h): the same bits as the network path, whether dH lands in the caller's
// buffer or in the result.
TEST_F(SameNodeTest, LargeMicroBatchesMatchTheNetworkPathBitForBit) {
  constexpr int64_t kWideD = 4096, kN = 600;  // 9.8 MB of fp32 hidden states, dH the same
  auto a = CreateKnownHead(*client_, "shm-large", kV, kWideD, v1::DTYPE_FP32, 12);
  auto b = CreateKnownHead(*client_, "net-large", kV, kWideD, v1::DTYPE_FP32, 12);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  auto shm_stream = shm_->OpenStepStream();
  auto net_stream = net_->OpenStepStream();
  ASSERT_TRUE(shm_stream.ok() && net_stream.ok());
  for (uint64_t seq = 1; seq <= 2; ++seq) {
    const HostBatch batch = MakeBatch(kN, kWideD, kV, v1::DTYPE_FP32, 77 + seq);
    client::Microbatch ms = ToMicrobatch(a->name, "shm", seq, batch);
    client::Microbatch mn = ToMicrobatch(b->name, "net", seq, batch);
    std::vector<std::byte> out_s, out_n;
    if (seq == 1) {
      out_s.resize(kN * kWideD * 4);
      out_n.resize(kN * kWideD * 4);
      ms.grad_hidden_out = std::span<std::byte>(out_s);
      mn.grad_hidden_out = std::span<std::byte>(out_n);
    }
    client::StepResult rs;
    StepBothPaths(**shm_stream, **net_stream, ms, mn, &rs);
    if (HasFatalFailure()) return;
    EXPECT_EQ(rs.grad_hidden_bytes, static_cast<uint64_t>(kN * kWideD * 4));
    EXPECT_EQ(rs.grad_hidden.size(), seq == 1 ? 0u : static_cast<size_t>(kN * kWideD * 4));
    EXPECT_TRUE(out_s == out_n) << "dH in the caller's buffer differs between the paths";
  }
  ASSERT_TRUE((*shm_stream)->Finish().ok());
  ASSERT_TRUE((*net_stream)->Finish().ok());
  auto ga = client_->PullGradient(a->name);
  auto gb = client_->PullGradient(b->name);
  ASSERT_TRUE(ga.ok() && gb.ok());
  EXPECT_EQ(ga->summary.microbatch_count(), 2u);
  EXPECT_TRUE(ga->data == gb->data) << "dW differs between the paths";
}

TEST_F(SameNodeTest, BytesAreCountedByPath) {
  auto head = CreateKnownHead(*client_, "bytes-by-path", kV, kD, v1::DTYPE_FP32, 3);
  ASSERT_TRUE(head.ok()) << head.status();
  const int port = server_->metrics_port();
  const std::string name = "losshead_step_data_bytes_total";
  const double shm_in = ScrapeSum(port, name, {{"path", "shared_memory"}, {"direction", "in"}});
  const double shm_out = ScrapeSum(port, name, {{"path", "shared_memory"}, {"direction", "out"}});
  const double net_in = ScrapeSum(port, name, {{"path", "network"}, {"direction", "in"}});
  const HostBatch batch = MakeBatch(64, kD, kV, v1::DTYPE_FP32, 11);
  auto r = shm_->Step(ToMicrobatch(head->name, "bytes", 1, batch));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->shared_memory);
  // The server counts a micro-batch once it is done with it; the answer may come first.
  const double in = batch.hidden_bytes.size() + batch.target_bytes.size();
  ASSERT_TRUE(ScrapeWhen(port, name, {{"path", "shared_memory"}, {"direction", "out"}},
                         shm_out + 64 * kD * 4)
                  .ok());
  EXPECT_EQ(ScrapeSum(port, name, {{"path", "shared_memory"}, {"direction", "in"}}), shm_in + in);
  EXPECT_EQ(ScrapeSum(port, name, {{"path", "shared_memory"}, {"direction", "out"}}),
            shm_out + 64 * kD * 4);
  // Nothing of the tensors came in the stream's messages.
  EXPECT_EQ(ScrapeSum(port, name, {{"path", "network"}, {"direction", "in"}}), net_in);
}

TEST_F(SameNodeTest, BadHandlesAndRangesAreRefusedAndChangeNothing) {
  auto head = CreateKnownHead(*client_, "bad-handles", kV, kD, v1::DTYPE_FP32, 5);
  ASSERT_TRUE(head.ok()) << head.status();
  constexpr int64_t kN = 32;
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 21);
  const uint64_t hidden = batch.hidden_bytes.size(), targets = batch.target_bytes.size();
  const uint64_t grad = kN * kD * 4;
  auto mine = client::SharedRegion::Register(socket_, "", size_t{1} << 20);
  auto other = client::SharedRegion::Register(socket_, "", size_t{1} << 20);
  auto small = client::SharedRegion::Register(socket_, "", 4096);
  ASSERT_TRUE(mine.ok() && other.ok() && small.ok()) << mine.status();
  ASSERT_EQ((*small)->size(), 4096u);
  ASSERT_LT(4096u, hidden);
  // Valid contents everywhere, so that a range wrongly accepted would compute.
  for (const auto* r : {&*mine, &*other}) {
    std::memcpy((*r)->data(), batch.hidden_bytes.data(), hidden);
    std::memcpy((*r)->data() + 65536, batch.target_bytes.data(), targets);
  }
  uint64_t closed_id = 0;
  std::string closed_key;
  double regions_open = 0;
  const int port = server_->metrics_port();
  {
    auto closed = client::SharedRegion::Register(socket_, "", size_t{1} << 20);
    ASSERT_TRUE(closed.ok()) << closed.status();
    closed_id = (*closed)->id();
    closed_key = (*closed)->key();
    regions_open = ScrapeSum(port, "losshead_shared_memory_regions");
  }
  // A region whose connection closed goes at once (the listener sees the close).
  for (absl::Time until = absl::Now() + absl::Seconds(5); absl::Now() < until;) {
    if (ScrapeSum(port, "losshead_shared_memory_regions") == regions_open - 1) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  auto ref_in = [&](const client::SharedRegion& r) {
    v1::SharedMemoryRef ref;
    ref.set_region_id(r.id());
    ref.set_region_key(r.key());
    ref.set_hidden_bytes(hidden);
    ref.set_targets_offset(65536);
    ref.set_targets_bytes(targets);
    ref.set_grad_hidden_offset(131072);
    ref.set_grad_hidden_bytes(grad);
    return ref;
  };
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  struct Case {
    const char* what;
    v1::SharedMemoryRef ref;
    grpc::StatusCode code;
    bool inline_hidden = false;
  };
  std::vector<Case> cases;
  auto add = [&](const char* what, grpc::StatusCode code, auto change) {
    Case c{what, ref_in(**mine), code};
    change(c);
    cases.push_back(c);
  };
  add("region too small", grpc::StatusCode::OUT_OF_RANGE, [&](Case& c) {
    c.ref = ref_in(**small);
    c.ref.set_targets_offset(0);
    c.ref.set_grad_hidden_offset(0);
    c.ref.set_grad_hidden_bytes(0);
  });
  add("hidden past the end", grpc::StatusCode::OUT_OF_RANGE,
      [&](Case& c) { c.ref.set_hidden_offset((size_t{1} << 20) - hidden + 4); });
  add("targets offset past the end", grpc::StatusCode::OUT_OF_RANGE,
      [&](Case& c) { c.ref.set_targets_offset(kMax); });
  add("targets length wraps", grpc::StatusCode::OUT_OF_RANGE,
      [&](Case& c) { c.ref.set_targets_bytes(kMax - 1000); });
  add("dH range past the end", grpc::StatusCode::OUT_OF_RANGE,
      [&](Case& c) { c.ref.set_grad_hidden_offset((size_t{1} << 20) - 8); });
  add("no room for dH", grpc::StatusCode::INVALID_ARGUMENT,
      [&](Case& c) { c.ref.set_grad_hidden_bytes(grad - 4); });
  add("another client's region", grpc::StatusCode::PERMISSION_DENIED,
      [&](Case& c) { c.ref.set_region_id((*other)->id()); });
  add("a key of the wrong length", grpc::StatusCode::PERMISSION_DENIED,
      [&](Case& c) { c.ref.set_region_key("short"); });
  add("never registered", grpc::StatusCode::NOT_FOUND,
      [&](Case& c) { c.ref.set_region_id(closed_id + 1000); });
  add("hidden states inline too", grpc::StatusCode::INVALID_ARGUMENT,
      [&](Case& c) { c.inline_hidden = true; });
  add("a device reference to a host region", grpc::StatusCode::INVALID_ARGUMENT,
      [&](Case& c) { c.ref.set_kind(v1::REGION_KIND_DEVICE); });
  add("closed region", grpc::StatusCode::NOT_FOUND, [&](Case& c) {
    c.ref.set_region_id(closed_id);
    c.ref.set_region_key(closed_key);
  });

  const v1::HeadInfo before = Info(head->name);
  RawStream stream(server_->target());
  for (size_t i = 0; i < cases.size(); ++i) {
    v1::StepRequest r = Header(head->name, "bad", i + 1, kN);
    *r.mutable_header()->mutable_shared_memory() = cases[i].ref;
    if (cases[i].inline_hidden) {
      r.set_hidden(reinterpret_cast<const char*>(batch.hidden_bytes.data()), hidden);
    }
    r.set_last(true);
    ASSERT_TRUE(stream.Write(r));
  }
  stream.WritesDone();
  stream.ReadInBackground();
  EXPECT_TRUE(stream.Ended().ok());
  const std::vector<ReadAnswer> answers = Answers(stream.responses());
  ASSERT_EQ(answers.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(answers[i].first.has_error()) << cases[i].what;
    EXPECT_EQ(answers[i].first.error().code(), static_cast<int>(cases[i].code))
        << cases[i].what << ": " << answers[i].first.error().message();
  }
  // Nothing counted, nothing in dW, and every key still free: the same keys through a good
  // region compute now.
  const v1::HeadInfo after = Info(head->name);
  EXPECT_EQ(after.microbatches_total(), before.microbatches_total());
  EXPECT_EQ(after.tokens_total(), before.tokens_total());
  auto gradient = client_->PullGradient(head->name);
  ASSERT_TRUE(gradient.ok());
  EXPECT_EQ(gradient->summary.microbatch_count(), 0u);
  auto stream2 = shm_->OpenStepStream();
  ASSERT_TRUE(stream2.ok());
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE((*stream2)->Send(ToMicrobatch(head->name, "bad", i + 1, batch)).ok());
    auto r = (*stream2)->Receive();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->replayed);
    EXPECT_TRUE(r->shared_memory);
  }
}

TEST_F(SameNodeTest, RegistrationRefusesUnsealedMemory) {
  const int fd = ::memfd_create("losshead-unsealed", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 1 << 20), 0);
  auto connection = transport::ConnectSeqpacket(socket_);
  ASSERT_TRUE(connection.ok()) << connection.status();
  v1::SharedMemoryRegister request;
  request.set_bytes(1 << 20);
  ASSERT_TRUE(transport::SendWithFd(connection->get(), request.SerializeAsString(), fd).ok());
  ::close(fd);
  auto reply = transport::ReceiveWithFd(connection->get(), 4096);
  ASSERT_TRUE(reply.ok()) << reply.status();
  v1::SharedMemoryRegistered answer;
  ASSERT_TRUE(answer.ParseFromString(reply->bytes));
  EXPECT_EQ(answer.code(), static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION))
      << answer.message();
  EXPECT_EQ(MappingsNamed("losshead-unsealed"), 0);
}

// One registration message on a fresh connection (with `fd` in SCM_RIGHTS unless -1): the
// server's answer.
v1::SharedMemoryRegistered RegisterRaw(const std::string& socket,
                                       const v1::SharedMemoryRegister& request, int fd = -1) {
  v1::SharedMemoryRegistered answer;
  auto connection = transport::ConnectSeqpacket(socket);
  EXPECT_TRUE(connection.ok()) << connection.status();
  if (!connection.ok()) return answer;
  EXPECT_TRUE(transport::SendWithFd(connection->get(), request.SerializeAsString(), fd).ok());
  auto reply = transport::ReceiveWithFd(connection->get(), 4096);
  EXPECT_TRUE(reply.ok()) << reply.status();
  if (reply.ok()) EXPECT_TRUE(answer.ParseFromString(reply->bytes));
  return answer;
}

// The device path on a server that computes on CPUs (whether built with CUDA or not): no devices
// offered, every device region refused FAILED_PRECONDITION, malformed registrations
// INVALID_ARGUMENT, and nothing registered by any of them.
TEST_F(SameNodeTest, DeviceRegionsAreRefusedOnAServerWithoutCudaDevices) {
  auto stats = client_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->same_node().devices_size(), 0);
  EXPECT_TRUE(shm_->SameNodeDevices().empty());
  const int port = server_->metrics_port();
  const double regions = ScrapeSum(port, "losshead_shared_memory_regions");
  const std::string handle(64, '\x5a');
  auto region = shm_->RegisterDeviceRegion(handle, 0, 1 << 20, "0000:00:00.0");
  ASSERT_FALSE(region.ok());
  EXPECT_EQ(region.status().code(), absl::StatusCode::kFailedPrecondition) << region.status();
  // The network client has no same-node path at all: the same code, from the client.
  auto net = net_->RegisterDeviceRegion(handle, 0, 1 << 20, "0000:00:00.0");
  EXPECT_EQ(net.status().code(), absl::StatusCode::kFailedPrecondition) << net.status();

  v1::SharedMemoryRegister device;
  device.set_kind(v1::REGION_KIND_DEVICE);
  device.set_bytes(1 << 20);
  device.set_device_handle(handle);
  EXPECT_EQ(RegisterRaw(socket_, device).code(),
            static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
  // A device registration that carries a descriptor, or a kind the server does not know.
  const int fd = ::memfd_create("losshead-device-with-fd", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 1 << 20), 0);
  ASSERT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  EXPECT_EQ(RegisterRaw(socket_, device, fd).code(),
            static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  v1::SharedMemoryRegister unknown;
  unknown.set_kind(static_cast<v1::RegionKind>(7));
  unknown.set_bytes(1 << 20);
  EXPECT_EQ(RegisterRaw(socket_, unknown, fd).code(),
            static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  ::close(fd);
  EXPECT_EQ(MappingsNamed("losshead-device-with-fd"), 0);
  EXPECT_EQ(ScrapeSum(port, "losshead_shared_memory_regions"), regions);
}

// A child process registers regions and is killed with them open: the server unmaps them.
TEST_F(SameNodeTest, AClientKilledWithRegionsOpenLeavesNothingMapped) {
  constexpr int kRegions = 3;
  constexpr size_t kBytes = size_t{1} << 20;
  const int port = server_->metrics_port();
  // The regions of earlier tests' clients are gone once their connections' closes are seen.
  const std::string mapped = "losshead_shared_memory_mapped_bytes";
  for (absl::Time until = absl::Now() + absl::Seconds(5); absl::Now() < until;) {
    if (ScrapeSum(port, mapped) == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(ScrapeSum(port, mapped), 0);
  ASSERT_EQ(MappingsNamed("losshead-dead-client"), 0);
  // Another process: posix_spawn, as fork would need this process's whole commit again.
  int ready[2];
  ASSERT_EQ(::pipe2(ready, O_CLOEXEC), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, ready[1], 1);
  const std::string regions = std::to_string(kRegions), bytes = std::to_string(kBytes);
  char* args[] = {const_cast<char*>(LOSSHEAD_REGION_HOLDER), const_cast<char*>(socket_.c_str()),
                  const_cast<char*>(regions.c_str()), const_cast<char*>(bytes.c_str()), nullptr};
  pid_t child = 0;
  ASSERT_EQ(::posix_spawn(&child, LOSSHEAD_REGION_HOLDER, &actions, nullptr, args, environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  ::close(ready[1]);
  char done = 0;
  ASSERT_EQ(::read(ready[0], &done, 1), 1) << "the child could not register its regions";
  ::close(ready[0]);
  EXPECT_EQ(MappingsNamed("losshead-dead-client"), kRegions);
  EXPECT_EQ(ScrapeSum(port, mapped), kRegions * kBytes);
  EXPECT_EQ(ScrapeSum(port, "losshead_shared_memory_regions"), kRegions);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  for (absl::Time until = absl::Now() + absl::Seconds(10); absl::Now() < until;) {
    if (MappingsNamed("losshead-dead-client") == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(MappingsNamed("losshead-dead-client"), 0);
  EXPECT_EQ(ScrapeSum(port, mapped), 0);
  EXPECT_EQ(ScrapeSum(port, "losshead_shared_memory_regions"), 0);
}

TEST_F(SameNodeTest, ReplaysAreExactlyOnceAcrossBothPaths) {
  auto head = CreateKnownHead(*client_, "replay", kV, kD, v1::DTYPE_BF16, 9);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(40, kD, kV, v1::DTYPE_BF16, 31, /*ignore_every=*/3);
  auto first = shm_->Step(ToMicrobatch(head->name, "once", 1, batch));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(first->shared_memory);
  EXPECT_FALSE(first->replayed);
  // Again through shared memory (another region offset: a fresh stream), then over the network:
  // the same bytes are the same micro-batch.
  auto stream = shm_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  ASSERT_TRUE((*stream)->Send(ToMicrobatch(head->name, "once", 1, batch)).ok());
  auto again = (*stream)->Receive();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->replayed);
  EXPECT_TRUE(again->shared_memory);
  ExpectSameBits(*again, *first);
  auto over_network = net_->Step(ToMicrobatch(head->name, "once", 1, batch));
  ASSERT_TRUE(over_network.ok()) << over_network.status();
  EXPECT_TRUE(over_network->replayed);
  ExpectSameBits(*over_network, *first);
  // Other bytes under the same key: ALREADY_EXISTS, through shared memory as over the network.
  const HostBatch other = MakeBatch(40, kD, kV, v1::DTYPE_BF16, 32, 3);
  auto differs = shm_->Step(ToMicrobatch(head->name, "once", 1, other));
  EXPECT_EQ(differs.status().code(), absl::StatusCode::kAlreadyExists) << differs.status();
  const v1::HeadInfo info = Info(head->name);
  EXPECT_EQ(info.microbatches_since_pull(), 1u);
  EXPECT_EQ(info.tokens_since_pull(), static_cast<uint64_t>(first->token_count));
}

// With tokens, a region is its registering token's: registering needs a writer's, and another
// token presenting its id and key is refused.
TEST(SameNodeTokensTest, ARegionServesOnlyTheTokenThatRegisteredIt) {
  const std::string kWriterA = "writer-a-0123456789abcdef", kWriterB = "writer-b-0123456789abcdef";
  const std::string kReader = "reader-0123456789abcdef";
  const std::string path = ::testing::TempDir() + "/same_node_tokens";
  {
    std::ofstream out(path);
    out << "writer " << kWriterA << "\nwriter " << kWriterB << "\nreader " << kReader << "\n";
  }
  server::ServerOptions options = TestServer::Options();
  options.auth_tokens_file = path;
  auto server = TestServer::StartWith(options);
  ASSERT_TRUE(server.ok()) << server.status();
  client::ClientOptions client_options;
  client_options.bearer_token = kWriterA;
  auto a = client::Client::Connect((*server)->target(), client_options);
  ASSERT_TRUE(a.ok());
  auto stats = (*a)->GetStats();
  ASSERT_TRUE(stats.ok() && stats->has_same_node()) << stats.status();
  const std::string socket = stats->same_node().socket();
  auto head = CreateKnownHead(**a, "tokens", kV, kD, v1::DTYPE_FP32, 4);
  ASSERT_TRUE(head.ok()) << head.status();
  constexpr int64_t kN = 8;
  const HostBatch batch = MakeBatch(kN, kD, kV, v1::DTYPE_FP32, 5);
  auto r = (*a)->Step(ToMicrobatch(head->name, "a", 1, batch));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->shared_memory);

  EXPECT_EQ(client::SharedRegion::Register(socket, "", 4096).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(client::SharedRegion::Register(socket, "Bearer " + kReader, 4096).status().code(),
            absl::StatusCode::kPermissionDenied);
  auto region = client::SharedRegion::Register(socket, "Bearer " + kWriterA, size_t{1} << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  std::memcpy((*region)->data(), batch.hidden_bytes.data(), batch.hidden_bytes.size());
  std::memcpy((*region)->data() + 65536, batch.target_bytes.data(), batch.target_bytes.size());
  auto step_with = [&](const std::string& token, uint64_t sequence) {
    RawStream stream((*server)->target(), token);
    v1::StepRequest request = Header(head->name, "raw", sequence, kN);
    v1::SharedMemoryRef* ref = request.mutable_header()->mutable_shared_memory();
    ref->set_region_id((*region)->id());
    ref->set_region_key((*region)->key());
    ref->set_hidden_bytes(batch.hidden_bytes.size());
    ref->set_targets_offset(65536);
    ref->set_targets_bytes(batch.target_bytes.size());
    ref->set_grad_hidden_offset(131072);
    ref->set_grad_hidden_bytes(kN * kD * 4);
    request.set_last(true);
    EXPECT_TRUE(stream.Write(request));
    stream.WritesDone();
    stream.ReadInBackground();
    EXPECT_TRUE(stream.Ended().ok());
    const std::vector<ReadAnswer> answers = Answers(stream.responses());
    EXPECT_EQ(answers.size(), 1u);
    return answers.empty() ? v1::StepResponse() : answers[0].first;
  };
  const v1::StepResponse other = step_with(kWriterB, 1);
  ASSERT_TRUE(other.has_error());
  EXPECT_EQ(other.error().code(), static_cast<int>(grpc::StatusCode::PERMISSION_DENIED));
  const v1::StepResponse own = step_with(kWriterA, 1);
  ASSERT_TRUE(own.has_result()) << own.error().message();
  EXPECT_TRUE(own.result().grad_hidden_in_shared_memory());
  EXPECT_FALSE(own.result().replayed());    // the refusal left the key free
  EXPECT_EQ(own.result().loss(), r->loss);  // the same bytes as the client's step
}

TEST(SameNodeDisabledTest, ClientsFallBackToTheNetworkPath) {
  server::ServerOptions options = TestServer::Options();
  options.same_node = false;
  auto server = TestServer::StartWith(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto c = Connect((*server)->target(), true);
  ASSERT_NE(c, nullptr);
  auto stats = c->GetStats();
  ASSERT_TRUE(stats.ok());
  EXPECT_FALSE(stats->has_same_node());
  EXPECT_EQ(c->data_path(), "network");
  auto head = CreateKnownHead(*c, "fallback", kV, kD, v1::DTYPE_FP32, 1);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch batch = MakeBatch(20, kD, kV, v1::DTYPE_FP32, 2);
  auto r = c->Step(ToMicrobatch(head->name, "fb", 1, batch));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->shared_memory);
  EXPECT_EQ(r->grad_hidden.size(), 20u * kD * 4);
  // A header naming shared memory anyway: FAILED_PRECONDITION, and its key stays free.
  RawStream stream((*server)->target());
  v1::StepRequest request = Header(head->name, "fb", 2, 20);
  request.mutable_header()->mutable_shared_memory()->set_region_id(1);
  request.set_last(true);
  ASSERT_TRUE(stream.Write(request));
  stream.WritesDone();
  stream.ReadInBackground();
  EXPECT_TRUE(stream.Ended().ok());
  const std::vector<ReadAnswer> answers = Answers(stream.responses());
  ASSERT_EQ(answers.size(), 1u);
  EXPECT_EQ(answers[0].first.error().code(),
            static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION));
  auto info = c->GetHead(head->name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 1u);
}

}  // namespace
}  // namespace losshead::testing
