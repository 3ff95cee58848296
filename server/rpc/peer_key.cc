#include "server/rpc/peer_key.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"

namespace losshead::server {
namespace {

// Key layout: family byte, address bytes (4 or 16), port (2 bytes, network order).
std::string KeyOf(int family, const void* address, size_t size, uint16_t port_network_order) {
  std::string key(1, static_cast<char>(family));
  key.append(static_cast<const char*>(address), size);
  key.append(reinterpret_cast<const char*>(&port_network_order), sizeof(port_network_order));
  return key;
}

}  // namespace

std::optional<std::string> PeerKeyOfSockaddr(const sockaddr_storage& addr) {
  if (addr.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(addr);
    return KeyOf(AF_INET, &in.sin_addr, sizeof(in.sin_addr), in.sin_port);
  }
  if (addr.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(addr);
    if (IN6_IS_ADDR_V4MAPPED(&in6.sin6_addr)) {
      return KeyOf(AF_INET, &in6.sin6_addr.s6_addr[12], 4, in6.sin6_port);
    }
    return KeyOf(AF_INET6, &in6.sin6_addr, sizeof(in6.sin6_addr), in6.sin6_port);
  }
  return std::nullopt;
}

std::optional<std::string> PeerKeyOfUri(absl::string_view uri) {
  int family;
  if (absl::ConsumePrefix(&uri, "ipv4:")) {
    family = AF_INET;
  } else if (absl::ConsumePrefix(&uri, "ipv6:")) {
    family = AF_INET6;
  } else {
    return std::nullopt;
  }
  // gRPC percent-encodes the brackets (and a scope's %) of an IPv6 address in some versions.
  std::string text = absl::StrReplaceAll(uri, {{"%5B", "["}, {"%5D", "]"}, {"%25", "%"}});
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  int port = 0;
  if (!absl::SimpleAtoi(absl::string_view(text).substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return std::nullopt;
  }
  std::string host = text.substr(0, colon);
  if (family == AF_INET6) {
    if (host.size() < 2 || host.front() != '[' || host.back() != ']') return std::nullopt;
    host = host.substr(1, host.size() - 2);
    host = host.substr(0, host.find('%'));  // a scope id: the address alone keys it
  }
  sockaddr_storage addr{};
  addr.ss_family = static_cast<sa_family_t>(family);
  if (family == AF_INET) {
    auto& in = reinterpret_cast<sockaddr_in&>(addr);
    if (inet_pton(AF_INET, host.c_str(), &in.sin_addr) != 1) return std::nullopt;
    in.sin_port = htons(static_cast<uint16_t>(port));
  } else {
    auto& in6 = reinterpret_cast<sockaddr_in6&>(addr);
    if (inet_pton(AF_INET6, host.c_str(), &in6.sin6_addr) != 1) return std::nullopt;
    in6.sin6_port = htons(static_cast<uint16_t>(port));
  }
  return PeerKeyOfSockaddr(addr);
}

}  // namespace losshead::server
