"""Data-parallel training with roundpipe: every process trains the same model
on its share of each batch; step() combines the gradients of all processes.

Launch it the way torch.distributed programs are launched (any launcher that
sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT):

    torchrun --nproc_per_node 2 examples/data_parallel.py
    # two machines, one process each:
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST0 --master_port 29500 \\
             --nproc_per_node 1 examples/data_parallel.py      # on HOST0
    torchrun --nnodes 2 --node_rank 1 --master_addr HOST0 --master_port 29500 \\
             --nproc_per_node 1 examples/data_parallel.py      # on HOST1

or let it start N local processes itself:

    python examples/data_parallel.py --nproc 2

Each process uses the devices ROUNDPIPE_DEVICES gives it (e.g. one GPU per
process with CUDA_VISIBLE_DEVICES, or cpu:1).
"""
import argparse
import os
import subprocess
import sys

import torch
from torch import nn

import roundpipe


def spawn(nproc, argv):
    """Runs this script in `nproc` local processes; returns the first failure's code."""
    env = dict(os.environ, WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    procs = [subprocess.Popen([sys.executable, __file__, *argv], env=dict(env, RANK=str(r)))
             for r in range(nproc)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c != 0), 0)


def without_nproc(argv):
    """The arguments for the processes: all but `--nproc N` / `--nproc=N`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=0, help="start this many local processes")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over processes)")
    parser.add_argument("--checkpoint", default="", help="save the training state here at the end")
    args, rest = parser.parse_known_args()
    if args.nproc > 0 and "RANK" not in os.environ:
        sys.exit(spawn(args.nproc, without_nproc(sys.argv[1:])))

    group = roundpipe.distributed.init_process_group(timeout=120)
    rank, world = group.rank, group.world_size
    assert args.batch % world == 0, "--batch must divide evenly over the processes"
    torch.manual_seed(0)  # rank 0's weights are copied to every process anyway
    net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256), nn.GELU(),
                        nn.Linear(256, 10))
    model = roundpipe.RoundPipe(net, process_group=group)
    opt = torch.optim.AdamW(model.optim_parameters(), lr=3e-3)
    share = args.batch // world
    teacher = torch.Generator().manual_seed(1)
    w_true = torch.randn(32, 10, generator=teacher)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 + step)  # the same global batch on every process
        x = torch.randn(args.batch, 32, generator=g)
        y = (x @ w_true).argmax(dim=1)
        mine = slice(rank * share, (rank + 1) * share)
        loss = model.forward_backward(
            (x[mine],), label=y[mine],
            loss_fn=lambda out, label: nn.functional.cross_entropy(out, label) * label.shape[0] / args.batch)
        model.step(lambda: (opt.step(), opt.zero_grad()))
        if step % 10 == 0 or step == args.steps - 1:
            total = loss.reshape(1).clone()
            group.all_reduce_sum(total, "loss")  # waits for the queued step first
            if rank == 0:
                print(f"step {step:3d}  loss {total.item():.4f}  ({world} processes)", flush=True)
    if args.checkpoint:
        roundpipe.save_checkpoint(args.checkpoint, model, optimizer=opt, step=args.steps)  # rank 0 writes
    model.synchronize()


if __name__ == "__main__":
    main()
