"""The pool of devices, as scripts written for the reference implementation
read it: ``roundpipe.device.device_list``, one entry per device of the pool
(ROUNDPIPE_DEVICES), each with ``.device`` (the ``torch.device`` its work runs
on) and ``.name``. Reading it fixes the pool, as the first model does."""
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


__all__ = ["PoolDevice", "device_list"]
