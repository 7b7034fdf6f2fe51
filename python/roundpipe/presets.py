"""Llama and Qwen3 dense decoders (docs/python.md, "API summary"), built by
the C++ engine and held in Python as an ``nn.Sequential``: embedding |
decoder blocks | head.

    from roundpipe import RoundPipe, presets
    config = presets.load_config("Qwen3-0.6B/config.json")    # or tiny_llama_config()
    net = presets.make_decoder(config)                        # nn.Sequential
    presets.load_hf_weights(net, config, "Qwen3-0.6B")        # optional: Hugging Face weights
    model = RoundPipe(net)
    loss = model.forward_backward(input_args=(input_ids,), input_kwargs={"labels": labels},
                                  loss_fn=presets.loss_fn)

Each layer is a :class:`NativeLayer`: an ``nn.Module`` whose parameters are
the C++ module's own tensors (so ``state_dict``, ``requires_grad_``, ``to``
and optimizers work as usual); RoundPipe runs it in C++, without the GIL.
Called directly, a layer runs the same C++ forward.

Labels are aligned with the positions (``labels[b, t]`` is the token after
``input_ids[b, :t+1]``; no shift inside) and ``-100`` is ignored. With labels
the head returns the mean cross-entropy, computed in chunks so full logits
never exist; without them it returns logits ``[B, T, V]``. The math is
Hugging Face's (``LlamaForCausalLM`` / ``Qwen3ForCausalLM``, eager attention).
"""
import json
import os
from typing import Any, Dict, Iterable, List, Mapping, Tuple, Union

import torch
from torch import nn

from . import _C
from . import safetensors as _safetensors

DecoderConfig = _C.DecoderConfig


def config_from_hf(config: Union[Mapping[str, Any], str]) -> "_C.DecoderConfig":
    """A :class:`DecoderConfig` from a Hugging Face ``config.json``: a dict or
    its JSON text. Fields take Hugging Face's defaults; bad values raise
    ValueError naming the field."""
    if isinstance(config, dict):
        config = json.dumps(config)
    if not isinstance(config, str):
        raise TypeError(f"config_from_hf: expected a dict or JSON text, got {type(config).__name__}")
    return _C.decoder_config_from_json(config)


def load_config(path: Union[str, "os.PathLike[str]"]) -> "_C.DecoderConfig":
    """Reads a Hugging Face ``config.json`` (or the directory holding one)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"load_config: cannot read {path!r}: {e.strerror}") from None
    return config_from_hf(text)


def tiny_llama_config() -> "_C.DecoderConfig":
    """Byte vocabulary (256), hidden 128, 4 layers, 4 heads / 2 kv heads, untied."""
    return _C.tiny_llama_config()


def tiny_qwen3_config() -> "_C.DecoderConfig":
    """As tiny_llama_config, with Qwen3's q/k norms and a tied head."""
    return _C.tiny_qwen3_config()


class _NativeChild(nn.Module):
    """A submodule of a NativeLayer: holds that submodule's tensors."""

    def __init__(self, type_name):
        super().__init__()
        self._type_name = type_name

    def _get_name(self):
        return self._type_name


class NativeLayer(nn.Module):
    """One C++ layer of a preset, as an ``nn.Module`` (see the module doc)."""

    def __init__(self, native: Any) -> None:
        super().__init__()
        object.__setattr__(self, "_roundpipe_native", native)
        self._mirror()
        self.training = native.is_training()

    def _mirror(self):
        """Puts the C++ module's tensors (new ones too, e.g. LoRA adapters)
        into this module tree."""
        native = self._roundpipe_native
        for name, tensor in native.named_parameters():
            owner, leaf = self._owner(name)
            if not isinstance(tensor, nn.Parameter):
                tensor.__class__ = nn.Parameter  # the C++ tensor itself, typed as a parameter
            owner._parameters[leaf] = tensor
        for name, tensor in native.named_buffers():
            owner, leaf = self._owner(name)
            owner._buffers[leaf] = tensor

    def _owner(self, dotted):
        *path, leaf = dotted.split(".")
        module = self
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = _NativeChild(part)
                module._modules[part] = child
            module = child
        return module, leaf

    def _get_name(self):
        return self._roundpipe_native.type_name()

    def train(self, mode: bool = True) -> "NativeLayer":
        super().train(mode)
        self._roundpipe_native.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._roundpipe_native.forward(args, kwargs)


def make_decoder(config: "_C.DecoderConfig") -> nn.Sequential:
    """embedding | ``num_hidden_layers`` blocks | head as an ``nn.Sequential``
    of NativeLayers, initialized as Hugging Face does (tied head: the head's
    ``lm_head.weight`` is the embedding's tensor)."""
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"make_decoder: expected a presets.DecoderConfig, got {type(config).__name__}")
    return nn.Sequential(*[NativeLayer(layer) for layer in _C.decoder_layers(config)])


def apply_lora(net: nn.Sequential, rank: int = 8, alpha: float = 16.0,
               target_modules: Union[str, Iterable[str]] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> int:
    """Adds LoRA adapters (PEFT's math: ``y = base(x) + alpha/rank * (x A^T) B^T``,
    A kaiming-uniform, B zero, so the model starts unchanged) to the named
    projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj) of every block of ``net`` (from make_decoder), and freezes
    everything else. Call before wrapping ``net`` in a RoundPipe: only the
    adapters then get optimizer copies and gradients. Returns the number of
    adapted projections; raises ValueError (nothing changed) on a bad
    argument, a second call, or a model that is not a preset."""
    if not isinstance(net, nn.Sequential) or not all(isinstance(m, NativeLayer) for m in net):
        raise TypeError("apply_lora: expected the nn.Sequential returned by presets.make_decoder")
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    config = _C.LoraConfig()
    config.rank, config.alpha, config.target_modules = rank, float(alpha), list(target_modules)
    count = _C.apply_lora([layer._roundpipe_native for layer in net], config)
    for layer in net:
        layer._mirror()
    return count


def lora_state_dict(net: nn.Module) -> Dict[str, torch.Tensor]:
    """The adapter tensors of ``net`` by parameter name (e.g. to save them)."""
    return {name: p for name, p in net.named_parameters() if ".lora_" in name}


def hf_parameter_names(config: "_C.DecoderConfig") -> List[Tuple[str, str]]:
    """``[(our name, Hugging Face name)]`` for each distinct parameter of
    ``make_decoder(config)`` (``"0.embed_tokens.weight"`` ->
    ``"model.embed_tokens.weight"``, ...)."""
    return _C.hf_parameter_names(config)


def load_hf_weights(net: nn.Module, config: "_C.DecoderConfig",
                    source: Union[Mapping[str, torch.Tensor], str, "os.PathLike[str]"]) -> None:
    """Copies Hugging Face weights into ``net`` (made by make_decoder(config)).
    ``source``: a dict of tensors, a ``.safetensors`` file, a sharded index
    (``*.safetensors.index.json``) or a directory holding either. Every
    parameter must be present with its shape (dtype is converted); extra
    tensors (e.g. rotary caches) are ignored. Raises ValueError naming what
    is missing or mis-shaped; on error nothing is copied."""
    if isinstance(source, dict):
        tensors = source
    else:
        tensors = _safetensors.load_checkpoint(os.fspath(source))
    params = dict(net.named_parameters())
    plan = []
    for ours, theirs in hf_parameter_names(config):
        if theirs not in tensors:
            raise ValueError(f"load_hf_weights: {theirs!r} (for {ours}) is missing from the weights")
        if ours not in params:
            raise ValueError(f"load_hf_weights: the model has no parameter {ours!r}: "
                             "was it made by make_decoder with this config?")
        src, dst = tensors[theirs], params[ours]
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"load_hf_weights: {theirs!r} has shape {tuple(src.shape)}, "
                             f"the model's {ours} has {tuple(dst.shape)}")
        plan.append((dst, src))
    with torch.no_grad():
        for dst, src in plan:
            dst.copy_(src)


def loss_fn(outputs: Any, labels: Any) -> torch.Tensor:
    """The loss function for forward_backward over a preset called with
    labels: the head already returns the loss."""
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 0:
        raise ValueError("presets.loss_fn: the head did not return a loss; pass "
                         "input_kwargs={'labels': labels} to forward_backward")
    return outputs


chunked_cross_entropy = _C.chunked_cross_entropy

__all__ = ["DecoderConfig", "NativeLayer", "config_from_hf", "load_config", "tiny_llama_config",
           "tiny_qwen3_config", "make_decoder", "apply_lora", "lora_state_dict", "hf_parameter_names", "load_hf_weights", "loss_fn",
           "chunked_cross_entropy"]
