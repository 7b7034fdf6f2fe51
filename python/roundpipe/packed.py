"""Frozen weights kept packed (docs/hf.md, "QLoRA: packed frozen weights").

A frozen ``nn.Linear`` of a LoRA model costs 2 bytes per weight in host
memory in bf16 and is uploaded twice per iteration (forward, then
recomputation and backward). :class:`PackedLinear` keeps it packed instead:

- ``"nf4"`` / ``"fp4"``: 4 bits per weight in bitsandbytes' layout (two
  codes per byte, the first in the high nibble; blocks of 64 weights scaled
  by their absolute maximum), with double quantization: the block maxima
  themselves as 8-bit codes of bitsandbytes' dynamic map in blocks of 256,
  less their mean. About 0.516 bytes per weight.
- ``"int8"``: one signed byte per weight, one fp32 scale per output row
  (the row's absolute maximum / 127). About 1 byte per weight.

The packed bytes and their quantization state are the module's frozen
parameters (``requires_grad=False``, as bitsandbytes' ``Params4bit``), so
the engine keeps them in its host slab at their exact size, page-locked like
every parameter, uploads them with the stage's other parameters in one copy,
fenced like any upload, and never downloads them (nothing trains them; no
optimizer copy is made for them); the weight is dequantized on the
device inside the layer's run, in the model's dtype, and dropped after the
matmul: a device holds one layer's dequantized weights at a time.
Dequantization is the product of the code's fp32 value and the block's fp32
scale, rounded once to the weight's dtype, which is what bitsandbytes'
``dequantize_4bit`` computes: the two agree bitwise.

A model loaded through bitsandbytes (``BitsAndBytesConfig(load_in_4bit=True)``,
its ``Linear4bit`` modules) is packed already: :func:`pack_frozen_linears`
takes its bytes and quantization state as they are.
"""
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["FORMATS", "PackedLinear", "pack_frozen_linears", "packed_bytes"]

FORMATS = ("nf4", "fp4", "int8")

BLOCK = 64          # weights per 4-bit block
NESTED_BLOCK = 256  # block maxima per block of the double quantization

# The 16 levels of NF4 (the normal-float code of QLoRA), as fp32.
_NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0)
# bitsandbytes' FP4 (1 sign, 2 exponent, 1 mantissa bits), normalized to 1.
_FP4 = (0.0, 1 / 192, 2 / 3, 1.0, 1 / 3, 1 / 2, 1 / 6, 1 / 4,
        0.0, -1 / 192, -2 / 3, -1.0, -1 / 3, -1 / 2, -1 / 6, -1 / 4)


def four_bit_code(fmt: str) -> torch.Tensor:
    """The 16 fp32 levels of ``"nf4"`` or ``"fp4"``, indexed by the 4-bit code."""
    return torch.tensor(_NF4 if fmt == "nf4" else _FP4, dtype=torch.float32)


def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (256 sorted fp32 values): for
    exponent e = 0..6, 2^e fractions (the midpoints of 2^e + 1 points evenly
    spaced over [0.1, 1]) times 10^(e - 6), both signs; then 0 and 1."""
    values = []
    for e in range(7):
        points = torch.linspace(0.1, 1, 2 ** e + 1, dtype=torch.float32)
        mids = (points[:-1] + points[1:]) / 2.0
        scale = 10 ** (e - 6)
        values += (scale * mids).tolist() + (-scale * mids).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


def _block_scales(flat, block):
    """Absolute maximum of each block of ``flat`` (the last one may be short)."""
    full = flat.numel() - flat.numel() % block
    maxima = flat[:full].reshape(-1, block).abs().amax(dim=1)
    if full < flat.numel():
        maxima = torch.cat([maxima, flat[full:].abs().amax().reshape(1)])
    return maxima


def _expand(scales, n, block):
    return scales.repeat_interleave(block)[:n]


def _nearest(values, code):
    """Index of the nearest level of the sorted ``code`` for each value."""
    bounds = (code[:-1] + code[1:]) / 2
    return torch.bucketize(values, bounds)


def quantize_4bit(weight: torch.Tensor, fmt: str):
    """(packed uint8 [n / 2], nested scales uint8, nested maxima fp32, offset fp32)."""
    flat = weight.detach().reshape(-1).float()
    n = flat.numel()
    maxima = _block_scales(flat, BLOCK)
    scaled = torch.clamp(flat / _expand(maxima.clamp(min=1e-38), n, BLOCK), -1, 1)
    code = four_bit_code(fmt)
    order = torch.argsort(code, stable=True)
    codes = order[_nearest(scaled, code[order])].to(torch.uint8)
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    packed = (codes[0::2] << 4) | codes[1::2]
    offset = maxima.mean()
    centred = maxima - offset
    nested = _block_scales(centred, NESTED_BLOCK)
    levels = dynamic_code()
    q = _nearest(torch.clamp(centred / _expand(nested.clamp(min=1e-38), centred.numel(), NESTED_BLOCK), -1, 1),
                 levels).to(torch.uint8)
    return packed, q, nested, offset


def dequantize_4bit(packed, scales, nested, offset, nested_code, code, shape, dtype):
    """The weight from its packed form: code level x block scale in fp32,
    rounded once to ``dtype`` (bitsandbytes' dequantize_4bit)."""
    n = 1
    for d in shape:
        n *= d
    maxima = nested_code[scales.long()] * _expand(nested, scales.numel(), NESTED_BLOCK) + offset
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n]
    values = code[codes.long()] * _expand(maxima, n, BLOCK)
    return values.reshape(shape).to(dtype)


class PackedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is kept packed (module doc). The
    bias, if any, stays a parameter as it was."""

    def __init__(self, fmt: str, shape, dtype: torch.dtype, bias: Optional[torch.Tensor], **packed: torch.Tensor):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"PackedLinear: format must be one of {FORMATS}, got {fmt!r}")
        self.fmt = fmt
        self.out_features, self.in_features = int(shape[0]), int(shape[1])
        self.weight_dtype = dtype
        self.packed_names = tuple(packed)
        for name, tensor in packed.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> "PackedLinear":
        """Packs ``linear``'s weight (which must be frozen)."""
        weight = linear.weight
        if weight.requires_grad:
            raise ValueError(f"frozen_weights={fmt!r} packs frozen weights; this nn.Linear's weight is trained "
                             "(requires_grad=True): freeze it, or leave frozen_weights unset")
        shape, dtype = tuple(weight.shape), weight.dtype
        if fmt == "int8":
            w = weight.detach().float()
            scale = w.abs().amax(dim=1).clamp(min=1e-38) / 127
            q = torch.clamp(torch.round(w / scale.unsqueeze(1)), -127, 127).to(torch.int8)
            tensors = {"packed": q, "row_scale": scale}
        else:
            packed, scales, nested, offset = quantize_4bit(weight, fmt)
            tensors = {"packed": packed, "scales": scales, "nested_scales": nested, "offset": offset,
                       "nested_code": dynamic_code(), "code": four_bit_code(fmt)}
        return cls(fmt, shape, dtype, linear.bias, **tensors)

    @classmethod
    def from_bitsandbytes(cls, module: nn.Module) -> "PackedLinear":
        """A bitsandbytes ``Linear4bit`` as it was loaded: its packed bytes
        and quantization state, unchanged."""
        weight = module.weight
        state = weight.quant_state
        if state is None:
            raise ValueError("a bitsandbytes Linear4bit without its quantization state (not quantized yet)")
        if state.blocksize != BLOCK:
            raise ValueError(f"bitsandbytes blocksize {state.blocksize} is not supported (only {BLOCK})")
        packed = weight.data.reshape(-1).view(torch.uint8)
        if state.nested:
            if state.state2.blocksize != NESTED_BLOCK:
                raise ValueError(f"bitsandbytes nested blocksize {state.state2.blocksize} is not supported")
            tensors = {"packed": packed, "scales": state.absmax, "nested_scales": state.state2.absmax,
                       "offset": torch.as_tensor(state.offset, dtype=torch.float32),
                       "nested_code": state.state2.code.float(), "code": state.code.float()}
        else:  # plain fp32 block maxima: as nested ones with unit levels
            raise ValueError("bitsandbytes 4-bit weights without double quantization are not supported: load with "
                             "bnb_4bit_use_double_quant=True")
        bias = module.bias
        return cls(state.quant_type, tuple(state.shape), state.dtype, bias, **tensors)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in its dtype, computed from the packed tensors."""
        if self.fmt == "int8":
            return (self.packed.float() * self.row_scale.unsqueeze(1)).to(self.weight_dtype)
        return dequantize_4bit(self.packed, self.scales, self.nested_scales, self.offset, self.nested_code,
                               self.code, (self.out_features, self.in_features), self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}, "
                f"dtype={self.weight_dtype}, bias={self.bias is not None}")


def packed_bytes(module: nn.Module) -> int:
    """Bytes of the packed tensors (codes and quantization state) of every
    PackedLinear in ``module``."""
    return sum(t.numel() * t.element_size() for m in module.modules() if isinstance(m, PackedLinear)
               for t in (getattr(m, name) for name in m.packed_names))


def _is_bitsandbytes_4bit(module):
    """A bitsandbytes 4-bit linear itself (not PEFT's adapter around one)."""
    return type(module).__module__.startswith("bitsandbytes.") and \
        hasattr(getattr(module, "weight", None), "quant_state")


def pack_frozen_linears(model: nn.Module, fmt: Optional[str], skip: tuple = ()) -> int:
    """Replaces, in place, every ``nn.Linear`` of ``model`` whose weight is
    frozen by a :class:`PackedLinear` of format ``fmt`` (one at a time: the
    full-precision weight is released as its packed form is made), and every
    bitsandbytes 4-bit linear by one holding its bytes as they are. Modules
    in ``skip`` (the LM head) stay. Returns how many were packed; with a
    format and no frozen linear, raises ValueError."""
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"frozen_weights must be one of {', '.join(map(repr, FORMATS))} or None, got {fmt!r}")
    skip_ids = {id(m) for m in skip}
    targets = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if id(child) in skip_ids or isinstance(child, PackedLinear):
                continue
            if _is_bitsandbytes_4bit(child):
                targets.append((parent, name, child, "bitsandbytes"))
            elif type(child).__module__.startswith("bitsandbytes.") and hasattr(child, "weight"):
                raise ValueError(f"{type(child).__name__} (bitsandbytes) weights cannot be wrapped as they are "
                                 "loaded: load the model with load_in_4bit=True and bnb_4bit_use_double_quant=True, "
                                 "or in bf16 and wrap it with frozen_weights='int8'")
            elif fmt is not None and type(child) is nn.Linear and not child.weight.requires_grad:
                targets.append((parent, name, child, fmt))
    if fmt is not None and not targets and not any(isinstance(m, PackedLinear) for m in model.modules()):
        raise ValueError(f"frozen_weights={fmt!r}: the model has no frozen nn.Linear weight to pack (frozen "
                         "weights are those with requires_grad=False, as a PEFT LoRA model's base weights)")
    for parent, name, child, how in targets:
        packed = PackedLinear.from_bitsandbytes(child) if how == "bitsandbytes" else PackedLinear.from_linear(child, how)
        setattr(parent, name, packed)
    return len(targets)
