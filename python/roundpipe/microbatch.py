"""Split and merge specs (docs/python.md, "API summary"), compatible with
``torch.distributed.pipelining.microbatch``'s classes (accepted as well)."""
import warnings
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from . import _C
from .run_config import _FIELDS as _RUN_CONFIG_FIELDS, RoundPipeRunConfig


class TensorChunkSpec:
    """Split (or, for outputs, concatenate) a tensor along ``split_dim``."""

    def __init__(self, split_dim: int = 0) -> None:
        self.split_dim = split_dim

    def __repr__(self):
        return f"TensorChunkSpec({self.split_dim})"


class Replicate:
    """Give every microbatch the whole value (for outputs: all must be equal).
    Use the class itself or an instance."""

    def __repr__(self):
        return "Replicate"


class CustomReducer:
    """Merge outputs with ``reduce_fn(acc, x)``, starting from ``init_value``."""

    def __init__(self, init_value: Any, reduce_fn: Callable[[Any, Any], Any]) -> None:
        self.init_value = init_value
        self.reduce_fn = reduce_fn

    def __repr__(self):
        return f"CustomReducer({self.init_value!r}, {self.reduce_fn!r})"


__all__ = ["TensorChunkSpec", "Replicate", "CustomReducer"]


# ---- the automatic split and merge, for models run in Python ----------------
# roundpipe.auto runs a whole model's microbatch loop in the calling thread.
# The engine's split and merge (src/batch/microbatch.cpp) are not bound on
# their own, only inside a pipeline call, which would copy every value through
# a device: these follow the engine's rules, and tests hold them to it.


def _rows(v):
    return v.shape[0] if isinstance(v, torch.Tensor) and v.dim() > 0 else None


def _packed_rows(v):
    """The rows a packed value (a merge_output=False output) was split from."""
    if isinstance(v, _C.MicrobatchValues) and len(v) > 0 and all(_rows(t) is not None for t in v):
        return sum(_rows(t) for t in v)
    return None


def _batch_size(args, kwargs):
    """The batch size of a call: dim 0 of the first tensor with dims
    in the positional args; where they hold packed values and no such tensor,
    the rows those were split from; else the first in the keyword args."""
    leaves = pytree.tree_leaves(args)
    for rows in (_rows, _packed_rows):
        found = next((r for r in map(rows, leaves) if r is not None), None)
        if found is not None:
            return found
    return next((r for r in map(_rows, pytree.tree_leaves(kwargs)) if r is not None), None)


def _with_packed_split(args, kwargs, run_config, model_config):
    """The run config for a call whose positional inputs are packed: the
    engine takes the batch size from the first tensor it can split, a keyword
    one here, so the keyword tensors of the packed batch size are split and the
    others replicated by an explicit kwargs spec. Other calls: ``run_config``."""
    split = run_config.split_input if run_config is not None and run_config.split_input is not None \
        else model_config.split_input
    if not kwargs or split not in (None, (None, None)):
        return run_config
    leaves = pytree.tree_leaves(args)
    if any(_rows(v) is not None for v in leaves):
        return run_config
    batch = next((r for r in map(_packed_rows, leaves) if r is not None), None)
    if batch is None:
        return run_config

    def spec(v):
        if _rows(v) is not None:
            return TensorChunkSpec(0) if _rows(v) == batch else Replicate
        if type(v) in (tuple, list):
            return type(v)(spec(x) for x in v)
        if type(v) is dict and all(isinstance(k, str) for k in v):
            return {k: spec(x) for k, x in v.items()}
        return None  # automatic

    fields = {f: getattr(run_config, f) for f in _RUN_CONFIG_FIELDS} if run_config is not None else {}
    return RoundPipeRunConfig(**{**fields, "split_input": (None, {k: spec(v) for k, v in kwargs.items()})})


def _split_auto(args, kwargs, label, n, warn=None):
    """The automatic split of (args, kwargs) and label into microbatches:
    ``([(args_m, kwargs_m)], [label_m])``, by the engine's own split.
    ``warn(n, batch)`` says that the batch is smaller than ``n``."""
    batch = _batch_size(args, kwargs)
    if batch is not None and batch < n:
        if batch < 1:
            raise ValueError("the batch is empty (dim 0 of the first input tensor is 0)")
        if warn is not None:
            warn(n, batch)
        else:
            warnings.warn(f"num_microbatch {n} is larger than the batch size {batch}; using {batch}",
                          stacklevel=3)
        n = batch
    packed = _with_packed_split(args, kwargs, None, RoundPipeRunConfig())
    return _C.split_inputs(tuple(args), dict(kwargs), n, packed), _C.split_label(label, n)


def _merge_auto(outputs):
    """The automatic merge of microbatch outputs, by the engine's own merge:
    tensors with dims are concatenated on dim 0, floating 0-dim tensors
    averaged, other values (integer 0-dim tensors included) must agree."""
    return _C.merge_outputs(list(outputs))
