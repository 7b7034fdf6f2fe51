"""Iteration overlap with buffers (docs/guide.md, "3. A training loop"): the
Hugging Face presets (whose rotary embedding holds a constant buffer),
BatchNorm in train mode and a counter buffer train bitwise as without overlap,
on 1 and 3 CPU devices with copies 200 us late (NaN until their fence). A
buffer no layer writes is never downloaded (the trace shows no write-back of
it, so nothing waits for one); a buffer written from some call on is
downloaded from that call on, and every later call sees its value."""
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import sys, torch
from torch import nn
sys.path.insert(0, sys.argv[1])
import hf_models
from models import Counter
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe

torch.set_num_threads(1)

def small(kind):
    torch.manual_seed(0)
    extra = nn.BatchNorm1d(16) if kind == "batchnorm" else Counter()
    return nn.Sequential(nn.Linear(16, 16), extra, nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

def train(kind, overlap, steps=4):
    cfg = RoundPipeRunConfig(num_microbatch=3)
    if kind in hf_models.FAMILIES:
        model = wrap_model_to_roundpipe(hf_models.model(kind), model_run_config=cfg, overlap_iterations=overlap)
    else:
        model = RoundPipe(small(kind), model_run_config=cfg, overlap_iterations=overlap)
    with OptimizerCtx():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(steps):
        if kind in hf_models.FAMILIES:
            ids, mask, labels = hf_models.batch(seed=i, rows=6, length=12)
            loss = model.forward_backward(input_kwargs={"input_ids": ids, "attention_mask": mask, "labels": labels},
                                          loss_fn=lambda out, _: out.loss)
        else:
            g = torch.Generator().manual_seed(i)
            loss = model.forward_backward(input_args=(torch.randn(6, 16, generator=g),),
                                          label=torch.randn(6, 4, generator=g), loss_fn=nn.functional.mse_loss)
        losses.append(loss.detach().clone())
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

bad = []
for kind in sys.argv[2].split(","):
    (l0, s0), (l1, s1) = train(kind, False), train(kind, True)
    if not all(torch.equal(a, b) for a, b in zip(l0, l1)):
        bad.append(f"{kind}: losses {l0} vs {l1}")
    for k in s0:
        if not torch.equal(s0[k], s1[k]):
            bad.append(f"{kind}: {k}")
    if kind == "counter" and s1["model.1.calls"].item() != 4 * 3:
        bad.append(f"counter counted {s1['model.1.calls'].item()} microbatches, not 12")
print("\n".join(bad) if bad else "BITWISE")
"""


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("kinds", ["batchnorm,counter", "llama,qwen3", "qwen3_moe,gpt_oss"])
def test_overlap_with_buffers_is_bitwise_the_training_without(devices, kinds):
    env = dict(os.environ, ROUNDPIPE_DEVICES=f"cpu:{devices}", ROUNDPIPE_CPU_COPY_DELAY_US="200")
    out = subprocess.run([sys.executable, "-c", SCRIPT, os.path.dirname(__file__), kinds], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "BITWISE", out.stdout[-3000:]


WATCHED = r"""
import json, os, sys, tempfile, torch
from torch import nn
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig, trace

torch.set_num_threads(1)
CALLS, FIRST_WRITE, M = 6, 3, 3

class Watched(nn.Module):
    # A rotary table it only reads (non-persistent, as transformers'), and a
    # count of the microbatches seen since its inputs grew large, replaced
    # by assignment (a new tensor each time) and read back into the output.
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, 16, 2) / 16.0), persistent=False)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        if x.abs().max() > 50:
            self.seen = self.seen + 1
        return torch.tanh(0.01 * x) * (1 + 0.01 * self.seen) + 0.1 * self.inv_freq.repeat(2)

def train(overlap, path):
    torch.manual_seed(0)
    net = nn.Sequential(Watched(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=M), overlap_iterations=overlap,
                      name="watched")
    with OptimizerCtx():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    trace.start_trace(path)
    for i in range(CALLS):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(6, 16, generator=g) * (100.0 if i >= FIRST_WRITE else 1.0)
        loss = model.forward_backward(input_args=(x,), label=torch.randn(6, 4, generator=g),
                                      loss_fn=nn.functional.mse_loss)
        losses.append(loss.detach().clone())
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    trace.stop_trace()
    events = json.load(open(path))["traceEvents"]
    downloaded = {}
    for e in events:
        if e.get("cat") == "download" and e.get("name", "").startswith("buffers"):
            call = e["args"]["call"]
            downloaded[call] = downloaded.get(call, 0) + e["args"]["bytes"]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return losses, state, buffers, downloaded

bad = []
with tempfile.TemporaryDirectory() as d:
    runs = [train(overlap, os.path.join(d, f"{overlap}.json")) for overlap in (False, True)]
(l0, s0, b0, d0), (l1, s1, b1, d1) = runs
if not all(torch.equal(a, b) for a, b in zip(l0, l1)):
    bad.append(f"losses {l0} vs {l1}")
bad += [f"state {k}" for k in s0 if not torch.equal(s0[k], s1[k])]
bad += [f"buffer {k}" for k in b0 if not torch.equal(b0[k], b1[k])]
expected = {call: 4 for call in range(FIRST_WRITE, CALLS)}  # the count's 4 bytes, never the table's 32
for name, downloaded in (("without overlap", d0), ("with overlap", d1)):
    if downloaded != expected:
        bad.append(f"{name}: buffer bytes downloaded per call {downloaded}, expected {expected}")
if b1["model.0.seen"].item() != (CALLS - FIRST_WRITE) * M:
    bad.append(f"counted {b1['model.0.seen'].item()} microbatches")
print("\n".join(bad) if bad else "EXACT")
"""


@pytest.mark.parametrize("devices", [1, 3])
def test_a_read_only_buffer_is_never_written_back_and_a_written_one_from_its_first_write_on(devices):
    env = dict(os.environ, ROUNDPIPE_DEVICES=f"cpu:{devices}", ROUNDPIPE_CPU_COPY_DELAY_US="200")
    out = subprocess.run([sys.executable, "-c", WATCHED], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "EXACT", out.stdout[-3000:]
