// Throwaway PKI for tests: a CA, a server certificate for 127.0.0.1 / localhost and a client
// certificate, plus a second CA that signed nothing the server trusts. Made with the openssl CLI.
#ifndef LOSSHEAD_TESTS_SECURITY_CERTS_H_
#define LOSSHEAD_TESTS_SECURITY_CERTS_H_

#include <string>

#include "absl/status/statusor.h"

namespace losshead::testing {

struct TestPki {
  std::string dir;  // removed by the destructor
  std::string ca_cert;
  std::string server_cert, server_key;
  std::string client_cert, client_key;        // signed by ca_cert
  std::string rogue_cert, rogue_key;          // signed by a CA nobody trusts
  // A server process's certificate for 127.0.0.1 / localhost that may also be a client's (signed
  // by ca_cert): the processes of a group present it to each other under mTLS.
  std::string peer_cert, peer_key;
  ~TestPki();
};

absl::StatusOr<std::unique_ptr<TestPki>> MakeTestPki();

// Writes `text` to `dir`/`name` and returns the path.
std::string WriteFile(const std::string& dir, const std::string& name, const std::string& text);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_SECURITY_CERTS_H_
