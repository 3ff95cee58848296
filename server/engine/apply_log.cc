#include "server/engine/apply_log.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/engine/request_fingerprint.h"

namespace losshead::server {

absl::StatusOr<std::optional<v1::ApplyOptimizerResponse>> ApplyLog::Find(
    const std::string& client_id, uint64_t key, const std::string& fingerprint) const {
  auto it = clients_.find(client_id);
  if (it == clients_.end()) return std::nullopt;
  const Client& client = it->second;
  if (auto r = client.responses.find(key); r != client.responses.end()) {
    const Remembered& remembered = r->second;
    if (!remembered.fingerprint.empty() && remembered.fingerprint != fingerprint) {
      return absl::AlreadyExistsError(absl::StrCat(
          "step_key ", key, " of client '", client_id,
          "' was already used for a different apply (this one differs in ",
          ApplyDifferences(remembered.fingerprint, fingerprint),
          "); a retry must resend the same request and a new step needs a new key; nothing "
          "was stepped"));
    }
    v1::ApplyOptimizerResponse replay = remembered.response;
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

void ApplyLog::Record(const std::string& client_id, uint64_t key, std::string fingerprint,
                      const v1::ApplyOptimizerResponse& response) {
  Client& client = clients_[client_id];
  client.max_applied = std::max(client.max_applied, key);
  client.responses[key] = Remembered{.fingerprint = std::move(fingerprint), .response = response};
  while (client.responses.size() > window_) client.responses.erase(client.responses.begin());
}

std::vector<ApplyClientCheckpoint> ApplyLog::Export() const {
  std::vector<ApplyClientCheckpoint> out;
  out.reserve(clients_.size());
  for (const auto& [id, client] : clients_) {
    ApplyClientCheckpoint c{.client_id = id, .max_applied = client.max_applied};
    for (const auto& [key, remembered] : client.responses) {
      c.responses.push_back(RememberedApply{
          .key = key, .fingerprint = remembered.fingerprint, .response = remembered.response});
    }
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
    for (const RememberedApply& r : c.responses) {
      client.responses[r.key] = Remembered{.fingerprint = r.fingerprint, .response = r.response};
    }
    while (client.responses.size() > window_) client.responses.erase(client.responses.begin());
  }
}

}  // namespace losshead::server
