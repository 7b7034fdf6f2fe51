"""A model of a call's peak device memory (docs/train.md, "Long sequences").

``predict_peak_bytes`` predicts the peak bytes one ``forward_backward`` holds
on a device, from the model's layers (``LayerMemory``: the bytes of each
layer's weights and gradients, and the activation bytes per token it holds
at the peak of its forward with gradients and backward pass), the stages of
the call's plan, the tokens of one microbatch, the recompute grain and the
sequence tile. ``hf_layer_memory`` gives the layers of a Hugging Face
decoder (Llama, Qwen3, Mistral and other dense decoders run through the
presets) from its config alone, so a model never built can be sized:
``max_tokens`` finds the longest sequence that fits a budget.

What a device holds at its peak, in this model:

- the running stage's weights and gradients; between stages, a stage's
  weights and gradients and the next stage's weights (prefetched into the
  engine's second stage slot);
- in a recomputed stage, for the layer whose backward pass needs the most:
  its input and the gradient of its output (one ``tokens x hidden`` tensor
  each), what its forward with gradients keeps and what its backward pass
  adds (``bytes_per_token``), and, tiled, one tile's intermediates
  (``bytes_per_tile_token``) and the MLP's outputs its forward kept;
- in the fused last stage (never recomputed), and in every stage at stage
  grain, what every layer's forward keeps at once, plus the last layer's
  backward pass.

Activation bytes per token of a decoder block are fitted to what torch
allocates on CPU devices (tests/python/test_memory_model.py checks the
predictions against the engine's measured peaks within 10 %); a GPU's
attention kernels keep about as much per token (memory-efficient kernels
are linear in the length) but their workspaces differ: leave a margin.
"""
import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

from .tiling import auto_sequence_tile

__all__ = ["BUDGET_MARGIN", "LayerMemory", "call_tile", "default_memory_budget", "hf_layer_memory", "max_tokens",
           "predict_peak_bytes"]

# What the default budget leaves of an accelerator's memory: the CUDA
# context, the allocator's fragmentation, kernels' workspaces.
BUDGET_MARGIN = 0.10


@dataclass(frozen=True)
class LayerMemory:
    """What one layer needs on a device.

    - ``weight_bytes``: its parameters and buffers as uploaded.
    - ``grad_bytes``: the gradients of its trainable parameters;
      ``grad_bytes_at_peak``: those that exist at the peak of its untiled
      backward pass (None: all).
    - ``bytes_per_token``: activation bytes per token of the microbatch at
      the peak of its forward with gradients and its backward pass, untiled.
    - ``bytes_per_token_tiled``: the same with its position-wise parts
      tiled (None: the layer is not tiled).
    - ``bytes_per_tile_token``: bytes per token of one tile while it is
      computed (tiled only).
    - ``tiled_fixed_bytes``: what its tiled backward adds that does not
      grow with the tokens (the tiled parts' weight gradients of one tile
      beside their running sum).
    - ``saved_bytes_per_token``: what its forward with gradients keeps for
      the backward pass (a fused stage keeps it for all its layers at once);
      ``saved_bytes_per_token_tiled``: the same, tiled (None: as untiled).
    - ``width``: elements per token of its MLP's widest intermediate (for the
      automatic tile; 0 when not tiled).
    - ``hidden_bytes_per_token``: bytes per token of the hidden states it
      takes and passes on.
    - ``loss_bytes_per_token``, ``loss_chunk_tokens``: bytes per token of
      a loss computed over chunks of at most that many tokens (the chunked
      loss's logits and their gradients), and ``loss_phase_bytes_per_token``
      the other bytes per token while it runs (its peak: the larger of this
      phase's and ``bytes_per_token``'s).
    """

    weight_bytes: int
    grad_bytes: int
    bytes_per_token: float
    grad_bytes_at_peak: Optional[int] = None
    bytes_per_token_tiled: Optional[float] = None
    bytes_per_tile_token: float = 0.0
    tiled_fixed_bytes: int = 0
    saved_bytes_per_token: float = 0.0
    saved_bytes_per_token_tiled: Optional[float] = None
    width: int = 0
    hidden_bytes_per_token: float = 0.0
    loss_bytes_per_token: float = 0.0
    loss_chunk_tokens: int = 0
    loss_phase_bytes_per_token: float = 0.0

    def __post_init__(self):
        for name, value in self.__dict__.items():
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"LayerMemory.{name} must be a number >= 0, got {value!r}")

    def saved_bytes(self, tokens: int, rows: int, tile: Optional[int]) -> float:
        """What its forward with gradients keeps for ``tokens`` tokens in
        ``rows`` rows with tiles of ``tile`` tokens (None: untiled)."""
        if tile is not None and self.saved_bytes_per_token_tiled is not None and tile * rows < tokens:
            return self.saved_bytes_per_token_tiled * tokens
        return self.saved_bytes_per_token * tokens

    def peak_grad_bytes(self, tokens: int, rows: int, tile: Optional[int]) -> int:
        """Its gradient bytes at the peak of its backward pass (tiled: all)."""
        tiled = tile is not None and self.bytes_per_token_tiled is not None and tile * rows < tokens
        return self.grad_bytes if tiled or self.grad_bytes_at_peak is None else self.grad_bytes_at_peak

    def activation_bytes(self, tokens: int, rows: int, tile: Optional[int]) -> float:
        """Activation bytes at the peak of its backward pass for ``tokens``
        tokens in ``rows`` rows, with tiles of ``tile`` tokens per row (None:
        untiled)."""
        loss = 0.0
        if self.loss_bytes_per_token:
            loss = self.loss_bytes_per_token * min(tokens, self.loss_chunk_tokens or tokens) + \
                self.loss_phase_bytes_per_token * tokens
        if tile is not None and self.bytes_per_token_tiled is not None and tile * rows < tokens:
            # The MLP's outputs, kept by the forward, come back for the recomputation.
            return (self.bytes_per_token_tiled + self.hidden_bytes_per_token) * tokens + \
                self.bytes_per_tile_token * tile * rows + self.tiled_fixed_bytes
        return max(self.bytes_per_token * tokens, loss)


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _stages_of(num_layers, stages):
    if stages is None:
        return [range(i, i + 1) for i in reversed(range(num_layers))]
    stages = list(stages)
    if not all(isinstance(r, range) for r in stages):
        raise TypeError(f"stages must be ranges of layer indices, got {stages!r}")
    covered = sorted(i for r in stages for i in r)
    if covered != list(range(num_layers)):
        raise ValueError(f"stages must cover the {num_layers} layers once each, got {stages!r}")
    return stages


def call_tile(layers: Sequence[LayerMemory], rows: int, length: int, sequence_tile: Optional[int],
              element_size: int) -> Optional[int]:
    """The tile (tokens of each row; None: untiled) a call with
    ``sequence_tile`` uses, as the presets' blocks choose it: the given one
    if shorter than ``length``, else untiled; None: the automatic tile
    (roundpipe.tiling.auto_sequence_tile) of the widest tiled layer."""
    if sequence_tile is not None:
        return sequence_tile if sequence_tile < length else None
    widths = [m.width for m in layers if m.width and m.bytes_per_token_tiled is not None]
    return auto_sequence_tile(rows, length, max(widths), element_size) if widths else None


def predict_peak_bytes(layers: Sequence[LayerMemory], tokens: int, rows: int = 1, stages: Any = None,
                       recompute_grain: str = "layer", sequence_tile: Optional[int] = None,
                       element_size: int = 2, num_microbatch: int = 1) -> int:
    """Predicted peak device bytes of one ``forward_backward`` whose
    microbatches hold ``tokens`` tokens in ``rows`` rows each, for
    ``layers`` (the model's, in order).

    - ``stages``: the backward stages of the call's plan, ranges of layer
      indices as ``ModelExecutePlan.bwd_plan`` lists them (the first is the
      fused stage); default: one layer per stage.
    - ``recompute_grain``: ``"layer"`` or ``"stage"`` (a recomputed stage
      keeps every layer's activations at once).
    - ``sequence_tile``: tokens per tile of each row as in
      ``RoundPipeRunConfig`` (None: the automatic tile, computed for
      ``element_size``-byte activations).
    - ``num_microbatch``: with more than one, a device also holds the
      gradients of a whole stage and the next microbatch's inputs."""
    layers = list(layers)
    if not layers or not all(isinstance(m, LayerMemory) for m in layers):
        raise TypeError("layers must be a non-empty sequence of LayerMemory")
    _check_int("tokens", tokens, 1)
    _check_int("rows", rows, 1)
    _check_int("element_size", element_size, 1)
    _check_int("num_microbatch", num_microbatch, 1)
    if tokens % rows:
        raise ValueError(f"tokens ({tokens}) must be a multiple of rows ({rows})")
    if recompute_grain not in ("layer", "stage"):
        raise ValueError(f"recompute_grain must be 'layer' or 'stage', got {recompute_grain!r}")
    if sequence_tile is not None:
        _check_int("sequence_tile", sequence_tile, 1)
    stages = _stages_of(len(layers), stages)
    tile = call_tile(layers, rows, tokens // rows, sequence_tile, element_size)
    weights = [sum(layers[i].weight_bytes for i in r) for r in stages]
    grads = [sum(layers[i].grad_bytes for i in r) for r in stages]
    peak = 0.0
    for number, stage in enumerate(stages):
        members = sorted(stage)
        # The running stage's weights and gradients (those that exist at
        # the peak), its activations; the stage prefetched into the other
        # slot (weights_peak below) comes up once the running one is past
        # its peak.
        resident = weights[number]
        hidden = max(layers[i].hidden_bytes_per_token for i in members) * tokens
        others = [grads[number] - layers[i].grad_bytes + layers[i].peak_grad_bytes(tokens, rows, tile)
                  for i in members]
        if number == 0 or recompute_grain == "stage":
            # Every layer's forward keeps what its backward needs; the last
            # layer then runs its backward pass on top.
            kept = sum(layers[i].saved_bytes(tokens, rows, tile) for i in members[:-1])
            act = kept + layers[members[-1]].activation_bytes(tokens, rows, tile) + others[-1]
        else:
            act = max(layers[i].activation_bytes(tokens, rows, tile) + g for i, g in zip(members, others))
        if num_microbatch > 1:
            act += hidden
        peak = max(peak, resident + act)
    # Between stages: a stage's weights and gradients, and the weights of
    # the next one, prefetched into the other slot.
    weights_peak = max(w + g + max((o for j, o in enumerate(weights) if j != i), default=0)
                       for i, (w, g) in enumerate(zip(weights, grads)))
    return int(math.ceil(max(peak, weights_peak)))


def _element_size(dtype):
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return torch.empty((), dtype=dtype).element_size()


def _config_value(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def hf_layer_memory(config: Any, dtype: torch.dtype = torch.bfloat16, trainable: bool = True) -> List[LayerMemory]:
    """The layers of a Hugging Face dense decoder as the presets run it
    (embedding | one layer per decoder block | head with the chunked loss),
    from its config alone: Llama, Qwen3, Mistral, Qwen2 and other decoders
    with a gated MLP and rotary attention. ``dtype``: the weights' and
    activations' dtype; ``trainable``: every weight is trained (full
    fine-tune; False: no weight gradients, as for frozen weights)."""
    e = _element_size(dtype)
    h = _config_value(config, "hidden_size")
    heads = _config_value(config, "num_attention_heads")
    blocks = _config_value(config, "num_hidden_layers")
    vocab = _config_value(config, "vocab_size")
    if not all(isinstance(v, int) and v > 0 for v in (h, heads, blocks, vocab)):
        raise ValueError("config must give hidden_size, num_attention_heads, num_hidden_layers and vocab_size "
                         f"(a Hugging Face decoder's config), got {type(config).__name__}")
    if _config_value(config, "num_experts", "num_local_experts", "n_routed_experts"):
        raise ValueError(f"hf_layer_memory: mixture-of-experts configs ({type(config).__name__}) are not modelled yet")
    kv = _config_value(config, "num_key_value_heads", default=heads)
    hd = _config_value(config, "head_dim", default=h // heads)
    width = _config_value(config, "intermediate_size", default=4 * h)
    qd, kvd = heads * hd, kv * hd
    qk_norm = getattr(config, "model_type", "") in ("qwen3", "olmo2", "gemma3_text") or \
        bool(getattr(config, "use_qk_norm", False))
    attn_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))

    mlp_params = 3 * h * width + (2 * width + h if mlp_bias else 0)
    block_params = h * qd + 2 * h * kvd + qd * h + mlp_params + 2 * h
    block_params += qd + 2 * kvd + h if attn_bias else 0
    block_params += 2 * hd if qk_norm else 0
    upcast = 4 - e if e < 4 else 0  # norms compute in fp32
    common = 4 * heads + 2 * hd * e + 8  # attention's log-sum-exp, the rotary tables, the norms' scales
    if qk_norm:
        common += 8 * (qd + kvd) + 4 * (heads + kv)
    attention = e * (5 * h + 4 * qd + 4 * kvd)
    untiled = max(e * (8 * h + 2 * qd + 2 * kvd + 6 * width) + 2 * upcast * h, attention) + common
    tiled = max(e * (7 * h + 2 * qd + 2 * kvd), attention) + common
    saved_untiled = e * (6 * h + 2 * qd + 2 * kvd + 4 * width) + 2 * upcast * h + common
    # What a layer takes and passes on: the hidden states, the gradient
    # coming back, the rotary tables, the token ids and labels.
    boundary = e * 3 * h + 2 * hd * e + 16
    block = LayerMemory(
        weight_bytes=block_params * e, grad_bytes=block_params * e if trainable else 0,
        grad_bytes_at_peak=h * width * e if trainable else 0,  # untiled, the MLP's down projection's
        bytes_per_token=untiled + boundary, bytes_per_token_tiled=tiled + boundary,
        bytes_per_tile_token=3 * width * e, tiled_fixed_bytes=2 * mlp_params * e if trainable else 0,
        saved_bytes_per_token=saved_untiled, saved_bytes_per_token_tiled=e * (4 * h + 2 * qd + 2 * kvd) + common,
        width=width,
        hidden_bytes_per_token=e * h)

    embedding_params = vocab * h
    embedding = LayerMemory(weight_bytes=embedding_params * e, grad_bytes=embedding_params * e if trainable else 0,
                            bytes_per_token=boundary, saved_bytes_per_token=16, hidden_bytes_per_token=e * h)
    head_params = vocab * h + h
    chunk = max(1, (1 << 24) // vocab)  # roundpipe.hf: the loss's chunks of tokens
    head_input = e * h + 2 * hd * e + 16  # no gradient comes back to the head
    # The final norm and the LM head's backward pass; the loss's chunks
    # compute their logits in fp32.
    head = LayerMemory(weight_bytes=head_params * e, grad_bytes=head_params * e if trainable else 0,
                       grad_bytes_at_peak=0, bytes_per_token=head_input + 6 * e * h + 2 * upcast * h,
                       hidden_bytes_per_token=e * h, loss_bytes_per_token=12.5 * vocab, loss_chunk_tokens=chunk,
                       loss_phase_bytes_per_token=head_input + 4 * h + 520)
    return [embedding] + [block] * blocks + [head]


def max_tokens(layers: Sequence[LayerMemory], budget: int, rows: int = 1, **options: Any) -> int:
    """The most tokens per row (a multiple of nothing; 0 if none fit) whose
    predicted peak (``predict_peak_bytes(layers, rows * n, rows,
    **options)``) stays within ``budget`` bytes."""
    _check_int("budget", budget, 1)
    _check_int("rows", rows, 1)

    def fits(n):
        return predict_peak_bytes(layers, rows * n, rows, **options) <= budget

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
        if high > 1 << 40:
            return low
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def default_memory_budget(device: str) -> Optional[int]:
    """The default budget of a pool device (``"cuda:0"``, ``"cpu:1"``): its
    capacity less ``BUDGET_MARGIN``; None (no limit) for CPU virtual
    devices, whose memory is the host's."""
    if not isinstance(device, str):
        raise TypeError(f"device must be a pool device's name, got {type(device).__name__}")
    kind, _, index = device.partition(":")
    if kind != "cuda" or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(int(index.split("x")[0] or 0)).total_memory
    return int(total * (1 - BUDGET_MARGIN))
