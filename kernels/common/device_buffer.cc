#include "absl/strings/str_cat.h"
#include "losshead/kernels/backend.h"

namespace losshead::kernels {

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    owner_ = other.owner_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.owner_ = nullptr;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::Reset() {
  if (owner_ != nullptr && data_ != nullptr) owner_->Free(data_);
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = other.data_;
    bytes_ = other.bytes_;
    free_ = other.free_;
    other.data_ = nullptr;
    other.bytes_ = 0;
    other.free_ = nullptr;
  }
  return *this;
}

void HostBuffer::Reset() {
  if (data_ != nullptr && free_ != nullptr) free_(data_);
  data_ = nullptr;
  bytes_ = 0;
  free_ = nullptr;
}

namespace {

// The work before it ran inline: nothing to wait for.
class ReachedMark final : public StreamMark {
 public:
  absl::Status Wait() override { return absl::OkStatus(); }
};

}  // namespace

absl::StatusOr<std::unique_ptr<StreamMark>> Stream::Mark() {
  return std::make_unique<ReachedMark>();
}

absl::StatusOr<HostBuffer> Backend::AllocateHost(size_t) {
  return absl::UnimplementedError(absl::StrCat(name(), " backend: no staging host memory"));
}

absl::Status Backend::CopyOnDevice(void*, const void*, size_t, Stream&) {
  return absl::UnimplementedError(absl::StrCat(name(), " backend: no copies between devices"));
}

}  // namespace losshead::kernels
