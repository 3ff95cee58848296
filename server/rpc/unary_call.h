// What every unary handler does around its work: answer and record the call, and refuse new calls
// while the server drains.
#ifndef LOSSHEAD_SERVER_RPC_UNARY_CALL_H_
#define LOSSHEAD_SERVER_RPC_UNARY_CALL_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "server/rpc/service_context.h"

namespace losshead::server {

// Answers a unary call and records it; `reactor` may not be used afterwards.
void FinishUnary(ServiceContext* ctx, grpc::ServerUnaryReactor* reactor, const char* method,
                 absl::Time start, const absl::Status& status);

// True (and the call answered UNAVAILABLE) while the server shuts down.
bool RefuseWhileDraining(ServiceContext* ctx, grpc::ServerUnaryReactor* reactor, const char* method,
                         absl::Time start);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_UNARY_CALL_H_
