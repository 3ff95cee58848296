// What the kill -9 tests share: a fresh checkpoint directory per run, and a client with the
// deadlines a restarting server needs.
#ifndef LOSSHEAD_TESTS_RECOVERY_RECOVERY_PROCESS_H_
#define LOSSHEAD_TESTS_RECOVERY_RECOVERY_PROCESS_H_

#include <memory>
#include <string>

#include "losshead/client/client.h"
#include "tests/common/server_process.h"

namespace losshead::testing {

// A new directory under the system's temporary directory ("" when none can be made).
std::string RecoveryTempDir();
// A client of `process` (unary calls 30 s, streams 120 s); null when it cannot connect.
std::unique_ptr<client::Client> ConnectToServer(const ServerProcess& process);

}  // namespace losshead::testing

#endif  // LOSSHEAD_TESTS_RECOVERY_RECOVERY_PROCESS_H_
