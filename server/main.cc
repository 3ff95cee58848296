// losshead-server: serves losshead.v1.LossHead until SIGTERM or SIGINT, then drains and exits.
// SIGHUP re-reads --auth_tokens_file (token rotation without a restart).
#include <sys/resource.h>

#include <csignal>
#include <cstdio>
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpc/grpc.h"
#include "server/flags.h"
#include "server/server.h"
#include "transport/heap_tuning.h"

namespace {

// Signal handlers may only touch lock-free state: flags polled by main.
volatile std::sig_atomic_t g_stop_signal = 0;
volatile std::sig_atomic_t g_reload_requested = 0;

void OnSignal(int signal) { g_stop_signal = signal; }
void OnReload(int /*signal*/) { g_reload_requested = 1; }

// Every client connection takes descriptors (server/rpc/connection_guard.h), and the soft limit
// is often 1024 where the hard one allows far more: take what the hard limit allows. The default
// of --max_connections is derived from the result.
void RaiseDescriptorLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  const rlim_t was = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    std::fprintf(stderr, "losshead-server: cannot raise the descriptor limit from %llu\n",
                 static_cast<unsigned long long>(was));
  }
}

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "the fused LM-head (linear + cross-entropy) gRPC service\n\nusage: losshead-server [flags]");
  losshead::server::ConfigureFlagsUsage();
  absl::ParseCommandLine(argc, argv);
  RaiseDescriptorLimit();
  // gRPC's message buffers stay mapped between messages (see heap_tuning.h).
  losshead::transport::KeepTransferBuffersMapped();
  // Held for the life of the process and never released: gRPC's library teardown, which the last
  // release would start, waits for its internal threads (9 s on a 16-core GPU host after a busy
  // run) and frees nothing the exit does not.
  grpc_init();
  absl::StatusOr<losshead::server::ServerOptions> options = losshead::server::OptionsFromFlags();
  if (!options.ok()) {
    std::fprintf(stderr, "losshead-server: %s\n", options.status().ToString().c_str());
    return 2;
  }
  auto server = losshead::server::Server::Start(*options);
  if (!server.ok()) {
    std::fprintf(stderr, "losshead-server: cannot start: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGHUP, OnReload);
  std::string devices;
  for (const losshead::kernels::Backend* backend : (*server)->devices()) {
    absl::StrAppend(&devices, devices.empty() ? "" : ", ", backend->device_description());
  }
  // A Unix socket (unix:PATH) has no port: its address is printed as given.
  const std::string serving =
      absl::StartsWith(options->listen_address, "unix:")
          ? options->listen_address
          : absl::StrCat(HostOf(options->listen_address), ":", (*server)->port());
  std::fprintf(stderr, "losshead-server: serving gRPC on %s, backend %s on %s\n", serving.c_str(),
               std::string((*server)->devices().front()->name()).c_str(), devices.c_str());
  if ((*server)->metrics_port() != 0) {
    std::fprintf(stderr, "losshead-server: metrics on http://%s:%d/metrics\n",
                 HostOf(options->metrics_address).c_str(), (*server)->metrics_port());
  } else {
    std::fprintf(stderr, "losshead-server: metrics disabled\n");
  }
  while (g_stop_signal == 0) {
    absl::SleepFor(absl::Milliseconds(100));
    if (g_reload_requested != 0) {
      g_reload_requested = 0;
      std::fprintf(stderr, "losshead-server: SIGHUP\n");
      (*server)->ReloadTokens().IgnoreError();  // the server logs the outcome
    }
  }
  std::fprintf(stderr, "losshead-server: signal %d, draining (up to %s)\n",
               static_cast<int>(g_stop_signal),
               absl::FormatDuration(options->drain_timeout).c_str());
  const absl::Time drain_start = absl::Now();
  (*server)->Shutdown(options->drain_timeout);
  (*server)->Wait();
  std::fprintf(stderr, "losshead-server: stopped after %.0f ms, releasing memory\n",
               absl::ToDoubleMilliseconds(absl::Now() - drain_start));
  const absl::Time release_start = absl::Now();
  server->reset();  // heads, device memory and the backend
  std::fprintf(stderr, "losshead-server: exited cleanly (memory released in %.0f ms)\n",
               absl::ToDoubleMilliseconds(absl::Now() - release_start));
  return 0;
}
