#include "kernels/collective/group_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace losshead::kernels {
namespace {

constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;  // HMAC-SHA256
constexpr std::byte kAccepted{1};
constexpr std::byte kRefused{0};

struct Offer {
  uint8_t has_secret = 0;
  uint8_t reserved[7] = {};
  uint8_t nonce[kNonceBytes] = {};
};

std::span<const std::byte> Bytes(const Offer& offer) {
  return std::as_bytes(std::span<const Offer>(&offer, 1));
}
std::span<std::byte> Bytes(Offer& offer) {
  return std::as_writable_bytes(std::span<Offer>(&offer, 1));
}

using Proof = std::array<std::byte, kProofBytes>;

// HMAC-SHA256(secret, role | connector's hello | acceptor's hello | connector's offer |
// acceptor's offer): bound to this connection (both nonces) and to its direction (the role).
Proof ProofOf(absl::string_view secret, absl::string_view role,
              std::span<const std::byte> connector_hello, std::span<const std::byte> acceptor_hello,
              const Offer& connector_offer, const Offer& acceptor_offer) {
  std::string text(role);
  for (std::span<const std::byte> part :
       {connector_hello, acceptor_hello, Bytes(connector_offer), Bytes(acceptor_offer)}) {
    text.append(reinterpret_cast<const char*>(part.data()), part.size());
  }
  Proof proof{};
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(text.data()), text.size(),
       reinterpret_cast<unsigned char*>(proof.data()), &length);
  return proof;
}

bool Equal(const Proof& a, const Proof& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

absl::Status Denied(absl::string_view who, absl::string_view why) {
  return absl::PermissionDeniedError(absl::StrCat("process group: ", who, " ", why));
}

}  // namespace

absl::Status AuthenticatePeer(const tcp::Fd& fd, bool connector, absl::string_view secret,
                              std::span<const std::byte> connector_hello,
                              std::span<const std::byte> acceptor_hello, absl::string_view who,
                              absl::Time deadline, MeshKeys* keys) {
  Offer mine;
  mine.has_secret = secret.empty() ? 0 : 1;
  if (!secret.empty() && RAND_bytes(mine.nonce, kNonceBytes) != 1) {
    return absl::InternalError("process group: no random bytes for the group secret's check");
  }
  if (absl::Status s = tcp::WriteAll(fd, Bytes(mine), deadline); !s.ok()) return s;
  Offer theirs;
  if (absl::Status s = tcp::ReadAll(fd, Bytes(theirs), deadline); !s.ok()) return s;
  if (theirs.has_secret != mine.has_secret) {
    return mine.has_secret != 0
               ? Denied(who,
                        "holds no group secret and this process requires one "
                        "(--group_secret_file)")
               : Denied(who,
                        "requires a group secret (--group_secret_file) and this process "
                        "holds none");
  }
  if (secret.empty()) return absl::OkStatus();
  const Offer& connector_offer = connector ? mine : theirs;
  const Offer& acceptor_offer = connector ? theirs : mine;
  const Proof connector_proof = ProofOf(secret, "connector", connector_hello, acceptor_hello,
                                        connector_offer, acceptor_offer);
  const Proof acceptor_proof =
      ProofOf(secret, "acceptor", connector_hello, acceptor_hello, connector_offer, acceptor_offer);
  // The sealed mesh's keys, one per direction: the same PRF under labels of their own, never sent.
  const auto key_of = [&](absl::string_view label) {
    const Proof k =
        ProofOf(secret, label, connector_hello, acceptor_hello, connector_offer, acceptor_offer);
    MeshKey key;
    std::copy(k.begin(), k.end(), key.begin());
    return key;
  };
  const auto keep_keys = [&] {
    if (keys == nullptr) return;
    const MeshKey to_acceptor = key_of("mesh key: connector to acceptor");
    const MeshKey to_connector = key_of("mesh key: acceptor to connector");
    keys->send = connector ? to_acceptor : to_connector;
    keys->receive = connector ? to_connector : to_acceptor;
  };
  std::byte verdict = kRefused;
  if (connector) {
    if (absl::Status s = tcp::WriteAll(fd, connector_proof, deadline); !s.ok()) return s;
    if (absl::Status s = tcp::ReadAll(fd, std::span<std::byte>(&verdict, 1), deadline); !s.ok()) {
      return s;
    }
    if (verdict != kAccepted) {
      return Denied(who, "refused this process's group secret: the two hold different secrets");
    }
    Proof received{};
    if (absl::Status s = tcp::ReadAll(fd, received, deadline); !s.ok()) return s;
    const bool valid = Equal(received, acceptor_proof);
    const std::byte answer = valid ? kAccepted : kRefused;
    if (absl::Status s = tcp::WriteAll(fd, std::span<const std::byte>(&answer, 1), deadline);
        !s.ok()) {
      return valid ? s : Denied(who, "does not hold this group's secret");
    }
    if (!valid) return Denied(who, "does not hold this group's secret");
    keep_keys();
    return absl::OkStatus();
  }
  Proof received{};
  if (absl::Status s = tcp::ReadAll(fd, received, deadline); !s.ok()) return s;
  if (!Equal(received, connector_proof)) {
    // Nothing but the refusal: a process without the secret gets no proof of ours to study.
    (void)tcp::WriteAll(fd, std::span<const std::byte>(&kRefused, 1), deadline);
    return Denied(who, "does not hold this group's secret");
  }
  std::array<std::byte, 1 + kProofBytes> answer;
  answer[0] = kAccepted;
  std::copy(acceptor_proof.begin(), acceptor_proof.end(), answer.begin() + 1);
  if (absl::Status s = tcp::WriteAll(fd, answer, deadline); !s.ok()) return s;
  if (absl::Status s = tcp::ReadAll(fd, std::span<std::byte>(&verdict, 1), deadline); !s.ok()) {
    return s;
  }
  if (verdict != kAccepted) {
    return Denied(who, "refused this process's group secret: the two hold different secrets");
  }
  keep_keys();
  return absl::OkStatus();
}

}  // namespace losshead::kernels
