// Recycled host memory for whole-tensor transfers (pull, download, push staging). A fresh
// gigabyte-sized allocation is zero-filled and then mapped by the kernel page by page on first
// touch: for a 2 GB dW that costs more than the copy that fills it, on every pull. A buffer given
// back once the transfer has been written out serves the next transfer of that size as it is.
// Process-wide and thread-safe; at most kIdleTransferBytes stay idle.
#ifndef LOSSHEAD_SERVER_ENGINE_TRANSFER_BUFFERS_H_
#define LOSSHEAD_SERVER_ENGINE_TRANSFER_BUFFERS_H_

#include <cstddef>
#include <string>

namespace losshead::server {

// Enough for the dW (fp32) and W (bf16) of a 128k x 4096 head side by side.
inline constexpr size_t kIdleTransferBytes = size_t{4} << 30;

// A string of exactly `bytes` bytes, holding stale bytes when recycled: the caller overwrites all.
std::string TakeTransferBuffer(size_t bytes);
// Keeps `buffer` for a later TakeTransferBuffer (within kIdleTransferBytes; else frees it).
void GiveTransferBuffer(std::string buffer);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_TRANSFER_BUFFERS_H_
