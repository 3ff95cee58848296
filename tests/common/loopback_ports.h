// Loopback ports for tests that start servers or process groups on this host: ports the kernel
// chose as free a moment ago (all n bound at once, so they differ, then released). Another
// process may take one before the test binds it; tests use them at once.
#ifndef LOSSHEAD_TESTS_COMMON_LOOPBACK_PORTS_H_
#define LOSSHEAD_TESTS_COMMON_LOOPBACK_PORTS_H_

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace losshead::testing {

inline std::vector<int> FreeLoopbackPorts(int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    socklen_t length = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length);
    ports.push_back(ntohs(addr.sin_port));
    fds.push_back(fd);
  }
  for (int fd : fds) close(fd);
  return ports;
}

// The same as "127.0.0.1:<port>".
inline std::vector<std::string> FreeLoopbackAddresses(int n) {
  std::vector<std::string> addresses;
  for (int port : FreeLoopbackPorts(n)) addresses.push_back(absl::StrCat("127.0.0.1:", port));
  return addresses;
}

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_COMMON_LOOPBACK_PORTS_H_
