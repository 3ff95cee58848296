// Plain HTTP against a port on loopback, for the tests of the metrics endpoint.
#ifndef LOSSHEAD_TESTS_COMMON_HTTP_EXCHANGE_H_
#define LOSSHEAD_TESTS_COMMON_HTTP_EXCHANGE_H_

#include <string>

#include "absl/status/statusor.h"

namespace losshead::testing {

// Sends `request` verbatim to 127.0.0.1:port and returns everything the peer answers until it
// closes the connection. A peer that resets the connection after answering (as a server does when
// it closes with part of the request unread) still yields what arrived. Each read and write times
// out after 10 s. UNAVAILABLE when the connection or a transfer fails.
absl::StatusOr<std::string> HttpExchange(int port, const std::string& request);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_COMMON_HTTP_EXCHANGE_H_
