"""The per-device memory budget of a call (RoundPipeRunConfig.memory_budget;
docs/train.md, "Long sequences"): a ``forward_backward`` of a model with a
memory model (roundpipe.memory; ``wrap_model_to_roundpipe`` gives Hugging
Face decoders one) is checked before it starts. When the automatic tile
would not fit, a smaller tile that does is chosen; a call that cannot fit
at all raises ValueError with the predicted peak, the budget and the
longest sequence that would fit."""
from typing import Any, List, Optional

import torch

from . import _C
from .memory import LayerMemory, call_tile, default_memory_budget, hf_layer_memory, max_tokens, predict_peak_bytes

__all__ = ["check_memory_budget", "hf_memory_model"]

# The smallest tile the budget chooses: shorter tiles make small matrix
# products for little memory.
_MIN_AUTO_TILE = 128


def hf_memory_model(model: torch.nn.Module, num_layers: int) -> Optional[List[LayerMemory]]:
    """The memory model of a Hugging Face decoder run as ``num_layers``
    preset layers, or None when its config is not one it models."""
    config = getattr(model, "config", None)
    params = list(model.parameters())
    floating = [p for p in params if p.is_floating_point()]
    if config is None or not floating:
        return None
    try:
        layers = hf_layer_memory(config, floating[0].dtype, trainable=all(p.requires_grad for p in floating))
    except (TypeError, ValueError):
        return None
    return layers if len(layers) == num_layers else None


def _size(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _budget(value):
    if value is not None:
        return value
    budgets = [default_memory_budget(name) for name in _C.get_device_names()]
    budgets = [b for b in budgets if b is not None]
    return min(budgets) if budgets else None


def _tokens(args, kwargs):
    ids = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if ids is None and args:
        ids = args[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return None
    return int(ids.shape[0]), int(ids.shape[1])


def check_memory_budget(layers: List[LayerMemory], field: Any, num_devices: int, default_plan: Any,
                        args: tuple, kwargs: dict, element_size: int) -> Optional[int]:
    """Checks a ``forward_backward`` against its budget. ``field(name)``
    gives the call's run option. Returns the tile to use when the budget
    chose one (None: the call's own), raises ValueError when it cannot fit."""
    budget = _budget(field("memory_budget"))
    shape = _tokens(args, kwargs)
    if budget is None or shape is None:
        return None
    batch, length = shape
    n = min(field("num_microbatch") or num_devices + 1, batch)
    rows = -(-batch // n)
    plan = field("execute_plan") or default_plan()
    options = dict(stages=plan.bwd_plan, recompute_grain=field("recompute_grain") or "stage",
                   element_size=element_size, num_microbatch=n)
    tile = field("sequence_tile")
    predicted = predict_peak_bytes(layers, rows * length, rows, sequence_tile=tile, **options)
    if predicted <= budget:
        return None
    if tile is None and options["recompute_grain"] == "layer":
        auto = call_tile(layers, rows, length, None, element_size) or length
        candidate = auto // 2
        while candidate >= _MIN_AUTO_TILE:
            if predict_peak_bytes(layers, rows * length, rows, sequence_tile=candidate, **options) <= budget:
                return candidate
            candidate //= 2
    longest = max_tokens(layers, budget, rows, sequence_tile=tile, **options)
    raise ValueError(
        f"forward_backward: {rows} sequence(s) of {length} tokens per microbatch need about "
        f"{_size(predicted)} on a device (roundpipe.memory), over the memory budget of "
        f"{_size(budget)} (RoundPipeRunConfig.memory_budget); the longest sequence that fits is "
        f"{longest} tokens ({rows} per microbatch" + (", recompute_grain='layer' fits more" if
                                                    options["recompute_grain"] != "layer" else "") + ")")
