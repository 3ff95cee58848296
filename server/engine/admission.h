// Server-wide admission of Step micro-batches: a bound on how many may be in flight (header read,
// not yet answered), on the bytes held for them, and the two timeouts after which the Step reactor
// lets go of what a stream holds. Bytes are reserved before they are buffered (from the header:
// the larger of its request and the most its answer can be, then piece by piece when more
// arrive), so the request bytes buffered and the answers held can never exceed the bound, whatever
// the clients send. Once a micro-batch is computed its reservation becomes its answer's bytes,
// held until the last of them is written: answers a client does not read count like requests.
// The stall timeout bounds how long a micro-batch being received may hold its reservation without
// progress; the unread timeout how long an answer may wait to be written.
#ifndef LOSSHEAD_SERVER_ENGINE_ADMISSION_H_
#define LOSSHEAD_SERVER_ENGINE_ADMISSION_H_

#include <cstddef>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "losshead/v1/losshead.pb.h"

namespace losshead::server {

class Admission {
 public:
  Admission(size_t max_microbatches, size_t max_bytes, absl::Duration retry_after,
            absl::Duration stall_timeout = absl::InfiniteDuration(),
            absl::Duration unread_timeout = absl::InfiniteDuration())
      : max_microbatches_(max_microbatches),
        max_bytes_(max_bytes),
        retry_after_(retry_after),
        stall_timeout_(stall_timeout),
        unread_timeout_(unread_timeout) {}

  // Admits one micro-batch with `bytes` reserved; false (nothing taken) beyond either bound.
  bool TryAdmit(size_t bytes);
  // Reserves `bytes` more for an admitted micro-batch; false (nothing taken) beyond the bound.
  bool TryReserve(size_t bytes);
  // Gives back `microbatches` admissions and `bytes` reserved bytes.
  void Release(size_t microbatches, size_t bytes);
  // Replaces `from` reserved bytes by `to` (a computed micro-batch's request by its answer). Never
  // refused: the answer exists already. One larger than its reservation (only when it is larger
  // than the whole bound, see AnswerBytes) is booked past the bound, which then refuses
  // micro-batches until it is written.
  void Replace(size_t from, size_t to);

  size_t microbatches() const;
  size_t bytes() const;
  size_t max_bytes() const { return max_bytes_; }
  // How long a micro-batch being received may wait without progress (StepReactor says what
  // progress is); infinite: no bound.
  absl::Duration stall_timeout() const { return stall_timeout_; }
  // How long an answer may wait to be written (its client does not read); infinite: no bound.
  absl::Duration unread_timeout() const { return unread_timeout_; }

  // The RESOURCE_EXHAUSTED of a refused micro-batch: "retry after N ms" in the message and N in
  // the status payload (see RetryAfterMs), which the Step response carries as retry_after_ms.
  absl::Status Refusal(absl::string_view what) const;

 private:
  const size_t max_microbatches_;
  const size_t max_bytes_;
  const absl::Duration retry_after_;
  const absl::Duration stall_timeout_;
  const absl::Duration unread_timeout_;
  mutable absl::Mutex mu_;
  size_t microbatches_ ABSL_GUARDED_BY(mu_) = 0;
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Request bytes a header announces (N x D x hidden dtype + N x target dtype + N x 4 per token
// input named) for a head of hidden size `hidden_size`; 0 when the header's fields do not allow computing it (the micro-batch is
// then reserved for piece by piece and fails validation later). Saturates instead of overflowing.
uint64_t AnnouncedBytes(const v1::StepHeader& header, int64_t hidden_size);

// The most bytes the answer to `header` can hold: N x (D x dH dtype + 4 + 4 x outputs + 8 x k): dH
// in grad_hidden_dtype (hidden_dtype when unset; none with skip_grad_hidden), 4 bytes per token
// for per-token losses, which a reduction of NONE returns unasked, 4 per token for each of
// options.token_outputs and 8 per token and top-k entry (options.top_k, counted as at most
// kernels::kMaxTopK). At most AnnouncedBytes unless dH is asked for in a
// wider dtype than the hidden states. 0 when the fields do not allow computing it (the micro-batch
// then fails validation and its answer is an error). Saturates instead of overflowing.
uint64_t AnswerBytes(const v1::StepHeader& header, int64_t hidden_size);

// The retry hint of a status built by Admission::Refusal; 0 when it has none.
uint32_t RetryAfterMs(const absl::Status& status);

}  // namespace losshead::server

#endif  // LOSSHEAD_SERVER_ENGINE_ADMISSION_H_
