"""Faults around a model, from Python: a save on a full disk is an OSError and
Ctrl-C while the file is written a KeyboardInterrupt (no file, no abort, the
old checkpoint in place, training goes on); calls from inside the model's own
callbacks are errors, not deadlocks; one model driven from two threads
finishes; batches whose parts disagree, a failed synchronous step and the
smaller mistakes of docs/python.md get clear errors or the documented state."""
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import roundpipe
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS)
from models import mse_loss_fn  # noqa: E402


def make(seed=0, width=8):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=3))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return net, model, opt


def train(model, opt, steps=1, is_async=True, width=8):
    for _ in range(steps):
        model.forward_backward((torch.randn(6, width),), label=torch.randn(6, 3), loss_fn=mse_loss_fn(3))
        model.step(lambda: (opt.step(), opt.zero_grad()), is_async=is_async)


def run_script(tmp_path, body, *args):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent('''
        import json, os, resource, signal, sys, threading, time
        import torch
        sys.path.insert(0, {tests!r})
        import roundpipe
        from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
        from models import mse_loss_fn
        signal.signal(signal.SIGINT, signal.default_int_handler)
    ''').format(tests=TESTS) + textwrap.dedent(body))
    done = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, ROUNDPIPE_DEVICES="cpu:2"))
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


FULL_DISK = '''
    d = sys.argv[1]
    path = os.path.join(d, "model.ckpt")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    def train():
        model.forward_backward((torch.randn(4, 512),), label=torch.randn(4, 4), loss_fn=mse_loss_fn(2))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    train()
    roundpipe.save_checkpoint(path, model, optimizer=opt, step=1)
    train()
    # A disk that takes 256 KiB more: writes past it fail with EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, hard))
    report = {}
    try:
        roundpipe.save_checkpoint(path, model, optimizer=opt, step=2)
        report["error"] = None
    except OSError as e:
        report["error"] = [type(e).__name__, e.errno, e.filename, str(e)]
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    report["files"] = sorted(os.listdir(d))
    fresh = RoundPipe(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4)))
    report["old step"] = roundpipe.load_checkpoint(path, fresh)["step"]
    train()  # the model trains on
    model.synchronize()
    report["finite"] = all(bool(p.isfinite().all()) for p in net.parameters())
    roundpipe.save_checkpoint(path, model, optimizer=opt, step=3)
    report["new step"] = roundpipe.load_checkpoint(path, fresh)["step"]
    print(json.dumps(report))
'''


def test_a_full_disk_is_an_oserror_and_loses_nothing(tmp_path):
    d = tmp_path / "ckpts"
    d.mkdir()
    report = run_script(tmp_path, FULL_DISK, d)
    kind, errno, filename, message = report["error"]
    assert kind == "OSError" and errno == 27, report  # EFBIG
    assert filename == str(d / "model.ckpt") and "save_checkpoint" in message, report
    assert report["files"] == ["model.ckpt"], report  # no temporary file left
    assert report["old step"] == 1 and report["finite"] and report["new step"] == 3, report


CTRL_C_WHILE_WRITING = '''
    d = sys.argv[1]
    path = os.path.join(d, "model.ckpt")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with OptimizerCtx():
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    def train():
        model.forward_backward((torch.randn(2, 1024),), label=torch.randn(2, 1024), loss_fn=mse_loss_fn(2))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    train()
    roundpipe.save_checkpoint(path, model, step=1)
    size = os.path.getsize(path)
    train()
    model.synchronize()  # the save below only writes

    def watch():
        """SIGINT once the temporary file holds a third of a checkpoint."""
        while True:
            tmp = [f for f in os.listdir(d) if ".tmp." in f]
            try:
                if tmp and os.path.getsize(os.path.join(d, tmp[0])) > size // 3:
                    os.kill(os.getpid(), signal.SIGINT)
                    return
            except FileNotFoundError:
                pass
            time.sleep(0.001)
    report = {}
    for attempt in range(3):
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            roundpipe.save_checkpoint(path, model, step=2)
            report["interrupted"] = False
        except KeyboardInterrupt:
            report["interrupted"] = True
        watcher.join(timeout=5)
        if report["interrupted"]:
            break
    report["files"] = sorted(os.listdir(d))
    report["old step"] = roundpipe.load_checkpoint(path, model)["step"]
    train()
    roundpipe.save_checkpoint(path, model, step=3)
    report["new step"] = roundpipe.load_checkpoint(path, model)["step"]
    print(json.dumps(report))
'''


def test_ctrl_c_while_the_checkpoint_is_written_is_a_keyboardinterrupt(tmp_path):
    d = tmp_path / "ckpts"
    d.mkdir()
    report = run_script(tmp_path, CTRL_C_WHILE_WRITING, d)
    assert report["interrupted"], report
    assert report["files"] == ["model.ckpt"], report
    assert report["old step"] == 1 and report["new step"] == 3, report


def test_a_symlink_is_written_through(tmp_path):
    net, model, opt = make()
    train(model, opt)
    (tmp_path / "runs").mkdir()
    (tmp_path / "latest.ckpt").symlink_to("runs/a.ckpt")
    roundpipe.save_checkpoint(tmp_path / "latest.ckpt", model, step=5)
    assert (tmp_path / "latest.ckpt").is_symlink()
    assert roundpipe.load_checkpoint(tmp_path / "runs" / "a.ckpt", model)["step"] == 5


# ---- calls from inside callbacks, and two threads ----

@pytest.mark.parametrize("is_async", [False, True])
def test_calls_from_inside_a_step_fn_are_errors_not_deadlocks(tmp_path, is_async):
    net, model, opt = make()
    train(model, opt)
    errors = {}

    def step_fn():
        for name, call in (("save_checkpoint", lambda: roundpipe.save_checkpoint(tmp_path / "x.ckpt", model)),
                           ("synchronize", model.synchronize),
                           ("step", lambda: model.step(lambda: None)),
                           ("forward_backward", lambda: model.forward_backward(
                               (torch.randn(6, 8),), label=torch.randn(6, 3), loss_fn=mse_loss_fn(3))),
                           ("load_state_dict", lambda: model.load_state_dict(net.state_dict())),
                           ("to", lambda: model.to(torch.float64))):
            try:
                call()
                errors[name] = None
            except RuntimeError as e:
                errors[name] = str(e)
        opt.step()
        opt.zero_grad()

    model.forward_backward((torch.randn(6, 8),), label=torch.randn(6, 3), loss_fn=mse_loss_fn(3))
    model.step(step_fn, is_async=is_async)
    model.synchronize()
    for name, error in errors.items():
        assert error is not None, f"{name} from a step_fn did not fail"
        assert "inside the step_fn" in error and "model.step(...) returns" in error, (name, error)
    assert not os.path.exists(tmp_path / "x.ckpt")
    train(model, opt, 2)  # still training
    roundpipe.save_checkpoint(tmp_path / "x.ckpt", model)  # where a save belongs


def test_calls_from_inside_a_loss_fn_are_errors():
    net, model, opt = make()
    seen = []

    def loss_fn(out, y):
        try:
            model.synchronize()
            seen.append(None)
        except RuntimeError as e:
            seen.append(str(e))
        return torch.nn.functional.mse_loss(out, y)

    model.forward_backward((torch.randn(6, 8),), label=torch.randn(6, 3), loss_fn=loss_fn)
    model.synchronize()
    assert len(seen) == 3 and all(s and "inside the loss_fn" in s for s in seen), seen


def test_one_model_from_two_threads_finishes():
    net, model, opt = make()
    steps = []

    def loop():
        for i in range(12):
            model.forward_backward((torch.randn(6, 8),), label=torch.randn(6, 3), loss_fn=mse_loss_fn(3))
            model.step(lambda: (steps.append(1), opt.step(), opt.zero_grad()), is_async=i % 3 != 0)
            if i % 4 == 0:
                model.state_dict()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    model.synchronize()
    assert len(steps) == 24
    assert all(bool(p.isfinite().all()) for p in net.parameters())


# ---- wrong input and failed steps ----

def test_inputs_and_labels_of_different_batch_sizes_are_value_errors():
    net, model, opt = make()
    with pytest.raises(ValueError, match="label has 3 rows .* the inputs has 6"):
        model.forward_backward((torch.randn(6, 8),), label=torch.randn(3, 3), loss_fn=mse_loss_fn(3))

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, a, b):
            return self.lin(a) + b

    pair = RoundPipe(Pair(), model_run_config=RoundPipeRunConfig(num_microbatch=2))
    with pytest.raises(ValueError, match=r"args\[1\] has 5 rows .* args\[0\] has 6"):
        pair.forward_backward((torch.randn(6, 4), torch.randn(5, 4)), label=torch.randn(6, 4),
                              loss_fn=mse_loss_fn(2))
    train(model, opt)  # still usable


def test_a_failed_synchronous_step_leaves_the_last_successful_step():
    net, model, opt = make()
    train(model, opt, 2)  # asynchronous: the model one step behind
    model.forward_backward((torch.randn(6, 8),), label=torch.randn(6, 3), loss_fn=mse_loss_fn(3))
    last = []

    def failing():
        last.extend(p.detach().clone() for p in model.optim_parameters())
        opt.step()
        raise KeyError("the step fails")

    with pytest.raises(KeyError):
        model.step(failing, is_async=False)
    now = [p.detach().clone() for p in net.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(now, last))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), last))


def test_smaller_mistakes_get_clear_errors(tmp_path):
    net, model, opt = make()
    with pytest.raises(TypeError, match="execute_plan must be a roundpipe.ModelExecutePlan, got str"):
        RoundPipeRunConfig(execute_plan="x")
    with pytest.raises(ValueError, match="num_microbatch must be from 1 to"):
        RoundPipeRunConfig(num_microbatch=2**64)
    calls = []

    def mixed(out, y):
        calls.append(1)
        loss = torch.nn.functional.mse_loss(out, y)
        return loss if len(calls) == 1 else [loss]

    with pytest.raises(TypeError, match="loss_fn returned a tensor for some microbatches"):
        model.forward_backward((torch.randn(6, 8),), label=torch.randn(6, 3), loss_fn=mixed)
    # An SGD loading an Adam checkpoint: refused at the load, not at the next step.
    with OptimizerCtx():
        adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    train(model, adam)
    roundpipe.save_checkpoint(tmp_path / "adam.ckpt", model, optimizer=adam)
    with pytest.raises(ValueError, match="state of a Adam optimizer, not of a SGD"):
        roundpipe.load_checkpoint(tmp_path / "adam.ckpt", model, optimizer=opt)
    train(model, opt)


def test_a_load_into_the_wrapped_model_is_not_undone_by_the_next_step():
    net, model, _ = make()
    with OptimizerCtx():
        still = torch.optim.SGD(model.parameters(), lr=0.0)  # steps change nothing
    train(model, still, 2)
    model.synchronize()
    other = {k: torch.full_like(v, 0.5) for k, v in net.state_dict().items()}
    net.load_state_dict(other)  # the wrapped model's own load, not the wrapper's
    with torch.no_grad():
        net[0].weight.add_(-0.375)  # an in-place op
    train(model, still, 2)
    model.synchronize()
    assert torch.equal(net[0].weight, torch.full_like(net[0].weight, 0.125))
    assert all(torch.equal(v, other[k]) for k, v in net.state_dict().items() if k != "0.weight")
