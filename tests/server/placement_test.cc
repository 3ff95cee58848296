// The engine's placements on their own, over CPU "devices": Placement::Create picks the layout the
// spec asks for (and refuses a device count that is not the placement's), each replica holds the
// rows its layout says, and W copied in through the placement comes back out bit for bit, the
// same on every device that holds a row, whatever the layout. The heads built on them are checked
// against the one-device head in replicated_head_test.cc and sharded_head_test.cc.
#include "server/engine/placement.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"
#include "server/engine/replica_group.h"
#include "server/engine/replicated_placement.h"
#include "server/engine/sharded_placement.h"

namespace losshead::server {
namespace {

constexpr int64_t kV = 11;
constexpr int64_t kD = 5;

struct Devices {
  std::vector<std::unique_ptr<kernels::Backend>> owned;
  std::vector<kernels::Backend*> list;
};

Devices MakeDevices(int k) {
  Devices devices;
  for (int r = 0; r < k; ++r) {
    auto backend = kernels::CreateBackend(kernels::BackendKind::kCpu);
    EXPECT_TRUE(backend.ok()) << backend.status();
    if (!backend.ok()) return devices;
    devices.list.push_back(backend->get());
    devices.owned.push_back(std::move(*backend));
  }
  return devices;
}

v1::HeadSpec Spec(v1::PlacementKind kind, int devices) {
  v1::HeadSpec spec;
  spec.set_name("h");
  spec.set_vocab_size(kV);
  spec.set_hidden_size(kD);
  spec.set_weight_dtype(v1::DTYPE_FP32);
  spec.mutable_placement()->set_kind(kind);
  spec.mutable_placement()->set_devices(devices);
  return spec;
}

struct Case {
  v1::PlacementKind kind;
  int k;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const char* kind = info.param.kind == v1::PLACEMENT_SHARDED      ? "sharded"
                     : info.param.kind == v1::PLACEMENT_REPLICATED ? "replicated"
                                                                   : "single";
  return std::string(kind) + "_k" + std::to_string(info.param.k);
}

class PlacementTest : public ::testing::TestWithParam<Case> {};

TEST_P(PlacementTest, PicksTheLayoutTheSpecAsksFor) {
  const Case c = GetParam();
  Devices devices = MakeDevices(c.k);
  auto placement = Placement::Create(devices.list, Spec(c.kind, c.k), kernels::DType::kFP32);
  ASSERT_TRUE(placement.ok()) << placement.status();
  Placement& p = **placement;
  const bool sharded = c.kind == v1::PLACEMENT_SHARDED;
  EXPECT_EQ(dynamic_cast<ShardedPlacement*>(&p) != nullptr, sharded);
  EXPECT_EQ(dynamic_cast<SingleDevicePlacement*>(&p) != nullptr, !sharded && c.k == 1);
  EXPECT_EQ(dynamic_cast<ReplicatedPlacement*>(&p) != nullptr, !sharded);
  ASSERT_EQ(p.group().size(), c.k);
  for (int r = 0; r < c.k; ++r) {
    const Replica& replica = p.group()[r];
    const kernels::Shard own = kernels::ShardRange(kV, c.k, r);
    EXPECT_EQ(replica.rows.begin, own.begin) << "rank " << r;
    EXPECT_EQ(replica.rows.end, own.end) << "rank " << r;
    EXPECT_EQ(replica.held.begin, sharded ? own.begin : 0) << "rank " << r;
    EXPECT_EQ(replica.held.end, sharded ? own.end : kV) << "rank " << r;
  }
  // The holders hold every row exactly once, in rank order.
  int64_t next_row = 0;
  for (const Replica* holder : p.WeightHolders()) {
    EXPECT_EQ(holder->held.begin, next_row);
    next_row = holder->held.end;
  }
  EXPECT_EQ(next_row, kV);
  EXPECT_EQ(p.WeightHolders().size(), sharded ? static_cast<size_t>(c.k) : 1u);

  // A device count other than the placement's is refused, nothing placed.
  Devices more = MakeDevices(c.k + 1);
  EXPECT_EQ(Placement::Create(more.list, Spec(c.kind, c.k), kernels::DType::kFP32).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(PlacementTest, CopiesWeightsInAndOutBitForBit) {
  const Case c = GetParam();
  Devices devices = MakeDevices(c.k);
  auto placement = Placement::Create(devices.list, Spec(c.kind, c.k), kernels::DType::kFP32);
  ASSERT_TRUE(placement.ok()) << placement.status();
  Placement& p = **placement;
  ReplicaGroup& group = p.group();
  for (int r = 0; r < c.k; ++r) {
    Replica& replica = group[r];
    auto stream = replica.backend.CreateStream();
    ASSERT_TRUE(stream.ok()) << stream.status();
    replica.stream = std::move(*stream);
    auto weights = replica.backend.Allocate(replica.held.size() * kD * sizeof(float));
    ASSERT_TRUE(weights.ok()) << weights.status();
    replica.weights = std::move(*weights);
  }
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> w(kV * kD);
  for (float& x : w) x = normal(rng);
  const char* host = reinterpret_cast<const char*>(w.data());
  {
    ReplicaGroup::Cut cut(group);
    // In two pieces split inside a row: each holder takes its part of each.
    const int64_t split = 2 * kD + 3;
    ASSERT_TRUE(p.CopyIn(&Replica::weights, sizeof(float), host, 0, split).ok());
    ASSERT_TRUE(p.CopyIn(&Replica::weights, sizeof(float), host + split * sizeof(float), split,
                         kV * kD - split)
                    .ok());
    ASSERT_TRUE(p.BroadcastWeights().ok());
    ASSERT_TRUE(group.Synchronize().ok());
  }
  // Every device holds its rows of W as they were sent.
  for (int r = 0; r < c.k; ++r) {
    const Replica& replica = group[r];
    const float* held = replica.weights.as<float>();
    for (int64_t j = 0; j < replica.held.size() * kD; ++j) {
      ASSERT_EQ(held[j], w[replica.held.begin * kD + j]) << "rank " << r << ", element " << j;
    }
  }
  std::vector<float> out(kV * kD, -1.0f);
  {
    const ReplicaGroup::DeviceLocks holders(p.WeightHolders());
    ASSERT_TRUE(p.CopyWeightsOut(reinterpret_cast<char*>(out.data())).ok());
    ASSERT_TRUE(p.SynchronizeHolders().ok());
  }
  EXPECT_EQ(std::memcmp(out.data(), w.data(), w.size() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(Layouts, PlacementTest,
                         ::testing::Values(Case{v1::PLACEMENT_UNSPECIFIED, 1},
                                           Case{v1::PLACEMENT_REPLICATED, 1},
                                           Case{v1::PLACEMENT_REPLICATED, 3},
                                           Case{v1::PLACEMENT_SHARDED, 1},
                                           Case{v1::PLACEMENT_SHARDED, 3}),
                         Name);

}  // namespace
}  // namespace losshead::server
