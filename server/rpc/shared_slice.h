// A gRPC slice that references bytes inside a shared object instead of copying them: the slice
// holds a reference to the owner until gRPC has written it, however long the write takes.
#ifndef LOSSHEAD_SERVER_RPC_SHARED_SLICE_H_
#define LOSSHEAD_SERVER_RPC_SHARED_SLICE_H_

#include <cstddef>
#include <memory>

#include "grpcpp/support/slice.h"

namespace losshead::server {

template <typename Owner>
grpc::Slice SharedSlice(const std::shared_ptr<Owner>& owner, const char* data, size_t bytes) {
  // gRPC only reads the slice; its constructor merely takes a mutable pointer.
  return grpc::Slice(
      const_cast<char*>(data), bytes,
      +[](void* holder) { delete static_cast<std::shared_ptr<Owner>*>(holder); },
      new std::shared_ptr<Owner>(owner));
}

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_RPC_SHARED_SLICE_H_
