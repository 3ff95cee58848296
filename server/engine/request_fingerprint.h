// Fingerprints of what an idempotency key answered, so that a repeat of the key with other content
// is refused instead of being answered from memory (IdempotencyCache for micro-batches, ApplyLog
// for optimizer applies).
//
// Tensor digests are XXH3-64 (Debian's libxxhash): a fixed function of the bytes, the same in every
// process, build and machine, so that fingerprints kept in a checkpoint still match after a
// restart. They are taken over the bytes in order, so a tensor sent in other pieces (another
// message size) digests the same. The request fields that shape a result are kept as the request
// itself less its routing fields (head, key), serialized deterministically with an empty
// sub-message the same as an absent one: small, exact, and able to say which field differs.
#ifndef LOSSHEAD_SERVER_ENGINE_REQUEST_FINGERPRINT_H_
#define LOSSHEAD_SERVER_ENGINE_REQUEST_FINGERPRINT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "losshead/v1/losshead.pb.h"

struct XXH3_state_s;

namespace losshead::server {

// XXH3-64 of bytes fed piece by piece: Value() equals Of() of their concatenation.
class ByteDigest {
 public:
  ByteDigest();
  ~ByteDigest();
  ByteDigest(ByteDigest&&) noexcept;
  ByteDigest& operator=(ByteDigest&&) noexcept;

  void Update(absl::string_view bytes);
  uint64_t Value() const;
  static uint64_t Of(absl::string_view bytes);

 private:
  struct Free {
    void operator()(XXH3_state_s* state) const;
  };
  std::unique_ptr<XXH3_state_s, Free> state_;
};

// What a micro-batch asked for: its tensors' digests and the header's fields that shape the result
// (num_tokens, dtypes, options, loss options: everything but head, client id and sequence).
struct StepFingerprint {
  uint64_t hidden = 0;
  uint64_t targets = 0;
  std::string shape;  // the header less head, client id and sequence, serialized deterministically

  bool operator==(const StepFingerprint&) const = default;
};

// The header's part of a fingerprint (StepFingerprint::shape).
std::string StepShape(const v1::StepHeader& header);
// "hidden", "targets", "num_tokens", "options", ... that differ between two fingerprints, joined
// with ", " (for an error message); empty when they are equal.
std::string StepDifferences(const StepFingerprint& remembered, const StepFingerprint& repeat);

// What an optimizer apply asked for: the request less head, client id and step key (the
// hyper-parameters, divisor, clipping fields and expected version), serialized deterministically.
std::string ApplyFingerprint(const v1::ApplyOptimizerRequest& request);
// "params", "grad_divisor", "max_norm", ... that differ between two apply fingerprints, as above.
std::string ApplyDifferences(absl::string_view remembered, absl::string_view repeat);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_REQUEST_FINGERPRINT_H_
