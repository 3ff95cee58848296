// `losshead bench`: the timed streams.
#include <unistd.h>

#include <deque>
#include <span>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/cli/bench.h"

namespace losshead::cli::bench {
namespace {

// One stream's loop: keeps `depth` micro-batches in flight until `more` says stop.
absl::Status RunStream(client::Client& client, const std::string& head, int index, int64_t n,
                       const Batch& batch, int depth, int64_t iterations, bool fresh_results,
                       Clock::time_point stop, std::vector<double>* latencies,
                       std::vector<Answered>* answers) {
  const std::string client_id = absl::StrCat("bench-", getpid(), "-", index);
  // At the client id's home when the server is one of a group holding the head together.
  auto stream = client.OpenStepStream(client_id);
  if (!stream.ok()) return stream.status();
  std::deque<Clock::time_point> started;
  // Micro-batch s writes its dH into grad[s % depth] as it arrives: at most `depth` are in flight
  // and answers come in order, so the buffer's previous micro-batch has been received. Written
  // once here, so that the timed run maps no pages (a fresh 64 MiB result costs 16,384 faults).
  std::vector<std::vector<std::byte>> grad(fresh_results ? 0 : depth);
  for (std::vector<std::byte>& g : grad) g.assign(batch.hidden.size() * sizeof(uint16_t), {});
  uint64_t sequence = 0;
  auto more = [&] {
    return iterations > 0 ? static_cast<int64_t>(sequence) < iterations : Clock::now() < stop;
  };
  absl::Status status;
  while (status.ok() && (more() || !started.empty())) {
    while (status.ok() && static_cast<int>(started.size()) < depth && more()) {
      started.push_back(Clock::now());
      client::Microbatch mb = MakeMicrobatch(head, client_id, ++sequence, n, batch);
      if (!grad.empty()) mb.grad_hidden_out = std::span<std::byte>(grad[sequence % depth]);
      status = (*stream)->Send(mb);
    }
    if (started.empty()) break;
    auto result = (*stream)->Receive();
    if (!result.ok()) {
      status = result.status();
      break;
    }
    const Clock::time_point now = Clock::now();
    latencies->push_back(std::chrono::duration<double>(now - started.front()).count());
    started.pop_front();
    answers->push_back({now, result->token_count});
  }
  absl::Status finished = (*stream)->Finish();
  return status.ok() ? finished : status;
}

}  // namespace

client::Microbatch MakeMicrobatch(const std::string& head, const std::string& client_id,
                                  uint64_t sequence, int64_t n, const Batch& batch) {
  client::Microbatch mb;
  mb.head = head;
  mb.client_id = client_id;
  mb.sequence = sequence;
  mb.num_tokens = n;
  mb.hidden_dtype = v1::DTYPE_BF16;
  mb.hidden = client::AsBytes(batch.hidden);
  mb.target_dtype = v1::DTYPE_INT32;
  mb.targets = client::AsBytes(batch.targets);
  return mb;
}

TimedRun RunTimed(const std::vector<std::unique_ptr<client::Client>>& clients,
                  const std::string& head, const Settings& settings, const Batch& batch) {
  TimedRun run;
  run.streams.resize(settings.streams);
  run.start = Clock::now();
  run.stop = run.start + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(settings.seconds));
  std::vector<std::thread> threads;
  for (int i = 0; i < settings.streams; ++i) {
    threads.emplace_back([&, i] {
      StreamRecord& r = run.streams[i];
      r.status = RunStream(*clients[settings.dedicated_connections ? i : 0], head, i,
                           settings.tokens, batch, settings.depth, settings.iterations,
                           settings.fresh_results, run.stop, &r.latencies, &r.answers);
    });
  }
  for (std::thread& t : threads) t.join();
  run.elapsed = std::chrono::duration<double>(Clock::now() - run.start).count();
  return run;
}

}  // namespace losshead::cli::bench
