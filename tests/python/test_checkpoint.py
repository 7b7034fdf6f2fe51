"""Checkpoints (roundpipe.save_checkpoint / load_checkpoint): a resumed run
reproduces the uninterrupted one bitwise, also on another device count (in
separate processes, as test_invariance.py), with dropout and async steps;
damaged files and other architectures are ValueErrors that change nothing."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import mse_loss_fn, value_model  # noqa: E402

SCRIPT = textwrap.dedent('''
    import sys, torch
    sys.path.insert(0, {tests!r})
    import roundpipe
    from roundpipe import RoundPipe, RoundPipeRunConfig
    from models import mse_loss_fn, value_model
    mode, ckpt, out = sys.argv[1:4]
    torch.set_num_threads(1)
    # Another seed when resuming: other initial weights and random streams,
    # which the checkpoint must replace.
    torch.manual_seed(0 if mode == "full" else 5)
    net = value_model(dropout=0.3)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=4))
    opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 8, generator=g), torch.randn(16, 3, generator=g)) for _ in range(8)]
    first = 0
    if mode == "resume":
        info = roundpipe.load_checkpoint(ckpt, model, optimizer=opt)
        assert info["step"] == 4 and info["extra"] == {{"note": "half way"}}, info
        first = 4
    losses = {{}}
    for step in range(first, 8):
        x, y = data[step]
        losses[step] = model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(4))
        model.step(lambda: (opt.step(), opt.zero_grad()))
        if mode == "full" and step == 3:
            roundpipe.save_checkpoint(ckpt, model, optimizer=opt, step=4, extra={{"note": "half way"}})
    model.synchronize()
    torch.save({{"losses": losses, "state": net.state_dict(),
                "copies": [p.detach().clone() for p in model.optim_parameters()],
                "devices": roundpipe.get_num_devices()}}, out)
''')


def test_resume_is_bitwise_identical_on_other_device_counts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    ckpt = tmp_path / "ckpt.pt"

    def run(mode, devices):
        out = tmp_path / f"{mode}{devices}.pt"
        env = dict(os.environ, ROUNDPIPE_DEVICES=f"cpu:{devices}")
        subprocess.run([sys.executable, str(script), mode, str(ckpt), str(out)], env=env, check=True, timeout=240)
        result = torch.load(out)
        assert result["devices"] == devices
        return result

    full = run("full", 2)
    for devices in (1, 3):
        part = run("resume", devices)
        assert sorted(part["losses"]) == [4, 5, 6, 7]
        for step, loss in part["losses"].items():
            assert torch.equal(loss, full["losses"][step]), f"cpu:{devices}: loss of step {step} differs"
        for name, t in full["state"].items():
            assert torch.equal(t, part["state"][name]), f"cpu:{devices}: {name} differs"
        assert len(full["copies"]) == len(part["copies"]) > 0
        for a, b in zip(full["copies"], part["copies"]):
            assert torch.equal(a, b), f"cpu:{devices}: an optimizer copy differs"


def _trained(seed=0):
    torch.manual_seed(seed)
    model = RoundPipe(value_model(), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    opt = roundpipe.optim.SGD(model.optim_parameters(), lr=0.1, momentum=0.9)
    model.forward_backward((torch.randn(8, 8),), label=torch.randn(8, 3), loss_fn=mse_loss_fn(2))
    model.step(lambda: (opt.step(), opt.zero_grad()))
    return model, opt


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_optimizer_scaler_and_extra_round_trip(tmp_path):
    path = tmp_path / "round.ckpt"
    model, opt = _trained()
    scaler = roundpipe.GradScaler(init_scale=128.0, growth_interval=7)
    roundpipe.save_checkpoint(path, model, optimizer=opt, scaler=scaler, step=12, extra={"lr": [1, 2]})
    model.synchronize()

    other, other_opt = _trained(seed=1)
    other_scaler = roundpipe.GradScaler()
    info = roundpipe.load_checkpoint(path, other, optimizer=other_opt, scaler=other_scaler)
    assert info == {"step": 12, "extra": {"lr": [1, 2]}}
    assert other_scaler.get_scale() == 128.0 and other_scaler.get_growth_interval() == 7
    saved, loaded = opt.state_dict(), other_opt.state_dict()
    assert sorted(saved["state"]) == sorted(loaded["state"]) and len(saved["state"]) == len(opt.param_groups[0]["params"])
    for key, a in saved["state"].items():
        b = loaded["state"][key]
        assert sorted(a) == sorted(b), key
        for name in a:
            assert torch.equal(torch.as_tensor(a[name]), torch.as_tensor(b[name])), f"state {key} {name}"
    assert saved["param_groups"] == loaded["param_groups"]
    other.synchronize()
    for name, t in _snapshot(model).items():
        assert torch.equal(t, other.state_dict()[name]), name


def test_damaged_files_and_other_architectures_are_value_errors(tmp_path):
    path = tmp_path / "good.ckpt"
    model, opt = _trained()
    roundpipe.save_checkpoint(path, model, optimizer=opt)
    data = path.read_bytes()

    target, target_opt = _trained(seed=2)
    before = _snapshot(target)
    bad = tmp_path / "bad.ckpt"
    for content in (b"", b"x" * 4000, data[: len(data) // 2], data[:-1],
                    data[:len(data) // 3] + bytes([data[len(data) // 3] ^ 0x5A]) + data[len(data) // 3 + 1:]):
        bad.write_bytes(content)
        with pytest.raises(ValueError, match="not a valid roundpipe checkpoint"):
            roundpipe.load_checkpoint(bad, target, optimizer=target_opt)
    with pytest.raises(ValueError, match="cannot open"):
        roundpipe.load_checkpoint(tmp_path / "absent.ckpt", target)

    torch.manual_seed(3)
    wider = RoundPipe(value_model(width=6))
    with pytest.raises(ValueError, match="shape"):
        roundpipe.load_checkpoint(path, wider)

    no_opt = tmp_path / "no_opt.ckpt"
    roundpipe.save_checkpoint(no_opt, model)
    with pytest.raises(ValueError, match="no optimizer state"):
        roundpipe.load_checkpoint(no_opt, target, optimizer=target_opt)
    for name, t in before.items():
        assert torch.equal(t, target.state_dict()[name]), f"{name} changed by a failed load"
