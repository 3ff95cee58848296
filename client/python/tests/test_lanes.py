"""The threads that run a step's other Step streams (losshead._lanes)."""

import threading

import pytest

from losshead._lanes import LaneThreads


def _run_together(lanes: LaneThreads, n: int) -> set:
    """Runs n callables that can only finish together; returns the threads they ran on."""
    barrier = threading.Barrier(n, timeout=10)
    seen = set()
    lock = threading.Lock()

    def work() -> None:
        with lock:
            seen.add(threading.current_thread())
        barrier.wait()

    for done in [lanes.run(work) for _ in range(n)]:
        assert done.wait(10)
    return seen


def test_threads_are_kept_from_call_to_call():
    lanes = LaneThreads("test-lane")
    first = _run_together(lanes, 3)
    assert len(first) == 3 and all(t.daemon for t in first)
    # The same threads serve the next call (none new is started while three are idle).
    again = _run_together(lanes, 3)
    assert again == first
    # More at once than ever before: one more thread.
    assert len(_run_together(lanes, 4) - first) == 1
    lanes.close()
    for t in first:
        t.join(10)
        assert not t.is_alive()
    with pytest.raises(RuntimeError):
        lanes.run(lambda: None)


def test_a_callable_that_raises_still_reports_done(capsys):
    lanes = LaneThreads("test-lane")

    def boom() -> None:
        raise ValueError("boom")

    threads = []
    assert lanes.run(boom).wait(10)
    assert "ValueError: boom" in capsys.readouterr().err
    # The thread goes on serving.
    assert lanes.run(lambda: threads.append(threading.current_thread())).wait(10)
    assert lanes.run(lambda: threads.append(threading.current_thread())).wait(10)
    assert len(threads) == 2 and threads[0] is threads[1]
    lanes.close()
