// Counts the unary and transfer calls of losshead.v1.LossHead that are running, so that shutdown
// can wait for them and then close idle connections at once instead of waiting for every client
// to hang up (gRPC's Shutdown otherwise waits, up to its deadline, for connections to close).
// Step streams are tracked by StepStreams and not counted here: their path stays free of
// interceptors.
#ifndef LOSSHEAD_SERVER_RPC_LIVE_CALLS_H_
#define LOSSHEAD_SERVER_RPC_LIVE_CALLS_H_

#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"

namespace losshead::server {

class LiveCalls {
 public:
  void Enter();
  void Leave();
  // Blocks until no counted call runs or `deadline` passes; true if none runs.
  bool WaitUntilNone(absl::Time deadline) const;

  // An interceptor factory for ServerBuilder whose interceptors count the call they live in.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> CountingFactory();

 private:
  mutable absl::Mutex mu_;
  int count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_LIVE_CALLS_H_
