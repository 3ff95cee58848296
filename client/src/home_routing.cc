// A head replicated across server processes (docs/multi-process.md) runs a client id's
// micro-batches only at its home process: where the client learns the home (a redirect, or the
// group's members) and the connections to the homes it keeps.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/string_view.h"
#include "losshead/client/client.h"
#include "losshead/v1/process_control.grpc.pb.h"

namespace losshead::client {
namespace {

// The server's home rule: FNV-1a 64 of the client id's bytes, mod the number of processes.
int HomeRank(absl::string_view client_id, size_t processes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : client_id) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return static_cast<int>(hash % processes);
}

}  // namespace

std::optional<std::string> HomeRedirect(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kFailedPrecondition) return std::nullopt;
  constexpr absl::string_view kMarker = "home=";
  const absl::string_view message = status.message();
  const size_t at = message.rfind(kMarker);
  if (at == absl::string_view::npos) return std::nullopt;
  absl::string_view address = message.substr(at + kMarker.size());
  address = address.substr(0, address.find_first_of(") "));
  if (address.empty()) return std::nullopt;
  return std::string(address);
}

Client* Client::KnownHome(const std::string& client_id) {
  if (client_id.empty() || !options_.follow_home_redirect) return nullptr;
  absl::MutexLock lock(&homes_mu_);
  auto it = home_of_.find(client_id);
  return it != home_of_.end() ? it->second : nullptr;
}

Client* Client::FollowHome(const std::string& client_id, const std::string& address) {
  absl::MutexLock lock(&homes_mu_);
  std::unique_ptr<Client>& client = home_clients_[address];
  if (client == nullptr) {
    ClientOptions options = options_;
    options.bearer_token = [&] {
      absl::MutexLock token(&token_mu_);
      return bearer_token_;
    }();
    options.follow_home_redirect = false;  // once: the home does not send it on
    absl::StatusOr<std::unique_ptr<Client>> connected = Connect(address, options);
    if (!connected.ok()) {
      home_clients_.erase(address);
      return nullptr;
    }
    client = std::move(*connected);
  }
  home_of_[client_id] = client.get();
  return client.get();
}

Client* Client::HomeFromMembers(const std::string& client_id) {
  if (client_id.empty() || !options_.follow_home_redirect) return nullptr;
  if (Client* known = KnownHome(client_id); known != nullptr) return known;
  std::string address;
  {
    absl::MutexLock lock(&members_mu_);
    if (!members_asked_) {
      auto stub = v1::ProcessControl::NewStub(channel_);
      v1::MembersResponse response;
      auto context = NewContext(options_.deadline);
      const grpc::Status status = stub->Members(context.get(), v1::MembersRequest(), &response);
      // Any answer settles it for this connection: an error (UNIMPLEMENTED without a
      // ProcessControl service, FAILED_PRECONDITION outside a group, a token that may not ask)
      // leaves the micro-batches here, where a refusal still names their home. A server not
      // reached (UNAVAILABLE, DEADLINE_EXCEEDED) is asked again next time.
      if (status.error_code() != grpc::StatusCode::UNAVAILABLE &&
          status.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
        members_asked_ = true;
        members_.assign(response.addresses().begin(), response.addresses().end());
        member_rank_ = response.rank();
      }
    }
    if (members_.size() < 2) return nullptr;
    const int home = HomeRank(client_id, members_.size());
    if (home == member_rank_) return nullptr;
    address = members_[home];
  }
  return FollowHome(client_id, address);
}

absl::StatusOr<std::unique_ptr<StepStream>> Client::OpenStepStream(const std::string& client_id) {
  if (Client* home = HomeFromMembers(client_id); home != nullptr) return home->OpenStepStream();
  return OpenStepStream();
}

}  // namespace losshead::client
