"""What a training loop does to a head besides stepping it: look at or discard its gradient
window, and save or put back its whole state under a name.

Once the optimizer runs on the server, the server holds the head's only copy: W, the fp32
master weights, the optimizer's moments and step count, the open dW window. A trainer's
`zero_grad` must discard the window (`discard_gradient`), and a trainer's checkpoint must be able
to put the server back to its step: `snapshot_head` writes a named snapshot on the server (with
`--checkpoint_dir`), the checkpoint keeps the tag, and `restore_head` puts the head back to it,
exactly. `list_snapshots` and `delete_snapshot` prune the snapshots of rotated checkpoints;
deleting a head leaves its snapshots alone.
"""

from __future__ import annotations

from typing import List

import grpc

from losshead._base import ClientBase
from losshead._proto.losshead.v1 import losshead_pb2 as pb
from losshead.errors import LossheadError


class HeadState(ClientBase):
    """gradient_summary, discard_gradient and the named snapshots of `losshead.Client`."""

    # -- the gradient window ----------------------------------------------------------------
    def gradient_summary(self, head: str) -> pb.GradientSummary:
        """What the head's open gradient window holds (micro-batches, tokens, the weights
        versions they ran against), without its data and without resetting it. Retried like any
        read."""
        return self._with_retry(lambda: self._summary_once(head, reset=False))

    def discard_gradient(self, head: str) -> pb.GradientSummary:
        """Discards the head's gradient window, atomically, without moving dW over the wire:
        what a trainer's `zero_grad` does to a head whose gradient lives on the server. Each
        micro-batch lands wholly in the discarded window or wholly in the next; nothing of the
        discarded ones reaches dW later. Returns the summary of what was discarded
        (`was_reset` set). Needs a writer token.

        Like a pull with reset, it is never re-sent once it may have reached the server (a
        second discard would drop micro-batches sent after the first): the client only waits,
        with the retry policy's backoff, for a connection before its single attempt."""
        self._wait_for_connection()
        return self._summary_once(head, reset=True)

    def _summary_once(self, head: str, reset: bool) -> pb.GradientSummary:
        request = pb.PullGradientRequest(head=head, reset=reset, summary_only=True)
        try:
            chunks = self._stub.PullGradient(request, timeout=self.timeout,
                                             metadata=self._metadata)
            first = next(chunks, None)
            if first is None:
                raise LossheadError(grpc.StatusCode.INTERNAL,
                                    "PullGradient(summary_only) answered no message")
            if first.data or first.summary.total_bytes:
                # A server older than summary_only sends dW: only its summary is wanted.
                chunks.cancel()
            else:
                for _ in chunks:  # the call's status: one message, then OK
                    pass
        except grpc.RpcError as e:
            raise LossheadError.from_rpc_error(e) from None
        return first.summary

    # -- named snapshots ----------------------------------------------------------------------
    def snapshot_head(self, head: str, tag: str) -> pb.SnapshotInfo:
        """Writes the head's whole state (W, dW window, version, counters, optimizer master
        weights, moments and step count, remembered micro-batches and applies) to the server's
        snapshot `tag` (<checkpoint_dir>/snapshots/<tag>/<head>.lhck), replacing one of the same
        tag; returns what was written (version, optimizer step, bytes, time). The server's own
        checkpoint of the head is not touched.

        A tag is [A-Za-z0-9._-]{1,128} not starting with '.'. FAILED_PRECONDITION without
        --checkpoint_dir, INVALID_ARGUMENT for a bad tag, NOT_FOUND for an unknown head. Retried
        on a transient failure (a repeat writes the head's state again)."""
        if not tag:
            # Without a tag the request is a plain checkpoint of the head.
            raise ValueError("losshead: a snapshot needs a tag")
        response = self._unary(self._stub.Checkpoint, pb.CheckpointRequest(head=head, tag=tag))
        return response.snapshot

    def restore_head(self, head: str, tag: str) -> pb.HeadInfo:
        """Replaces the head's whole state with its snapshot `tag` and returns the restored
        head's HeadInfo: `weights_version` and `optimizer_step` are the snapshot's. The head
        need not exist (it is created with the snapshot's spec and placement). Atomic: a
        micro-batch, pull or apply lands wholly before (and is lost with the old state) or
        wholly after, on the restored one. A restart of the server keeps the restored state.

        NOT_FOUND for a missing snapshot, DATA_LOSS for a corrupt one, RESOURCE_EXHAUSTED when
        the restored head does not fit beside the live one (or --max_heads is reached),
        FAILED_PRECONDITION without --checkpoint_dir. Retried on a transient failure (restoring
        twice leaves the same state)."""
        try:
            return self._unary(self._stub.RestoreHead, pb.RestoreHeadRequest(head=head, tag=tag))
        finally:
            self._head_facts.pop(head, None)  # the spec may be another one now

    def delete_snapshot(self, head: str, tag: str) -> None:
        """Deletes the head's snapshot `tag`. NOT_FOUND when there is none (but not when a
        retry finds it gone after an attempt whose answer was lost)."""
        attempts = 0

        def once() -> None:
            nonlocal attempts
            attempts += 1
            try:
                self._unary_once(self._stub.DeleteSnapshot,
                                 pb.DeleteSnapshotRequest(head=head, tag=tag))
            except LossheadError as e:
                if attempts == 1 or e.code != grpc.StatusCode.NOT_FOUND:
                    raise

        self._with_retry(once)

    def list_snapshots(self, head: str) -> List[pb.SnapshotInfo]:
        """The head's snapshots, by tag (the head need not exist). Read from each file's
        header, unverified: `restore_head` checks the whole file."""
        return list(self._unary(self._stub.ListSnapshots,
                                pb.ListSnapshotsRequest(head=head)).snapshots)
