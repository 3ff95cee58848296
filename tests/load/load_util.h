// Servers with chosen bounds, clients with a chosen retry policy, and raw Step streams that can
// stop anywhere inside a micro-batch: what the load and fault tests share.
#ifndef LOSSHEAD_TESTS_LOAD_LOAD_UTIL_H_
#define LOSSHEAD_TESTS_LOAD_LOAD_UTIL_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "losshead/client/client.h"
#include "losshead/v1/losshead.grpc.pb.h"
#include "server/server.h"
#include "tests/service/host_tensors.h"

namespace losshead::testing {

// A CPU server on 127.0.0.1:0 with `options` applied over the test defaults.
absl::StatusOr<std::unique_ptr<server::Server>> StartServer(
    const std::function<void(server::ServerOptions&)>& adjust);

// A client on the network path (never the same-node path: these tests act on its TCP traffic).
std::unique_ptr<client::Client> Connect(int port, const client::RetryPolicy& retry,
                                        size_t max_message_bytes = size_t{4} << 20);

// A retry policy for tests: many quick attempts, so that only a real loss fails a test.
client::RetryPolicy FastRetries(int max_attempts = 1000);

// The StepRequest messages of one micro-batch, cut into `pieces` messages (header on the first,
// last = true on the final one).
std::vector<v1::StepRequest> StepMessages(const client::Microbatch& mb, int pieces);

// Polls GetStats until `pred` holds (or gives up after `limit`, returning the last stats).
v1::Stats WaitForStats(client::Client& client, const std::function<bool(const v1::Stats&)>& pred,
                       absl::Duration limit = absl::Seconds(30));

// A TCP connection to 127.0.0.1:`port` that sends the HTTP/2 client preface (the magic and an
// empty SETTINGS frame) and nothing else; -1 on failure (errno set).
int IdleConnection(int port);
// Reads what the server sent on `fd` (its SETTINGS, a GOAWAY) without waiting: true once the
// server has closed the connection, false while it is open.
bool ClosedByServer(int fd);
// Waits up to `limit` for the server to close `fd`; true if it did.
bool WaitClosedByServer(int fd, absl::Duration limit);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_LOAD_LOAD_UTIL_H_
