"""The optimizer state a training run keeps in host memory, chosen by one
switch (docs/hf.md, "Compact optimizer state"; the CLI's
``--optimizer-state``):

- ``"fp32"``: the optimizer copies and the AdamW moments in fp32 (with a bf16
  model: 18 bytes per parameter, the layout of DeepSpeed's ZeRO-Offload).
- ``"compact"``: AdamW with blockwise 8-bit moments
  (``roundpipe.optim.AdamW8bit``; tensors under
  ``roundpipe._C.adam_min_blockwise8_numel`` elements keep fp32 moments) and
  optimizer copies in the model's dtype: bf16 for a bf16 model, fp32 for an
  fp32 one. fp16 models are refused: fp16 copies would lose small updates.

    state = "compact"
    model = roundpipe.wrap_model_to_roundpipe(
        model, optim_dtype=optimizer_state.optim_dtype_for("train", model, state))
    with roundpipe.OptimizerCtx():
        optimizer = optimizer_state.adamw(model.parameters(), state, lr=1e-4)
"""
from typing import Any

import torch
from torch import nn

from . import optim

OPTIMIZER_STATES = ("fp32", "compact")


def check(who: str, optimizer_state: str) -> str:
    """Returns ``optimizer_state`` if it is one of OPTIMIZER_STATES, else
    raises ValueError."""
    if optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(f"{who}: optimizer_state must be 'fp32' or 'compact', got {optimizer_state!r}")
    return optimizer_state


def optim_dtype_for(who: str, model: nn.Module, optimizer_state: str) -> torch.dtype:
    """The ``optim_dtype`` for RoundPipe/wrap_model_to_roundpipe: fp32 copies
    for ``"fp32"``; for ``"compact"`` the dtype of the model's trainable
    parameters (which must all be bf16 or all fp32)."""
    if check(who, optimizer_state) == "fp32":
        return torch.float32
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    if torch.float16 in dtypes:
        raise ValueError(f"{who}: optimizer_state='compact' is not supported for an fp16 model (fp16 optimizer "
                         "copies lose small updates); load the model in bf16 (dtype=torch.bfloat16) or use "
                         "optimizer_state='fp32'")
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(d) for d in dtypes))
        raise ValueError(f"{who}: optimizer_state='compact' keeps the optimizer copies in the model's dtype, but "
                         f"its trainable parameters mix {names}; convert the model to one dtype or pass "
                         "optim_dtype explicitly")
    return dtypes.pop() if dtypes else torch.float32


def adamw(params: optim.Params, optimizer_state: str, **kwargs: Any) -> optim.AdamW:
    """``roundpipe.optim.AdamW(params, **kwargs)`` for ``"fp32"``,
    ``roundpipe.optim.AdamW8bit(params, **kwargs)`` for ``"compact"``."""
    cls = optim.AdamW8bit if check("optimizer_state.adamw", optimizer_state) == "compact" else optim.AdamW
    return cls(params, **kwargs)


__all__ = ["OPTIMIZER_STATES", "check", "optim_dtype_for", "adamw"]
