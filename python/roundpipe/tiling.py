"""Sequence tiling of a decoder block's position-wise parts (docs/train.md,
"Long sequences").

A block's MLP (dense or mixture of experts) and its norms treat every token
on its own, so they can run over tiles of the sequence: ``tiled_call`` runs a
module tile by tile without keeping any tile's intermediate activations,
keeps only its input, and in the backward pass recomputes and
backpropagates one tile at a time. The MLP's ``tokens x intermediate``
tensors, the largest a block makes, then exist for one tile at a time; the
price is one more forward of the tiled parts in the backward pass, which
the presets' blocks save in a recomputation: its forward takes the MLP's
outputs from the first forward (kept with the layer's recompute data on the
host) instead of running the MLP again.

The Hugging Face presets' decoder blocks (roundpipe.hf_generic) tile their
MLP and norms when the sequence is longer than the tile:
``RoundPipeRunConfig(sequence_tile=n)`` sets the tile (in tokens of each
row); by default it is chosen so that one tile's MLP intermediates stay
within ``AUTO_TILE_BYTES`` (``auto_sequence_tile``), and shorter sequences
are not tiled.
"""
import threading
from typing import Any, Callable, List, Optional, Sequence

import torch

__all__ = ["AUTO_TILE_BYTES", "SequenceTileSetting", "auto_sequence_tile", "tiled_call", "tile_counts"]

# One tile's MLP intermediates (three tokens x width tensors) stay within
# this, and tiles stay long, their matrix products large (Llama-3.1-8B in
# bf16: tiles of 3,120 tokens).
AUTO_TILE_BYTES = 256 << 20

_counts_lock = threading.Lock()
_counts = {"forward": 0, "backward": 0, "reused": 0}


class SequenceTileSetting:
    """The ``sequence_tile`` of the call a model is running (None:
    automatic), held by a layer that starts the state its blocks pass along.
    The layer's device replicas share it (copies are the object itself): a
    RoundPipe sets it as a call starts, and the layer puts it into each
    microbatch's state, so the recomputation and backward of a block see
    the tile its forward saw."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: Optional[int] = None

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def tile_counts() -> dict:
    """How many tiles ``tiled_call`` has run in this process, in forward
    passes and in backward passes (recomputed tiles), and how many of its
    calls took the outputs of an earlier forward (``reused``)."""
    with _counts_lock:
        return dict(_counts)


def _count(kind, n):
    with _counts_lock:
        _counts[kind] += n


def auto_sequence_tile(rows: int, length: int, width: int, element_size: int,
                       budget: Optional[int] = None) -> Optional[int]:
    """The tile (tokens of each of ``rows`` rows) that keeps three
    ``tokens x width`` tensors of ``element_size`` bytes within ``budget``
    (default ``AUTO_TILE_BYTES``); None when the whole ``length`` does."""
    if budget is None:
        budget = AUTO_TILE_BYTES
    per_row = 3 * width * element_size * max(1, rows)
    tile = max(1, budget // max(1, per_row))
    return None if tile >= length else tile


def _bounds(length, tile):
    return [(start, min(start + tile, length)) for start in range(0, length, tile)]


def _layout(out, rows, length):
    """How an output of one tile lies along the sequence: ``"seq"``
    (rows, tokens, ...), ``"flat"`` (rows * tokens, ...), or None."""
    if out.dim() >= 2 and out.shape[0] == rows and out.shape[1] == length:
        return "seq"
    if out.dim() >= 1 and out.shape[0] == rows * length:
        return "flat"
    return None


def _join(pieces, layout, rows):
    if layout == "seq":
        return torch.cat(pieces, dim=1)
    # Rows first, as the untiled output flattens them (the mask of the
    # load-balancing loss is flattened the same way).
    parts = [p.reshape(rows, -1, *p.shape[1:]) for p in pieces]
    joined = torch.cat(parts, dim=1)
    return joined.reshape(-1, *joined.shape[2:])


def _piece(grad, layout, rows, length, start, end):
    if grad is None:
        return None
    if layout == "seq":
        return grad[:, start:end]
    return grad.reshape(rows, length, *grad.shape[1:])[:, start:end].reshape(-1, *grad.shape[1:])


def _as_tensors(out, who):
    values = list(out) if isinstance(out, (tuple, list)) else [out]
    if not all(isinstance(v, torch.Tensor) for v in values):
        raise TypeError(f"{who} returned {type(out).__name__} with values that are not tensors; only "
                        "modules that return tensors can be tiled over the sequence (a sequence_tile of at "
                        "least the sequence length runs it untiled)")
    return values


class _Tiled(torch.autograd.Function):
    """``run`` over tiles of ``x`` (dim 1); ``params``: the tensors ``run``
    uses that need gradients, given here so that theirs come back through
    this function (summed over the tiles)."""

    @staticmethod
    def forward(ctx, run, tile, info, x, *params):
        rows, length = x.shape[0], x.shape[1]
        bounds = _bounds(length, tile)
        given = info.get("given")
        if given is not None:
            _count("reused", 1)
            joined, layouts = [o.detach() for o in given], [_layout(o, rows, length) for o in given]
            if None in layouts:
                raise RuntimeError(f"{info['who']}: outputs of shapes {[tuple(o.shape) for o in given]} were "
                                   f"given for {rows} row(s) of {length} tokens")
        else:
            joined, layouts = _Tiled._compute(run, bounds, info["who"], x, rows)
        ctx.run, ctx.bounds, ctx.layouts, ctx.rows, ctx.who = run, bounds, layouts, rows, info["who"]
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, *params)
        for out in joined:
            if not (out.is_floating_point() or out.is_complex()):
                ctx.mark_non_differentiable(out)
        return tuple(joined)

    @staticmethod
    def _compute(run, bounds, who, x, rows):
        pieces, layouts = [], None
        for start, end in bounds:
            outs = _as_tensors(run(x.detach()[:, start:end].contiguous()), who)
            tile_layouts = [_layout(o, rows, end - start) for o in outs]
            if layouts is None:
                layouts = tile_layouts
            if None in tile_layouts or tile_layouts != layouts:
                shapes = [tuple(o.shape) for o in outs]
                raise RuntimeError(f"{who} gave outputs of shapes {shapes} for a tile of {end - start} "
                                   f"tokens of {rows} row(s): they do not follow the sequence, so it cannot be "
                                   "tiled; set RoundPipeRunConfig(sequence_tile=...) to at least the sequence "
                                   "length to run it untiled")
            pieces.append(outs)
        _count("forward", len(bounds))
        return [_join([p[i] for p in pieces], layouts[i], rows) for i in range(len(layouts))], layouts

    @staticmethod
    def backward(ctx, *grads):
        x, *params = ctx.saved_tensors
        length = x.shape[1]
        wants_x = ctx.needs_input_grad[3]
        wanted = [p for p, needs in zip(params, ctx.needs_input_grad[4:]) if needs]
        grad_x = torch.empty_like(x) if wants_x else None
        # Summed over the tiles in fp32 for 16-bit parameters.
        sums = [torch.zeros_like(p, dtype=torch.float32 if p.dtype in (torch.float16, torch.bfloat16)
                                 else p.dtype) for p in wanted]
        device, enabled, dtype = ctx.autocast
        for start, end in reversed(ctx.bounds):
            piece = x[:, start:end].detach().contiguous().requires_grad_(wants_x)
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                outs = _as_tensors(ctx.run(piece), ctx.who)
            pairs = [(o, _piece(g, lay, ctx.rows, length, start, end))
                     for o, g, lay in zip(outs, grads, ctx.layouts)]
            pairs = [(o, g) for o, g in pairs if g is not None and o.requires_grad]
            inputs = ([piece] if wants_x else []) + wanted
            if not pairs or not inputs:
                if wants_x:
                    grad_x[:, start:end] = 0
                continue
            got = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
            if wants_x:
                grad_x[:, start:end] = got[0] if got[0] is not None else 0
                got = got[1:]
            for total, g in zip(sums, got):
                if g is not None:
                    total.add_(g)
        _count("backward", len(ctx.bounds))
        grad_params = iter(s.to(p.dtype) for s, p in zip(sums, wanted))
        return (None, None, None, grad_x,
                *[next(grad_params) if needs else None for needs in ctx.needs_input_grad[4:]])


def tiled_call(run: Callable[[torch.Tensor], Any], x: torch.Tensor, tile: int,
               params: Sequence[torch.Tensor] = (), who: str = "the module",
               outputs: Optional[Sequence[torch.Tensor]] = None) -> List[torch.Tensor]:
    """``run(x)`` computed over tiles of ``tile`` positions of ``x``'s dim 1
    (rows, tokens, ...), for a position-wise ``run`` (each token's outputs
    depend on that token's inputs only). ``run`` returns a tensor or a tuple
    of tensors, each laid out as (rows, tokens, ...) or (rows * tokens,
    ...); they come back as one list, joined over the tiles. ``params``: the
    tensors ``run`` uses besides ``x`` that need gradients (a module's
    parameters). No tile's intermediate activations are kept: the backward
    pass recomputes each tile and backpropagates it before the next.

    ``outputs``: the joined outputs of ``run(x)`` as an earlier forward
    computed them (kept for a recomputation, roundpipe.recompute): they are
    returned as this call's, and only the backward pass runs ``run``."""
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tiled_call: tile must be an int >= 1, got {tile!r}")
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError("tiled_call: x must be a tensor of shape (rows, tokens, ...)")
    info = {"who": who, "given": None if outputs is None else list(outputs)}
    return list(_Tiled.apply(run, tile, info, x, *params))
