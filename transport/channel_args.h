// gRPC channel arguments for connections that carry tensors, shared by the server and the client.
//
// gRPC reads a socket into buffers it sizes adaptively from 8 KiB, which suits small RPCs; a
// stream of 4 MiB messages then costs thousands of reads and slices per message. Reading at least
// 1 MiB at a time (up to 8 MiB) measured on an H100 host over loopback (one Step stream, 8192 x
// 4096 bf16 micro-batches): 57,000 -> 80,000 tokens/s, and the pulls and downloads of a 128256 x
// 4096 head 5-30 % faster (BENCHMARKS.md). The price is up to 1 MiB of read buffer per open
// connection.
//
// Plaintext connections only: with TLS and reads this large, gRPC 1.51 (Debian 12) leaks the
// slice array of a connection whose handshake fails (LeakSanitizer in tests/security), which an
// untrusted peer could repeat at will; TLS connections keep gRPC's own read sizes.
#ifndef LOSSHEAD_TRANSPORT_CHANNEL_ARGS_H_
#define LOSSHEAD_TRANSPORT_CHANNEL_ARGS_H_

#include <grpc/grpc.h>

#include <array>
#include <utility>

namespace losshead::transport {

inline constexpr std::array<std::pair<const char*, int>, 3> kTensorTransportArgs = {{
    {GRPC_ARG_TCP_READ_CHUNK_SIZE, 1 << 20},
    {GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 1 << 20},
    {GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 8 << 20},
}};

}  // namespace losshead::transport

#endif  // LOSSHEAD_TRANSPORT_CHANNEL_ARGS_H_
