"""Checkpoints of the whole training state, resumable to a bitwise-identical
trajectory, also on another number of devices (see docs/guide.md).

The file holds the model's parameters and buffers, its optimizer copies, the
gradients not yet handed to an optimizer, the engine's counters (random
streams, steps) and timings, plus the optimizer's and the scaler's
``state_dict()`` and ``extra``. It is written atomically: a crash during a save
leaves the previous file in place.
"""
import copy
import io
import os
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

import torch

from . import _C

if TYPE_CHECKING:
    from ._model import RoundPipe
    from .grad_scaler import GradScaler

__all__ = ["save_checkpoint", "load_checkpoint"]


def _engine_of(model, who):
    """The model's engine, which the checkpoint functions of the extension take."""
    if not hasattr(model, "_engine") or not hasattr(model, "_layers"):
        raise TypeError(f"{who}: model must be a roundpipe.RoundPipe, got {type(model).__name__}")
    if not any(True for layer in model._layers for _ in list(layer.parameters()) + list(layer.buffers())):
        raise ValueError(f"{who}: the model has no parameters or buffers; there is nothing to checkpoint")
    if model._engine is None:
        raise ValueError(f"{who}: this RoundPipe model was closed")
    return model._engine


def save_checkpoint(path: Union[str, "os.PathLike[str]"], model: "RoundPipe",
                    optimizer: Optional[torch.optim.Optimizer] = None, scaler: Optional["GradScaler"] = None,
                    step: int = 0, extra: Any = None) -> None:
    """Writes the whole training state of ``model`` (a RoundPipe) to ``path``.

    ``optimizer`` (any torch.optim-style optimizer over
    ``model.optim_parameters()``) and ``scaler`` (roundpipe.GradScaler) are
    saved when given; ``step`` is the caller's step counter; ``extra`` is any
    picklable object returned again by load_checkpoint. Waits for the step in
    flight but does not change the training trajectory.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"save_checkpoint: step must be an int, got {type(step).__name__}")
    path = os.fspath(path)
    engine = _engine_of(model, "save_checkpoint")
    # The optimizer's state belongs to the optimizer thread until it is idle.
    _C.checkpoint_drain(engine)
    state = {
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "optimizer_class": type(optimizer).__qualname__ if optimizer is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "extra": extra,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    _C.save_checkpoint(path, engine, step, "{}", buffer.getvalue())


def load_checkpoint(path: Union[str, "os.PathLike[str]"], model: "RoundPipe",
                    optimizer: Optional[torch.optim.Optimizer] = None,
                    scaler: Optional["GradScaler"] = None) -> Dict[str, Any]:
    """Restores a checkpoint into ``model`` (same architecture, any device
    count), and into ``optimizer`` and ``scaler`` when given. Returns
    ``{"step": ..., "extra": ...}``.

    ValueError for a missing, truncated or corrupt file, another architecture,
    or an optimizer/scaler whose state the file does not hold or that does not
    fit; the model, optimizer and scaler are then unchanged.
    """
    path = os.fspath(path)
    pending = _C.read_checkpoint(path, _engine_of(model, "load_checkpoint"))
    state = {"optimizer": None, "scaler": None, "extra": None}
    if pending.extra is not None:
        try:
            state = torch.load(io.BytesIO(pending.extra), weights_only=False)
        except Exception as e:
            raise ValueError(f"load_checkpoint: '{path}': the optimizer and scaler state cannot be read: {e}") from e
    if optimizer is not None and state["optimizer"] is None:
        raise ValueError(f"load_checkpoint: '{path}' holds no optimizer state (it was saved without an optimizer)")
    if scaler is not None and state["scaler"] is None:
        raise ValueError(f"load_checkpoint: '{path}' holds no GradScaler state (it was saved without a scaler)")
    saved_class = state.get("optimizer_class")
    if optimizer is not None and saved_class is not None and saved_class != type(optimizer).__qualname__:
        # torch's load_state_dict would take it, and the first step would fail.
        raise ValueError(f"load_checkpoint: '{path}' holds the state of a {saved_class} optimizer, not of "
                         f"a {type(optimizer).__qualname__}: build the optimizer the checkpoint was saved with")
    optimizer_before = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    scaler_before = scaler.state_dict() if scaler is not None else None
    try:
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
    except Exception as e:
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_before)
        if scaler is not None and scaler_before:
            scaler.load_state_dict(scaler_before)
        raise ValueError(f"load_checkpoint: '{path}': the saved optimizer or scaler state does not fit: {e}") from e
    pending.apply()
    return {"step": pending.step, "extra": state["extra"]}
