#include "server/engine/apply_log.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace losshead::server {

absl::StatusOr<std::optional<v1::ApplyOptimizerResponse>> ApplyLog::Find(
    const std::string& client_id, uint64_t key) const {
  auto it = clients_.find(client_id);
  if (it == clients_.end()) return std::nullopt;
  const Client& client = it->second;
  if (auto r = client.responses.find(key); r != client.responses.end()) {
    v1::ApplyOptimizerResponse replay = r->second;
    replay.set_replayed(true);
    return replay;
  }
  if (key <= client.max_applied) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step_key ", key, " of client '", client_id, "' is not above its highest applied key ",
        client.max_applied,
        " and is not remembered: keys must increase, and an older apply's answer is gone"));
  }
  return std::nullopt;
}

void ApplyLog::Record(const std::string& client_id, uint64_t key,
                      const v1::ApplyOptimizerResponse& response) {
  Client& client = clients_[client_id];
  client.max_applied = std::max(client.max_applied, key);
  client.responses[key] = response;
  while (client.responses.size() > window_) client.responses.erase(client.responses.begin());
}

std::vector<ApplyClientCheckpoint> ApplyLog::Export() const {
  std::vector<ApplyClientCheckpoint> out;
  out.reserve(clients_.size());
  for (const auto& [id, client] : clients_) {
    ApplyClientCheckpoint c{.client_id = id, .max_applied = client.max_applied};
    c.responses.assign(client.responses.begin(), client.responses.end());
    out.push_back(std::move(c));
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.client_id < b.client_id; });
  return out;
}

void ApplyLog::Import(const std::vector<ApplyClientCheckpoint>& clients) {
  clients_.clear();
  for (const ApplyClientCheckpoint& c : clients) {
    Client& client = clients_[c.client_id];
    client.max_applied = c.max_applied;
    client.responses.insert(c.responses.begin(), c.responses.end());
    while (client.responses.size() > window_) client.responses.erase(client.responses.begin());
  }
}

}  // namespace losshead::server
