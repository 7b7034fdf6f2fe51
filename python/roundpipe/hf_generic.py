"""The generic decoder preset (docs/hf.md, "Other decoders"): any Hugging
Face decoder-only causal LM whose decoder blocks are one ``nn.ModuleList``
becomes one RoundPipe of embedding | one layer per block | head, on the
fused pipeline with asynchronous steps.

Nothing of an architecture's math is written here. The layers hold the
loaded model's own modules and run its own code:

- The embedding layer runs the inner model's ``forward`` (token and position
  embeddings, embedding scaling, dropout, the attention masks of each layer
  type, the rotary tables of each layer type) with its decoder blocks
  replaced by stand-ins that record the arguments each block is called
  with, and stops at the last one. What it passes on: the hidden states
  the first block gets, and every block's other arguments (each distinct
  value once).
- Block layer ``i`` calls block ``i`` with the running hidden states and
  block ``i``'s recorded arguments; mixture-of-experts routers' logits are
  summed for the auxiliary loss as in the presets.
- The head layer is the presets' (roundpipe.hf.HFHead): the final norm, the
  LM head, the logit transform the config names, the chunked loss.

A model is refused (``GenericDecoderUnsupported`` with the reason; the
caller falls back to AutoRoundPipe) when it is not a causal LM, has no
single block list or no single final norm, or has cross-attention. An
architecture not in ``TESTED_MODEL_TYPES`` is checked once when it is
wrapped: the layers, run one after the other on a short input, must give the
model's own logits.
"""
import contextlib
import copy
import threading

import torch
from torch import nn

from .hf import _MOE_FAMILIES, HFHead, _EmbeddingBase, _RouterCapture, _base_model, _family, _has_aux_loss, \
    _refuse_packed_experts
from .recompute import doing_recompute, get_recompute_data, save_for_recompute
from .tiling import SequenceTileSetting, auto_sequence_tile, tiled_call

__all__ = ["GenericDecoderUnsupported", "TESTED_MODEL_TYPES", "generic_layers", "preset_layers"]

# Architectures whose generic preset is tested against transformers
# (tests/python/test_hf_generic.py).
TESTED_MODEL_TYPES = frozenset((
    "mistral", "qwen2", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "mixtral", "qwen2_moe",
    "deepseek_v3", "gpt_neox", "gpt2", "granite", "phi", "cohere", "starcoder2", "stablelm", "olmo", "olmoe", "jamba",
    "llama", "qwen3", "qwen3_moe",
))

# Attributes of a decoder block that inner models read while calling it.
_BLOCK_ATTRIBUTES = ("attention_type", "layer_type", "is_sliding", "layer_idx")


class GenericDecoderUnsupported(ValueError):
    """The model cannot be cut into embedding | blocks | head (the message
    says why)."""


class _Stop(Exception):
    """Raised by the last block's stand-in: the inner model's forward has
    done all it does before the blocks."""


_RECORDING = threading.local()  # the calls the stand-ins record, per thread


class _BlockInputs(nn.Module):
    """Stands in for decoder block ``index`` inside the embedding layer:
    records the arguments the inner model calls it with."""

    def __init__(self, index, count, block):
        super().__init__()
        self.index, self.count = index, count
        for name in _BLOCK_ATTRIBUTES:
            value = getattr(block, name, None)
            if isinstance(value, (str, int, bool)):
                setattr(self, name, value)

    def forward(self, *args, **kwargs):
        _RECORDING.calls.append((args, kwargs))
        if self.index >= self.count - 1:
            raise _Stop()
        return args[0] if args else kwargs["hidden_states"]


class GenericEmbedding(_EmbeddingBase):
    """Layer 0: the inner model's forward up to its first block (module doc).
    Takes the presets' keywords (roundpipe.hf); returns the state the blocks
    pass along."""

    def __init__(self, hf, stack):
        super().__init__()
        inner = stack.inner
        prelude = copy.copy(inner)  # the inner model's attributes; its own module dicts
        for slot in ("_parameters", "_buffers", "_modules"):
            prelude.__dict__[slot] = dict(inner.__dict__[slot])
        inner_blocks = inner._modules[stack.blocks_name]
        count = len(stack.blocks)
        prelude._modules[stack.blocks_name] = nn.ModuleList(
            _BlockInputs(i, count, block) for i, block in enumerate(inner_blocks))
        prelude._modules[stack.norm_name] = nn.Identity()  # never reached: the last stand-in stops
        self.prelude = prelude
        self.num_blocks = len(stack.blocks)
        self.tile_setting = SequenceTileSetting()
        self._init_call(hf, _has_aux_loss(hf))

    def _embed(self, state, input_ids, inputs_embeds):
        calls = []
        _RECORDING.calls = calls
        try:
            self.prelude(input_ids=input_ids, attention_mask=state["attention_mask"],
                         position_ids=state["position_ids"], inputs_embeds=inputs_embeds, use_cache=False)
        except _Stop:
            pass
        finally:
            _RECORDING.calls = None
        if len(calls) != self.num_blocks:
            raise RuntimeError(f"the {type(self.prelude).__name__}'s forward called {len(calls)} of its "
                               f"{self.num_blocks} decoder blocks")
        values, index_of = [], {}

        def ref(value):
            if id(value) not in index_of:
                index_of[id(value)] = len(values)
                values.append(value)
            return index_of[id(value)]

        first_args, first_kwargs = calls[0]
        state["hidden_states"] = first_args[0] if first_args else first_kwargs["hidden_states"]
        block_args = []
        for args, kwargs in calls:
            positional = [ref(a) for a in args[1:]] if args else []
            keywords = {k: ref(v) for k, v in kwargs.items() if k != "hidden_states"}
            block_args.append((positional, keywords))
        state["values"] = values
        state["block_args"] = block_args


# A block's children that run position by position: its feed-forward part
# (dense or mixture of experts), found by name or by class, and its norms.
_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe")
_MLP_CLASS_ENDINGS = ("mlp", "moe", "moeblock", "feedforward")


def _position_wise_parts(block):
    parts = []
    for name, child in block.named_children():
        kind = type(child).__name__.lower()
        if name in _MLP_NAMES or kind.endswith(_MLP_CLASS_ENDINGS) or "norm" in kind:
            parts.append(name)
    return parts


def _mlp_width(config):
    """Elements per token of the widest intermediate of a block's MLP: the
    intermediate size, or for a mixture of experts the routed experts' and
    shared experts' sizes summed over the experts each token goes to."""
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None) or 0
    dense = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    per_token = getattr(config, "num_experts_per_tok", None)
    routed = getattr(config, "moe_intermediate_size", None)
    if not per_token:
        return dense
    if not routed:
        return per_token * dense
    shared = getattr(config, "shared_expert_intermediate_size", None) or \
        (getattr(config, "n_shared_experts", None) or 0) * routed
    return max(dense, per_token * routed + shared)


def _draws_randomness(module):
    """Whether a module draws random numbers in training (dropout, router
    jitter): its tiles would not recompute to the same values."""
    if not module.training:
        return False
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for attr in ("jitter_noise", "dropout", "dropout_rate", "hidden_dropout"):
            value = getattr(m, attr, None)
            if isinstance(value, float) and value > 0:
                return True
    return False


class TiledParts:
    """While ``active``: the block's position-wise parts run over tiles of
    ``tile`` tokens (roundpipe.tiling.tiled_call) when called with one
    ``(rows, tokens, hidden)`` tensor; the logits of the routers inside them
    go to the block's capture list, joined over the tiles.

    The outputs of the parts other than norms are kept for the layer's
    recomputation (``saved``, then ``keep``): in it (``replay``) they are
    taken instead of running those parts again, so a tiled MLP runs once
    in the forward, once in the recomputation's backward, as untiled."""

    def __init__(self, owner, tile):
        self.owner, self.tile = owner, tile
        self.saved, self.replay = [], None

    def keep(self):
        """Hands the kept outputs to the engine (once per layer forward; a
        no-op outside a forward that saves for recomputation)."""
        if self.saved:
            save_for_recompute(*self.saved)

    def take_replay(self):
        """In a recomputation: the outputs the forward kept, if any."""
        try:
            self.replay = list(get_recompute_data())
        except RuntimeError:  # the forward kept none
            self.replay = None

    def _replayed(self, number, x):
        """The kept outputs of part ``number`` for ``x``, next in order."""
        if not self.replay:
            return None
        entry = self.replay.pop(0)
        number_kept, count, is_tuple, *outs = entry
        if number_kept != number or not outs or outs[0].device != x.device or \
                not all(o.shape[0] in (x.shape[0], x.shape[0] * x.shape[1]) for o in outs):
            self.replay = None  # not this forward's: recompute from here on
            return None
        return count, bool(is_tuple), outs

    def covers(self, router_name):
        return any(router_name.startswith(part + ".") for part in self.owner.tiled_parts)

    @contextlib.contextmanager
    def active(self, captured):
        block = self.owner.block
        saved = []
        try:
            for part in self.owner.tiled_parts:
                module = block.get_submodule(part)
                routers = [] if captured is None else [
                    block.get_submodule(r) for r in self.owner.router_names if r.startswith(part + ".")]
                saved.append((module, module.__dict__.get("forward")))
                module.forward = self._tiled_forward(part, module, module.forward, routers, captured)
            yield
        finally:
            for module, previous in reversed(saved):
                del module.forward
                if previous is not None:
                    module.forward = previous

    def _tiled_forward(self, part, module, original, routers, captured):
        tile, index = self.tile, getattr(self.owner, "router_index", 0)
        who = f"decoder block {self.owner.index}'s {part} ({type(module).__name__})"
        # Norms are cheap to run again; the MLP's outputs are worth keeping.
        number = None if "norm" in type(module).__name__.lower() else self.owner.tiled_parts.index(part)

        def forward(*args, **kwargs):
            x = args[0] if len(args) == 1 and not kwargs else None
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] <= tile or _draws_randomness(module):
                return original(*args, **kwargs)
            form = {}

            def run(piece):
                caught = []
                hooks = [r.register_forward_hook(lambda _m, _i, out: caught.append(out[index])) for r in routers]
                try:
                    out = original(piece)
                finally:
                    for h in hooks:
                        h.remove()
                form["tuple"] = isinstance(out, tuple)
                outs = tuple(out) if form["tuple"] else (out,)
                form["count"] = len(outs)
                return outs + tuple(caught)

            params = [p for p in module.parameters() if p.requires_grad]
            replayed = self._replayed(number, x) if number is not None else None
            if replayed is not None:
                form["count"], form["tuple"], given = replayed
                outs = tiled_call(run, x, tile, params, who=who, outputs=given)
            else:
                outs = tiled_call(run, x, tile, params, who=who)
                if number is not None and not torch.is_grad_enabled():
                    self.saved.append((number, form["count"], int(form["tuple"]), *[o.detach() for o in outs]))
            own, caught = outs[:form["count"]], outs[form["count"]:]
            if captured is not None:
                captured.extend(caught)
            return tuple(own) if form["tuple"] else own[0]

        return forward


class GenericBlock(_RouterCapture):
    """Decoder block ``index`` of the loaded model, called with the
    arguments its inner model gave it (module doc). Its position-wise parts
    run over tiles of the sequence when it is longer than the call's
    ``sequence_tile`` (by default: roundpipe.tiling.auto_sequence_tile)."""

    def __init__(self, hf, stack, index):
        super().__init__()
        self.block = stack.blocks[index]
        self.index = index
        self.tiled_parts = _position_wise_parts(self.block)
        self.mlp_width = _mlp_width(hf.config)
        self._init_router(hf)

    def forward(self, state):
        positional, keywords = state["block_args"][self.index]
        values = state["values"]
        tile = self.sequence_tile(state)
        tiles = TiledParts(self, tile) if tile is not None else None
        if tiles is not None and doing_recompute():
            tiles.take_replay()
        out = self._run_block(state, [values[i] for i in positional], {k: values[i] for k, i in keywords.items()},
                              tiles=tiles)
        if tiles is not None and not doing_recompute():
            tiles.keep()
        return out

    def sequence_tile(self, state):
        """The tile of this call (None: untiled): the call's sequence_tile,
        or the automatic one; None when the sequence fits in one tile."""
        hidden = state["hidden_states"]
        if not self.tiled_parts or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            return None
        length = hidden.shape[1]
        tile = state.get("sequence_tile")
        if tile is None:
            tile = auto_sequence_tile(hidden.shape[0], length, self.mlp_width, hidden.element_size())
        return tile if tile is not None and tile < length else None


class DecoderStack:
    """Where a causal LM keeps its parts: the inner model, its block list and
    final norm (by attribute name), its LM head."""

    def __init__(self, model):
        hf = _base_model(model)
        self.hf = hf
        config = getattr(hf, "config", None)
        name = type(hf).__name__
        if config is None or not callable(getattr(hf, "get_output_embeddings", None)):
            raise GenericDecoderUnsupported(f"a {name} is not a Hugging Face transformers model")
        if getattr(config, "is_encoder_decoder", False):
            raise GenericDecoderUnsupported(f"a {name} is an encoder-decoder model, not a decoder-only one")
        if not name.endswith(("ForCausalLM", "LMHeadModel")):
            raise GenericDecoderUnsupported(f"a {name} is not a causal language model (*ForCausalLM)")
        if getattr(config, "add_cross_attention", False):
            raise GenericDecoderUnsupported(f"the {name} has cross-attention")
        inner = getattr(hf, "base_model", hf)
        if inner is hf or not isinstance(inner, nn.Module):
            raise GenericDecoderUnsupported(f"the {name} has no inner decoder model")
        self.inner = inner
        lists = [(n, c) for n, c in inner.named_children() if isinstance(c, nn.ModuleList)]
        if len(lists) != 1 or len(lists[0][1]) == 0:
            raise GenericDecoderUnsupported(
                f"the {type(inner).__name__} has {len(lists)} module lists; the generic preset needs exactly one, "
                "its decoder blocks")
        self.blocks_name, blocks = lists[0]
        # Some models keep more blocks than their forward runs (multi-token
        # prediction layers): the forward's are the first num_hidden_layers.
        count = getattr(config, "num_hidden_layers", None)
        self.blocks = list(blocks)[:count] if isinstance(count, int) and count > 0 else list(blocks)
        norms = [n for n, c in inner.named_children() if "norm" in type(c).__name__.lower()]
        if len(norms) != 1:
            raise GenericDecoderUnsupported(
                f"the {type(inner).__name__} has {len(norms)} norm modules beside its blocks "
                f"({', '.join(norms) or 'none'}); the generic preset needs exactly one, its final norm")
        self.norm_name = norms[0]
        self.norm = getattr(inner, self.norm_name)
        head = hf.get_output_embeddings()
        if not isinstance(head, nn.Linear):
            raise GenericDecoderUnsupported(f"the {name}'s output embedding is a {type(head).__name__}, "
                                            "not an nn.Linear")
        self.head = head
        self.model_type = getattr(config, "model_type", None)


def generic_layers(model: nn.Module) -> nn.Sequential:
    """embedding | blocks | head for ``model`` as an ``nn.Sequential``
    holding the model's own modules; raises GenericDecoderUnsupported."""
    try:
        stack = DecoderStack(model)
    except GenericDecoderUnsupported:
        raise
    except Exception as e:  # noqa: BLE001 - a model this code does not understand: not this preset
        raise GenericDecoderUnsupported(f"its parts could not be found ({type(e).__name__}: {e})") from None
    hf = stack.hf
    try:
        blocks = [GenericBlock(hf, stack, i) for i in range(len(stack.blocks))]
        layers = nn.Sequential(GenericEmbedding(hf, stack), *blocks, HFHead(hf, stack.norm, stack.head))
    except Exception as e:  # noqa: BLE001 - a model this code does not understand: not this preset
        raise GenericDecoderUnsupported(f"its layers could not be built ({type(e).__name__}: {e})") from None
    if stack.model_type not in TESTED_MODEL_TYPES:
        _check_against_model(hf, layers)
    return layers


def _check_against_model(hf, layers):
    """The layers run one after the other must give the model's own logits
    on a short input (eval mode, no gradients)."""
    vocab = hf.config.vocab_size
    ids = (torch.arange(8, dtype=torch.long) * 7 + 3).remainder(vocab).unsqueeze(0)
    modes = [(m, m.training) for m in hf.modules()]
    hf.eval()
    try:
        with torch.no_grad():
            expected = hf(input_ids=ids, use_cache=False).logits
            state = ids
            out = layers[0](input_ids=state)
            for layer in list(layers)[1:]:
                out = layer(out)
            got = out.logits
    except Exception as e:  # noqa: BLE001 - any failure means: not this preset
        raise GenericDecoderUnsupported(f"the layers failed on a test input ({type(e).__name__}: {e})") from None
    finally:
        for m, mode in modes:
            m.training = mode
    scale = max(1.0, float(expected.abs().max()))
    tolerance = (1e-4 if expected.dtype == torch.float32 else 3e-2) * scale
    if got.shape != expected.shape or float((got.float() - expected.float()).abs().max()) > tolerance:
        raise GenericDecoderUnsupported("its layers, run one after the other, do not give the model's logits "
                                        "(its forward does more than embedding | blocks | final norm | LM head)")


def preset_layers(model: nn.Module) -> "nn.Sequential | None":
    """The named preset's layers for a loaded Hugging Face causal LM (the
    generic decoder preset's, after the checks of the family), or None if
    its type is not one of the four families."""
    family = _family(model)
    if family is None:
        return None
    model = _base_model(model)
    for path in ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"):
        try:
            model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"wrap_model_to_roundpipe: the {type(model).__name__} has no '{path}'; the preset "
                             "needs the module layout transformers gives it") from None
    if family in _MOE_FAMILIES:
        _refuse_packed_experts(model)
    return generic_layers(model)
