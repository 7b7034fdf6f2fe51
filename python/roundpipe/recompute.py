"""Recompute hooks: a layer can keep data from its forward for the
recomputation of that forward before backward."""
from typing import Any, Tuple

from . import _C


def save_for_recompute(*data: Any) -> None:
    """Keep ``data`` (tensors must not require grad) for this layer's
    recomputation. At most once per layer forward; a no-op when grad is off or
    in the fused stage (which is never recomputed)."""
    _C.save_for_recompute(tuple(data))


def doing_recompute() -> bool:
    """True while a layer's forward is being recomputed."""
    return _C.doing_recompute()


def get_recompute_data() -> Tuple[Any, ...]:
    """The tuple given to save_for_recompute in the original forward."""
    assert doing_recompute(), "get_recompute_data() called outside recomputation; check doing_recompute() first"
    return _C.get_recompute_data()
