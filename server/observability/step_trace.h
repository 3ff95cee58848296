// --step_trace: one JSON line per answered micro-batch with the times of its phases, so that a
// step's timeline (when its first bytes arrived, when the device started on it, when its last
// answer left) can be read off rather than guessed from the phase histograms' sums.
//
// Times are Unix microseconds of the server's wall clock: a client on the same host can lay its
// own timestamps beside them (client/python/benchmarks/step_phases.py --trace). A phase the
// micro-batch never reached (it was refused, replayed or failed) is 0.
#ifndef LOSSHEAD_SERVER_OBSERVABILITY_STEP_TRACE_H_
#define LOSSHEAD_SERVER_OBSERVABILITY_STEP_TRACE_H_

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace losshead::server {

struct StepTraceRecord {
  std::string head;
  std::string client_id;
  uint64_t sequence = 0;
  int64_t tokens = 0;  // as the header announces
  int code = 0;        // the answer's status code (0: OK)
  bool replayed = false;
  absl::Time first_message = absl::UnixEpoch();  // its header arrived
  absl::Time last_message = absl::UnixEpoch();   // its last request arrived
  absl::Time picked = absl::UnixEpoch();         // a worker took it
  absl::Time stage = absl::UnixEpoch();          // it had an I/O slot; copies in began
  absl::Time compute = absl::UnixEpoch();        // it had the device (compute lock)
  absl::Time compute_end = absl::UnixEpoch();    // its run was synchronised
  absl::Time finish_end = absl::UnixEpoch();     // dH was back on the host
  absl::Time first_send = absl::UnixEpoch();     // its first answer was handed to gRPC
  absl::Time sent = absl::UnixEpoch();           // its last answer was written
};

class StepTrace {
 public:
  // Appends to `path` (created if missing). The errno-derived status when it cannot be opened.
  static absl::StatusOr<std::unique_ptr<StepTrace>> Open(const std::string& path);
  ~StepTrace();
  StepTrace(const StepTrace&) = delete;
  StepTrace& operator=(const StepTrace&) = delete;

  // One line, written whole (lines of concurrent streams never interleave) and flushed.
  void Write(const StepTraceRecord& record);

  // The line Write writes, without its newline (exposed for tests).
  static std::string Format(const StepTraceRecord& record);

 private:
  explicit StepTrace(std::FILE* file) : file_(file) {}

  absl::Mutex mu_;
  std::FILE* const file_ ABSL_GUARDED_BY(mu_);
};

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_OBSERVABILITY_STEP_TRACE_H_
