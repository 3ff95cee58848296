// A client process that registers shared memory regions with a server's same-node socket and then
// holds them until it is killed (tests/service/same_node_test.cc kills it): it writes one byte to
// stdout once every region is registered. Plain system calls only.
//   region_holder <socket> <regions> <bytes>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>

#include "losshead/v1/losshead.pb.h"

int main(int argc, char** argv) {
  if (argc != 4) return 1;
  const std::string socket_name = argv[1];
  const int regions = std::atoi(argv[2]);
  const size_t bytes = std::strtoull(argv[3], nullptr, 10);
  losshead::v1::SharedMemoryRegister request;
  request.set_bytes(bytes);
  const std::string message = request.SerializeAsString();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket_name.data(), socket_name.size());
  addr.sun_path[0] = '\0';  // an abstract name ("@...")
  const socklen_t addr_len = offsetof(sockaddr_un, sun_path) + socket_name.size();
  for (int i = 0; i < regions; ++i) {
    const int fd = ::memfd_create("losshead-dead-client", MFD_ALLOW_SEALING);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
        ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
      return 2;
    }
    const int s = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
    if (s < 0 || ::connect(s, reinterpret_cast<const sockaddr*>(&addr), addr_len) != 0) return 3;
    iovec iov{const_cast<char*>(message.data()), message.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
    char answer[256];
    if (::sendmsg(s, &msg, 0) < 0) return 4;
    const ssize_t got = ::recv(s, answer, sizeof(answer), 0);
    losshead::v1::SharedMemoryRegistered registered;
    if (got <= 0 || !registered.ParseFromArray(answer, static_cast<int>(got)) ||
        registered.code() != 0) {
      return 5;
    }
    ::close(fd);  // the server's mapping keeps the memory; the socket stays open
  }
  const char done = 1;
  if (::write(1, &done, 1) != 1) return 6;
  for (;;) ::pause();
}
