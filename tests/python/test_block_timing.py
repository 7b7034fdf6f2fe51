"""The Python benchmarks' block timing (bench/block_timing.py), as
tests/cpp/test_block_timing.cpp tests its C++ twin: a call that returns
before its work is done must not look faster than the same work inline. The
work is sleeps on one shared "device", so the comparison holds on a loaded
machine."""
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))

from block_timing import Side, alternate_blocks, median  # noqa: E402

FRONT, BACK = 0.004, 0.012


class FakeDevice:
    """Runs one piece of work at a time, whoever asks."""

    def __init__(self):
        self.lock = threading.Lock()

    def run(self, seconds):
        with self.lock:
            time.sleep(seconds)


class EarlyReturningEngine:
    """call() does its first part and returns; the rest runs on a background
    thread, as a call's backward stages do after it returned at its losses."""

    def __init__(self, device):
        self.device = device
        self.cv = threading.Condition()
        self.queued = 0
        self.stop = False
        self.worker = threading.Thread(target=self.loop, daemon=True)
        self.worker.start()

    def call(self):
        self.device.run(FRONT)
        with self.cv:
            self.queued += 1
            self.cv.notify_all()

    def synchronize(self):
        with self.cv:
            self.cv.wait_for(lambda: self.queued == 0)

    def loop(self):
        with self.cv:
            while True:
                self.cv.wait_for(lambda: self.stop or self.queued > 0)
                if self.queued == 0:
                    return
                self.cv.release()
                try:
                    self.device.run(BACK)
                finally:
                    self.cv.acquire()
                self.queued -= 1
                self.cv.notify_all()

    def close(self):
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        self.worker.join()


def test_an_early_returning_call_is_not_faster_than_the_same_work_inline():
    device = FakeDevice()
    engine = EarlyReturningEngine(device)
    try:
        times = alternate_blocks([Side("early", engine.call, engine.synchronize),
                                  Side("inline", lambda: (device.run(FRONT), device.run(BACK)))],
                                 rounds=7, steps=4, warmup_rounds=1)
    finally:
        engine.close()
    early, inline = median(times["early"]), median(times["inline"])
    # Sleeps last at least as long as asked and the device runs one at a time:
    # the early return's block is charged the whole work, as the inline one.
    # (No bound on their ratio: a timing threshold fails on a loaded machine.)
    assert early >= FRONT + BACK and inline >= FRONT + BACK, (early, inline)


def test_blocks_alternate_and_only_timed_blocks_are_kept():
    order, finishes = [], []
    times = alternate_blocks([Side("a", lambda: order.append("a"), lambda: finishes.append("a")),
                              Side("b", lambda: order.append("b"))], rounds=5, steps=3, warmup_rounds=1)
    assert order.count("a") == order.count("b") == 18
    assert len(finishes) == 6
    assert len(times["a"]) == len(times["b"]) == 5
    assert order[0::3][:4] == ["a", "b", "b", "a"]  # the side that starts a round rotates
