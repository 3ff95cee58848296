// Bootstrap of the full mesh and the one primitive every cross-process collective is made of: an
// exchange of byte ranges with every peer at once, driven by poll(2) so that large transfers in
// both directions never wait on each other (two peers each writing before reading would fill
// their socket buffers and stall), under one deadline.
#include "losshead/kernels/process_group.h"

#include <openssl/crypto.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "kernels/collective/group_auth.h"
#include "kernels/collective/mesh_cipher.h"
#include "kernels/collective/tcp.h"

namespace losshead::kernels {
namespace {

constexpr uint32_t kHelloMagic = 0x4c485047;  // "LHPG"
constexpr size_t kGroupNameBytes = 64;
constexpr size_t kMinSecretBytes = 16;

// What each end of a connection sends first. Fields in the host's byte order: the processes of
// one group run the same build on hosts of one architecture.
struct Hello {
  uint32_t magic = kHelloMagic;
  uint32_t version = kProcessGroupProtocolVersion;
  uint32_t world = 0;
  uint32_t rank = 0;
  uint32_t sealed = 0;  // 1: this process seals the mesh (ProcessGroupOptions::encrypt)
  char group[kGroupNameBytes] = {};
};

Hello MakeHello(const ProcessGroupOptions& options) {
  Hello hello;
  hello.world = static_cast<uint32_t>(options.world);
  hello.rank = static_cast<uint32_t>(options.rank);
  hello.sealed = options.encrypt ? 1 : 0;
  std::memcpy(hello.group, options.group_name.data(), options.group_name.size());
  return hello;
}

std::span<const std::byte> Bytes(const Hello& hello) {
  return std::as_bytes(std::span<const Hello>(&hello, 1));
}
std::span<std::byte> Bytes(Hello& hello) {
  return std::as_writable_bytes(std::span<Hello>(&hello, 1));
}

std::string GroupName(const Hello& hello) {
  return std::string(hello.group, strnlen(hello.group, kGroupNameBytes));
}

// `theirs` came from the process at `address`; `want_rank` is the rank it must have, or -1 for any
// rank above ours not yet connected (the acceptor's case, checked by the caller).
absl::Status CheckHello(const Hello& mine, const Hello& theirs, absl::string_view address,
                        int want_rank) {
  const std::string who = absl::StrCat("the process at ", address);
  if (theirs.magic != kHelloMagic) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, " does not speak the process group protocol"));
  }
  if (theirs.version != mine.version) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, " speaks protocol version ", theirs.version, ", this process ", mine.version));
  }
  if (theirs.world != mine.world) {
    return absl::FailedPreconditionError(absl::StrCat(who, " has a world of ", theirs.world,
                                                      " processes, this process ", mine.world));
  }
  if (GroupName(theirs) != GroupName(mine)) {
    return absl::FailedPreconditionError(absl::StrCat(who, " is of group \"", GroupName(theirs),
                                                      "\", this process of \"", GroupName(mine),
                                                      "\""));
  }
  if (theirs.sealed != mine.sealed) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, theirs.sealed != 0 ? " seals" : " does not seal",
                     " the group's mesh (--group_mesh_encryption), this process ",
                     mine.sealed != 0 ? "does" : "does not"));
  }
  if (want_rank >= 0 && theirs.rank != static_cast<uint32_t>(want_rank)) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, " is process ", theirs.rank, ", expected process ", want_rank));
  }
  return absl::OkStatus();
}

absl::Status CheckOptions(const ProcessGroupOptions& options) {
  if (options.world < 1) {
    return absl::InvalidArgumentError(absl::StrCat("process group: world ", options.world, " < 1"));
  }
  if (options.peers.size() != static_cast<size_t>(options.world)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "process group: ", options.peers.size(), " peer addresses for a world of ", options.world));
  }
  if (options.rank < 0 || options.rank >= options.world) {
    return absl::InvalidArgumentError(
        absl::StrCat("process group: rank ", options.rank, " is outside [0, ", options.world, ")"));
  }
  for (size_t p = 0; p < options.peers.size(); ++p) {
    if (absl::StatusOr<tcp::HostPort> a = tcp::ParseHostPort(options.peers[p]); !a.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("process group: peer ", p, ": ", a.status().message()));
    }
  }
  if (options.group_name.size() >= kGroupNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("process group: group name of ",
                                                   options.group_name.size(), " bytes (at most ",
                                                   kGroupNameBytes - 1, ")"));
  }
  if (!options.secret.empty() && options.secret.size() < kMinSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("process group: a secret of ",
                                                   options.secret.size(), " bytes (at least ",
                                                   kMinSecretBytes, ")"));
  }
  if (options.encrypt && options.secret.empty()) {
    return absl::InvalidArgumentError(
        "process group: sealing the mesh needs the group secret its keys come from");
  }
  if (options.bootstrap_timeout <= absl::ZeroDuration() ||
      options.op_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("process group: timeouts must be positive");
  }
  return absl::OkStatus();
}

std::string Describe(const absl::Status& status, absl::string_view context) {
  return absl::StrCat(context, ": ", status.message());
}

// Connects to lower-ranked process q, retrying while it is not up yet, and exchanges hellos;
// `keys` gets the connection's mesh keys where the processes hold a secret.
absl::StatusOr<tcp::Fd> ConnectTo(const ProcessGroupOptions& options, const Hello& mine, int q,
                                  absl::Time deadline, MeshKeys* keys) {
  const std::string& address = options.peers[q];
  const tcp::HostPort to = *tcp::ParseHostPort(address);
  absl::Status last;
  while (true) {
    absl::StatusOr<tcp::Fd> fd =
        tcp::Connect(to, std::min(deadline, absl::Now() + absl::Seconds(2)));
    if (fd.ok()) {
      if (absl::Status s = tcp::WriteAll(*fd, Bytes(mine), deadline); !s.ok()) {
        last = s;
      } else {
        Hello theirs;
        absl::Status s2 = tcp::ReadAll(*fd, Bytes(theirs), deadline);
        if (s2.ok()) {
          if (absl::Status c = CheckHello(mine, theirs, address, q); !c.ok()) return c;
          const absl::Status a =
              AuthenticatePeer(*fd, /*connector=*/true, options.secret, Bytes(mine), Bytes(theirs),
                               absl::StrCat("process ", q, " at ", address), deadline, keys);
          if (a.ok()) return std::move(*fd);
          if (a.code() == absl::StatusCode::kPermissionDenied) return a;
          s2 = a;  // it went away during the check: try again
        }
        if (s2.code() == absl::StatusCode::kDeadlineExceeded) {
          return absl::DeadlineExceededError(
              absl::StrCat("process group: process ", q, " at ", address,
                           " took the connection but sent no "
                           "hello within ",
                           absl::FormatDuration(options.bootstrap_timeout)));
        }
        last = s2;  // it went away (restarting, or refused us without a hello): try again
      }
    } else {
      last = fd.status();
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "process group: process ", q, " at ", address, " never came within ",
          absl::FormatDuration(options.bootstrap_timeout), " (last: ", last.message(), ")"));
    }
    absl::SleepFor(std::min(absl::Milliseconds(50), deadline - absl::Now()));
  }
}

// Accepts every higher-ranked process on `listener`, each into fds[its rank] (its mesh keys into
// keys[its rank]).
absl::Status AcceptHigher(const ProcessGroupOptions& options, const Hello& mine,
                          const tcp::Fd& listener, absl::Time deadline, std::vector<tcp::Fd>* fds,
                          std::vector<MeshKeys>* keys) {
  int missing = options.world - 1 - options.rank;
  while (missing > 0) {
    absl::StatusOr<tcp::Fd> fd = tcp::Accept(listener, deadline);
    if (!fd.ok()) {
      if (fd.status().code() != absl::StatusCode::kDeadlineExceeded) return fd.status();
      std::vector<std::string> absent;
      for (int q = options.rank + 1; q < options.world; ++q) {
        if (!(*fds)[q].valid()) absent.push_back(absl::StrCat(q, " (", options.peers[q], ")"));
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "process group: process(es) ", absl::StrJoin(absent, ", "), " never connected within ",
          absl::FormatDuration(options.bootstrap_timeout)));
    }
    Hello theirs;
    // A connection that sends no hello soon is not a peer (a probe, a port scan): drop it.
    const absl::Time hello_by = std::min(deadline, absl::Now() + absl::Seconds(5));
    if (!tcp::ReadAll(*fd, Bytes(theirs), hello_by).ok() || theirs.magic != kHelloMagic) continue;
    // Every peer that got this far is answered with our hello, so that it can name the problem too.
    const absl::Status sent = tcp::WriteAll(*fd, Bytes(mine), deadline);
    const std::string address =
        theirs.rank < options.peers.size() ? options.peers[theirs.rank] : "an unknown address";
    if (absl::Status c = CheckHello(mine, theirs, address, -1); !c.ok()) return c;
    const int q = static_cast<int>(theirs.rank);
    if (q <= options.rank || q >= options.world) {
      return absl::FailedPreconditionError(
          absl::StrCat("process group: process ", q, " connected to process ", options.rank,
                       ", which only takes connections from higher ranks"));
    }
    if (!sent.ok()) continue;  // it left; it will connect again
    // Before the rank is taken: a process without the group's secret claims nothing.
    MeshKeys connection_keys;
    const absl::Status a =
        AuthenticatePeer(*fd, /*connector=*/false, options.secret, Bytes(theirs), Bytes(mine),
                         absl::StrCat("the process at ", address, " (claiming process ", q, ")"),
                         std::min(deadline, absl::Now() + absl::Seconds(5)), &connection_keys);
    if (a.code() == absl::StatusCode::kPermissionDenied) return a;
    if (!a.ok()) continue;  // it left during the check; it will connect again
    if ((*fds)[q].valid()) {
      return absl::FailedPreconditionError(
          absl::StrCat("process group: two processes claim rank ", q));
    }
    (*fds)[q] = std::move(*fd);
    (*keys)[q] = connection_keys;
    --missing;
  }
  return absl::OkStatus();
}

// One peer's share of an exchange going out: the bytes as they are, or sealed record by record
// (mesh_cipher.h) just before each goes.
class Sending {
 public:
  Sending(std::span<const std::byte> data, MeshCipher* sealer) : data_(data), sealer_(sealer) {}
  bool done() const { return taken_ == data_.size() && at_ == wire_.size(); }
  // Bytes of data_ gone (on a sealed mesh: sealed, the record on its way included).
  size_t progress() const { return sealer_ != nullptr ? taken_ : taken_ - (wire_.size() - at_); }
  // Sends what the socket takes now; the error (for the peer's name) otherwise.
  absl::Status Pump(int fd) {
    if (at_ == wire_.size()) {
      const size_t n =
          sealer_ != nullptr ? MeshRecordPlainBytes(data_.size(), taken_) : data_.size() - taken_;
      if (sealer_ != nullptr) {
        record_.resize(n + kMeshTagBytes);
        if (absl::Status s = sealer_->Seal(data_.subspan(taken_, n), record_); !s.ok()) return s;
        wire_ = record_;
      } else {
        wire_ = data_.subspan(taken_, n);
      }
      taken_ += n;
      at_ = 0;
    }
    const ssize_t put = send(fd, wire_.data() + at_, wire_.size() - at_, MSG_NOSIGNAL);
    if (put < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("send: ", tcp::ErrnoText(errno)));
    }
    if (put > 0) at_ += static_cast<size_t>(put);
    return absl::OkStatus();
  }

 private:
  const std::span<const std::byte> data_;
  MeshCipher* const sealer_;
  std::vector<std::byte> record_;
  std::span<const std::byte> wire_;  // what goes now: a part of data_, or record_
  size_t taken_ = 0;                 // bytes of data_ in wire_ or gone
  size_t at_ = 0;                    // bytes of wire_ gone
};

// One peer's share of an exchange coming in: straight into place, or record by record, each
// opened (its tag checked) once it came whole.
class Receiving {
 public:
  Receiving(std::span<std::byte> data, MeshCipher* opener) : data_(data), opener_(opener) {}
  bool done() const { return filled_ == data_.size(); }
  size_t progress() const { return filled_; }  // bytes of data_ in place
  absl::Status Pump(int fd) {
    std::span<std::byte> into = data_.subspan(filled_);
    if (opener_ != nullptr) {
      if (record_.empty()) {
        record_.resize(MeshRecordPlainBytes(data_.size(), filled_) + kMeshTagBytes);
        got_ = 0;
      }
      into = std::span<std::byte>(record_).subspan(got_);
    }
    const ssize_t got = recv(fd, into.data(), into.size(), 0);
    if (got == 0) {
      return absl::UnavailableError("the peer closed the connection (its process ended?)");
    }
    if (got < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return absl::OkStatus();
      return absl::UnavailableError(absl::StrCat("recv: ", tcp::ErrnoText(errno)));
    }
    if (opener_ == nullptr) {
      filled_ += static_cast<size_t>(got);
      return absl::OkStatus();
    }
    got_ += static_cast<size_t>(got);
    if (got_ < record_.size()) return absl::OkStatus();
    const size_t n = record_.size() - kMeshTagBytes;
    if (absl::Status s = opener_->Open(record_, data_.subspan(filled_, n)); !s.ok()) return s;
    filled_ += n;
    got_ = 0;
    record_.clear();
    return absl::OkStatus();
  }

 private:
  const std::span<std::byte> data_;
  MeshCipher* const opener_;
  std::vector<std::byte> record_;  // the record coming in, on a sealed mesh
  size_t filled_ = 0;              // bytes of data_ in place
  size_t got_ = 0;                 // bytes of record_ in
};

}  // namespace

struct ProcessGroup::State {
  std::mutex exchange_mu;  // one exchange at a time
  std::vector<tcp::Fd> fds;
  // On a sealed mesh, each peer's two directions (null for this process, and when not sealing).
  std::vector<std::unique_ptr<MeshCipher>> sealers, openers;
  mutable absl::Mutex status_mu;
  absl::Status broken ABSL_GUARDED_BY(status_mu);
  uint64_t exchanges = 0;  // for errors: which exchange failed
};

absl::StatusOr<std::vector<std::string>> ExpandPeerPattern(absl::string_view pattern, int world) {
  const size_t at = pattern.find("{}");
  if (at == absl::string_view::npos || pattern.find("{}", at + 2) != absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer pattern \"", pattern, "\" must hold exactly one {}"));
  }
  if (world < 1) {
    return absl::InvalidArgumentError(absl::StrCat("peer pattern: world ", world, " < 1"));
  }
  std::vector<std::string> peers;
  for (int p = 0; p < world; ++p) {
    peers.push_back(absl::StrCat(pattern.substr(0, at), p, pattern.substr(at + 2)));
  }
  return peers;
}

absl::StatusOr<int> RankFromHostname(absl::string_view hostname) {
  const absl::string_view name = hostname.substr(0, hostname.find('.'));
  const size_t dash = name.rfind('-');
  int rank = -1;
  if (dash == absl::string_view::npos || dash + 1 == name.size() ||
      !std::all_of(name.begin() + dash + 1, name.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(name.substr(dash + 1), &rank)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host name \"", hostname, "\" does not end in -<ordinal> as a StatefulSet's pods do"));
  }
  return rank;
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Create(
    const ProcessGroupOptions& options) {
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  const absl::Time deadline = absl::Now() + options.bootstrap_timeout;
  const Hello mine = MakeHello(options);
  std::vector<tcp::Fd> fds(options.world);
  std::vector<MeshKeys> keys(options.world);
  tcp::Fd listener;
  // Listening comes first: higher ranks may be connecting already (they retry until it is up).
  if (options.rank + 1 < options.world) {
    tcp::HostPort at;
    if (options.listen.empty()) {
      at.port = tcp::ParseHostPort(options.peers[options.rank])->port;
    } else {
      absl::StatusOr<tcp::HostPort> parsed = tcp::ParseHostPort(options.listen);
      if (!parsed.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("process group: listen: ", parsed.status().message()));
      }
      at = *parsed;
    }
    absl::StatusOr<tcp::Fd> l = tcp::Listen(at);
    if (!l.ok()) return absl::UnavailableError(Describe(l.status(), "process group"));
    listener = std::move(*l);
  }
  // Lower ranks first, then higher ones: process p waits only on lower ranks, so no cycle forms.
  for (int q = 0; q < options.rank; ++q) {
    absl::StatusOr<tcp::Fd> fd = ConnectTo(options, mine, q, deadline, &keys[q]);
    if (!fd.ok()) return fd.status();
    fds[q] = std::move(*fd);
  }
  if (listener.valid()) {
    if (absl::Status s = AcceptHigher(options, mine, listener, deadline, &fds, &keys); !s.ok()) {
      return s;
    }
  }
  std::vector<int> raw;
  for (tcp::Fd& fd : fds) raw.push_back(fd.Release());
  std::unique_ptr<ProcessGroup> group(
      new ProcessGroup(options.rank, options.peers, std::move(raw), options.op_timeout));
  group->state_->sealers.resize(options.world);
  group->state_->openers.resize(options.world);
  if (options.encrypt) {
    for (int q = 0; q < options.world; ++q) {
      if (q == options.rank) continue;
      group->state_->sealers[q] = std::make_unique<MeshCipher>(keys[q].send);
      group->state_->openers[q] = std::make_unique<MeshCipher>(keys[q].receive);
    }
  }
  for (MeshKeys& k : keys) {
    OPENSSL_cleanse(k.send.data(), k.send.size());
    OPENSSL_cleanse(k.receive.data(), k.receive.size());
  }
  return group;
}

ProcessGroup::ProcessGroup(int rank, std::vector<std::string> peers, std::vector<int> fds,
                           absl::Duration op_timeout)
    : rank_(rank),
      peers_(std::move(peers)),
      op_timeout_(op_timeout),
      state_(std::make_unique<State>()) {
  for (int fd : fds) state_->fds.emplace_back(fd);
}

ProcessGroup::~ProcessGroup() { Shutdown(); }

absl::Status ProcessGroup::health() const {
  absl::MutexLock lock(&state_->status_mu);
  return state_->broken;
}

absl::Status ProcessGroup::Break(absl::Status status) {
  absl::MutexLock lock(&state_->status_mu);
  if (state_->broken.ok()) state_->broken = status;
  return status;
}

void ProcessGroup::Shutdown() {
  (void)Break(absl::UnavailableError("the process group was shut down"));
  // shutdown(2) wakes an exchange in flight on another thread (its poll sees the end), which then
  // releases the lock; only then are the descriptors closed.
  for (tcp::Fd& fd : state_->fds) {
    if (fd.valid()) shutdown(fd.get(), SHUT_RDWR);
  }
  std::lock_guard<std::mutex> lock(state_->exchange_mu);
  for (tcp::Fd& fd : state_->fds) fd.Close();
}

absl::Status ProcessGroup::Exchange(absl::string_view what,
                                    std::span<const std::span<const std::byte>> sends,
                                    std::span<const std::span<std::byte>> recvs) {
  std::lock_guard<std::mutex> lock(state_->exchange_mu);
  const uint64_t number = ++state_->exchanges;
  if (absl::Status h = health(); !h.ok()) {
    return absl::UnavailableError(
        absl::StrCat(what, ": the process group is unusable (", h.message(), ")"));
  }
  const int world = size();
  const absl::Time deadline = absl::Now() + op_timeout_;
  std::vector<Sending> out;
  std::vector<Receiving> in;
  out.reserve(world);
  in.reserve(world);
  for (int q = 0; q < world; ++q) {
    const bool peer = q != rank_;
    out.emplace_back(peer ? sends[q] : std::span<const std::byte>(),
                     peer ? state_->sealers[q].get() : nullptr);
    in.emplace_back(peer ? recvs[q] : std::span<std::byte>(),
                    peer ? state_->openers[q].get() : nullptr);
  }
  const auto fail = [&](int q, absl::string_view why) {
    return Break(absl::UnavailableError(absl::StrCat(what, " (exchange ", number, ") with process ",
                                                     q, " at ", peers_[q], ": ", why)));
  };
  std::vector<pollfd> polls;
  std::vector<int> peer_of;
  while (true) {
    polls.clear();
    peer_of.clear();
    for (int q = 0; q < world; ++q) {
      if (q == rank_) continue;
      short events = 0;
      if (!out[q].done()) events |= POLLOUT;
      if (!in[q].done()) events |= POLLIN;
      if (events == 0) continue;
      polls.push_back(pollfd{state_->fds[q].get(), events, 0});
      peer_of.push_back(q);
    }
    if (polls.empty()) return absl::OkStatus();
    const int n = poll(polls.data(), polls.size(), tcp::PollMillis(deadline));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Break(absl::UnavailableError(absl::StrCat(what, ": poll: ", tcp::ErrnoText(errno))));
    }
    if (n == 0) {
      if (absl::Now() < deadline) continue;
      const int q = peer_of[0];
      return fail(q,
                  absl::StrCat("not finished within ", absl::FormatDuration(op_timeout_), " (sent ",
                               out[q].progress(), " of ", sends[q].size(), " bytes, received ",
                               in[q].progress(), " of ", recvs[q].size(), ")"));
    }
    for (size_t i = 0; i < polls.size(); ++i) {
      const short ready = polls[i].revents;
      if (ready == 0) continue;
      const int q = peer_of[i];
      const int fd = polls[i].fd;
      if ((polls[i].events & POLLIN) && (ready & (POLLIN | POLLHUP | POLLERR))) {
        if (absl::Status s = in[q].Pump(fd); !s.ok()) return fail(q, s.message());
      }
      if ((polls[i].events & POLLOUT) && (ready & (POLLOUT | POLLHUP | POLLERR))) {
        if (absl::Status s = out[q].Pump(fd); !s.ok()) return fail(q, s.message());
      } else if ((ready & (POLLHUP | POLLERR)) && !(polls[i].events & POLLIN)) {
        return fail(q, "the connection broke");
      }
    }
  }
}

absl::StatusOr<std::vector<std::vector<std::byte>>> ProcessGroup::AllGather(
    absl::string_view what, std::span<const std::byte> mine) {
  const int world = size();
  std::vector<std::vector<std::byte>> all(world, std::vector<std::byte>(mine.size()));
  std::copy(mine.begin(), mine.end(), all[rank_].begin());
  std::vector<std::span<const std::byte>> sends(world, mine);
  std::vector<std::span<std::byte>> recvs(world);
  for (int q = 0; q < world; ++q) {
    if (q != rank_) recvs[q] = all[q];
  }
  if (absl::Status s = Exchange(what, sends, recvs); !s.ok()) return s;
  return all;
}

absl::StatusOr<std::vector<absl::Status>> GatherStatuses(ProcessGroup& group,
                                                         absl::string_view what,
                                                         const absl::Status& mine) {
  // Fixed size (AllGather's contract): the code, then the message, cut to fit and NUL-padded.
  constexpr size_t kBytes = 1024;
  std::vector<std::byte> encoded(kBytes, std::byte{0});
  const uint32_t code = static_cast<uint32_t>(mine.code());
  std::memcpy(encoded.data(), &code, sizeof(code));
  const size_t n = std::min(mine.message().size(), kBytes - sizeof(code) - 1);
  std::memcpy(encoded.data() + sizeof(code), mine.message().data(), n);
  absl::StatusOr<std::vector<std::vector<std::byte>>> all = group.AllGather(what, encoded);
  if (!all.ok()) return all.status();
  std::vector<absl::Status> statuses;
  for (const std::vector<std::byte>& bytes : *all) {
    uint32_t theirs = 0;
    std::memcpy(&theirs, bytes.data(), sizeof(theirs));
    const char* text = reinterpret_cast<const char*>(bytes.data() + sizeof(theirs));
    statuses.emplace_back(static_cast<absl::StatusCode>(theirs),
                          std::string(text, strnlen(text, bytes.size() - sizeof(theirs))));
  }
  return statuses;
}

}  // namespace losshead::kernels
