#include "server/rpc/same_node_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "losshead/v1/losshead.pb.h"
#include "server/security/auth.h"
#include "server/security/token_table.h"

namespace losshead::server {
namespace {

using transport::OwnedFd;

// A registration is a few dozen bytes; anything much larger is not one.
constexpr size_t kMaxRegisterBytes = 4096;

v1::SharedMemoryRegistered Refusal(const absl::Status& status) {
  v1::SharedMemoryRegistered out;
  out.set_code(static_cast<int>(status.code()));
  out.set_message(std::string(status.message()));
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SameNodeListener>> SameNodeListener::Start(
    SharedRegions* regions, const TokenTable* tokens) {
  uint8_t nonce[8];
  if (::getrandom(nonce, sizeof(nonce), 0) != sizeof(nonce)) {
    return absl::InternalError("no random bytes for the same-node socket's name");
  }
  const std::string name = absl::StrCat(
      "@losshead-", ::getpid(), "-",
      absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(nonce), sizeof(nonce))));
  absl::StatusOr<OwnedFd> listen = transport::ListenSeqpacket(name);
  if (!listen.ok()) return listen.status();
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError("no pipe for the same-node listener");
  }
  return std::unique_ptr<SameNodeListener>(new SameNodeListener(
      regions, tokens, name, *std::move(listen), OwnedFd(pipe_fds[0]), OwnedFd(pipe_fds[1])));
}

SameNodeListener::SameNodeListener(SharedRegions* regions, const TokenTable* tokens,
                                   std::string name, OwnedFd listen, OwnedFd wake_read,
                                   OwnedFd wake_write)
    : regions_(regions),
      tokens_(tokens),
      name_(std::move(name)),
      listen_(std::move(listen)),
      wake_read_(std::move(wake_read)),
      wake_write_(std::move(wake_write)) {
  thread_ = std::thread([this] { Loop(); });
}

SameNodeListener::~SameNodeListener() {
  const char stop = 1;
  (void)!::write(wake_write_.get(), &stop, 1);
  thread_.join();
}

void SameNodeListener::Loop() {
  struct Connection {
    OwnedFd fd;
    uint64_t region = 0;  // 0: not registered yet
    absl::Time accepted;
  };
  std::vector<Connection> connections;
  std::vector<pollfd> polled;
  for (;;) {
    polled.clear();
    polled.push_back({wake_read_.get(), POLLIN, 0});
    polled.push_back({listen_.get(), POLLIN, 0});
    for (const Connection& c : connections) polled.push_back({c.fd.get(), POLLIN, 0});
    // Wakes at least every second to close connections that never registered.
    const int ready = ::poll(polled.data(), polled.size(), 1000);
    if (ready < 0 && errno != EINTR) break;
    if (polled[0].revents != 0) break;  // stopping
    const absl::Time now = absl::Now();
    std::vector<bool> drop(connections.size(), false);
    for (size_t i = 0; i < connections.size(); ++i) {
      Connection& c = connections[i];
      const short events = polled[i + 2].revents;
      if (events == 0) {
        drop[i] = c.region == 0 && now - c.accepted > kRegisterTimeout;
        continue;
      }
      absl::StatusOr<transport::FdMessage> message =
          transport::ReceiveWithFd(c.fd.get(), kMaxRegisterBytes, /*nonblocking=*/true);
      if (!message.ok() && absl::IsUnavailable(message.status()) &&
          (events & (POLLHUP | POLLERR)) == 0) {
        continue;  // woken for nothing
      }
      if (!message.ok() || message->closed || c.region != 0) {
        // Closed, broken, or a second message on a registered connection (not part of the
        // protocol): either way its region goes.
        drop[i] = true;
        continue;
      }
      v1::SharedMemoryRegister request;
      absl::Status refused;
      const bool parsed = request.ParseFromString(message->bytes);
      // A device region comes as its CUDA IPC handle in the message (device_ipc.h).
      const bool device = parsed && request.kind() == v1::REGION_KIND_DEVICE;
      if (!parsed) {
        refused = absl::InvalidArgumentError("a registration that is not SharedMemoryRegister");
      } else if (request.kind() != v1::REGION_KIND_UNSPECIFIED &&
                 request.kind() != v1::REGION_KIND_HOST && !device) {
        refused = absl::InvalidArgumentError(
            absl::StrCat("a registration of unknown region kind ", request.kind()));
      } else if (device && message->fd.get() >= 0) {
        refused = absl::InvalidArgumentError(
            "a device region's registration carries its IPC handle, not a descriptor");
      } else if (!device && message->fd.get() < 0) {
        refused = absl::InvalidArgumentError("a registration without a memfd (SCM_RIGHTS)");
      } else if (tokens_ != nullptr) {
        const Role role = tokens_->Current()->Authenticate(request.authorization());
        if (role == Role::kNone) {
          refused = absl::UnauthenticatedError(
              "registering shared memory needs a valid 'Bearer <token>' authorization");
        } else if (role < Role::kWriter) {
          refused = absl::PermissionDeniedError("registering shared memory needs a writer token");
        }
      }
      v1::SharedMemoryRegistered answer;
      if (refused.ok()) {
        std::string principal = CallerIdentity(tokens_, request.authorization());
        absl::StatusOr<std::shared_ptr<SharedRegion>> region =
            device ? regions_->RegisterDevice(request.device_handle(), request.device_offset(),
                                              request.bytes(), request.device_pci_bus_id(),
                                              std::move(principal))
                   : regions_->Register(message->fd.get(), request.bytes(), std::move(principal));
        if (region.ok()) {
          c.region = (*region)->id();
          answer.set_region_id(c.region);
          answer.set_region_key(
              std::string(reinterpret_cast<const char*>((*region)->key().data()), kRegionKeyBytes));
        } else {
          refused = region.status();
        }
      }
      if (!refused.ok()) answer = Refusal(refused);
      // The descriptor is closed here either way: the mapping keeps the memory.
      if (!transport::SendWithFd(c.fd.get(), answer.SerializeAsString()).ok() || !refused.ok()) {
        drop[i] = true;
      }
    }
    // Dropping a connection unregisters its region (unmapped once no micro-batch holds it).
    size_t kept = 0;
    for (size_t i = 0; i < connections.size(); ++i) {
      if (drop[i]) {
        if (connections[i].region != 0) regions_->Unregister(connections[i].region);
        continue;
      }
      if (kept != i) connections[kept] = std::move(connections[i]);
      ++kept;
    }
    connections.resize(kept);
    if (polled[1].revents != 0) {
      for (;;) {
        OwnedFd fd(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (fd.get() < 0) break;
        if (connections.size() >= kMaxConnections) continue;  // closed at once
        connections.push_back({std::move(fd), 0, now});
      }
    }
  }
  for (const Connection& c : connections) {
    if (c.region != 0) regions_->Unregister(c.region);
  }
}

}  // namespace losshead::server
