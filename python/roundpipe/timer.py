"""Per-layer timing (docs/trace.md, "1. Per-layer timing").

Every call measures each layer's forward (``fwd``), recomputation (``re``) and
backward (``bwd``) time per microbatch on the devices. The first record of
each is discarded; later ones update a bias-corrected moving average
(decay 0.9). The automatic execution plan balances its stages with these
estimates. ``ModelTimer.VERBOSE = True`` prints, after every call, one line
per layer and action on stderr::

    Layer 3 fwd  new record: 1.234 ms  new estimate: 1.200 ms
"""
import os
from typing import Any, Dict, List, Optional, Union

from . import _C
from ._engines import engines_of


class _VerboseFlag(type):
    """Makes ``ModelTimer.VERBOSE`` a process-wide switch of the engine."""

    @property
    def VERBOSE(cls):
        return _C.timer_verbose()

    @VERBOSE.setter
    def VERBOSE(cls, on):
        _C.set_timer_verbose(bool(on))


class ModelTimer(metaclass=_VerboseFlag):
    """The timing estimates of one RoundPipe model (``model.timer``)."""

    DECAY = 0.9

    def __init__(self, model: Any) -> None:  # a RoundPipe (whose module imports this one)
        self._model = model

    def estimate(self, layer: int, action: str) -> Optional[float]:
        """The estimate in ms of ``action`` ("fwd", "re", "bwd") on ``layer``,
        or None before the first kept record."""
        return self._model._engine.timer_estimate(int(layer), action)

    def num_records(self, layer: int, action: str) -> int:
        """Records kept for ``action`` on ``layer`` (the first one is not)."""
        return self._model._engine.timer_records(int(layer), action)

    def estimates(self) -> Dict[str, List[Optional[float]]]:
        """``{"fwd": [...], "re": [...], "bwd": [...]}`` with None where unknown."""
        n = len(self._model._layers)
        return {a: [self.estimate(i, a) for i in range(n)] for a in ("fwd", "re", "bwd")}

    def reset(self) -> None:
        """Forgets every record (the next one is discarded again)."""
        self._model._engine.timer_reset()

    def __repr__(self):
        return f"ModelTimer({self._model.name!r}, {self.estimates()!r})"


def save_timings(path: Union[str, "os.PathLike[str]"], *models: Any) -> None:
    """Writes the models' per-layer costs as a timings file for roundpipe-sim
    (``roundpipe-sim --timings PATH``), atomically."""
    _C.save_timings(str(path), engines_of(models, "save_timings"))
