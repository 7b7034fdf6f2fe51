"""OptimizerCtx (docs/python.md, "API summary")."""
from typing import Any

from . import _C


class OptimizerCtx:
    """Inside ``with OptimizerCtx():``, ``model.parameters()`` and
    ``model.named_parameters()`` of every RoundPipe model return the optimizer
    copies (as inside a step_fn), so

        with OptimizerCtx():
            optimizer = Adam(model.parameters(), lr=1e-3)

    builds the optimizer over the copies the optimizer thread updates. Acts on
    the current thread; nests."""

    def __init__(self) -> None:
        self._guards = []

    def __enter__(self) -> "OptimizerCtx":
        self._guards.append(_C._OptimizerCtxGuard())
        return self

    def __exit__(self, *exc: Any) -> bool:
        self._guards.pop()
        return False
