"""Training data for language models: pre-tokenized token files, packed into
sequences and served in a seeded, resumable shuffled order; and a small
built-in English corpus with a byte-level tokenizer.

    data = TokenFile("train.bin")                     # uint16, memory-mapped
    batcher = TokenBatcher(data, seq_len=256, seed=1, eval_fraction=0.01)
    input_ids, labels = batcher.next_batch(8)         # [8, 256] int64 each
    state = batcher.state_dict()                      # save with a checkpoint
    batcher.load_state_dict(state)                    # same batches again

A token file is a flat array of little-endian ``uint16`` or ``uint32`` token
ids with no header, as written by ``np.array(ids, dtype=np.uint16).tofile(path)``
(the ``.bin`` files of nanoGPT). The file does not record its dtype: by default
it is ``uint32`` when ``vocab_size > 65536``, else ``uint16``.

Windows of ``seq_len + 1`` tokens are cut at a stride of ``seq_len``: window
``w`` is tokens ``[w*T, w*T + T]``, its inputs the first ``T`` and its labels
the last ``T`` (so ``labels[:, :-1] == input_ids[:, 1:]``). Held-out
evaluation windows are the end of the stream, sharing no token with the
training windows. Each epoch visits the training windows in a permutation
that depends only on ``(seed, epoch)``, identical on every platform.

Malformed files and bad arguments raise ``ValueError`` naming the file (and,
for a token ``>= vocab_size``, its position and value); system errors raise
``RuntimeError``. The full rules are in include/roundpipe/token_data.h.
"""
import os
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from . import _C

PathLike = Union[str, "os.PathLike[str]"]

#: The vocabulary of the byte-level tokenizer: one token per byte, no specials.
BYTE_VOCAB_SIZE = 256


def _dtype_name(dtype) -> Optional[str]:
    """``None``, ``"uint16"``/``"uint32"``, a numpy dtype (``np.uint16``) or a torch one."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    try:
        import numpy as np
        return np.dtype(dtype).name
    except (ImportError, TypeError):
        raise TypeError(f"dtype must be 'uint16', 'uint32' or a numpy dtype, got {dtype!r}") from None


class DataPosition(NamedTuple):
    """Where a TokenBatcher is: the next window is the ``index``-th of epoch
    ``epoch``'s order drawn from ``seed``."""
    seed: int
    epoch: int
    index: int


class TokenFile:
    """A token file, memory-mapped; or tokens in memory (``from_tensor``).

    ``vocab_size > 0`` makes every read check its tokens against it (lazily:
    a bad token is reported when a read first covers it; ``validate()``
    checks the whole file)."""

    def __init__(self, path: PathLike, dtype: Union[str, torch.dtype, None] = None, vocab_size: int = 0) -> None:
        self._core = _C.TokenFile(os.fspath(path), _dtype_name(dtype), int(vocab_size))

    @classmethod
    def from_tensor(cls, tokens: Union[torch.Tensor, Sequence[int], Any], name: str = "<memory>",
                    vocab_size: int = 0) -> "TokenFile":
        """Tokens held in memory (a 1-D integer tensor, array or list;
        values in ``[0, 2**32)``, checked)."""
        self = cls.__new__(cls)
        self._core = _C.TokenFile.from_tensor(torch.as_tensor(tokens), name, None, int(vocab_size))
        return self

    @classmethod
    def _wrap(cls, core) -> "TokenFile":
        self = cls.__new__(cls)
        self._core = core
        return self

    @property
    def path(self) -> str:
        return self._core.path

    @property
    def dtype(self) -> str:
        """``"uint16"`` or ``"uint32"``."""
        return self._core.dtype

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    def __len__(self) -> int:
        return self._core.size()

    def size(self) -> int:
        """The number of tokens."""
        return self._core.size()

    def tokens(self, begin: int, count: int) -> torch.Tensor:
        """Tokens ``[begin, begin + count)`` as a new int64 tensor."""
        return self._core.tokens(begin, count)

    def validate(self) -> None:
        """Checks every token against ``vocab_size`` (no-op when it is 0)."""
        self._core.validate()

    def __repr__(self) -> str:
        return f"TokenFile({self.path!r}, dtype={self.dtype!r}, tokens={len(self)})"


class TokenBatcher:
    """Packs a token stream into sequences of ``seq_len`` and serves batches
    in a seeded per-epoch shuffled order (file order with ``shuffle=False``).
    Epochs wrap around inside a batch, so every batch is full.

    ``data`` is a TokenFile, a path, or a 1-D tensor of tokens. At most one of
    ``eval_windows`` (a count) and ``eval_fraction`` (of all windows, at least
    one when > 0) holds out the end of the stream for ``eval_batches``.
    Not thread-safe: use one batcher from one thread at a time."""

    def __init__(self, data: Union[TokenFile, PathLike, torch.Tensor], seq_len: int, seed: int = 0,
                 shuffle: bool = True, eval_windows: int = 0, eval_fraction: float = 0.0) -> None:
        if isinstance(data, torch.Tensor):
            data = TokenFile.from_tensor(data)
        elif not isinstance(data, TokenFile):
            data = TokenFile(data)
        self._data = data
        self._core = _C.TokenBatcher(data._core, int(seq_len), int(seed), bool(shuffle),
                                     int(eval_windows), float(eval_fraction))

    @property
    def data(self) -> TokenFile:
        return self._data

    @property
    def seq_len(self) -> int:
        return self._core.seq_len

    @property
    def train_windows(self) -> int:
        """The number of training windows (one epoch)."""
        return self._core.train_windows

    @property
    def eval_windows(self) -> int:
        return self._core.eval_windows

    def next_batch(self, batch_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, labels)``, each ``[batch_size, seq_len]`` int64."""
        return self._core.next_batch(batch_size)

    def position(self) -> DataPosition:
        return DataPosition(*self._core.position())

    def seek(self, position: Union[DataPosition, Sequence[int]]) -> None:
        """Moves to ``position`` (a DataPosition, a ``(seed, epoch, index)``
        tuple, or a dict with those keys): the following batches are then
        bitwise those that followed it before."""
        if isinstance(position, dict):
            position = DataPosition(position["seed"], position["epoch"], position["index"])
        seed, epoch, index = position
        self._core.seek(int(seed), int(epoch), int(index))

    def state_dict(self) -> Dict[str, Any]:
        """``{"seed", "epoch", "index"}``: the whole state, for checkpoints."""
        return self.position()._asdict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.seek(state)

    def eval_batches(self, batch_size: int, max_batches: int = 0) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """The evaluation windows in order, ``batch_size`` per batch (the last
        may be smaller); at most ``max_batches`` batches when it is > 0."""
        return self._core.eval_batches(batch_size, max_batches)

    def window_at(self, seed: int, epoch: int, index: int) -> int:
        """The file-order index of the window at ``index`` of epoch ``epoch``."""
        return self._core.window_at(int(seed), int(epoch), int(index))


def write_token_file(path: PathLike, tokens: Union[torch.Tensor, Sequence[int], Any],
                     dtype: Union[str, torch.dtype] = "uint16") -> None:
    """Writes ``tokens`` (a 1-D integer tensor, array or list) as a token file
    of ``dtype`` (``"uint16"``/``"uint32"`` or the numpy dtype), atomically.
    Raises ``ValueError`` before writing when a token does not fit."""
    _C.write_token_file(os.fspath(path), torch.as_tensor(tokens), _dtype_name(dtype))


def shuffled_order(n: int, seed: int, epoch: int) -> List[int]:
    """The permutation of ``range(n)`` a TokenBatcher uses for ``(seed, epoch)``."""
    return _C.shuffled_order(int(n), int(seed), int(epoch))


def encode_bytes(text: Union[str, bytes]) -> torch.Tensor:
    """The bytes of ``text`` (UTF-8 for a str) as int64 tokens in ``[0, 256)``."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    return _C.encode_bytes(bytes(text))


def decode_bytes(tokens: Union[torch.Tensor, Sequence[int]]) -> bytes:
    """The inverse of ``encode_bytes`` (``.decode("utf-8", "replace")`` for text)."""
    return _C.decode_bytes(torch.as_tensor(tokens))


def default_corpus() -> str:
    """The built-in corpus: the first chapters of Lewis Carroll's "Alice's
    Adventures in Wonderland" (1865, public domain), ~31 KB of ASCII."""
    return _C.default_corpus()


def default_tokens() -> torch.Tensor:
    """``encode_bytes(default_corpus())``."""
    return _C.default_token_data()


def default_token_file() -> TokenFile:
    """The built-in corpus as a TokenFile (``vocab_size`` 256)."""
    return TokenFile._wrap(_C.default_token_file())


__all__ = ["BYTE_VOCAB_SIZE", "DataPosition", "TokenFile", "TokenBatcher", "write_token_file",
           "shuffled_order", "encode_bytes", "decode_bytes", "default_corpus", "default_tokens",
           "default_token_file"]
