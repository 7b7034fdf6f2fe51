"""Throughput of sides compared in alternating blocks of iterations: the
Python twin of bench/block_timing.h (read its comment for the why).

A roundpipe call returns at its losses while its backward stages run on, so a
block is `steps` iterations of one side followed by that side's `finish`
(roundpipe: `model.synchronize()`; a GPU loop: `torch.cuda.synchronize()`),
all inside the timed interval. Blocks of the sides alternate, the order
rotating every round; each side's figure is the median seconds per
iteration over its timed blocks.
"""
import statistics
import time


class Side:
    def __init__(self, name, step, finish=None):
        self.name, self.step, self.finish = name, step, finish


def time_block(side, steps):
    """Seconds per iteration of one block: `steps` calls of step, then finish."""
    start = time.perf_counter()
    for _ in range(steps):
        side.step()
    if side.finish is not None:
        side.finish()
    return (time.perf_counter() - start) / steps


def alternate_blocks(sides, rounds=5, steps=2, warmup_rounds=1):
    """{name: [seconds per iteration of each timed block]} after `warmup_rounds`
    untimed rounds (one block per side each)."""
    times = {s.name: [] for s in sides}
    for r in range(warmup_rounds + rounds):
        for k in range(len(sides)):
            side = sides[(k + r) % len(sides)]
            t = time_block(side, steps)
            if r >= warmup_rounds:
                times[side.name].append(t)
    return times


def median(ts):
    return statistics.median(ts)


def describe(rounds, steps, warmup_rounds):
    return (f"timing: blocks of {steps} iterations, each ending when its side's work is done "
            f"(roundpipe: synchronize()), sides alternated, median of {rounds} blocks after "
            f"{warmup_rounds} warm-up round(s)")
