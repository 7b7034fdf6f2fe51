"""B9: the pipeline on the real engine (docs/guide.md).

CPU devices whose layers compute by sleeping (forward F = 4 ms, backward 2F,
recomputation sleeps again), as a GPU kernel keeps a device busy without a
host core; 16 layers of one Linear(64, 64); M = 9 at every D; copies 500 us
late (ROUNDPIPE_CPU_COPY_DELAY_US=500); default settings except
preserve_rng_state=False (as docs/guide.md defines B9). D = 1, 2, 4, 8, each
in a process of its own (the device pool is fixed at first use). Models: no
buffers ("plain"); a constant buffer in the first layer, persistent and only
read ("const_buffer"); the rotary table of the presets in the first layer,
inv_freq of shape [head_dim / 2] registered with persistent=False as
transformers' rotary embeddings do, only read ("const_buffer_nonpersistent");
a buffer written in forward, as BatchNorm's running statistics
("written_buffer"); and the plain model with the random-state replay left on
("plain_keyed").

Protocol, as a user times a training loop: each iteration is
model.forward_backward(...) then model.step(...) with an asynchronous step
of roundpipe.optim.Adam (lr 1e-4; step_fn = opt.step() then opt.zero_grad());
t is the median wall time of one iteration (the forward_backward call and
the step call, measured from the start of the one to the return of the
other) over 10 iterations after 3 warm-up ones, and efficiency(D) =
t(1) / (D x t(D)).

    python bench/b9_pipeline.py            all of it; prints RESULT id=B9 ...
"""
import json
import os
import statistics
import subprocess
import sys
import time

F = 0.004
LAYERS, WIDTH, M, BATCH = 16, 64, 9, 18
HEAD_DIM = WIDTH  # the rotary table's head dimension
WARMUP, MEASURED = 3, 10
MODELS = ("plain", "const_buffer", "const_buffer_nonpersistent", "written_buffer", "plain_keyed")
BUFFERED = MODELS[:4]  # the rows held to the target


def child(models):
    import torch
    from torch import nn
    from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
    from roundpipe.optim import Adam

    torch.set_num_threads(1)

    from sleep_backward import sleep_backward

    SleepBackward = sleep_backward(2 * F)

    class Sleeping(nn.Module):
        def __init__(self, buffer=None):
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)
            self.buffer = buffer
            if buffer == "rotary":
                inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
                self.register_buffer("inv_freq", inv_freq, persistent=False)
            elif buffer is not None:
                self.register_buffer("table", torch.zeros(WIDTH))

        def forward(self, x):
            time.sleep(F)
            if self.buffer == "written":
                with torch.no_grad():
                    self.table.mul_(0.9).add_(0.1 * x.mean(0))
            if self.buffer == "rotary":
                x = x + 0 * torch.cat((self.inv_freq, self.inv_freq))
            elif self.buffer is not None:
                x = x + 0 * self.table
            return SleepBackward.apply(self.lin(x))

    out = {}
    for name in models:
        torch.manual_seed(0)
        buffer = {"const_buffer": "const", "const_buffer_nonpersistent": "rotary",
                  "written_buffer": "written"}.get(name)
        net = nn.Sequential(Sleeping(buffer), *[Sleeping() for _ in range(LAYERS - 1)])
        cfg = RoundPipeRunConfig(num_microbatch=M, preserve_rng_state=(name == "plain_keyed"))
        model = RoundPipe(net, model_run_config=cfg, name=name)
        with OptimizerCtx():
            opt = Adam(model.parameters(), lr=1e-4)
        x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        iterations = []
        for _ in range(WARMUP + MEASURED):
            start = time.perf_counter()
            model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
            model.step(lambda: (opt.step(), opt.zero_grad()))
            iterations.append(time.perf_counter() - start)
        model.synchronize()
        out[name] = 1000 * statistics.median(iterations[WARMUP:])
    print("B9CHILD " + json.dumps(out))


def main():
    ms = {}
    for d in (1, 2, 4, 8):
        env = dict(os.environ, ROUNDPIPE_DEVICES=f"cpu:{d}", ROUNDPIPE_CPU_COPY_DELAY_US="500")
        run = subprocess.run([sys.executable, __file__, "--child", ",".join(MODELS)], env=env,
                             capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"B9: the run on {d} devices failed:\n{run.stderr[-3000:]}")
        line = [l for l in run.stdout.splitlines() if l.startswith("B9CHILD ")][-1]
        ms[d] = json.loads(line[len("B9CHILD "):])
        print(f"D={d}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms[d].items()), flush=True)
    keys = []
    for name in MODELS:
        for d in (1, 2, 4, 8):
            keys.append(f"ms_d{d}_{name}={ms[d][name]:.2f}")
        speedup = ms[1][name] / ms[8][name]
        keys.append(f"speedup_d8_{name}={speedup:.3f}")
        keys.append(f"eff_d8_{name}={speedup / 8:.3f}")
    effs = {n: ms[1][n] / ms[8][n] / 8 for n in MODELS}
    met = min(effs[n] for n in BUFFERED) >= 0.90
    near = abs(effs["const_buffer_nonpersistent"] - effs["plain"]) <= 0.02
    print("targets (docs/guide.md): eff_d8_plain, eff_d8_const_buffer, "
          "eff_d8_const_buffer_nonpersistent, eff_d8_written_buffer >= 0.90: " + ("met" if met else "NOT met") +
          "; eff_d8_const_buffer_nonpersistent within 0.02 of eff_d8_plain: " + ("met" if near else "NOT met") +
          f"; eff_d8_plain_keyed {effs['plain_keyed']:.3f}")
    print("RESULT id=B9 " + " ".join(keys))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2].split(","))
    else:
        main()
