// Benchmark of a vocabulary-sharded micro-batch (bf16, mean reduction): the shard sequence of
// losshead/kernels/shard_problem.h over k GPUs joined by NCCL (per token chunk: logits and
// statistics on every shard, AllGather, gradient and dH parts, Reduce of dH to shard 0, rounding on
// shard 0), against the unsharded fused Run on GPU 0, in one process on the same random data.
//
//   losshead_shard_bench [--n=8192] [--v=128256] [--d=4096] [--shards=1,2,4] [--runs=10]
//                        [--budget_mib=4096] [--one_gpu] [--fp32_logits] [--no_unsharded]
//                        [--stash=M] [--chunks=C] [--overlap] [--broadcast] [--no_exchange]
//
// Per k: the median wall time of the whole micro-batch (all shards' streams synchronised), its
// ratio to the unsharded call, and the device memory per GPU (W and dW rows, workspace, buffers).
// Every configuration is set up first and then timed in rounds of one call each, so that a GPU's
// clocks drifting over the run do not favour whichever is timed first.
// k larger than the visible GPUs is skipped. With --one_gpu, the k shards' sequences run one after
// another on GPU 0 with no exchange (statistics and partials are then one shard's, so the results
// are not the head's): the per-shard compute time a k-GPU run cannot beat, for hosts with one GPU.
// --fp32_logits runs both the unsharded call and the shards with CudaBackendOptions::bf16_logits
// off (the logits chunk in fp32). --no_unsharded skips the unsharded call, for a head too large
// for one GPU (no ratios then). --stash=M times M micro-batches per call, reported per
// micro-batch, and each k twice: adding to dW as they run, and with deferred dW (each shard's
// G and H into a stash of M micro-batches, then one flush per shard;
// losshead/kernels/grad_stash.h).
// --chunks=C splits each micro-batch into at least C token chunks. --overlap issues the exchanges
// on a second stream per shard, ordered by events, so that a chunk's dH sum runs beside the next
// chunk's logits. --broadcast sends H from shard 0 to the others first (as the server stages it
// on one shard), per chunk. --no_exchange runs the k GPUs with no collective at all (results are
// not the head's): the compute a k-GPU run cannot beat.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/bench/bench_util.h"
#include "kernels/bench/random_fill.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "losshead/kernels/backend.h"
#include "losshead/kernels/collective.h"

namespace losshead {
namespace {

using bench::Unwrap;
using kernels::Backend;
using kernels::DeviceBuffer;

// One shard's buffers and calls.
struct ShardState {
  Backend* backend = nullptr;
  std::unique_ptr<kernels::Stream> stream;
  std::unique_ptr<kernels::Stream> comm;  // --overlap: the exchanges' stream
  std::vector<cudaEvent_t> events;        // --overlap: reused every micro-batch
  kernels::ShardProblem problem;
  kernels::ShardArguments args;
  DeviceBuffer hidden, weight, targets, grad, stats, partial, workspace, grad_hidden, scalars;
  DeviceBuffer stash;  // deferred dW only
  size_t bytes = 0;    // what it holds
};

DeviceBuffer Alloc(Backend& backend, size_t bytes, size_t* total) {
  *total += bytes;
  return Unwrap(backend.Allocate(std::max<size_t>(bytes, 1)), "allocate");
}

cudaStream_t Native(kernels::Stream& stream) { return static_cast<cudaStream_t>(stream.native()); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// k shards (on GPUs 0..k-1, or all on GPU 0 with `one_gpu`), filled with the same random data
// (the counter-based fill gives every device the same H, targets, and its rows of one W). With
// stash_tokens > 0, each shard defers dW into a stash of that many tokens.
std::vector<ShardState> MakeShards(std::vector<std::unique_ptr<Backend>>& gpus, int k,
                                   const kernels::Problem& p, size_t budget, bool one_gpu,
                                   int64_t stash_tokens, int min_chunks) {
  std::vector<ShardState> s(k);
  int64_t chunk = p.n;
  for (int r = 0; r < k; ++r) {
    const kernels::Shard rows = kernels::ShardRange(p.v, k, r);
    s[r].backend = gpus[one_gpu ? 0 : r].get();
    s[r].problem = {.problem = p,
                    .row_begin = rows.begin,
                    .rows = rows.size(),
                    .shards = one_gpu ? 1 : k,
                    .rank = one_gpu ? 0 : r};
    chunk =
        std::min(chunk, Unwrap(s[r].backend->PlanShard(s[r].problem, budget), "plan").chunk_rows);
  }
  chunk = std::min(chunk, (p.n + min_chunks - 1) / min_chunks);
  chunk = kernels::BalancedChunkRows(p.n, chunk);  // as the server's engine runs them
  for (int r = 0; r < k; ++r) {
    ShardState& st = s[r];
    Backend& b = *st.backend;
    const int64_t rows = st.problem.rows;
    const kernels::ShardPlan plan = Unwrap(b.PlanShard(st.problem, budget), "plan");
    st.stream = Unwrap(b.CreateStream(), "stream");
    st.comm = Unwrap(b.CreateStream(), "stream");
    BENCH_CUDA(cudaSetDevice(b.device_ordinal()));
    st.events.resize(1 + (p.n + chunk - 1) / chunk);  // one for every wait, one per H chunk
    for (cudaEvent_t& e : st.events) {
      BENCH_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    }
    st.hidden = Alloc(b, p.n * p.d * 2, &st.bytes);
    st.weight = Alloc(b, rows * p.d * 2, &st.bytes);
    st.targets = Alloc(b, p.n * 4, &st.bytes);
    st.grad = Alloc(b, rows * p.d * 4, &st.bytes);
    st.stats = Alloc(b, st.problem.shards * kernels::kShardStats * chunk * 4, &st.bytes);
    st.partial = Alloc(b, chunk * p.d * 4, &st.bytes);
    st.workspace = Alloc(b, plan.workspace_bytes, &st.bytes);
    st.scalars = Alloc(b, 16, &st.bytes);
    // Shard 0 rounds dH; with one_gpu every shard runs alone, as its own shard 0.
    if (r == 0 || one_gpu) st.grad_hidden = Alloc(b, p.n * p.d * 2, &st.bytes);
    const cudaStream_t cs = Native(*st.stream);
    BENCH_CUDA(bench::FillUniformBf16(st.hidden.as<__nv_bfloat16>(), p.n * p.d, 1.0f, 1, cs));
    // Random rows of W, seeded by where they start.
    BENCH_CUDA(bench::FillUniformBf16(st.weight.as<__nv_bfloat16>(), rows * p.d, 0.02f,
                                      1000 + st.problem.row_begin, cs));
    BENCH_CUDA(bench::FillTargets(st.targets.as<int32_t>(), p.n, p.v, 7, cs));
    BENCH_CUDA(cudaMemsetAsync(st.grad.data(), 0, st.grad.bytes(), cs));
    kernels::ShardArguments& a = st.args;
    a.hidden = st.hidden.data();
    a.weight = st.weight.data();
    a.targets = st.targets.as<int32_t>();
    if (stash_tokens > 0) {
      const kernels::Problem shape = kernels::ShardStashShape(st.problem);
      st.stash = Alloc(b, Unwrap(b.GradStashBytes(shape, stash_tokens), "stash"), &st.bytes);
      a.grad_stash = {.data = st.stash.data(), .capacity = stash_tokens};
    } else {
      a.grad_weight = st.grad.as<float>();
    }
    a.grad_hidden_partial = st.partial.as<float>();
    a.stats = st.stats.as<float>();
    a.stats_chunk_rows = chunk;
    a.workspace = st.workspace.data();
    a.workspace_bytes = plan.workspace_bytes;
    if (r == 0 || one_gpu) {
      a.token_count = st.scalars.as<int64_t>();
      a.loss_sum = reinterpret_cast<float*>(st.scalars.as<char>() + 8);
    }
    BENCH_OK(st.stream->Synchronize());
  }
  return s;
}

// How a micro-batch's exchanges are issued.
struct Exchange {
  bool overlap = false;    // on each shard's second stream, ordered by events
  bool broadcast = false;  // H from shard 0 to the others, chunk by chunk
};

// `waiter` waits for the work issued on `signal` so far. A wait takes the event's state when it is
// issued, so one event serves every wait issued right after its record.
void After(ShardState& st, kernels::Stream& signal, kernels::Stream& waiter) {
  BENCH_CUDA(cudaSetDevice(st.backend->device_ordinal()));
  BENCH_CUDA(cudaEventRecord(st.events[0], Native(signal)));
  BENCH_CUDA(cudaStreamWaitEvent(Native(waiter), st.events[0], 0));
}

// One micro-batch over the shards, as the server's engine drives it (shard_step.cc).
void RunSharded(std::vector<ShardState>& s, kernels::Collective* collective, int64_t n, int64_t d,
                Exchange ex) {
  const int64_t chunk_rows = s[0].args.stats_chunk_rows;
  std::vector<void*> stats, partials, hidden;
  std::vector<kernels::Stream*> streams, comms;
  for (ShardState& st : s) {
    stats.push_back(st.stats.data());
    partials.push_back(st.partial.data());
    hidden.push_back(st.hidden.data());
    streams.push_back(st.stream.get());
    comms.push_back(ex.overlap ? st.comm.get() : st.stream.get());
    BENCH_OK(st.backend->ShardBegin(st.problem, st.args, *st.stream));
    if (ex.overlap) After(st, *st.stream, *st.comm);
  }
  const std::vector<int64_t> slices(s.size(), kernels::kShardStats * chunk_rows);
  const auto chunk_at = [&](int64_t t0) {
    return kernels::ShardChunk{.begin = t0, .size = std::min(chunk_rows, n - t0)};
  };
  const bool broadcast = ex.broadcast && collective != nullptr;
  if (broadcast) {
    // Every chunk's rows of H ahead of the exchanges, so that chunk c + 1's arrive while chunk c
    // computes; chunk c's event (events[1 + c]) marks its arrival.
    for (int64_t t0 = 0, c = 0; t0 < n; t0 += chunk_rows, ++c) {
      std::vector<void*> rows;
      for (void* h : hidden) rows.push_back(static_cast<char*>(h) + t0 * d * 2);
      BENCH_OK(collective->Broadcast(rows, chunk_at(t0).size * d, kernels::DType::kBF16, 0, comms));
      if (!ex.overlap) continue;
      for (ShardState& st : s) {
        BENCH_CUDA(cudaSetDevice(st.backend->device_ordinal()));
        BENCH_CUDA(cudaEventRecord(st.events[1 + c], Native(*st.comm)));
      }
    }
  }
  for (int64_t t0 = 0, c = 0; t0 < n; t0 += chunk_rows, ++c) {
    const kernels::ShardChunk chunk = chunk_at(t0);
    for (ShardState& st : s) {
      if (broadcast && ex.overlap) {
        BENCH_CUDA(cudaSetDevice(st.backend->device_ordinal()));
        BENCH_CUDA(cudaStreamWaitEvent(Native(*st.stream), st.events[1 + c], 0));
      }
      BENCH_OK(st.backend->ShardForward(st.problem, st.args, chunk, *st.stream));
      if (ex.overlap) After(st, *st.stream, *st.comm);
    }
    if (collective != nullptr) {
      BENCH_OK(collective->AllGather(stats, slices, kernels::DType::kFP32, comms));
    }
    for (ShardState& st : s) {
      if (ex.overlap) After(st, *st.comm, *st.stream);
      BENCH_OK(st.backend->ShardBackward(st.problem, st.args, chunk, *st.stream));
      if (ex.overlap) After(st, *st.stream, *st.comm);
    }
    if (collective != nullptr) {
      BENCH_OK(collective->Reduce(partials, chunk.size * d, kernels::DType::kFP32, 0, comms));
    }
    BENCH_OK(s[0].backend->ShardStoreGradHidden(s[0].problem, s[0].partial.as<float>(), chunk,
                                                s[0].grad_hidden.data(), *comms[0]));
  }
  for (ShardState& st : s) {
    BENCH_OK(st.stream->Synchronize());
    BENCH_OK(st.comm->Synchronize());
  }
}

// `m` micro-batches one after another; with stashes, each into the next rows, then one flush per
// shard adds them all to its dW.
void RunMicroBatches(std::vector<ShardState>& s, kernels::Collective* collective, int64_t n,
                     int64_t d, int m, Exchange ex) {
  for (int i = 0; i < m; ++i) {
    for (ShardState& st : s) st.args.grad_stash.tokens = i * n;
    RunSharded(s, collective, n, d, ex);
  }
  // Every shard's flush launched before any is waited for, as the server flushes them.
  for (ShardState& st : s) {
    if (st.stash.data() == nullptr) continue;
    const kernels::GradStash all{
        .data = st.stash.data(), .capacity = st.args.grad_stash.capacity, .tokens = m * n};
    BENCH_OK(st.backend->FlushGradStash(kernels::ShardStashShape(st.problem), all,
                                        st.grad.as<float>(), st.workspace.data(),
                                        st.workspace.bytes(), *st.stream));
  }
  for (ShardState& st : s) BENCH_OK(st.stream->Synchronize());
}

// The unsharded fused call's buffers on one GPU (the one-device head's Run).
struct WholeState {
  std::unique_ptr<kernels::Stream> stream;
  DeviceBuffer hidden, weight, targets, grad, grad_hidden, scalars, workspace;
  kernels::Arguments args;
  size_t bytes = 0;
};

WholeState MakeWhole(Backend& b, const kernels::Problem& p, size_t budget) {
  WholeState w;
  const int64_t n = p.n, d = p.d, v = p.v;
  w.stream = Unwrap(b.CreateStream(), "stream");
  const cudaStream_t cs = Native(*w.stream);
  BENCH_CUDA(cudaSetDevice(b.device_ordinal()));
  w.hidden = Alloc(b, n * d * 2, &w.bytes);
  w.weight = Alloc(b, v * d * 2, &w.bytes);
  w.targets = Alloc(b, n * 4, &w.bytes);
  w.grad = Alloc(b, v * d * 4, &w.bytes);
  w.grad_hidden = Alloc(b, n * d * 2, &w.bytes);
  w.scalars = Alloc(b, 16, &w.bytes);
  const size_t ws_bytes = Unwrap(b.WorkspaceBytes(p, budget), "workspace");
  w.workspace = Alloc(b, ws_bytes, &w.bytes);
  BENCH_CUDA(bench::FillUniformBf16(w.hidden.as<__nv_bfloat16>(), n * d, 1.0f, 1, cs));
  BENCH_CUDA(bench::FillUniformBf16(w.weight.as<__nv_bfloat16>(), v * d, 0.02f, 1000, cs));
  BENCH_CUDA(bench::FillTargets(w.targets.as<int32_t>(), n, v, 7, cs));
  BENCH_CUDA(cudaMemsetAsync(w.grad.data(), 0, w.grad.bytes(), cs));
  kernels::Arguments& a = w.args;
  a.hidden = w.hidden.data();
  a.weight = w.weight.data();
  a.targets = w.targets.as<int32_t>();
  a.grad_hidden = w.grad_hidden.data();
  a.grad_weight = w.grad.as<float>();
  a.token_count = w.scalars.as<int64_t>();
  a.loss_sum = reinterpret_cast<float*>(w.scalars.as<char>() + 8);
  a.workspace = w.workspace.data();
  a.workspace_bytes = ws_bytes;
  BENCH_OK(w.stream->Synchronize());
  return w;
}

// One timed call (a whole micro-batch, every stream it uses synchronised) and its wall times.
struct Timed {
  std::function<void()> call;
  std::vector<double> ms;
  double Median() const { return losshead::Median(ms); }
};

// Two warm-up rounds (plans, handles, NCCL channels), then `runs` rounds of every call once each,
// so that clock and temperature drift over the run weighs on all of them alike.
void TimeInterleaved(std::vector<Timed>& timed, int runs) {
  for (int round = 0; round < 2; ++round) {
    for (Timed& t : timed) t.call();
  }
  for (int round = 0; round < runs; ++round) {
    for (Timed& t : timed) {
      const auto start = std::chrono::steady_clock::now();
      t.call();
      t.ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
    }
  }
}

int Main(int argc, char** argv) {
  int64_t n = 8192, v = 128256, d = 4096;
  int runs = 10;
  size_t budget = size_t{4096} << 20;
  bool one_gpu = false;
  kernels::CudaBackendOptions options;
  bool unsharded = true;
  int stash = 0;  // micro-batches per timed call with deferred dW; 0: one, no deferral
  int min_chunks = 1;
  Exchange exchange;
  bool no_exchange = false;
  std::vector<int> shard_counts = {1, 2, 4};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--n=", 0) == 0) n = std::atoll(a.c_str() + 4);
    if (a.rfind("--v=", 0) == 0) v = std::atoll(a.c_str() + 4);
    if (a.rfind("--d=", 0) == 0) d = std::atoll(a.c_str() + 4);
    if (a.rfind("--runs=", 0) == 0) runs = std::max(1, std::atoi(a.c_str() + 7));
    if (a.rfind("--budget_mib=", 0) == 0) budget = size_t(std::atoll(a.c_str() + 13)) << 20;
    if (a == "--one_gpu") one_gpu = true;
    if (a == "--fp32_logits") options.bf16_logits = false;
    if (a == "--no_unsharded") unsharded = false;
    if (a.rfind("--stash=", 0) == 0) stash = std::max(0, std::atoi(a.c_str() + 8));
    if (a.rfind("--chunks=", 0) == 0) min_chunks = std::max(1, std::atoi(a.c_str() + 9));
    if (a == "--overlap") exchange.overlap = true;
    if (a == "--broadcast") exchange.broadcast = true;
    if (a == "--no_exchange") no_exchange = true;
    if (a.rfind("--shards=", 0) == 0) {
      shard_counts.clear();
      for (absl::string_view part : absl::StrSplit(a.substr(9), ',')) {
        int k = 0;
        if (!absl::SimpleAtoi(part, &k) || k < 1) {
          std::fprintf(stderr, "bad --shards\n");
          return 2;
        }
        shard_counts.push_back(k);
      }
    }
  }
  const int gpus_visible = kernels::CudaDeviceCount();
  if (gpus_visible < 1) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  std::vector<std::unique_ptr<Backend>> gpus;
  for (int i = 0; i < gpus_visible; ++i) {
    gpus.push_back(Unwrap(kernels::CreateCudaBackend(i, options), "backend"));
  }
  const kernels::Problem p{.n = n, .d = d, .v = v, .dtype = kernels::DType::kBF16};
  std::printf(
      "shard_bench: N=%lld V=%lld D=%lld bf16 mean, %s logits, budget %zu MiB, %d GPU(s): "
      "%s%s%s%s%s\n",
      static_cast<long long>(n), static_cast<long long>(v), static_cast<long long>(d),
      options.bf16_logits ? "bf16" : "fp32", budget >> 20, gpus_visible,
      gpus[0]->device_description().c_str(),
      one_gpu ? ", shards one after another on GPU 0 (no exchange)" : "",
      no_exchange ? ", no exchange" : "",
      exchange.overlap ? ", exchanges on their own streams" : "",
      exchange.broadcast ? ", H broadcast from shard 0" : "");

  // Every configuration is set up first, then timed round by round (TimeInterleaved): the
  // unsharded fused call on GPU 0 (the one-device head's Run), then each k.
  std::vector<Timed> timed;
  WholeState whole;
  if (unsharded) {
    whole = MakeWhole(*gpus[0], p, budget);
    timed.push_back({[&] {
      for (int i = 0; i < std::max(stash, 1); ++i) {
        BENCH_OK(gpus[0]->Run(p, whole.args, *whole.stream));
        BENCH_OK(whole.stream->Synchronize());
      }
    }});
  }
  const int per_call = std::max(stash, 1);
  struct Placement {
    int k;
    bool deferred = false;
    std::vector<ShardState> shards;
    std::unique_ptr<kernels::Collective> collective;
    size_t first_timed = 0;  // its calls in `timed`: one, or with --one_gpu one per shard
  };
  std::vector<Placement> placements;
  std::vector<std::pair<int, bool>> configurations;
  for (int k : shard_counts) {
    configurations.emplace_back(k, false);
    if (stash > 0) configurations.emplace_back(k, true);
  }
  placements.reserve(configurations.size());  // the calls below hold pointers into them
  for (const auto& [k, deferred] : configurations) {
    if (!one_gpu && k > gpus_visible) {
      if (!deferred) std::printf("k=%d: skipped, %d GPU(s) visible\n", k, gpus_visible);
      continue;
    }
    Placement& pl = placements.emplace_back();
    pl.k = k;
    pl.deferred = deferred;
    pl.shards = MakeShards(gpus, k, p, budget, one_gpu, deferred ? stash * n : 0, min_chunks);
    if (!one_gpu && !no_exchange && k > 1) {
      std::vector<Backend*> devices;
      for (int r = 0; r < k; ++r) devices.push_back(gpus[r].get());
      pl.collective = Unwrap(kernels::CreateCollective(devices), "collective");
    }
    pl.first_timed = timed.size();
    if (one_gpu) {
      // Each shard's sequence alone; the slowest is what k GPUs would wait for.
      for (ShardState& st : pl.shards) {
        timed.push_back({[&st, n, d, per_call] {
          std::vector<ShardState> one;
          one.push_back(std::move(st));
          RunMicroBatches(one, nullptr, n, d, per_call, Exchange{});
          st = std::move(one[0]);
        }});
      }
    } else {
      timed.push_back({[&pl, n, d, per_call, exchange] {
        RunMicroBatches(pl.shards, pl.collective.get(), n, d, per_call, exchange);
      }});
    }
  }
  TimeInterleaved(timed, runs);

  const double whole_ms = unsharded ? timed[0].Median() / per_call : 0;
  if (unsharded) {
    std::printf("unsharded Run on GPU 0: %.2f ms, %.0f tokens/s, device memory %.2f GiB\n",
                whole_ms, n / whole_ms * 1e3, whole.bytes / double(1 << 30));
  }
  for (const Placement& pl : placements) {
    const size_t calls = one_gpu ? pl.shards.size() : 1;
    double ms = 0;
    for (size_t i = 0; i < calls; ++i) ms = std::max(ms, timed[pl.first_timed + i].Median());
    ms /= per_call;
    size_t most = 0;
    for (const ShardState& st : pl.shards) most = std::max(most, st.bytes);
    const std::string ratio = unsharded ? absl::StrFormat(" (%.3f of unsharded; target <= %.3f)",
                                                          ms / whole_ms, 1.25 / pl.k)
                                        : "";
    const std::string mode =
        stash == 0 ? ""
                   : absl::StrFormat(pl.deferred ? ", deferred dW (%d into a stash, one flush)"
                                                 : ", dW as they run (%d in a row)",
                                     stash);
    std::printf(
        "k=%d%s: %.2f ms per micro-batch%s, %.0f tokens/s, chunk %lld tokens, device memory per "
        "GPU %.2f GiB (largest shard)\n",
        pl.k, mode.c_str(), ms, ratio.c_str(), n / ms * 1e3,
        static_cast<long long>(pl.shards[0].args.stats_chunk_rows), most / double(1 << 30));
  }
  for (Placement& pl : placements) {
    for (ShardState& st : pl.shards) {
      BENCH_CUDA(cudaSetDevice(st.backend->device_ordinal()));
      for (cudaEvent_t e : st.events) BENCH_CUDA(cudaEventDestroy(e));
    }
  }
  return 0;
}

}  // namespace
}  // namespace losshead

int main(int argc, char** argv) { return losshead::Main(argc, argv); }
