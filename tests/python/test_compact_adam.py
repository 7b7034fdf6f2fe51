"""roundpipe.optim.Adam/AdamW with compact states (state_dtype): the API,
state dict round trips and conversions (from torch.optim.AdamW's fp32 state
and back), bad input, and a short training run tracking fp32 AdamW."""
import copy

import pytest
import torch

import roundpipe.optim as rpo
from roundpipe import _C

SHAPES = [(64, 80), (4096,), (300,), (5,)]  # 8-bit applies to the first two


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def run(opt, params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 0.1
        opt.step()


@pytest.mark.parametrize("state_dtype,expected", [(torch.bfloat16, torch.bfloat16), ("bfloat16", torch.bfloat16),
                                                  ("int8", torch.uint8), ("blockwise8", torch.uint8)])
def test_state_layout(state_dtype, expected):
    params = make_params()
    opt = rpo.AdamW(params, lr=1e-2, state_dtype=state_dtype)
    run(opt, params, 2)
    for p in params:
        s = opt.state[p]
        big = p.numel() >= _C.adam_min_blockwise8_numel
        want = expected if expected == torch.bfloat16 or big else torch.float32
        assert s["exp_avg"].dtype == want and s["exp_avg_sq"].dtype == want
        assert s["exp_avg"].shape == p.shape
        if want == torch.uint8:
            assert s["exp_avg_absmax"].dtype == torch.float32
            assert s["exp_avg_absmax"].numel() == (p.numel() + 255) // 256
            assert s["exp_avg_sq_absmax"].numel() == (p.numel() + 255) // 256
        else:
            assert "exp_avg_absmax" not in s
        assert s["step"].item() == 2


def test_convenience_classes_and_defaults():
    params = make_params()
    assert rpo.AdamW(params).param_groups[0]["state_dtype"] == "float32"
    assert rpo.AdamW(params, state_dtype=torch.float32).param_groups[0]["state_dtype"] == "float32"
    assert rpo.AdamW8bit(params).param_groups[0]["state_dtype"] == "int8"
    assert rpo.Adam8bit(params).param_groups[0]["decoupled_weight_decay"] is False
    opt = rpo.AdamW([{"params": params[:1], "state_dtype": torch.bfloat16}, {"params": params[1:]}],
                    state_dtype="int8")
    assert [g["state_dtype"] for g in opt.param_groups] == ["bfloat16", "int8"]


def test_fp32_state_dtype_is_bitwise_the_default():
    a, b = make_params(), make_params()
    oa, ob = rpo.AdamW(a, lr=1e-2), rpo.AdamW(b, lr=1e-2, state_dtype=torch.float32)
    run(oa, a, 3)
    run(ob, b, 3)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_state_dict_round_trip_is_bitwise(state_dtype):
    a = make_params()
    oa = rpo.AdamW(a, lr=1e-2, state_dtype=state_dtype)
    run(oa, a, 3)
    saved = copy.deepcopy(oa.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    ob = rpo.AdamW(b, lr=1e-2, state_dtype=state_dtype)
    ob.load_state_dict(saved)
    for x, y in zip(a, b):
        for key, value in oa.state[x].items():
            assert ob.state[y][key].dtype == value.dtype, key
            assert torch.equal(ob.state[y][key], value), key
    run(oa, a, 2, seed=5)
    run(ob, b, 2, seed=5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_converts_torch_adamw_state_and_back(state_dtype):
    params = make_params()
    ref = torch.optim.AdamW(params, lr=1e-2)
    run(ref, params, 3)
    compact_params = [p.detach().clone().requires_grad_() for p in params]
    opt = rpo.AdamW(compact_params, lr=1e-2, state_dtype=state_dtype)
    opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["state_dtype"] == ("bfloat16" if state_dtype == torch.bfloat16 else "int8")
    smap, umap = _C.blockwise8_map(True), _C.blockwise8_map(False)
    for p, q in zip(params, compact_params):
        r, s = ref.state[p], opt.state[q]
        if s["exp_avg"].dtype == torch.bfloat16:
            assert torch.equal(s["exp_avg"], r["exp_avg"].to(torch.bfloat16))
            assert torch.equal(s["exp_avg_sq"], r["exp_avg_sq"].to(torch.bfloat16))
        elif s["exp_avg"].dtype == torch.uint8:
            for key, amax, m in (("exp_avg", "exp_avg_absmax", smap), ("exp_avg_sq", "exp_avg_sq_absmax", umap)):
                scale = s[amax].repeat_interleave(256)[:q.numel()]
                back = (m[s[key].reshape(-1).long()] * scale).reshape(q.shape)
                # Within the widest gap of the map times the block's absmax (the
                # signed map has no -1, so -absmax itself is off by half a gap).
                tol = float((m[1:] - m[:-1]).max()) * scale.reshape(q.shape)
                assert ((back - r[key]).abs() <= tol).all(), key
        else:
            assert torch.equal(s["exp_avg"], r["exp_avg"])
    # Back into torch.optim.AdamW: the widened states, fp32.
    back_params = [p.detach().clone().requires_grad_() for p in compact_params]
    back = torch.optim.AdamW(back_params, lr=1e-2)
    fp32 = rpo.AdamW(back_params, lr=1e-2)
    fp32.load_state_dict(opt.state_dict())
    for q, b in zip(compact_params, back_params):
        assert fp32.state[b]["exp_avg"].dtype == torch.float32
        assert "exp_avg_absmax" not in fp32.state[b]
        if opt.state[q]["exp_avg"].dtype == torch.bfloat16:
            assert torch.equal(fp32.state[b]["exp_avg"], opt.state[q]["exp_avg"].float())
    back.load_state_dict(fp32.state_dict())
    run(back, back_params, 1)


def test_bad_state_dtypes_and_params():
    params = make_params()
    for bad in (torch.float16, "fp8", torch.int8, 8):
        with pytest.raises(ValueError, match=r"invalid state_dtype.*torch.bfloat16.*'int8'"):
            rpo.AdamW(params, state_dtype=bad)
    with pytest.raises(ValueError, match="amsgrad is not supported with state_dtype='int8'"):
        rpo.Adam(params, amsgrad=True, state_dtype="int8")
    z = torch.randn(4096, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match=r"parameter 1 of group 0 .*complex64.*float32 parameters only"):
        rpo.AdamW([params[0], z], state_dtype=torch.bfloat16)
    h = torch.randn(8, dtype=torch.float16, requires_grad=True)
    with pytest.raises(ValueError, match=r"parameter 0 of group 0 .*float16"):
        rpo.AdamW8bit([h])
    # A state of the wrong size names the parameter and the tensor.
    opt = rpo.AdamW8bit(params)
    run(opt, params, 1)
    bad = opt.state_dict()
    bad["state"][1]["exp_avg_absmax"] = torch.zeros(3)
    fresh = rpo.AdamW8bit([p.detach().clone().requires_grad_() for p in params])
    with pytest.raises(ValueError, match=r"AdamW8bit: parameter 1 \(group 0, position 1\).*'exp_avg_absmax' has 3"):
        fresh.load_state_dict(bad)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, "int8"])
def test_training_tracks_fp32_adamw(state_dtype):
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    y = torch.tanh(x @ torch.randn(64, 64)) @ torch.randn(64, 1)

    def train(**kw):
        torch.manual_seed(1)
        net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64),
                                  torch.nn.Tanh(), torch.nn.Linear(64, 1))
        opt = rpo.AdamW(net.parameters(), lr=3e-3, **kw)
        losses = []
        for i in range(150):
            idx = slice((i * 64) % 512, (i * 64) % 512 + 64)
            loss = torch.nn.functional.mse_loss(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return sum(losses[-20:]) / 20, losses[0]

    ref, first = train()
    got, _ = train(state_dtype=state_dtype)
    assert ref < 0.5 * first
    assert abs(got - ref) <= 0.05 * ref + 1e-3
