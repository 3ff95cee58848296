#include "server/rpc/region_input.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "losshead/kernels/dtype_convert.h"
#include "server/engine/proto_convert.h"
#include "server/engine/request_fingerprint.h"

namespace losshead::server {
namespace {

// As StepAssembler's: small enough that the digest's pass leaves each step in cache for the check.
constexpr size_t kCacheStepBytes = size_t{256} << 10;

// The assembler's digest and NaN/Inf check (step_assembler.h), over hidden states that land in
// `all` front to back.
class Landing {
 public:
  Landing(const v1::StepHeader& header, const char* all) : all_(all) {
    if (auto dtype = FloatDType(header.hidden_dtype(), "hidden_dtype"); dtype.ok()) dtype_ = *dtype;
    if (!header.client_id().empty() && !header.options().forward_only()) digest_.emplace();
  }

  // [0, end) of `all` holds its bytes now (end only grows).
  void LandedTo(size_t end) {
    while (landed_ < end) {
      const size_t n = std::min(kCacheStepBytes, end - landed_);
      if (digest_.has_value()) digest_->Update(absl::string_view(all_ + landed_, n));
      landed_ += n;
      if (!dtype_.has_value() || nonfinite_) continue;
      // Whole elements only: a step may end inside one, which the next step completes.
      const size_t element = kernels::DTypeSize(*dtype_);
      const size_t whole = landed_ / element * element;
      if (whole > checked_) {
        const float max_abs =
            kernels::MaxAbs(*dtype_, all_ + checked_, (whole - checked_) / element);
        max_abs_ = std::max(max_abs_, max_abs);
        nonfinite_ = !std::isfinite(max_abs);
        checked_ = whole;
      }
    }
  }

  std::optional<uint64_t> digest() const {
    return digest_.has_value() ? std::optional<uint64_t>(digest_->Value()) : std::nullopt;
  }
  // As the assembler's: a value found stands; "none found" only from a check of every byte.
  std::optional<float> max_abs() const {
    if (!dtype_.has_value() || !(nonfinite_ || checked_ == landed_)) return std::nullopt;
    return max_abs_;
  }

 private:
  const char* const all_;
  std::optional<kernels::DType> dtype_;
  std::optional<ByteDigest> digest_;
  size_t landed_ = 0;
  size_t checked_ = 0;
  bool nonfinite_ = false;
  float max_abs_ = 0;
};

// [offset, offset + bytes) of `region` into `dst`.
absl::Status CopyOut(const SharedRegion& region, char* dst, uint64_t offset, uint64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (const DeviceMapping* device = region.device(); device != nullptr) {
    return device->CopyOut(dst, offset, bytes);
  }
  std::memcpy(dst, region.data() + offset, bytes);
  return absl::OkStatus();
}

// The same, handing each piece to `landing` as it lands: a device region's in DMA pieces (the
// next one's copy running while one is digested and checked), a host region's in cache steps.
absl::Status CopyOutLanding(const SharedRegion& region, char* dst, uint64_t offset, uint64_t bytes,
                            Landing& landing) {
  if (const DeviceMapping* device = region.device(); device != nullptr) {
    return device->CopyOutPieces(dst, offset, bytes,
                                 [&landing](uint64_t end) { landing.LandedTo(end); });
  }
  for (uint64_t at = 0; at < bytes;) {
    const uint64_t n = std::min<uint64_t>(kCacheStepBytes, bytes - at);
    std::memcpy(dst + at, region.data() + offset + at, n);
    at += n;
    landing.LandedTo(at);
  }
  return absl::OkStatus();
}

absl::Status CopyFailed(const SharedRegion& region, const absl::Status& status) {
  return absl::InternalError(
      absl::StrCat("the hidden states and targets could not be copied out of shared memory region ",
                   region.id(), " (", status.message(),
                   "); nothing was computed or counted: the micro-batch may be sent again"));
}

}  // namespace

absl::Status TakeRegionInput(const RegionInput& input, PinnedPool* pinned, MicroBatch& mb) {
  const SharedRegion& region = *input.region;
  if (!region.registered()) {
    return absl::NotFoundError(absl::StrCat(
        "shared memory region ", region.id(),
        " was unregistered (its client's connection closed) before its micro-batch ran: nothing "
        "was computed or counted"));
  }
  if (!mb.hidden_bytes().empty() || !mb.targets.empty()) {
    return absl::InvalidArgumentError(
        "a micro-batch whose header names shared memory carries hidden states or targets in its "
        "messages too");
  }
  std::string targets(input.targets_bytes, '\0');
  if (absl::Status s = CopyOut(region, targets.data(), input.targets_offset, input.targets_bytes);
      !s.ok()) {
    return CopyFailed(region, s);
  }
  // Into page-locked memory where the pool gives some: the device's DMA writes it at the bus
  // rate, and the head's copy to its own device then needs no staging either.
  PinnedBytes pinned_hidden;
  char* dst = nullptr;
  if (pinned != nullptr && input.hidden_bytes > 0) {
    pinned_hidden = pinned->Take(input.hidden_bytes);
    dst = pinned_hidden ? pinned_hidden.Extend(input.hidden_bytes) : nullptr;
    if (dst == nullptr) pinned_hidden.Reset();
  }
  std::string hidden;
  if (dst == nullptr) {
    hidden.resize(input.hidden_bytes);
    dst = hidden.data();
  }
  Landing landing(mb.header, dst);
  if (absl::Status s =
          CopyOutLanding(region, dst, input.hidden_offset, input.hidden_bytes, landing);
      !s.ok()) {
    return CopyFailed(region, s);
  }
  mb.hidden = std::move(hidden);
  mb.pinned_hidden =
      pinned_hidden ? std::make_shared<PinnedBytes>(std::move(pinned_hidden)) : nullptr;
  mb.targets = std::move(targets);
  mb.hidden_digest = landing.digest();
  mb.targets_digest.reset();
  if (mb.hidden_digest.has_value()) mb.targets_digest = ByteDigest::Of(mb.targets);
  mb.hidden_max_abs = landing.max_abs();
  return absl::OkStatus();
}

}  // namespace losshead::server
