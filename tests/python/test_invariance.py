"""Bitwise device-count invariance (with a fixed num_microbatch, results do
not depend on the number of devices): the same training, dropout on, in
separate processes with ROUNDPIPE_DEVICES=cpu:1, cpu:2, cpu:4."""
import os
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, {tests!r})
    import roundpipe
    from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
    from models import mse_loss_fn, value_model
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = value_model(dropout=0.3)
    assert net.training and net[1].drop.p == 0.3
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    with OptimizerCtx():
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)
        losses.append(model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(4)))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    torch.save({{"losses": losses, "state": net.state_dict(), "devices": roundpipe.get_num_devices()}}, sys.argv[1])
''')


def test_bitwise_identical_for_1_2_4_devices(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    results = {}
    for n in (1, 2, 4):
        out = tmp_path / f"result{n}.pt"
        env = dict(os.environ, ROUNDPIPE_DEVICES=f"cpu:{n}")
        subprocess.run([sys.executable, str(script), str(out)], env=env, check=True, timeout=240)
        results[n] = torch.load(out)
        assert results[n]["devices"] == n
    base = results[1]
    for n in (2, 4):
        for a, b in zip(base["losses"], results[n]["losses"]):
            assert torch.equal(a, b), f"cpu:{n} loss {b} != cpu:1 loss {a}"
        for name, t in base["state"].items():
            assert torch.equal(t, results[n]["state"][name]), f"cpu:{n}: {name} differs"
