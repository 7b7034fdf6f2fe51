"""Ctrl-C (SIGINT, a real signal) during forward, forward_backward, step,
synchronize and save_checkpoint raises KeyboardInterrupt within a second;
nothing is half-applied and the model is usable afterwards (docs/guide.md,
"6. Errors"). Run in a subprocess, whose signal handling pytest does not
touch."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import json, os, signal, sys, threading, time
    import torch
    import roundpipe
    from roundpipe import RoundPipe, RoundPipeRunConfig

    # Python installs its KeyboardInterrupt handler only where SIGINT was not
    # ignored at start (a background job of a non-interactive shell starts
    # with it ignored): install it, as an interactive session has it.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    class Slow(torch.nn.Module):
        """A linear layer that takes `delay` seconds per microbatch."""
        def __init__(self, delay):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.delay = delay
        def forward(self, x):
            time.sleep(self.delay)
            return self.lin(x)

    def make(delay):
        torch.manual_seed(0)
        net = torch.nn.Sequential(Slow(0.0), Slow(delay), Slow(0.0))
        return net, RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=8))

    def interrupted(fn, after=0.5):
        """Runs fn, sending this process SIGINT after `after` seconds: the
        seconds from the signal to KeyboardInterrupt, or None if none came."""
        sent = []
        timer = threading.Timer(after, lambda: (sent.append(time.monotonic()), os.kill(os.getpid(), signal.SIGINT)))
        timer.start()
        try:
            fn()
        except KeyboardInterrupt:
            return time.monotonic() - sent[0]
        finally:
            timer.join()
        return None

    x, y = torch.randn(8, 4), torch.randn(8, 4)
    loss_fn = torch.nn.functional.mse_loss
    report = {}

    # forward_backward: cancelled, no gradient kept, the next call as a twin's.
    net, model = make(0.3)
    report["forward_backward"] = interrupted(lambda: model.forward_backward((x,), label=y, loss_fn=loss_fn))
    model.synchronize()
    report["forward_backward grads untouched"] = all(p.grad is None for p in net.parameters())
    twin_net, twin = make(0.0)
    a = model.forward_backward((x,), label=y, loss_fn=loss_fn)
    b = twin.forward_backward((x,), label=y, loss_fn=loss_fn)
    model.synchronize(); twin.synchronize()
    report["forward_backward usable"] = bool(torch.equal(a, b)) and all(
        torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), twin_net.parameters()))

    # forward
    net, model = make(0.3)
    with torch.no_grad():
        report["forward"] = interrupted(lambda: model(x))
        report["forward usable"] = bool(torch.allclose(model(x), net(x), rtol=1e-5, atol=1e-6))

    # step (synchronous, slow step_fn) and synchronize (after an async one):
    # the wait stops; the step itself finishes, once.
    net, model = make(0.0)
    steps = []
    def slow_step():
        time.sleep(2.0)
        steps.append(1)
    model.forward_backward((x,), label=y, loss_fn=loss_fn)
    report["step"] = interrupted(lambda: model.step(slow_step, is_async=False))
    model.synchronize()
    report["step ran once"] = len(steps) == 1
    model.step(slow_step)
    report["synchronize"] = interrupted(lambda: model.synchronize())
    model.synchronize()
    report["synchronize step ran once"] = len(steps) == 2

    # save_checkpoint waiting for a slow step: no file is left.
    model.step(slow_step)
    path = sys.argv[1]
    report["save_checkpoint"] = interrupted(lambda: roundpipe.save_checkpoint(path, model))
    report["save_checkpoint left no file"] = not os.path.exists(path)
    model.synchronize()
    roundpipe.save_checkpoint(path, model)
    report["save_checkpoint usable"] = os.path.exists(path)
    print(json.dumps(report))
''')


def test_ctrl_c_interrupts_blocking_calls_cleanly(tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "saved.ckpt")], capture_output=True,
                          text=True, timeout=240, env=dict(os.environ, ROUNDPIPE_DEVICES="cpu:2"))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)
    for call in ("forward_backward", "forward", "step", "synchronize", "save_checkpoint"):
        assert report[call] is not None, f"{call}: no KeyboardInterrupt"
        assert report[call] < 1.0, f"{call}: KeyboardInterrupt {report[call]:.2f} s after the signal"
    bad = [k for k, v in report.items() if v is False]
    assert not bad, bad
