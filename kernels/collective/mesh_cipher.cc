#include "kernels/collective/mesh_cipher.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <cstring>

#include "absl/strings/str_cat.h"

namespace losshead::kernels {

struct MeshCipher::Context {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  ~Context() { EVP_CIPHER_CTX_free(ctx); }
};

MeshCipher::MeshCipher(const MeshKey& key) : key_(key), ctx_(std::make_unique<Context>()) {}

MeshCipher::~MeshCipher() { OPENSSL_cleanse(key_.data(), key_.size()); }

std::array<unsigned char, 12> MeshCipher::NextNonce() {
  std::array<unsigned char, 12> nonce{};
  const uint64_t n = records_++;
  for (int i = 0; i < 8; ++i) nonce[4 + i] = static_cast<unsigned char>(n >> (8 * i));
  return nonce;
}

namespace {

const unsigned char* U(const std::byte* p) { return reinterpret_cast<const unsigned char*>(p); }
unsigned char* U(std::byte* p) { return reinterpret_cast<unsigned char*>(p); }

absl::Status CipherError(const char* what) {
  return absl::InternalError(absl::StrCat("mesh cipher: ", what, " failed"));
}

}  // namespace

absl::Status MeshCipher::Seal(std::span<const std::byte> plain, std::span<std::byte> record) {
  if (plain.size() > kMeshRecordBytes || record.size() != plain.size() + kMeshTagBytes) {
    return absl::InternalError("mesh cipher: a record of the wrong size");
  }
  if (ctx_->ctx == nullptr) return CipherError("EVP_CIPHER_CTX_new");
  const std::array<unsigned char, 12> nonce = NextNonce();
  int n = 0;
  if (EVP_EncryptInit_ex(ctx_->ctx, EVP_aes_256_gcm(), nullptr, U(key_.data()), nonce.data()) !=
          1 ||
      EVP_EncryptUpdate(ctx_->ctx, U(record.data()), &n, U(plain.data()),
                        static_cast<int>(plain.size())) != 1 ||
      EVP_EncryptFinal_ex(ctx_->ctx, U(record.data()) + n, &n) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx_->ctx, EVP_CTRL_GCM_GET_TAG, kMeshTagBytes,
                          U(record.data()) + plain.size()) != 1) {
    return CipherError("sealing");
  }
  return absl::OkStatus();
}

absl::Status MeshCipher::Open(std::span<const std::byte> record, std::span<std::byte> plain) {
  if (record.size() < kMeshTagBytes || plain.size() != record.size() - kMeshTagBytes ||
      plain.size() > kMeshRecordBytes) {
    return absl::InternalError("mesh cipher: a record of the wrong size");
  }
  if (ctx_->ctx == nullptr) return CipherError("EVP_CIPHER_CTX_new");
  const std::array<unsigned char, 12> nonce = NextNonce();
  // Straight into `plain` (no second pass over every byte); a record whose tag fails leaves
  // zeros there, never unauthenticated bytes.
  unsigned char tag[kMeshTagBytes];
  std::memcpy(tag, record.data() + plain.size(), kMeshTagBytes);
  int n = 0;
  if (EVP_DecryptInit_ex(ctx_->ctx, EVP_aes_256_gcm(), nullptr, U(key_.data()), nonce.data()) !=
          1 ||
      EVP_DecryptUpdate(ctx_->ctx, U(plain.data()), &n, U(record.data()),
                        static_cast<int>(plain.size())) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx_->ctx, EVP_CTRL_GCM_SET_TAG, kMeshTagBytes, tag) != 1) {
    std::memset(plain.data(), 0, plain.size());
    return CipherError("opening");
  }
  if (EVP_DecryptFinal_ex(ctx_->ctx, U(plain.data()) + n, &n) != 1) {
    std::memset(plain.data(), 0, plain.size());
    return absl::UnauthenticatedError(
        absl::StrCat("record ", records_ - 1,
                     " failed its authentication: altered in transit, replayed, out of order, or "
                     "sealed under another key"));
  }
  return absl::OkStatus();
}

}  // namespace losshead::kernels
