"""B9: the pipeline on the real engine (BENCHMARKS.md).

CPU devices whose layers compute by sleeping (forward F = 4 ms, backward 2F,
recomputation sleeps again), as a GPU kernel keeps a device busy without a
host core; 16 layers of one Linear(64, 64); M = 9 at every D; copies 500 us
late; asynchronous Adam steps; default settings except preserve_rng_state
=False (as BENCHMARKS.md defines B9). D = 1, 2, 4, 8, each in a
process of its own (the device pool is fixed at first use). Three models: no
buffers, a constant buffer in the first layer (as rotary embeddings), a
buffer written in forward (as BatchNorm's running statistics); and the plain
model with the random-state replay left on ("keyed").

efficiency(D) = t(1) / (D x t(D)) per iteration, t the median time between
the returns of successive forward_backward calls after 3 warm-up iterations.

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
WARMUP, MEASURED = 3, 5
MODELS = ("plain", "const_buffer", "written_buffer", "plain_keyed")


def child(models):
    import torch
    from torch import nn
    from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig

    torch.set_num_threads(1)

    class SleepBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(2 * F)
            return g

    class Sleeping(nn.Module):
        def __init__(self, buffer=None):
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)
            self.buffer = buffer
            if buffer is not None:
                self.register_buffer("table", torch.zeros(WIDTH))

        def forward(self, x):
            time.sleep(F)
            if self.buffer == "written":
                with torch.no_grad():
                    self.table.mul_(0.9).add_(0.1 * x.mean(0))
            if self.buffer is not None:
                x = x + 0 * self.table
            return SleepBackward.apply(self.lin(x))

    out = {}
    for name in models:
        torch.manual_seed(0)
        buffer = {"const_buffer": "const", "written_buffer": "written"}.get(name)
        net = nn.Sequential(Sleeping(buffer), *[Sleeping() for _ in range(LAYERS - 1)])
        cfg = RoundPipeRunConfig(num_microbatch=M, preserve_rng_state=(name == "plain_keyed"))
        model = RoundPipe(net, model_run_config=cfg, name=name)
        with OptimizerCtx():
            opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
        returns = []
        for _ in range(WARMUP + MEASURED + 1):
            model.forward_backward(input_args=(x,), label=y, loss_fn=nn.functional.mse_loss)
            returns.append(time.perf_counter())
            model.step(lambda: (opt.step(), opt.zero_grad()))
        model.synchronize()
        gaps = [b - a for a, b in zip(returns[WARMUP:], returns[WARMUP + 1:])]
        out[name] = 1000 * statistics.median(gaps)
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
    print("targets (BENCHMARKS.md): eff_d8_plain, eff_d8_const_buffer, eff_d8_written_buffer >= 0.90: " +
          ("met" if min(effs[n] for n in MODELS[:3]) >= 0.90 else "NOT met") +
          f"; eff_d8_plain_keyed {effs['plain_keyed']:.3f}")
    print("RESULT id=B9 " + " ".join(keys))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2].split(","))
    else:
        main()
