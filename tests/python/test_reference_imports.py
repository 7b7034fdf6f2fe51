"""Scripts written for the reference implementation import
``roundpipe.models.function`` and ``roundpipe.device``: the loss functions
match transformers' causal-LM loss and plain PyTorch (values and every
gradient), the chunked ones without the full logits, and a training loop
written against those imports runs unchanged on CPU devices."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import roundpipe.models.function as function
from roundpipe.models.function import (ChunkedCompileLinearCrossEntropy, ChunkedCompileLinearForCausalLMLoss,
                                       CompileCrossEntropy, CompileForCausalLMLoss, CompileLinearCrossEntropy)


def test_cross_entropies_are_summed_fp32_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(9, 13, generator=g), torch.randint(13, (9,), generator=g)
    labels[2] = -100
    expected = F.cross_entropy(logits, labels, reduction="sum")
    assert torch.allclose(CompileCrossEntropy(logits, labels, -100), expected)
    h, w, b = torch.randn(9, 5, generator=g), torch.randn(13, 5, generator=g), torch.randn(13, generator=g)
    assert torch.allclose(CompileLinearCrossEntropy(h, w, b, labels, -100),
                          F.cross_entropy(F.linear(h, w, b), labels, reduction="sum"))
    half = CompileCrossEntropy(logits.bfloat16(), labels, -100)
    assert half.dtype == torch.float32


@pytest.mark.parametrize("num_items", [None, 17])
def test_causal_lm_loss_matches_transformers(num_items):
    from transformers.loss.loss_utils import ForCausalLMLoss
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 8, 11, generator=g, requires_grad=True)
    labels = torch.randint(11, (3, 8), generator=g)
    labels[0, :3] = -100
    ours = CompileForCausalLMLoss(logits, labels, 11, num_items_in_batch=num_items)
    (grad,) = torch.autograd.grad(ours, logits)
    theirs = ForCausalLMLoss(logits, labels, 11, num_items_in_batch=num_items)
    (expected,) = torch.autograd.grad(theirs, logits)
    assert torch.allclose(ours, theirs, rtol=1e-6)
    assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_equals_the_full_logits_loss_with_every_gradient(monkeypatch, bias, dtype):
    monkeypatch.setattr(function, "TOKEN_CHUNK_SIZE", 5)  # several chunks, the last one short
    torch.manual_seed(2)
    hidden = torch.randn(2, 9, 8, dtype=dtype, requires_grad=True)
    head = nn.Linear(8, 13, bias=bias).to(dtype)
    labels = torch.randint(13, (2, 9))
    labels[1, 4:7] = -100
    chunked = ChunkedCompileLinearForCausalLMLoss(hidden, head, labels)
    got = torch.autograd.grad(chunked, [hidden, *head.parameters()])
    full = CompileForCausalLMLoss(head(hidden), labels, 13)
    expected = torch.autograd.grad(full, [hidden, *head.parameters()])
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    assert torch.allclose(chunked, full.float(), **tol)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.allclose(a.float(), b.float(), **tol)


def test_chunked_loss_never_holds_the_full_logits(monkeypatch):
    monkeypatch.setattr(function, "TOKEN_CHUNK_SIZE", 4)
    seen = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: seen.append(a[0].shape[0]) or real(*a))
    hidden, head = torch.randn(20, 6, requires_grad=True), nn.Linear(6, 7)
    loss = ChunkedCompileLinearCrossEntropy.apply(hidden, head.weight, head.bias, torch.randint(7, (20,)), -100)
    loss.backward()
    assert seen and max(seen) <= 4


LOOP = textwrap.dedent('''
    import torch
    from torch import nn
    from roundpipe import RoundPipe, RoundPipeRunConfig, OptimizerCtx
    from roundpipe.device import device_list
    from roundpipe.models.function import ChunkedCompileLinearForCausalLMLoss, CompileForCausalLMLoss

    torch.manual_seed(0)
    body = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    head = nn.Linear(16, 50, bias=False)
    reference = [p.detach().clone() for p in [*body.parameters(), *head.parameters()]]
    print("devices", [d.device.type for d in device_list])
    model = RoundPipe(nn.Sequential(*body, head), model_run_config=RoundPipeRunConfig(num_microbatch=len(device_list) + 1))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(50, (6, 10), generator=g)
        loss = model.forward_backward(input_args=(ids,), label=ids,
                                      loss_fn=lambda logits, y: CompileForCausalLMLoss(logits, y, 50))
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
        # The same step in plain PyTorch, the loss computed from the hidden
        # states without the full logits.
        plain_body = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        plain_head = nn.Linear(16, 50, bias=False)
        params = [*plain_body.parameters(), *plain_head.parameters()]
        with torch.no_grad():
            for p, r in zip(params, reference):
                p.copy_(r)
        total = 0
        for rows in torch.tensor_split(torch.arange(6), len(device_list) + 1):
            part = ChunkedCompileLinearForCausalLMLoss(plain_body(ids[rows]), plain_head, ids[rows])
            part.backward()
            total = total + part.detach()
        with torch.no_grad():
            for p, r in zip(params, reference):
                r.sub_(0.1 * p.grad)
        assert torch.allclose(loss, total, rtol=1e-5), (step, loss, total)
    model.synchronize()
    for p, r in zip(model.parameters(), reference):
        assert torch.allclose(p, r, rtol=1e-4, atol=1e-6)
    print("LOOP OK")
''')


def test_a_loop_written_against_the_reference_imports_runs_unchanged():
    env = dict(os.environ, ROUNDPIPE_DEVICES="cpu:2")
    run = subprocess.run([sys.executable, "-c", LOOP], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "devices ['cpu', 'cpu']" in run.stdout and "LOOP OK" in run.stdout
