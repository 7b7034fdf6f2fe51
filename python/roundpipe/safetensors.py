"""Safetensors files, with the names of the ``safetensors.torch`` module.

``load_file`` memory-maps the file: the tensors are zero-copy, copy-on-write
views of it (writing to one never changes the file), pages are read on first
use, and the mapping lives as long as any of the tensors. Files larger than
RAM can therefore be opened. The file must not be truncated or rewritten in
place while its tensors live; ``save_file`` replaces files atomically
(temporary file, flush, rename), which is safe.

Malformed or hostile files (offsets out of range, overlapping tensors, wrong
sizes, huge headers, invalid JSON, duplicate names...) raise ``ValueError``
naming the file, the tensor and the fault; system errors (a missing file, a
full disk) raise ``RuntimeError``. The rules are documented in
include/roundpipe/safetensors.h.

Sharded checkpoints in the Hugging Face layout
(``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``) are
written by ``save_sharded`` and read by ``load_checkpoint``.
"""
import os
from typing import Dict, Optional, Union

import torch

from . import _C

PathLike = Union[str, "os.PathLike[str]"]


def save_file(tensors: Dict[str, torch.Tensor], filename: PathLike,
              metadata: Optional[Dict[str, str]] = None) -> None:
    """Writes ``tensors`` (any device, any strides) and ``metadata`` to
    ``filename`` atomically. Tensors are stored by element size (largest
    first), then by name, as the reference writer does."""
    if not isinstance(tensors, dict):
        raise TypeError(f"save_file: tensors must be a dict[str, torch.Tensor], got {type(tensors).__name__}")
    _C.save_safetensors(os.fspath(filename), tensors, metadata)


def load_file(filename: PathLike, device: Union[str, int, torch.device] = "cpu") -> Dict[str, torch.Tensor]:
    """Every tensor of ``filename``, in the order of their bytes in the file.
    On the CPU they are views of the mapped file; for another ``device`` they
    are copied there."""
    tensors = _C.load_safetensors(os.fspath(filename))
    device = torch.device(device)
    if device.type != "cpu":
        tensors = {name: t.to(device) for name, t in tensors.items()}
    return tensors


def load_metadata(filename: PathLike) -> Dict[str, str]:
    """The ``__metadata__`` of ``filename`` (empty when it has none)."""
    return _C.load_safetensors_metadata(os.fspath(filename))


def save_sharded(tensors: Dict[str, torch.Tensor], directory: PathLike, max_shard_size: int,
                 metadata: Optional[Dict[str, str]] = None) -> str:
    """Writes ``tensors`` into ``directory`` as shards of at most
    ``max_shard_size`` bytes of tensor data each plus
    ``model.safetensors.index.json``; returns the index's path. Every shard
    carries ``metadata`` (with ``"format": "pt"`` added when absent)."""
    if not isinstance(tensors, dict):
        raise TypeError(f"save_sharded: tensors must be a dict[str, torch.Tensor], got {type(tensors).__name__}")
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int):
        raise TypeError(f"save_sharded: max_shard_size must be an int, got {type(max_shard_size).__name__}")
    if max_shard_size <= 0:
        raise ValueError(f"save_sharded: max_shard_size must be > 0, got {max_shard_size}")
    return _C.save_safetensors_sharded(os.fspath(directory), tensors, max_shard_size, metadata)


def load_checkpoint(path: PathLike) -> Dict[str, torch.Tensor]:
    """The tensors of a checkpoint: a ``.safetensors`` file, an index
    (``*.json``; tensors sorted by name), or a directory holding
    ``model.safetensors.index.json`` or ``model.safetensors``."""
    return _C.load_safetensors_checkpoint(os.fspath(path))


__all__ = ["save_file", "load_file", "load_metadata", "save_sharded", "load_checkpoint"]
