"""Sequence tiling of a decoder block's MLP and norms (roundpipe.tiling,
docs/train.md "Long sequences"): RoundPipeRunConfig(sequence_tile=...) is
validated; tiled_call gives the untiled outputs and gradients; and the
Hugging Face presets' blocks, tiled, give the untiled run's losses and every
gradient (fp32, 1e-5) for two dense (llama; gemma2, whose MLP output goes
through a norm, so the outputs a recomputation reuses must be the right
ones) and two mixture-of-experts (qwen2_moe, mixtral: router logits and
their load-balancing loss through the tiles) architectures, with padding
and with packed sequences, at layer and stage grain, with the tile set per
model, per call and automatically, in processes with 1 and 3 CPU devices.
Every tiled run shows its tiles counted (and recomputations reusing the
MLP's outputs), every untiled one none. And every architecture of the
generic preset (hf_tiny's), its layers run one after the other without the
engine: tiled, the untiled loss and every gradient."""
import textwrap

import pytest
import torch

from roundpipe import RoundPipeRunConfig, tiling

import hf_tiny
from device_reports import device_reports

TOLERANCE = 1e-5


# ---------------------------------------------------------------------------
# The run config field.

@pytest.mark.parametrize("bad, error, message", [
    (0, ValueError, r"sequence_tile must be >= 1 token per tile, got 0; use None for the automatic tile"),
    (-3, ValueError, r"sequence_tile must be >= 1"),
    (1.5, TypeError, r"sequence_tile must be an int \(tokens per tile\) or None \(automatic\), got float 1.5"),
    ("512", TypeError, r"got str '512'"),
    (True, TypeError, r"got bool True"),
])
def test_sequence_tile_is_validated(bad, error, message):
    with pytest.raises(error, match=message):
        RoundPipeRunConfig(sequence_tile=bad)


def test_sequence_tile_is_a_run_config_field():
    assert RoundPipeRunConfig().sequence_tile is None
    config = RoundPipeRunConfig(num_microbatch=2, sequence_tile=4096)
    assert config.sequence_tile == 4096
    assert "sequence_tile=4096" in repr(config)


# ---------------------------------------------------------------------------
# tiled_call on its own.

def _position_wise(up, down, router):
    """A SwiGLU-like MLP that also returns flattened router logits, as a
    mixture of experts' router does."""
    def run(x):
        rows, length, width = x.shape
        hidden = torch.nn.functional.silu(x @ up) * (x @ up.flip(1))
        return hidden @ down, (x.reshape(rows * length, width) @ router).tanh()
    return run


@pytest.mark.parametrize("tile", [1, 4, 9])
def test_tiled_call_gives_the_untiled_outputs_and_gradients(tile):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 10, 6, generator=g, requires_grad=True)
    params = [torch.randn(6, 12, generator=g, requires_grad=True), torch.randn(12, 6, generator=g, requires_grad=True),
              torch.randn(6, 4, generator=g, requires_grad=True)]
    run = _position_wise(*params)
    weights = [torch.randn(3, 10, 6, generator=g), torch.randn(30, 4, generator=g)]

    want = run(x)
    want_grads = torch.autograd.grad([(w * o).sum() for w, o in zip(weights, want)], [x, *params])
    before = tiling.tile_counts()
    got = tiling.tiled_call(run, x, tile, params)
    got_grads = torch.autograd.grad([(w * o).sum() for w, o in zip(weights, got)], [x, *params])
    after = tiling.tile_counts()
    tiles = -(-10 // tile)
    assert after["forward"] - before["forward"] == tiles
    assert after["backward"] - before["backward"] == tiles
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=TOLERANCE)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=TOLERANCE, atol=TOLERANCE)


def test_tiled_call_keeps_no_graph_of_its_tiles():
    """Only the input is kept for the backward pass: under grad, the tiles'
    intermediates are freed as soon as each tile's output is written."""
    x = torch.randn(2, 8, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    seen = []

    def run(piece):
        out = piece @ w
        seen.append(out.requires_grad)
        return out

    out, = tiling.tiled_call(run, x, 3, [w])
    assert out.requires_grad and seen == [False, False, False]
    out.sum().backward()
    assert seen[3:] == [True, True, True]
    torch.testing.assert_close(w.grad, x.detach().sum((0, 1)).unsqueeze(1).expand(4, 4))


def test_tiled_call_refuses_what_does_not_follow_the_sequence():
    x = torch.randn(2, 8, 4)
    with pytest.raises(RuntimeError, match=r"the mixer gave outputs of shapes \[\(2, 4\)\] for a tile of 3 tokens "
                                           r"of 2 row\(s\): they do not follow the sequence"):
        tiling.tiled_call(lambda piece: piece.sum(1), x, 3, who="the mixer")
    with pytest.raises(TypeError, match="only modules that return tensors can be tiled"):
        tiling.tiled_call(lambda piece: (piece, "state"), x, 3)
    with pytest.raises(ValueError, match="tile must be an int >= 1, got 0"):
        tiling.tiled_call(lambda piece: piece, x, 0)


def test_the_automatic_tile_keeps_the_mlp_intermediates_within_the_budget():
    # Llama-3.1-8B in bf16: 3 x 14336 x 2 bytes per token.
    assert tiling.auto_sequence_tile(1, 131072, 14336, 2) == (256 << 20) // (3 * 14336 * 2) == 3120
    assert tiling.auto_sequence_tile(1, 3120, 14336, 2) is None  # fits in one tile: untiled
    assert tiling.auto_sequence_tile(2, 131072, 14336, 2) == 1560  # per row of two
    assert tiling.auto_sequence_tile(1, 100, 48, 4, budget=3 * 48 * 4 * 7) == 7


# ---------------------------------------------------------------------------
# The Hugging Face presets' blocks, tiled, against untiled, on the engine.

SCRIPT = textwrap.dedent('''
    import json, sys, warnings, torch
    sys.path.insert(0, {tests!r})
    import hf_tiny
    from roundpipe import RoundPipeRunConfig, get_num_devices, tiling, wrap_model_to_roundpipe
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    ROWS, LENGTH = 3, 16

    def model(model_type):
        hf = hf_tiny.tiny_model(model_type)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():  # every weight non-zero: a gradient that does not flow shows
            for p in hf.parameters():
                if not p.abs().sum():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        return hf

    def inputs(kind):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, hf_tiny.VOCAB, (ROWS, LENGTH), generator=g)
        if kind == "packed":  # position_ids restart inside each row, no mask
            positions = torch.cat([torch.arange(6), torch.arange(10)]).unsqueeze(0).repeat(ROWS, 1)
            return {{"input_ids": ids, "position_ids": positions, "labels": ids}}
        mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
        mask[1, :5] = 0
        mask[2, :11] = 0
        labels = ids.masked_fill(mask == 0, -100)
        return {{"input_ids": ids, "attention_mask": mask, "labels": labels,
                "num_items_in_batch": (labels[:, 1:] != -100).sum()}}

    def run(model_type, kind, grain, model_tile=None, call_tile=None, budget=None):
        """The loss, every gradient, the no-grad logits, and the tiles run."""
        hf = model(model_type)
        net = wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(
            num_microbatch=3, recompute_grain=grain, sequence_tile=model_tile))
        call = RoundPipeRunConfig(sequence_tile=call_tile) if call_tile is not None else None
        kwargs = inputs(kind)
        saved = tiling.AUTO_TILE_BYTES
        if budget is not None:
            tiling.AUTO_TILE_BYTES = budget
        try:
            before = tiling.tile_counts()
            loss = net.forward_backward(input_kwargs=kwargs, loss_fn=lambda o, _: o.loss, run_config=call)
            net.synchronize()
            with torch.no_grad():
                logits = net(**{{**kwargs, "return_logits": True}}, roundpipe_run_config=call).logits
            after = tiling.tile_counts()
        finally:
            tiling.AUTO_TILE_BYTES = saved
        grads = [p.grad.clone() for p in hf.parameters()]
        assert all(g is not None for g in grads)
        return loss, grads, logits, {{k: after[k] - before[k] for k in after}}

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    def compare(model_type, kind, grain, **tiled):
        loss, grads, logits, untiled_tiles = run(model_type, kind, grain)
        t_loss, t_grads, t_logits, tiles = run(model_type, kind, grain, **tiled)
        # Relative to each tensor's largest gradient, but at least a
        # thousandth of the model's (a nearly vanishing gradient is noise).
        scale = max(g.abs().max() for g in grads)
        worst_grad = max(((a - b).abs().max() / torch.maximum(b.abs().max(), 1e-3 * scale)).item()
                         for a, b in zip(t_grads, grads))
        return {{"loss": rel(t_loss, loss), "every gradient": worst_grad, "logits": rel(t_logits, logits),
                "untiled tiles": untiled_tiles, "tiles": tiles}}

    # Auto: a budget of a 4-token tile (three 4 x width fp32 tensors per row).
    cases = {{
        "padding, layer grain, tile 5 (model)": ("padding", "layer", dict(model_tile=5)),
        "padding, stage grain, tile 5 (model)": ("padding", "stage", dict(model_tile=5)),
        "packed, layer grain, tile 4 (call)": ("packed", "layer", dict(call_tile=4)),
        "padding, layer grain, tile 3 (call over model's 8)": ("padding", "layer", dict(model_tile=8, call_tile=3)),
        "padding, layer grain, automatic": ("padding", "layer", dict(budget="auto")),
    }}
    report = {{"devices": get_num_devices()}}
    for model_type in sys.argv[1:]:
        from roundpipe.hf_generic import _mlp_width
        auto_budget = 3 * _mlp_width(hf_tiny.tiny_config(model_type)) * 4 * 4
        out = {{}}
        for name, (kind, grain, tiled) in cases.items():
            if tiled.get("budget") == "auto":
                tiled = dict(budget=auto_budget)
            out[name] = compare(model_type, kind, grain, **tiled)
        report[model_type] = out
    print(json.dumps(report))
''')

MODEL_TYPES = ["llama", "gemma2", "qwen2_moe", "mixtral"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return device_reports(tmp_path_factory, "sequence_tiling", SCRIPT, args=MODEL_TYPES)


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tiled_blocks_match_untiled(reports, model_type, devices):
    report = reports[devices]
    assert report["devices"] == devices
    cases = report[model_type]
    assert len(cases) == 5
    bad = {}
    for name, got in cases.items():
        print(f"{model_type} on {devices} device(s), {name}: loss {got['loss']:.2e}, every gradient "
              f"{got['every gradient']:.2e}, logits {got['logits']:.2e}, tiles {got['tiles']}")
        # The tiled path ran (forward and backward tiles), the untiled one never.
        assert got["untiled tiles"] == {"forward": 0, "backward": 0, "reused": 0}, (name, got)
        assert got["tiles"]["forward"] > 0 and got["tiles"]["backward"] > 0, (name, got)
        assert got["tiles"]["reused"] > 0, (name, got)
        bad.update({f"{name}: {k}": got[k] for k in ("loss", "every gradient", "logits") if not got[k] <= TOLERANCE})
    assert not bad, f"{model_type} on {devices} device(s), tiled differs from untiled: {bad}"


# ---------------------------------------------------------------------------
# Every architecture of the generic preset, its layers run one after the
# other in this process (no engine): tiled against untiled.

def _layers_run(model_type, tile):
    """The loss and every gradient of the generic preset's layers of a tiny
    model, run one after the other with the blocks' tile set to ``tile``."""
    import warnings

    from roundpipe.hf_generic import generic_layers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = hf_tiny.tiny_model(model_type)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # every weight non-zero: a gradient that does not flow shows
        for p in hf.parameters():
            if not p.abs().sum():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    layers = generic_layers(hf)
    layers[0].tile_setting.value = tile
    ids = torch.randint(0, hf_tiny.VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = layers[0](input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    for layer in list(layers)[1:]:
        out = layer(out)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in hf.named_parameters()}


@pytest.mark.parametrize("model_type", sorted(hf_tiny.ARCHITECTURES.keys() | hf_tiny.PRESET_ARCHITECTURES.keys()))
def test_every_architecture_tiles_to_the_untiled_gradients(model_type):
    loss, grads = _layers_run(model_type, None)
    before = tiling.tile_counts()
    tiled_loss, tiled_grads = _layers_run(model_type, 3)
    after = tiling.tile_counts()
    assert after["forward"] > before["forward"] and after["backward"] > before["backward"]
    torch.testing.assert_close(tiled_loss, loss, rtol=TOLERANCE, atol=0)
    scale = max(g.abs().max() for g in grads.values() if g is not None)
    for name, b in grads.items():
        a = tiled_grads[name]
        assert (a is None) == (b is None), name
        if b is not None:
            worst = ((a - b).abs().max() / torch.maximum(b.abs().max(), 1e-3 * scale)).item()
            assert worst <= TOLERANCE, f"{model_type}: {name}'s gradient differs by {worst:.2e}"
