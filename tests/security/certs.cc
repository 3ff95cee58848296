#include "tests/security/certs.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"

namespace losshead::testing {
namespace {

absl::Status Run(const std::string& command) {
  const std::string full = absl::StrCat(command, " >/dev/null 2>&1");
  if (std::system(full.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("failed: ", command));
  }
  return absl::OkStatus();
}

// A key and a certificate signed by `ca` (self-signed CA when `ca` is empty).
absl::Status MakeCert(const std::string& dir, const std::string& name, const std::string& subject,
                      const std::string& ca, const std::string& extensions) {
  const std::string ssl = LOSSHEAD_OPENSSL;
  const std::string key = absl::StrCat(dir, "/", name, ".key");
  const std::string crt = absl::StrCat(dir, "/", name, ".crt");
  if (ca.empty()) {
    return Run(absl::StrCat(ssl, " req -x509 -newkey rsa:2048 -nodes -days 2 -subj '", subject,
                            "' -keyout ", key, " -out ", crt));
  }
  const std::string csr = absl::StrCat(dir, "/", name, ".csr");
  const std::string ext = WriteFile(dir, name + ".ext", extensions);
  if (absl::Status s = Run(absl::StrCat(ssl, " req -newkey rsa:2048 -nodes -subj '", subject,
                                        "' -keyout ", key, " -out ", csr));
      !s.ok()) {
    return s;
  }
  return Run(absl::StrCat(ssl, " x509 -req -in ", csr, " -CA ", dir, "/", ca, ".crt -CAkey ", dir,
                          "/", ca, ".key -CAcreateserial -days 2 -extfile ", ext, " -out ", crt));
}

}  // namespace

std::string WriteFile(const std::string& dir, const std::string& name, const std::string& text) {
  const std::string path = absl::StrCat(dir, "/", name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TestPki::~TestPki() {
  std::error_code ignored;
  if (!dir.empty()) std::filesystem::remove_all(dir, ignored);
}

absl::StatusOr<std::unique_ptr<TestPki>> MakeTestPki() {
  auto pki = std::make_unique<TestPki>();
  std::string pattern = (std::filesystem::temp_directory_path() / "losshead-pki-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) return absl::InternalError("mkdtemp failed");
  pki->dir = pattern;
  const std::string& d = pki->dir;
  for (absl::Status s : {
           MakeCert(d, "ca", "/CN=losshead test CA", "", ""),
           MakeCert(d, "rogue-ca", "/CN=rogue CA", "", ""),
           MakeCert(d, "server", "/CN=localhost", "ca",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                    "extendedKeyUsage=serverAuth\n"),
           MakeCert(d, "client", "/CN=trainer", "ca", "extendedKeyUsage=clientAuth\n"),
           MakeCert(d, "rogue", "/CN=intruder", "rogue-ca", "extendedKeyUsage=clientAuth\n"),
           MakeCert(d, "peer", "/CN=localhost", "ca",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                    "extendedKeyUsage=serverAuth,clientAuth\n"),
       }) {
    if (!s.ok()) return s;
  }
  pki->ca_cert = d + "/ca.crt";
  pki->server_cert = d + "/server.crt";
  pki->server_key = d + "/server.key";
  pki->client_cert = d + "/client.crt";
  pki->client_key = d + "/client.key";
  pki->rogue_cert = d + "/rogue.crt";
  pki->rogue_key = d + "/rogue.key";
  pki->peer_cert = d + "/peer.crt";
  pki->peer_key = d + "/peer.key";
  return pki;
}

}  // namespace losshead::testing
