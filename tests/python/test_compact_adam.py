"""roundpipe.optim.Adam/AdamW with compact states (state_dtype): the API,
state dict round trips and conversions (from torch.optim.AdamW's fp32 state
and back), bad input, and a short training run tracking fp32 AdamW. And bf16
parameters: the fp32 update stored with the documented stochastic rounding,
on every SIMD path, reproducible and resumable, training like fp32."""
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
    with pytest.raises(ValueError, match=r"parameter 1 \(group 0, position 1\).*complex64.*float32 and bfloat16 "
                                         r"parameters only"):
        rpo.AdamW([params[0], z], state_dtype=torch.bfloat16)
    h = torch.randn(8, dtype=torch.float16, requires_grad=True)
    with pytest.raises(TypeError, match=r"parameter 0 \(group 0, position 0\).*float16"):
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


# ---- bf16 parameters ---------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _lowbias32(x):
    # int64 tensors holding 32-bit values: a product wraps past 2^63, but its
    # low 32 bits, the ones kept, are exact.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def stochastic_bf16(x, seed, step):
    """fp32 `x` rounded to bf16 as kernels.h documents (CompactAdamBuffers::sr_seed),
    with adam.h's seeding: seed = the parameter's index over all groups,
    step = the update's step number, element j = position in the parameter."""
    key = _splitmix64(_splitmix64(seed) ^ step)
    k0, k1 = key & _MASK32, key >> 32
    j = torch.arange(x.numel(), dtype=torch.int64)
    r = _lowbias32(_lowbias32((j & _MASK32) ^ k0) ^ (j >> 32) ^ k1)
    bits = x.detach().reshape(-1).contiguous().view(torch.int32).to(torch.int64) & _MASK32
    top = ((bits + (r >> 16)) >> 16) & 0xFFFF  # the kernel's 32-bit sum wraps
    out = torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16).view(torch.bfloat16)
    out[torch.isnan(x.reshape(-1))] = float("nan")
    return out.reshape(x.shape)


def bf16_params(seed=0):
    return [p.detach().to(torch.bfloat16).requires_grad_() for p in make_params(seed)]


def two_groups(params, **kw):
    return [{"params": params[:2], **kw}, {"params": params[2:], **kw}]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, "int8"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_bf16_params_step_like_fp32_then_documented_rounding(state_dtype, amsgrad):
    if amsgrad and state_dtype == "int8":
        pytest.skip("8-bit states have no amsgrad")
    # The reference: fp32 copies, widened from the bf16 parameters before each
    # step, updated by the fp32-parameter path with the same kind of states,
    # then rounded by the re-implemented hash.
    params = bf16_params()
    copies = [p.detach().float().requires_grad_() for p in params]
    kw = dict(lr=1e-2, amsgrad=amsgrad, state_dtype=state_dtype)
    opt = rpo.AdamW(two_groups(params), **kw)
    ref = rpo.AdamW(two_groups(copies), **kw)
    g = torch.Generator().manual_seed(5)
    for step in range(1, 5):
        for p, c in zip(params, copies):
            grad = (torch.randn(p.shape, generator=g) * 0.1).to(torch.bfloat16)
            p.grad, c.grad = grad, grad.float()
            with torch.no_grad():
                c.copy_(p.float())
        opt.step()
        ref.step()
        for index, (p, c) in enumerate(zip(params, copies)):
            assert p.dtype == torch.bfloat16
            expected = stochastic_bf16(c, index, step)
            assert torch.equal(p.detach().view(torch.int16), expected.view(torch.int16)), (index, step)
            for key, value in ref.state[c].items():
                assert torch.equal(opt.state[p][key], value), (index, step, key)


def test_bf16_param_first_step_rounds_differently_per_index_and_step():
    # Not every element can land on the same neighbour: the hash's bits differ.
    a = torch.full((4096,), 1.0, dtype=torch.bfloat16, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    opt = rpo.Adam([a, b], lr=1e-3)
    a.grad = b.grad = torch.ones_like(a)
    opt.step()
    assert not torch.equal(a, b)  # indices 0 and 1 seed different draws
    moved = (a.detach() != 1.0).float().mean().item()
    assert 0.1 < moved < 0.6  # about 1e-3 / 2^-8 of the elements round down


_ISA_SCRIPT = """
import hashlib, sys, torch
import roundpipe.optim as rpo
torch.set_num_threads(int(sys.argv[2]))
g = torch.Generator().manual_seed(7)
params = [torch.randn(s, generator=g).to(torch.bfloat16).requires_grad_() for s in [(300, 257), (4096,), (33,)]]
opt = rpo.AdamW(params, lr=1e-2, state_dtype={state_dtype!r})
for _ in range(4):
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 0.1).to(torch.bfloat16)
    opt.step()
h = hashlib.sha256()
for p in params:
    h.update(p.detach().view(torch.int16).numpy().tobytes())
    for k, v in sorted(opt.state[p].items()):
        h.update(k.encode()); h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
print(_C_isa(), h.hexdigest())
"""


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_bf16_params_bitwise_equal_on_every_simd_path_and_thread_count(state_dtype):
    import os
    import subprocess
    import sys
    script = _ISA_SCRIPT.format(state_dtype=state_dtype).replace(
        "_C_isa()", "__import__('roundpipe')._C.simd_isa()")
    results = {}
    for isa in ("scalar", "avx2", "avx512"):
        for threads in (1, 2):
            env = dict(os.environ, ROUNDPIPE_SIMD=isa)
            out = subprocess.run([sys.executable, "-c", script, isa, str(threads)], env=env,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                assert "not supported" in out.stderr or "unsupported" in out.stderr, out.stderr
                continue
            ran, digest = out.stdout.split()
            assert ran == isa
            results[(isa, threads)] = digest
    assert ("scalar", 1) in results and len(results) >= 2
    assert len(set(results.values())) == 1, results


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, "int8"])
def test_updates_far_below_half_an_ulp_move_bf16_params_on_average(state_dtype):
    # Adam's step is about lr = 1e-4 per element (constant gradient), while a
    # bf16 ulp below 1 is 2^-8: round to nearest would never move the
    # parameter; stochastic rounding follows the fp32 trajectory on average.
    fp32 = torch.ones(4096, requires_grad=True)
    bf16 = torch.ones(4096, dtype=torch.bfloat16, requires_grad=True)
    ref, opt = rpo.Adam([fp32], lr=1e-4), rpo.Adam([bf16], lr=1e-4, state_dtype=state_dtype)
    for _ in range(200):
        fp32.grad, bf16.grad = torch.ones(4096), torch.ones(4096, dtype=torch.bfloat16)
        ref.step()
        opt.step()
    drift = 1.0 - fp32.detach().mean().item()
    got = 1.0 - bf16.detach().float().mean().item()
    assert drift > 0.015
    assert abs(got - drift) < 0.1 * drift


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, "int8"])
def test_bf16_params_repeat_and_resume_bitwise(state_dtype):
    def grads(step):
        g = torch.Generator().manual_seed(100 + step)
        return [(torch.randn(s, generator=g) * 0.1).to(torch.bfloat16) for s in SHAPES]

    def steps(opt, params, first, last):
        for step in range(first, last):
            for p, grad in zip(params, grads(step)):
                p.grad = grad.clone()
            opt.step()

    a, b = bf16_params(), bf16_params()
    oa, ob = rpo.AdamW(two_groups(a), lr=1e-2, state_dtype=state_dtype), \
        rpo.AdamW(two_groups(b), lr=1e-2, state_dtype=state_dtype)
    steps(oa, a, 0, 6)
    steps(ob, b, 0, 6)
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    c = bf16_params()
    oc = rpo.AdamW(two_groups(c), lr=1e-2, state_dtype=state_dtype)
    steps(oc, c, 0, 3)
    saved = copy.deepcopy(oc.state_dict())
    d = [p.detach().clone().requires_grad_() for p in c]
    od = rpo.AdamW(two_groups(d), lr=1e-2, state_dtype=state_dtype)
    od.load_state_dict(saved)
    steps(od, d, 3, 6)
    for x, y in zip(a, d):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    for x, y in zip(a, d):
        for key, value in oa.state[x].items():
            assert torch.equal(od.state[y][key], value), key


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, "int8"])
def test_bf16_param_regression_tracks_torch_adamw(state_dtype):
    # Least squares with a 64 x 64 weight (4096 elements: 8-bit states apply);
    # the loss in fp32 from the widened weight, so the bf16 weight gets a bf16
    # gradient.
    torch.manual_seed(2)
    x = torch.randn(256, 64)
    y = x @ (torch.randn(64, 64) * 0.5)
    init = torch.randn(64, 64) * 0.1

    def train(w, opt):
        for _ in range(100):
            loss = torch.nn.functional.mse_loss(x @ w.float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return loss.item()

    w32 = init.clone().requires_grad_()
    ref = train(w32, torch.optim.AdamW([w32], lr=1e-2))
    first = torch.nn.functional.mse_loss(x @ init, y).item()
    assert ref < 0.7 * first
    w16 = init.to(torch.bfloat16).requires_grad_()
    got = train(w16, rpo.AdamW([w16], lr=1e-2, state_dtype=state_dtype))
    assert w16.dtype == torch.bfloat16 and w16.grad.dtype == torch.bfloat16
    assert abs(got - ref) <= 0.03 * ref


@pytest.mark.parametrize("cls", [rpo.Adam, rpo.AdamW, rpo.Adam8bit, rpo.AdamW8bit])
def test_bf16_params_accepted_by_every_adam_class(cls):
    params = bf16_params()
    opt = cls(params, lr=1e-2)
    before = [p.detach().clone() for p in params]
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, dtype=torch.bfloat16) * 0.1
        opt.step()
    for p, b in zip(params, before):
        assert p.dtype == torch.bfloat16 and not torch.equal(p, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.complex128])
@pytest.mark.parametrize("cls", [rpo.Adam, rpo.AdamW8bit])
def test_other_param_dtypes_are_a_type_error_naming_the_parameter(cls, dtype):
    params = make_params()
    bad = torch.randn(8).to(dtype).requires_grad_()
    with pytest.raises(TypeError, match=rf"{cls.__name__}: parameter 3 \(group 1, position 1\).*{dtype}.*"
                                        r"accepted: torch.float32, torch.bfloat16"):
        cls([{"params": params[:2]}, {"params": [params[2], bad]}])


def test_sgd_refuses_bf16_params_naming_them():
    a = torch.randn(8, requires_grad=True)
    b = torch.randn(8, dtype=torch.bfloat16, requires_grad=True)
    opt = rpo.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    with pytest.raises(TypeError, match=r"SGD: parameter 1 \(group 1, position 0\).*bfloat16.*Adam"):
        opt.step()
    assert torch.equal(a.grad, torch.ones_like(a))
