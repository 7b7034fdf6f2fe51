"""B8 (docs/guide.md): a model too big for a 24 GiB GPU, trained on one:
a decoder with Qwen3-4B shapes (36 layers, hidden 2560, 32 heads / 8 kv
heads, MLP 9728, vocab 151936), random weights, bf16 model with fp32 AdamW
copies on the host, full fine-tune, sequences of 2048 tokens, on a GPU capped
to 24 GiB with torch.cuda.set_per_process_memory_fraction (an RTX 4090's
memory). Measured against the H200's dense bf16 peak, 989 TFLOP/s, counting
model FLOPs as 6 x parameters x tokens (recomputation not counted).

    python bench/b8_big_model.py [--batch 16] [--blocks 1] [--steps 3] [--warmup 1] [--tiny]

No baseline runs beside it (the peak is a constant), so there is nothing to
alternate with; the steps are timed as blocks of --steps iterations that end
when roundpipe's work is done (synchronize(), bench/block_timing.py), as the
comparisons are, since a step returns before its backward stages are done;
with --blocks N the median of N blocks.

--tiny runs a small config (a dry run that works on CPU devices too; its mfu
is against the same peak and means nothing). Without a GPU it runs --tiny.
Prints: RESULT id=B8 tokens_per_s=... mfu=... peak_gpu_gib=... host_gib=...
"""
import argparse
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import roundpipe  # noqa: E402
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig, presets  # noqa: E402
from b5_gpu import qwen3_config, sync  # noqa: E402
from block_timing import Side, alternate_blocks, describe, median  # noqa: E402

PEAK_FLOPS = 989e12  # H200 dense bf16 (docs/guide.md)
CAP_BYTES = 24 * 2**30


def qwen3_4b_shapes(tiny):
    return qwen3_config(hidden=2560, mlp=9728, layers=36, heads=32, kv_heads=8, tiny=tiny)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step (one microbatch each)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; 64 with --tiny)")
    ap.add_argument("--blocks", type=int, default=1, help="timed blocks (the median is reported)")
    ap.add_argument("--steps", type=int, default=3, help="steps per block")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    tiny = args.tiny or not cuda
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_BYTES / total), 0)
    seq = args.seq or (64 if tiny else 2048)
    cfg = qwen3_4b_shapes(tiny)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    tokens = args.batch * seq
    print(f"B8: devices {roundpipe._C.get_device_names()}, torch {torch.__version__}, batch {args.batch} x {seq} "
          f"tokens, {args.warmup} warm-up + {args.blocks} x {args.steps} timed steps, GPU capped to "
          f"{CAP_BYTES / 2**30:.0f} GiB" if cuda else "B8: no GPU: the tiny config on CPU devices", flush=True)

    torch.manual_seed(0)
    t0 = time.perf_counter()
    net = presets.make_decoder(cfg).to(torch.bfloat16)
    n_params = sum(p.numel() for p in net.parameters())
    model = RoundPipe(net, optim_dtype=torch.float32, name="b8",
                      model_run_config=RoundPipeRunConfig(num_microbatch=args.batch))
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    print(f"model built in {time.perf_counter() - t0:.1f} s ({n_params / 1e9:.2f} B parameters)", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses = []

    def step():
        losses.append(float(model.forward_backward(input_args=(ids,), input_kwargs={"labels": labels},
                                                   loss_fn=lambda out, _: out / args.batch)))
        model.step(lambda: (opt.step(), opt.zero_grad()))

    def finish():
        model.synchronize()
        sync(device)

    for _ in range(args.warmup):
        step()
    finish()
    print(describe(args.blocks, args.steps, 0), flush=True)
    blocks = alternate_blocks([Side("roundpipe", step, finish)], rounds=args.blocks, steps=args.steps,
                              warmup_rounds=0)["roundpipe"]
    seconds = median(blocks)
    print(f"losses {[round(x, 4) for x in losses]}; {seconds:.3f} s per step", flush=True)
    peak_reserved = torch.cuda.max_memory_reserved() if cuda else 0
    peak_allocated = torch.cuda.max_memory_allocated() if cuda else 0
    host_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    tokens_per_s = tokens / seconds
    result = {
        "tokens_per_s": f"{tokens_per_s:.0f}",
        "mfu": f"{6 * n_params * tokens_per_s / PEAK_FLOPS:.3f}",
        "peak_gpu_gib": f"{peak_reserved / 2**30:.2f}",
        "peak_allocated_gib": f"{peak_allocated / 2**30:.2f}",
        "host_gib": f"{host_gib:.1f}",
        "params_b": f"{n_params / 1e9:.2f}",
        "batch": args.batch, "seq": seq, "model": "tiny" if tiny else "qwen3-4b",
        "blocks": args.blocks, "steps_per_block": args.steps,
    }
    print("RESULT id=B8 " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
