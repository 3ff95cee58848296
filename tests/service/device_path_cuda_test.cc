// The same-node device path (docs/same-node.md, "The device path"): a CUDA-backend server process
// on GPU 0 opens this process's device buffers through their IPC handles (a server opens no
// handle of its own process, hence the child process). Answers and dW are the network path's
// bit for bit, from a buffer on GPU 0 and on GPU 1 (a peer) when there are two; bad handles and
// ranges are refused with their exact codes; a repeat replays across the paths with dH written
// into the region; a client killed with a region open leaves nothing open. Skips without a GPU.
#include <cuda_runtime.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "losshead/client/client.h"
#include "tests/common/server_process.h"
#include "tests/service/host_tensors.h"
#include "tests/service/metrics_scrape.h"
#include "tests/service/test_server.h"

extern char** environ;

namespace losshead::testing {
namespace {

constexpr int64_t kD = 64, kV = 257;
constexpr uint64_t kRegionBytes = uint64_t{4} << 20;

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return count;
}

std::string BusId(int device) {
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) return "";
  std::string id(bus);
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return id;
}

// A loopback port free now (for the server's metrics endpoint).
int FreePort() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(s);
  return port;
}

// A cudaMalloc'd buffer of this process on `device`, and its IPC handle's bytes.
struct DeviceBuffer {
  int device = 0;
  void* data = nullptr;
  uint64_t bytes = 0;
  std::string handle;
  DeviceBuffer(int d, uint64_t n) : device(d), bytes(n) {
    EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&data, bytes), cudaSuccess);
    cudaIpcMemHandle_t h;
    EXPECT_EQ(cudaIpcGetMemHandle(&h, data), cudaSuccess);
    handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
  }
  ~DeviceBuffer() {
    cudaSetDevice(device);
    cudaFree(data);
  }
  uint8_t* at(uint64_t offset) const { return static_cast<uint8_t*>(data) + offset; }
};

uint64_t Aligned(uint64_t bytes) { return (bytes + 255) / 256 * 256; }

class DevicePathTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (DeviceCount() < 1) return;
    metrics_port_ = FreePort();
    // dW's stash is added only when read, so that the two heads' dW sum in the same order.
    auto started =
        ServerProcess::Start(LOSSHEAD_SERVER_BINARY,
                             {"--backend=cuda", "--devices=0", "--grad_stash_idle=inf",
                              absl::StrCat("--metrics_listen=127.0.0.1:", metrics_port_)},
                             ::testing::TempDir() + "/device_path_server.log");
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = started->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    if (DeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
    ASSERT_NE(server_, nullptr);
    dev_ = Connect(true);
    net_ = Connect(false);
    ASSERT_NE(dev_, nullptr);
    ASSERT_NE(net_, nullptr);
  }

  static std::unique_ptr<client::Client> Connect(bool same_node) {
    client::ClientOptions options;
    options.deadline = absl::Seconds(30);
    options.stream_deadline = absl::Seconds(60);
    options.same_node = same_node;
    auto c = client::Client::Connect(server_->target(), options);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // `batch` laid out in `buffer` from `base` (hidden | targets | dH), named by a Microbatch.
  static client::Microbatch OnDevice(const std::string& head, const std::string& client_id,
                                     uint64_t sequence, const HostBatch& batch,
                                     const DeviceBuffer& buffer, uint64_t base,
                                     std::shared_ptr<const client::DeviceRegion> region) {
    const uint64_t hidden = batch.hidden_bytes.size(), targets = batch.target_bytes.size();
    EXPECT_EQ(
        cudaMemcpy(buffer.at(base), batch.hidden_bytes.data(), hidden, cudaMemcpyHostToDevice),
        cudaSuccess);
    EXPECT_EQ(cudaMemcpy(buffer.at(base + Aligned(hidden)), batch.target_bytes.data(), targets,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    // The ordering contract: every write of the tensors is finished before the header goes.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    client::Microbatch mb = ToMicrobatch(head, client_id, sequence, batch);
    mb.hidden = {};
    mb.targets = {};
    mb.device = client::Microbatch::DeviceTensors{
        .region = std::move(region),
        .hidden_offset = 0,
        .hidden_bytes = hidden,
        .targets_offset = Aligned(hidden),
        .targets_bytes = targets,
        .grad_hidden_offset = Aligned(hidden) + Aligned(targets),
        .grad_hidden_bytes = hidden * 4};  // room for dH in fp32, whatever the dtype
    return mb;
  }

  // dH as the server wrote it into the region (`bytes` of it).
  static std::vector<std::byte> GradIn(const DeviceBuffer& buffer, uint64_t base,
                                       const client::Microbatch& mb, uint64_t bytes) {
    std::vector<std::byte> out(bytes);
    EXPECT_EQ(cudaMemcpy(out.data(), buffer.at(base + mb.device->grad_hidden_offset), bytes,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return out;
  }

  static inline ServerProcess* server_ = nullptr;
  static inline int metrics_port_ = 0;
  std::unique_ptr<client::Client> dev_;
  std::unique_ptr<client::Client> net_;
};

void ExpectSameAnswer(const client::StepResult& a, const client::StepResult& b) {
  EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof(double)), 0) << a.loss << " vs " << b.loss;
  EXPECT_EQ(std::memcmp(&a.loss_sum, &b.loss_sum, sizeof(double)), 0);
  EXPECT_EQ(a.token_count, b.token_count);
  EXPECT_EQ(a.grad_hidden_dtype, b.grad_hidden_dtype);
  EXPECT_EQ(a.grad_hidden_bytes, b.grad_hidden_bytes);
  EXPECT_EQ(a.per_token_loss, b.per_token_loss);
}

TEST_F(DevicePathTest, TheServerOffersItsDevice) {
  const std::vector<client::SameNodeDevice> devices = dev_->SameNodeDevices();
  ASSERT_EQ(devices.size(), 1u);
  EXPECT_EQ(devices[0].index, 0);
  EXPECT_EQ(devices[0].pci_bus_id, BusId(0));
  EXPECT_TRUE(net_->SameNodeDevices().empty());
}

// From a buffer on GPU 0 (the server's), and on GPU 1 when there is one: a peer when the two
// have peer access, refused FAILED_PRECONDITION otherwise.
TEST_F(DevicePathTest, AnswersAndGradientMatchTheNetworkPathBitForBit) {
  auto control = Connect(false);
  for (int device = 0; device < std::min(DeviceCount(), 2); ++device) {
    SCOPED_TRACE(absl::StrCat("client buffer on GPU ", device));
    int peer = 1;
    if (device != 0) ASSERT_EQ(cudaDeviceCanAccessPeer(&peer, 0, device), cudaSuccess);
    DeviceBuffer buffer(device, kRegionBytes + 8192);
    // The region starts 4096 bytes into the allocation: offsets are the region's own.
    constexpr uint64_t kBase = 4096;
    auto region = dev_->RegisterDeviceRegion(buffer.handle, kBase, kRegionBytes, BusId(device));
    if (peer == 0) {
      EXPECT_EQ(region.status().code(), absl::StatusCode::kFailedPrecondition) << region.status();
      continue;
    }
    ASSERT_TRUE(region.ok()) << region.status();
    for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP32}) {
      const std::string suffix = absl::StrCat(v1::DType_Name(dtype), "-", device);
      auto a = CreateKnownHead(*control, "dev-" + suffix, kV, kD, dtype, 7);
      auto b = CreateKnownHead(*control, "net-" + suffix, kV, kD, dtype, 7);
      ASSERT_TRUE(a.ok()) << a.status();
      ASSERT_TRUE(b.ok()) << b.status();
      uint64_t seq = 0;
      for (int64_t n : {1, 37, 300, 5}) {
        for (bool fp32_grad : {false, true}) {
          ++seq;
          const HostBatch batch = MakeBatch(n, kD, kV, dtype, 1000 * seq + n, 4);
          client::Microbatch md = OnDevice(a->name, "dev", seq, batch, buffer, kBase, *region);
          client::Microbatch mn = ToMicrobatch(b->name, "net", seq, batch);
          md.options.set_return_per_token_loss(true);
          mn.options.set_return_per_token_loss(true);
          if (fp32_grad) {
            md.options.set_grad_hidden_dtype(v1::DTYPE_FP32);
            mn.options.set_grad_hidden_dtype(v1::DTYPE_FP32);
          }
          auto rd = dev_->Step(md);
          auto rn = net_->Step(mn);
          ASSERT_TRUE(rd.ok()) << rd.status();
          ASSERT_TRUE(rn.ok()) << rn.status();
          EXPECT_TRUE(rd->device);
          EXPECT_FALSE(rn->device);
          EXPECT_TRUE(rd->grad_hidden.empty());
          ExpectSameAnswer(*rd, *rn);
          EXPECT_EQ(GradIn(buffer, kBase, md, rd->grad_hidden_bytes), rn->grad_hidden);
        }
      }
      auto ga = control->PullGradient(a->name);
      auto gb = control->PullGradient(b->name);
      ASSERT_TRUE(ga.ok() && gb.ok());
      EXPECT_EQ(ga->summary.microbatch_count(), gb->summary.microbatch_count());
      EXPECT_EQ(ga->data, gb->data);
    }
  }
}

TEST_F(DevicePathTest, BadHandlesAreRefusedAndOpenNothing) {
  const double regions = ScrapeSum(metrics_port_, "losshead_shared_memory_regions");
  DeviceBuffer buffer(0, 1 << 20);
  const std::string bus = BusId(0);
  struct Case {
    const char* what;
    std::string handle;
    uint64_t offset;
    uint64_t bytes;
    absl::StatusCode code;
  };
  const Case cases[] = {
      {"a handle of 63 bytes", buffer.handle.substr(0, 63), 0, 4096,
       absl::StatusCode::kInvalidArgument},
      {"a handle that opens nothing", std::string(64, '\0'), 0, 4096,
       absl::StatusCode::kInvalidArgument},
      {"a region of 0 bytes", buffer.handle, 0, 0, absl::StatusCode::kInvalidArgument},
      // Past the allocation's end even where the driver rounds its extent up (to 2 MiB).
      {"a region past the allocation's end", buffer.handle, (1 << 20) - 100, 4 << 20,
       absl::StatusCode::kInvalidArgument},
      {"a region larger than the allocation", buffer.handle, 0, 8 << 20,
       absl::StatusCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    auto region = dev_->RegisterDeviceRegion(c.handle, c.offset, c.bytes, bus);
    EXPECT_EQ(region.status().code(), c.code) << c.what << ": " << region.status();
  }
  // A good one opens after all of those.
  auto good = dev_->RegisterDeviceRegion(buffer.handle, 0, 1 << 20, bus);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(ScrapeSum(metrics_port_, "losshead_shared_memory_regions"), regions + 1);
  good->reset();
  for (absl::Time until = absl::Now() + absl::Seconds(5); absl::Now() < until;) {
    if (ScrapeSum(metrics_port_, "losshead_shared_memory_regions") == regions) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(ScrapeSum(metrics_port_, "losshead_shared_memory_regions"), regions);
}

// A key first sent over the network replays through the device region (dH written into it), and
// other bytes under it are ALREADY_EXISTS, nothing counted twice.
TEST_F(DevicePathTest, ReplaysAreExactlyOnceAcrossThePaths) {
  auto control = Connect(false);
  auto head = CreateKnownHead(*control, "dev-replay", kV, kD, v1::DTYPE_BF16, 9);
  ASSERT_TRUE(head.ok()) << head.status();
  DeviceBuffer buffer(0, kRegionBytes);
  auto region = dev_->RegisterDeviceRegion(buffer.handle, 0, kRegionBytes, BusId(0));
  ASSERT_TRUE(region.ok()) << region.status();
  const HostBatch batch = MakeBatch(40, kD, kV, v1::DTYPE_BF16, 77);
  auto first = net_->Step(ToMicrobatch(head->name, "replay", 1, batch));
  ASSERT_TRUE(first.ok()) << first.status();
  client::Microbatch again = OnDevice(head->name, "replay", 1, batch, buffer, 0, *region);
  auto replayed = dev_->Step(again);
  ASSERT_TRUE(replayed.ok()) << replayed.status();
  EXPECT_TRUE(replayed->replayed);
  EXPECT_TRUE(replayed->device);
  EXPECT_EQ(GradIn(buffer, 0, again, replayed->grad_hidden_bytes), first->grad_hidden);
  const HostBatch other = MakeBatch(40, kD, kV, v1::DTYPE_BF16, 78);
  auto conflict = dev_->Step(OnDevice(head->name, "replay", 1, other, buffer, 0, *region));
  EXPECT_EQ(conflict.status().code(), absl::StatusCode::kAlreadyExists) << conflict.status();
  auto info = control->GetHead(head->name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), 1u);
}

// Micro-batches of one stream in flight at once, each in its own slice of one region and large
// enough for several copy pieces (4 MiB): each is copied out when it runs while the next ones are
// read and admitted; answers, dH and dW are the network path's bit for bit, and so are the
// digests: each key repeated over the network replays.
TEST_F(DevicePathTest, SeveralMicroBatchesOfOneStreamInFlightMatchTheNetworkPath) {
  constexpr int64_t kWideD = 1024, kTokens = 3000;
  constexpr int kInFlight = 6;
  auto control = Connect(false);
  auto a = CreateKnownHead(*control, "dev-stream", kV, kWideD, v1::DTYPE_BF16, 21);
  auto b = CreateKnownHead(*control, "net-stream", kV, kWideD, v1::DTYPE_BF16, 21);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  std::vector<HostBatch> batches;
  for (int i = 0; i < kInFlight; ++i) {
    batches.push_back(MakeBatch(kTokens - 7 * i, kWideD, kV, v1::DTYPE_BF16, 500 + i, 5));
  }
  const uint64_t hidden = batches[0].hidden_bytes.size();
  const uint64_t slice = Aligned(hidden) + Aligned(batches[0].target_bytes.size()) + hidden * 4;
  DeviceBuffer buffer(0, slice * kInFlight);
  // A region per slice: OnDevice lays its tensors out from the region's start.
  std::vector<std::shared_ptr<const client::DeviceRegion>> regions;
  for (int i = 0; i < kInFlight; ++i) {
    auto region = dev_->RegisterDeviceRegion(buffer.handle, slice * i, slice, BusId(0));
    ASSERT_TRUE(region.ok()) << region.status();
    regions.push_back(*region);
  }
  auto ds = dev_->OpenStepStream();
  auto ns = net_->OpenStepStream();
  ASSERT_TRUE(ds.ok() && ns.ok());
  std::vector<client::Microbatch> sent;
  for (int i = 0; i < kInFlight; ++i) {
    sent.push_back(OnDevice(a->name, "dev", i + 1, batches[i], buffer, slice * i, regions[i]));
    ASSERT_TRUE((*ds)->Send(sent.back()).ok());
    ASSERT_TRUE((*ns)->Send(ToMicrobatch(b->name, "net", i + 1, batches[i])).ok());
  }
  for (int i = 0; i < kInFlight; ++i) {
    SCOPED_TRACE(absl::StrCat("micro-batch ", i + 1));
    auto rd = (*ds)->Receive();
    auto rn = (*ns)->Receive();
    ASSERT_TRUE(rd.ok()) << rd.status();
    ASSERT_TRUE(rn.ok()) << rn.status();
    EXPECT_EQ(rd->sequence, static_cast<uint64_t>(i + 1));
    EXPECT_TRUE(rd->device);
    ExpectSameAnswer(*rd, *rn);
    EXPECT_EQ(GradIn(buffer, slice * i, sent[i], rd->grad_hidden_bytes), rn->grad_hidden);
  }
  EXPECT_TRUE((*ds)->Finish().ok());
  EXPECT_TRUE((*ns)->Finish().ok());
  auto ga = control->PullGradient(a->name);
  auto gb = control->PullGradient(b->name);
  ASSERT_TRUE(ga.ok() && gb.ok());
  EXPECT_EQ(ga->summary.microbatch_count(), static_cast<uint64_t>(kInFlight));
  EXPECT_EQ(ga->data, gb->data);
  // The digests taken as the pieces landed are the network path's: every key replays.
  for (int i = 0; i < kInFlight; ++i) {
    auto again = net_->Step(ToMicrobatch(a->name, "dev", i + 1, batches[i]));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->replayed) << "micro-batch " << i + 1;
  }
  auto info = control->GetHead(a->name);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->microbatches_total(), static_cast<uint64_t>(kInFlight));
}

// A client frees its region (the connection closes) right after sending a micro-batch that waits
// behind others of its stream. Its bytes are copied only when it runs: by then the region is
// unregistered and the micro-batch is refused NOT_FOUND with nothing counted, or it ran first.
// Either way the key is counted at most once: sent again over the network it computes (refused)
// or replays (ran). (TakeRegionInput's refusal itself: tests/server/region_input_test.cc.)
TEST_F(DevicePathTest, ARegionFreedWhileItsMicroBatchWaitsIsRefusedWithNothingCounted) {
  constexpr int64_t kWideD = 512, kWideV = 65536, kTokens = 4096;
  constexpr int kAhead = 6;
  auto control = Connect(false);
  auto head = CreateKnownHead(*control, "dev-freed", kWideV, kWideD, v1::DTYPE_BF16, 31);
  ASSERT_TRUE(head.ok()) << head.status();
  const HostBatch ahead = MakeBatch(kTokens, kWideD, kWideV, v1::DTYPE_BF16, 41);
  const HostBatch batch = MakeBatch(kTokens, kWideD, kWideV, v1::DTYPE_BF16, 42);
  // Room for dH in fp32 after the tensors (OnDevice's layout): about 5 x the hidden states.
  DeviceBuffer buffer(0, kRegionBytes * 8);
  auto region = dev_->RegisterDeviceRegion(buffer.handle, 0, buffer.bytes, BusId(0));
  ASSERT_TRUE(region.ok()) << region.status();
  auto stream = dev_->OpenStepStream();
  ASSERT_TRUE(stream.ok());
  // Compute-heavy micro-batches first (the device path: little to read), then the one to free.
  const std::vector<client::Microbatch> first = [&] {
    std::vector<client::Microbatch> out;
    for (int i = 0; i < kAhead; ++i) {
      out.push_back(OnDevice(head->name, "ahead", i + 1, ahead, buffer, 0, *region));
      out.back().options.set_skip_grad_hidden(true);
    }
    return out;
  }();
  for (const client::Microbatch& mb : first) ASSERT_TRUE((*stream)->Send(mb).ok());
  DeviceBuffer other(0, kRegionBytes * 8);
  {
    auto freed = dev_->RegisterDeviceRegion(other.handle, 0, other.bytes, BusId(0));
    ASSERT_TRUE(freed.ok()) << freed.status();
    client::Microbatch mb = OnDevice(head->name, "freed", 1, batch, other, 0, *freed);
    ASSERT_TRUE((*stream)->Send(mb).ok());
    mb.device->region.reset();
    freed->reset();  // the last holder: the connection closes, the server unregisters it
  }
  for (int i = 0; i < kAhead; ++i) {
    auto r = (*stream)->Receive();
    ASSERT_TRUE(r.ok()) << r.status();
  }
  auto answer = (*stream)->Receive();
  EXPECT_TRUE((*stream)->Finish().ok());
  auto info = control->GetHead(head->name);
  ASSERT_TRUE(info.ok());
  auto again = net_->Step(ToMicrobatch(head->name, "freed", 1, batch));
  ASSERT_TRUE(again.ok()) << again.status();
  if (answer.ok()) {
    RecordProperty("branch", "copied before the region went");
    EXPECT_EQ(info->microbatches_total(), static_cast<uint64_t>(kAhead + 1));
    EXPECT_TRUE(again->replayed);
  } else {
    RecordProperty("branch", "refused");
    EXPECT_EQ(answer.status().code(), absl::StatusCode::kNotFound) << answer.status();
    EXPECT_EQ(info->microbatches_total(), static_cast<uint64_t>(kAhead));
    EXPECT_FALSE(again->replayed);
  }
  auto after = control->GetHead(head->name);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->microbatches_total(), static_cast<uint64_t>(kAhead + 1));
}

// A child process registers a device region and is killed holding it: the server closes it.
TEST_F(DevicePathTest, AClientKilledWithARegionOpenLeavesNothingOpen) {
  auto stats = dev_->GetStats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  const double regions = ScrapeSum(metrics_port_, "losshead_shared_memory_regions");
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  const std::string socket = stats->same_node().socket();
  const std::string bytes = std::to_string(kRegionBytes);
  char* argv[] = {const_cast<char*>(LOSSHEAD_DEVICE_REGION_HOLDER),
                  const_cast<char*>(socket.c_str()), const_cast<char*>("0"),
                  const_cast<char*>(bytes.c_str()), nullptr};
  pid_t child = 0;
  ASSERT_EQ(posix_spawn(&child, argv[0], &actions, nullptr, argv, environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  char ready = 0;
  ASSERT_EQ(::read(out[0], &ready, 1), 1) << "the holder did not register its region";
  ::close(out[0]);
  EXPECT_EQ(ScrapeSum(metrics_port_, "losshead_shared_memory_regions"), regions + 1);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  for (absl::Time until = absl::Now() + absl::Seconds(5); absl::Now() < until;) {
    if (ScrapeSum(metrics_port_, "losshead_shared_memory_regions") == regions) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(ScrapeSum(metrics_port_, "losshead_shared_memory_regions"), regions);
  // The server goes on serving the device path.
  DeviceBuffer buffer(0, 1 << 20);
  auto region = dev_->RegisterDeviceRegion(buffer.handle, 0, 1 << 20, BusId(0));
  EXPECT_TRUE(region.ok()) << region.status();
}

}  // namespace
}  // namespace losshead::testing
