// `losshead bench`: synthetic micro-batches over several concurrent Step streams; reports tokens/s
// and the latency of each micro-batch from its first byte sent to its answer received. The head it
// creates has --weight_dtype weights (and --matmul_precision) drawn from N(0, 0.02) (GEMMs on zeros
// run ~15 % faster than on real weights; --zero_head keeps the old zero head for comparison). The
// hidden states go up and dH comes back in bf16 whatever the head's dtype: the server converts, as
// it would for a bf16 trainer. The result is checked before anything is timed: the first tokens'
// losses and dH rows against a float64 computation on the host from the downloaded W.
#include "client/cli/bench.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "client/cli/flags.h"
#include "client/cli/host_math.h"

namespace losshead::cli {
namespace {

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "bench: %s: %s\n", what.c_str(), status.ToString().c_str());
  return 1;
}

// One client per stream with dedicated connections, else one; each connected before anything is
// timed: a stream opened on a channel whose attempt failed would fail at once rather than wait
// for the next one (the timed streams do not retry).
absl::StatusOr<std::vector<std::unique_ptr<client::Client>>> Connect(
    const bench::Settings& settings) {
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int i = 0; i < (settings.dedicated_connections ? settings.streams : 1); ++i) {
    auto c = ConnectFromFlags(settings.dedicated_connections, settings.same_node);
    if (!c.ok()) return c.status();
    clients.push_back(std::move(*c));
  }
  for (const auto& c : clients) {
    if (!c->channel()->WaitForConnected(std::chrono::system_clock::now() +
                                        std::chrono::seconds(30))) {
      return absl::UnavailableError(
          absl::StrCat("no connection to ", absl::GetFlag(FLAGS_server), " in 30 s"));
    }
  }
  // Which way the tensors go, as the streams will take it.
  std::printf("bench: data path %s\n", clients.front()->data_path().c_str());
  return clients;
}

// The bench's own head (--weight_dtype weights drawn from N(0, 0.02), or zeros with --zero_head),
// as the server reports it: the dtype and precision the steps run with.
absl::StatusOr<v1::HeadInfo> CreateOwnHead(client::Client& admin, const std::string& head,
                                           const bench::Settings& settings) {
  v1::HeadSpec spec;
  spec.set_name(head);
  spec.set_vocab_size(settings.vocab_size);
  spec.set_hidden_size(settings.hidden_size);
  spec.set_weight_dtype(settings.weight_dtype);
  spec.set_matmul_precision(settings.matmul_precision);
  *spec.mutable_placement() = settings.placement;
  if (settings.zero_head) {
    spec.mutable_init()->set_zeros(true);
  } else {
    spec.mutable_init()->mutable_normal()->set_std(0.02f);
    // Not --seed itself, which draws the hidden states: W stays unrelated to them whatever
    // generator the server's init uses.
    spec.mutable_init()->mutable_normal()->set_seed(settings.seed ^ 0x9e3779b97f4a7c15ull);
  }
  return admin.CreateHead(spec);
}

bench::Batch RandomBatch(const bench::Settings& settings) {
  std::mt19937_64 rng(settings.seed);
  bench::Batch batch;
  batch.hidden =
      ToBf16(RandomNormal(static_cast<size_t>(settings.tokens * settings.hidden_size), 1.0f, rng));
  batch.targets.resize(settings.tokens);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(settings.vocab_size - 1));
  for (int32_t& t : batch.targets) t = pick(rng);
  return batch;
}

// The check, then the timed run; the exit code.
int CheckAndTime(const std::vector<std::unique_ptr<client::Client>>& clients,
                 const std::string& head, bool own_head, const bench::Settings& settings,
                 const std::string& numerics) {
  const bench::Batch batch = RandomBatch(settings);
  // A finite loss over every token always; on a head of our own, the first tokens' losses and
  // dH rows against the host (a head given by --head may be trained or shared).
  absl::StatusOr<double> mean_loss = bench::CheckStep(*clients[0], head, own_head, settings, batch);
  if (!mean_loss.ok()) return Fail("check step", mean_loss.status());
  std::printf(
      "bench: check ok (mean loss %.5f; %s)\n", *mean_loss,
      own_head ? "first tokens' loss and dH match float64 on the host" : "finite over every token");
  std::fflush(stdout);  // a progress line: seen before the timed run, also through a pipe
  const bench::TimedRun run = bench::RunTimed(clients, head, settings, batch);
  int exit_code = 0;
  for (const bench::StreamRecord& stream : run.streams) {
    if (!stream.status.ok() && exit_code == 0) exit_code = Fail("stream", stream.status);
  }
  bench::Report(run, settings, numerics);
  return exit_code;
}

}  // namespace

int RunBench() {
  const absl::StatusOr<bench::Settings> settings = bench::SettingsFromFlags();
  if (!settings.ok()) return Fail("flags", settings.status());
  auto clients = Connect(*settings);
  if (!clients.ok()) return Fail("connect", clients.status());
  client::Client& admin = *clients->front();

  std::string head = absl::GetFlag(FLAGS_head);
  const bool own_head = head.empty();
  if (own_head) head = absl::StrCat("bench-", getpid());
  absl::StatusOr<v1::HeadInfo> info =
      own_head ? CreateOwnHead(admin, head, *settings) : admin.GetHead(head);
  if (!info.ok()) return Fail(own_head ? "create head" : "get head", info.status());
  const std::string numerics = DescribeNumerics(info->spec());
  std::printf("bench: %s head %s V=%lld D=%lld %s on %s; hidden bf16 on the wire\n",
              own_head ? "created" : "given", head.c_str(),
              static_cast<long long>(info->spec().vocab_size()),
              static_cast<long long>(info->spec().hidden_size()), numerics.c_str(),
              absl::StrJoin(info->devices(), ", ").c_str());

  int exit_code = CheckAndTime(*clients, head, own_head, *settings, numerics);
  // --keep_head leaves it for a look at its metrics afterwards
  // (scripts/run-process-group-bench.sh).
  if (own_head && !absl::GetFlag(FLAGS_keep_head)) {
    if (absl::Status s = admin.DeleteHead(head); !s.ok() && exit_code == 0) {
      exit_code = Fail("delete head", s);
    }
  }
  return exit_code;
}

}  // namespace losshead::cli
