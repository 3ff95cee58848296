// A client process that registers a device region (a cudaMalloc'd buffer of its own, by its IPC
// handle) with a server's same-node socket and holds it until it is killed
// (device_path_cuda_test.cc kills it): it writes one byte to stdout once registered.
//   device_region_holder <socket> <device> <bytes>
#include <cuda_runtime.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <string>

#include "losshead/client/device_region.h"

int main(int argc, char** argv) {
  if (argc != 4) return 1;
  const int device = std::atoi(argv[2]);
  const size_t bytes = std::strtoull(argv[3], nullptr, 10);
  void* buffer = nullptr;
  if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&buffer, bytes) != cudaSuccess) return 2;
  cudaIpcMemHandle_t handle;
  if (cudaIpcGetMemHandle(&handle, buffer) != cudaSuccess) return 3;
  char bus[32] = {};
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) return 4;
  std::string id(bus);
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  auto region = losshead::client::DeviceRegion::Register(
      argv[1], "", std::string_view(reinterpret_cast<const char*>(&handle), sizeof(handle)), 0,
      bytes, id);
  if (!region.ok()) return 5;
  const char done = 1;
  if (::write(1, &done, 1) != 1) return 6;
  for (;;) ::pause();
}
