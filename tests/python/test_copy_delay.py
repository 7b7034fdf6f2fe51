"""CPU devices with delayed copies (ROUNDPIPE_CPU_COPY_DELAY_US): every copy
completes late and reads as NaN until it has, so any read without its fence
changes a result. The same script runs with and without the delay, on one and
three devices, and must produce bitwise the same numbers: forward() results,
forward() followed by loss.backward(), a LoRA-like model with a frozen head,
save_for_recompute data, fused and recomputed plans, several steps."""
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import sys, torch
from torch import nn
import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig, ModelExecutePlan, OptimizerCtx

class Saving(nn.Module):
    # Keeps a device tensor for its recomputation (downloaded, then uploaded).
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
    def forward(self, x):
        if roundpipe.doing_recompute():
            (scale,) = roundpipe.get_recompute_data()
        else:
            scale = x.detach().abs().mean(dim=0)
            roundpipe.save_for_recompute(scale)
        return torch.tanh(self.lin(x)) * scale

torch.manual_seed(0)
results = {}
net = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), Saving(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
head = net[5]
for p in head.parameters():
    p.requires_grad_(False)  # frozen head: the last stage downloads no gradient
model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=3))
with OptimizerCtx():
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
plans = [None, ModelExecutePlan([range(0, 2), range(2, 4)], [range(4, 6), range(2, 4), range(0, 2)])]
x, y = torch.randn(12, 16), torch.randn(12, 4)
for step in range(4):
    cfg = RoundPipeRunConfig(execute_plan=plans[step % 2]) if plans[step % 2] else None
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss, run_config=cfg)
    results[f"loss{step}"] = loss.detach().clone()
    model.step(opt.step, is_async=step % 2 == 1)
model.synchronize()
with torch.no_grad():
    results["forward"] = model(x).clone()
xg = x.clone().requires_grad_(True)
out = model(xg)
out.square().sum().backward()
results["input_grad"] = xg.grad.clone()
model.synchronize()
for name, p in net.named_parameters():
    results["param." + name] = p.detach().clone()
    if p.grad is not None:
        results["grad." + name] = p.grad.detach().clone()
torch.save(results, sys.argv[1])
print("done")
"""


def run(tmp_path, devices, delay_us):
    out = tmp_path / f"{devices}-{delay_us}.pt"
    env = dict(os.environ, ROUNDPIPE_DEVICES=devices, ROUNDPIPE_CPU_COPY_DELAY_US=str(delay_us))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:3"])
def test_delayed_copies_give_bitwise_the_same_results(tmp_path, devices):
    prompt = run(tmp_path, devices, 0)
    delayed = run(tmp_path, devices, 300)
    assert prompt.keys() == delayed.keys()
    assert any(k.startswith("grad.") for k in prompt) and "input_grad" in prompt
    for key, value in prompt.items():
        assert torch.isfinite(value).all(), key
        assert torch.equal(value, delayed[key]), key


def test_a_bad_copy_delay_is_a_clear_error():
    env = dict(os.environ, ROUNDPIPE_DEVICES="cpu:1", ROUNDPIPE_CPU_COPY_DELAY_US="fast")
    done = subprocess.run([sys.executable, "-c", "import roundpipe; roundpipe.get_num_devices()"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "ROUNDPIPE_CPU_COPY_DELAY_US='fast'" in done.stderr and "microseconds" in done.stderr, done.stderr
