"""The pool of devices, as scripts written for the reference implementation
read it: ``roundpipe.device.device_list``, one entry per device of the pool
(ROUNDPIPE_DEVICES), each with ``.device`` (the ``torch.device`` its work runs
on) and ``.name``. Reading it fixes the pool, as the first model does.

``memory_stats()`` and ``reset_peak_memory_stats()`` read and restart the
engine's per-device memory counters (as torch.cuda's functions of those
names do for one GPU): CPU virtual devices count everything their work
allocates; devices over one GPU share its statistics."""
from typing import Dict, List
import re

import torch

from . import _C


class PoolDevice:
    """One device of the pool."""

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.name = name  # "cpu:1", "cuda:0"
        kind, _, number = name.partition(":")
        # CPU virtual devices all compute on the CPU; several pool devices
        # may share one GPU.
        self.device = torch.device("cpu") if kind == "cpu" else torch.device(kind, int(re.match(r"\d+", number)[0]))

    def __repr__(self):
        return f"PoolDevice(index={self.index}, name={self.name!r}, device={self.device})"


_devices = None


def __getattr__(name):
    global _devices
    if name == "device_list":
        if _devices is None:
            _devices = [PoolDevice(i, n) for i, n in enumerate(_C.get_device_names())]
        return list(_devices)
    raise AttributeError(f"module 'roundpipe.device' has no attribute '{name}'")


def memory_stats() -> List[Dict[str, int]]:
    """One dict per device of the pool, in pool order: ``device`` (its
    name), ``allocated_bytes`` (in use now), ``max_allocated_bytes`` (most in
    use since the last reset), ``max_reserved_bytes`` (most held, a GPU
    allocator's cached blocks included)."""
    return _C.device_memory_stats()


def reset_peak_memory_stats() -> None:
    """Starts a new peak measurement on every device of the pool."""
    _C.reset_peak_device_memory()


__all__ = ["PoolDevice", "device_list", "memory_stats", "reset_peak_memory_stats"]
