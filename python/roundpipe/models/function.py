"""Loss functions for causal language models, under the names scripts
written for the reference implementation import.

- ``CompileCrossEntropy``, ``CompileLinearCrossEntropy``: summed cross
  entropy (over logits, or over ``linear(hidden, weight, bias)``), computed in
  fp32, compiled with ``torch.compile`` for accelerator tensors.
- ``CompileForCausalLMLoss``: Hugging Face's ``ForCausalLMLoss`` (labels
  shifted by one, mean over the tokens that are not ``ignore_index``, or
  divided by ``num_items_in_batch``).
- ``ChunkedCompileLinearCrossEntropy``, ``ChunkedCompileLinearForCausalLMLoss``:
  the same from the last hidden states and the LM head, ``TOKEN_CHUNK_SIZE``
  tokens at a time: the full logits (tokens x vocabulary, in fp32) are never
  held; backward recomputes each chunk's logits.

``ROUNDPIPE_TORCH_COMPILE=0`` turns compilation off (CPU tensors always run
eagerly: compiling for the CPU needs a C++ toolchain and buys little here).
"""
import os
from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

TOKEN_CHUNK_SIZE = 4096

_compiled = {}


def _maybe_compiled(fn, *tensors):
    """``fn`` compiled when a tensor is on an accelerator, else ``fn`` itself."""
    if os.environ.get("ROUNDPIPE_TORCH_COMPILE", "1") == "0" or all(t is None or t.is_cpu for t in tensors):
        return fn
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn)
    return _compiled[fn]


def _cross_entropy_sum(logits, labels, ignore_index):
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def _linear_cross_entropy_sum(hidden_states, weight, bias, labels, ignore_index):
    return F.cross_entropy(F.linear(hidden_states, weight, bias).float(), labels, ignore_index=ignore_index,
                           reduction="sum")


def CompileCrossEntropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Cross entropy of ``logits`` [N, V] against ``labels`` [N], summed, in fp32."""
    return _maybe_compiled(_cross_entropy_sum, logits)(logits, labels, ignore_index)


def CompileLinearCrossEntropy(hidden_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                              labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Cross entropy of ``linear(hidden_states, weight, bias)`` against ``labels``, summed, in fp32."""
    return _maybe_compiled(_linear_cross_entropy_sum, hidden_states)(hidden_states, weight, bias, labels,
                                                                     ignore_index)


def _shifted(labels, shift_labels, ignore_index):
    if shift_labels is None:
        # Position t predicts token t + 1; the last position predicts nothing.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _divided(loss_sum, labels, num_items_in_batch, ignore_index):
    if num_items_in_batch is None:
        num_items_in_batch = (labels != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss_sum.device)
    return loss_sum / num_items_in_batch


def CompileForCausalLMLoss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                           num_items_in_batch: Union[torch.Tensor, int, None] = None, ignore_index: int = -100,
                           shift_labels: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
    """Hugging Face's causal-LM loss (``transformers``' ``ForCausalLMLoss``), in fp32."""
    targets = _shifted(labels, shift_labels, ignore_index).to(logits.device)
    loss_sum = CompileCrossEntropy(logits.reshape(-1, vocab_size), targets, ignore_index)
    return _divided(loss_sum, targets, num_items_in_batch, ignore_index)


class ChunkedCompileLinearCrossEntropy(torch.autograd.Function):
    """``CompileLinearCrossEntropy`` over ``TOKEN_CHUNK_SIZE`` tokens at a time.

    ``apply(hidden_states [N, H], weight [V, H], bias [V] or None, labels [N],
    ignore_index)`` (a sixth argument, the reference's grad-mode flag, is
    accepted and unused). Forward keeps only its inputs; backward recomputes each
    chunk's logits and takes d loss / d logits = softmax - one-hot (zero on
    ignored tokens).
    """

    @staticmethod
    def forward(ctx: Any, hidden_states: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: Optional[torch.Tensor], labels: torch.Tensor, ignore_index: int = -100,
                _requires_grad: Any = None) -> torch.Tensor:
        ctx.ignore_index = ignore_index
        ctx.save_for_backward(hidden_states, weight, bias, labels)
        total = torch.zeros((), dtype=torch.float32, device=hidden_states.device)
        for h, y in zip(hidden_states.split(TOKEN_CHUNK_SIZE), labels.split(TOKEN_CHUNK_SIZE)):
            total += CompileLinearCrossEntropy(h, weight, bias, y, ignore_index)
        return total

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:  # type: ignore[override]
        hidden_states, weight, bias, labels = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden_states) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if want_b and bias is not None else None
        start = 0
        for h, y in zip(hidden_states.split(TOKEN_CHUNK_SIZE), labels.split(TOKEN_CHUNK_SIZE)):
            logits = F.linear(h, weight, bias).float()
            g = torch.softmax(logits, dim=-1)
            kept = y != ctx.ignore_index
            g[torch.arange(len(y), device=g.device)[kept], y[kept]] -= 1
            g[~kept] = 0
            g *= grad_loss
            if want_h:
                grad_h[start:start + len(y)] = (g @ weight.float()).to(hidden_states.dtype)
            if want_w:
                grad_w += g.t() @ h.float()
            if grad_b is not None:
                grad_b += g.sum(0)
            start += len(y)
        return (grad_h, grad_w.to(weight.dtype) if want_w else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None)


def ChunkedCompileLinearForCausalLMLoss(hidden_states: torch.Tensor, lm_head: nn.Linear, labels: torch.Tensor,
                                        num_items_in_batch: Union[torch.Tensor, int, None] = None,
                                        ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None,
                                        **kwargs: Any) -> torch.Tensor:
    """``CompileForCausalLMLoss`` of ``lm_head(hidden_states)``, without the full logits."""
    hidden = hidden_states.reshape(-1, hidden_states.size(-1))
    targets = _shifted(labels, shift_labels, ignore_index).to(hidden.device)
    loss_sum = ChunkedCompileLinearCrossEntropy.apply(hidden, lm_head.weight, lm_head.bias, targets, ignore_index)
    return _divided(loss_sum, targets, num_items_in_batch, ignore_index)


__all__ = ["TOKEN_CHUNK_SIZE", "CompileCrossEntropy", "CompileForCausalLMLoss", "CompileLinearCrossEntropy",
           "ChunkedCompileLinearCrossEntropy", "ChunkedCompileLinearForCausalLMLoss"]
