"""B5 (docs/guide.md): training a decoder with Qwen3-1.7B shapes (28 layers,
hidden 2048, 16 heads / 8 kv heads, MLP 6144, vocab 151936), random weights,
bf16 model with fp32 optimizer copies, sequences of 2048 tokens, on the GPU:
roundpipe against plain PyTorch on the same GPU, in one process:
  (a) with per-layer activation checkpointing (the same recomputation),
  (b) without it (informational).
Plain PyTorch trains fp32 parameters under bf16 autocast with a fused AdamW
on the GPU; roundpipe keeps the model in host memory (bf16), its optimizer
copies in fp32, and runs AdamW on the CPU one step behind.

    python bench/b5_gpu.py [--batch 8] [--blocks 5] [--steps 3] [--warmup 2] [--tiny]

Timing (bench/block_timing.py): roundpipe's steps return before their
backward stages are done, so the sides are timed in alternating blocks of
--steps iterations, each ending when its side's work is done (roundpipe:
synchronize(); torch: the GPU synchronized), median of --blocks blocks.
A block's end waits for what the overlap would have hidden (the last step's
backward and optimizer step), so longer blocks are fairer to roundpipe.
Peak memory comes from a run of each side alone first (--warmup steps, at
least 2 so that the optimizer's states exist), which is also the warm-up.
The torch sides share one model, checkpointing switched per block, so that
two copies of its fp32 state need not fit beside each other.

--tiny runs a small config (a dry run that works on CPU devices too).
Prints a table, then: RESULT id=B5 tokens_per_s=... mfu=... tokens_vs_torch_ckpt=...
tokens_vs_torch=... peak_mem_vs_torch=... tokens_vs_reference=na ...
"""
import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))

import roundpipe  # noqa: E402
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig, presets  # noqa: E402
from reference_decoder import RefConfig, RefDecoder  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from block_timing import Side, alternate_blocks, describe, median  # noqa: E402


PEAK_FLOPS = 989e12  # H200 dense bf16 (docs/guide.md): mfu counts 6 x parameters x tokens


def qwen3_config(hidden, mlp, layers, heads, kv_heads, tiny=False):
    """A Qwen3 decoder config of these shapes (vocab 151936, head_dim 128);
    `tiny`: a small one instead, for a dry run on CPU devices."""
    if tiny:
        hidden, mlp, layers, heads, kv_heads = 128, 384, 4, 4, 2
    c = presets.DecoderConfig()
    c.model_type = "qwen3"
    c.vocab_size = 512 if tiny else 151936
    c.hidden_size, c.intermediate_size, c.num_hidden_layers = hidden, mlp, layers
    c.num_attention_heads, c.num_key_value_heads, c.head_dim = heads, kv_heads, 32 if tiny else 128
    c.rms_norm_eps, c.rope_theta, c.tie_word_embeddings = 1e-6, 1000000.0, True
    c.max_position_embeddings = 40960
    c.loss_chunk_size = 4096
    c.validate()
    return c


def qwen3_1_7b_shapes(tiny):
    return qwen3_config(hidden=2048, mlp=6144, layers=28, heads=16, kv_heads=8, tiny=tiny)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_bytes(device):
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


def reset_peak(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def allocated_bytes(device):
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def warm_up(step, steps, device, finish=None):
    """A side alone: `steps` steps and its finish (the peak-memory run)."""
    for _ in range(steps):
        step()
    if finish is not None:
        finish()
    sync(device)


def make_roundpipe(cfg, ids, labels, args, device):
    """The roundpipe side: (step, finish, n_params, losses, peak bytes of its
    warm-up run alone)."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    net = presets.make_decoder(cfg).to(torch.bfloat16)
    m = args.microbatches or ids.shape[0]
    model = RoundPipe(net, optim_dtype=torch.float32, name="b5",
                      model_run_config=RoundPipeRunConfig(num_microbatch=m))
    with OptimizerCtx():
        opt = roundpipe.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    n_params = sum(p.numel() for p in net.parameters())
    print(f"roundpipe: model built in {time.perf_counter() - t0:.1f} s ({n_params / 1e9:.2f} B parameters)",
          flush=True)
    reset_peak(device)
    losses = []

    def step():
        losses.append(float(model.forward_backward(input_args=(ids,), input_kwargs={"labels": labels},
                                                   loss_fn=lambda out, _: out / m)))
        model.step(lambda: (opt.step(), opt.zero_grad()))

    def finish():
        model.synchronize()
        sync(device)

    warm_up(step, max(args.warmup, 2), device, finish=finish)
    return step, finish, n_params, losses, peak_bytes(device)


def make_torch(cfg, ids, labels, args, device):
    """The torch sides on one model: {checkpoint_layers: step} and the peak
    bytes of each side's warm-up run alone (without what was allocated before)."""
    reset_peak(device)
    before = allocated_bytes(device)
    torch.manual_seed(0)
    if hasattr(torch, "set_default_device"):  # torch >= 2.0: build on the device directly
        with torch.device(device):
            ref = RefDecoder(RefConfig.of(cfg))
    else:
        ref = RefDecoder(RefConfig.of(cfg)).to(device)
    for p in ref.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-5, weight_decay=0.0, **fused)
    dev_ids, dev_labels = ids.to(device), labels.to(device)

    def make_step(checkpoint_layers):
        def step():
            ref.checkpoint_layers = checkpoint_layers
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = ref(dev_ids, dev_labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    steps, peaks = {}, {}
    for ckpt in (True, False):
        steps[ckpt] = make_step(ckpt)
        reset_peak(device)
        warm_up(steps[ckpt], max(args.warmup, 2), device)
        peaks[ckpt] = peak_bytes(device) - before if device.type == "cuda" else 0
    return steps, peaks


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; 64 with --tiny)")
    ap.add_argument("--microbatches", type=int, default=0, help="default: one per sequence")
    ap.add_argument("--blocks", type=int, default=5, help="timed blocks per side (the median is reported)")
    ap.add_argument("--steps", type=int, default=3, help="steps per block")
    ap.add_argument("--warmup", type=int, default=2, help="steps of each side alone first (at least 2)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--skip-torch", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seq = args.seq or (64 if args.tiny else 2048)
    cfg = qwen3_1_7b_shapes(args.tiny)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    tokens = args.batch * seq
    print(f"B5: devices {roundpipe._C.get_device_names()}, torch {torch.__version__}, batch {args.batch} x {seq} "
          f"tokens, {max(args.warmup, 2)} warm-up steps per side, then {args.blocks} blocks of {args.steps} "
          f"steps per side", flush=True)
    print(describe(args.blocks, args.steps, 0), flush=True)
    threads = "" if device.type == "cuda" else f" with {torch.get_num_threads()} intra-op threads"
    print(f"pairing: roundpipe on {roundpipe._C.get_device_names()} against torch on {device}{threads}"
          + ("" if device.type == "cuda" else " (a dry run: the ratios mean nothing here)"), flush=True)

    rp_step, rp_finish, n_params, losses, rp_peak = make_roundpipe(cfg, ids, labels, args, device)
    sides = [Side("roundpipe", rp_step, rp_finish)]
    peaks = {"roundpipe": rp_peak}
    if not args.skip_torch:
        torch_steps, torch_peaks = make_torch(cfg, ids, labels, args, device)
        sides += [Side("torch+ckpt", torch_steps[True], lambda: sync(device)),
                  Side("torch", torch_steps[False], lambda: sync(device))]
        peaks.update({"torch+ckpt": torch_peaks[True], "torch": torch_peaks[False]})
    times = alternate_blocks(sides, rounds=args.blocks, steps=args.steps, warmup_rounds=0)
    print(f"roundpipe: losses {[round(x, 4) for x in losses]}", flush=True)
    secs = {name: median(ts) for name, ts in times.items()}
    print(f"{'run':<12} {'s/step':>8} {'min':>8} {'max':>8} {'tokens/s':>10} {'peak GiB':>9}")
    for name, ts in times.items():
        print(f"{name:<12} {secs[name]:8.3f} {min(ts):8.3f} {max(ts):8.3f} {tokens / secs[name]:10.0f} "
              f"{peaks[name] / 2**30:9.2f}")
    rp_s = secs["roundpipe"]
    result = {"tokens_per_s": f"{tokens / rp_s:.0f}", "mfu": f"{6 * n_params * tokens / rp_s / PEAK_FLOPS:.3f}",
              "peak_gib": f"{rp_peak / 2**30:.2f}"}
    if not args.skip_torch:
        ck_s, ck_peak, pl_s, pl_peak = secs["torch+ckpt"], peaks["torch+ckpt"], secs["torch"], peaks["torch"]
        result.update(tokens_vs_torch_ckpt=f"{ck_s / rp_s:.3f}", tokens_vs_torch=f"{pl_s / rp_s:.3f}",
                      peak_mem_vs_torch=f"{rp_peak / ck_peak:.3f}" if ck_peak else "na",
                      torch_ckpt_peak_gib=f"{ck_peak / 2**30:.2f}", torch_peak_gib=f"{pl_peak / 2**30:.2f}")
    result.update(tokens_vs_reference="na", batch=args.batch, seq=seq, model="tiny" if args.tiny else "qwen3-1.7b",
                  blocks=args.blocks, steps_per_block=args.steps)
    print("RESULT id=B5 " + " ".join(f"{k}={v}" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
