"""B11 (docs/guide.md): the pipeline on Hugging Face architectures.

Tiny Mistral-, Gemma 3- and DeepSeek-V3-shaped models of 16 decoder blocks
(tests/python/hf_tiny.py's configs), fp32, through wrap_model_to_roundpipe
with default settings except preserve_rng_state=False (as B9), M = 9, on CPU
devices whose decoder blocks "compute" by sleeping as B9's layers do:
each block's forward sleeps F = 4 ms after its own (tiny) math, its backward
2F, recomputation sleeps again; copies 500 us late
(ROUNDPIPE_CPU_COPY_DELAY_US=500). D = 1 and D = 4, each in a process of its
own. The same models through AutoRoundPipe (wrap_model_to_roundpipe with
use_sequential_preset=False) beside them.

Protocol (B9's): each iteration is forward_backward then an asynchronous
step of roundpipe.optim.Adam (lr 1e-4); t is the median wall time of one
iteration over 5 iterations after 2 warm-up ones; efficiency(D) =
t(1) / (D x t(D)).

    python bench/b11_hf_pipeline.py            prints RESULT id=B11 ...
"""
import json
import os
import statistics
import subprocess
import sys
import time

F = 0.004
BLOCKS, M, ROWS, LENGTH = 16, 9, 9, 16
WARMUP, MEASURED = 2, 5
ARCHITECTURES = {"mistral": "mistral", "gemma3": "gemma3_text", "deepseek_v3": "deepseek_v3"}
PATHS = ("preset", "auto")


def child(paths):
    import warnings

    import torch
    from roundpipe import OptimizerCtx, RoundPipeRunConfig, wrap_model_to_roundpipe
    from roundpipe.optim import Adam

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
    import hf_tiny

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    from sleep_backward import sleep_backward

    SleepBackward = sleep_backward(2 * F)

    def sleeping(cls):
        def forward(self, *args, **kwargs):
            out = cls.forward(self, *args, **kwargs)
            time.sleep(F)
            if isinstance(out, tuple):
                return (SleepBackward.apply(out[0]),) + out[1:]
            return SleepBackward.apply(out)
        return type("Sleeping" + cls.__name__, (cls,), {"forward": forward})

    out = {}
    for name, model_type in ARCHITECTURES.items():
        for path in paths:
            fields = {"num_hidden_layers": BLOCKS}
            if model_type == "gemma3_text":
                fields["layer_types"] = ["sliding_attention", "full_attention"] * (BLOCKS // 2)
            hf = hf_tiny.tiny_model(model_type, **fields)
            blocks = hf.base_model.layers
            for block in blocks:
                block.__class__ = sleeping(type(block))
            config = RoundPipeRunConfig(num_microbatch=M, preserve_rng_state=False)
            model = wrap_model_to_roundpipe(hf, use_sequential_preset=(path == "preset"),
                                            model_run_config=config, name=f"{name}-{path}")
            with OptimizerCtx():
                opt = Adam(model.parameters(), lr=1e-4)
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, hf_tiny.VOCAB, (ROWS, LENGTH), generator=g)
            kwargs = {"input_ids": ids, "labels": ids}
            iterations = []
            for _ in range(WARMUP + MEASURED):
                start = time.perf_counter()
                model.forward_backward(input_kwargs=kwargs, loss_fn=lambda o, _: o.loss)
                model.step(lambda: (opt.step(), opt.zero_grad()))
                iterations.append(time.perf_counter() - start)
            model.synchronize()
            out[f"{name}_{path}"] = 1000 * statistics.median(iterations[WARMUP:])
    print("B11CHILD " + json.dumps(out))


def main():
    ms = {}
    for d in (1, 4):
        env = dict(os.environ, ROUNDPIPE_DEVICES=f"cpu:{d}", ROUNDPIPE_CPU_COPY_DELAY_US="500")
        run = subprocess.run([sys.executable, __file__, "--child", ",".join(PATHS)], env=env,
                             capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"B11: the run on {d} devices failed:\n{run.stderr[-3000:]}")
        line = [l for l in run.stdout.splitlines() if l.startswith("B11CHILD ")][-1]
        ms[d] = json.loads(line[len("B11CHILD "):])
        print(f"D={d}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms[d].items()), flush=True)
    keys, effs = [], {}
    for name in ARCHITECTURES:
        for path in PATHS:
            key = f"{name}_{path}"
            effs[key] = ms[1][key] / (4 * ms[4][key])
        keys.append(f"eff_d4_{name}={effs[name + '_preset']:.3f}")
        keys.append(f"eff_d4_auto_{name}={effs[name + '_auto']:.3f}")
        for d in (1, 4):
            keys.append(f"ms_d{d}_{name}={ms[d][name + '_preset']:.1f}")
            keys.append(f"ms_d{d}_auto_{name}={ms[d][name + '_auto']:.1f}")
    met = min(effs[n + "_preset"] for n in ARCHITECTURES) >= 0.85
    print("target (docs/guide.md): eff_d4_mistral, eff_d4_gemma3, eff_d4_deepseek_v3 >= 0.85: " +
          ("met" if met else "NOT met"))
    print("RESULT id=B11 " + " ".join(keys))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2].split(","))
    else:
        main()
