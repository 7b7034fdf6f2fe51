"""Data parallelism (roundpipe.distributed): processes that each train on
their share of the batch equal one process on the concatenated batch with the
same microbatches (dropout included), with torch and roundpipe optimizers;
rank 0 writes the checkpoint, which resumes in one process; bad arguments
are clear errors."""
import itertools
import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import assert_close, mse_loss_fn, value_model  # noqa: E402

pytestmark = pytest.mark.skipif(not roundpipe.distributed.is_available(), reason="built without c10d Gloo")

ROWS, MICROBATCHES, STEPS = 4, 2, 4
_ports = itertools.count(29500 + os.getpid() % 20000)

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    import roundpipe
    from roundpipe import RoundPipe, RoundPipeRunConfig
    from models import mse_loss_fn, value_model
    out, ckpt, optimizer, pin = sys.argv[1:5]
    torch.set_num_threads(1)
    group = roundpipe.distributed.init_process_group(timeout=60)
    rank, world = group.rank, group.world_size
    torch.manual_seed(rank)  # other weights and seeds than rank 0's: the group copies rank 0's
    net = value_model(dropout=0.3)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch={micro}), process_group=group,
                      pin_model=pin)
    if optimizer == "torch":
        opt = torch.optim.SGD(model.optim_parameters(), lr=0.05, momentum=0.9)
    else:
        opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-2)
    losses = []
    for step in range({steps}):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(world * {rows}, 8, generator=g), torch.randn(world * {rows}, 3, generator=g)
        mine = slice(rank * {rows}, (rank + 1) * {rows})
        losses.append(model.forward_backward((x[mine],), label=y[mine], loss_fn=mse_loss_fn({micro})))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    roundpipe.save_checkpoint(ckpt, model, optimizer=opt, step={steps})  # rank 0 writes
    total = torch.stack(losses).clone()
    group.all_reduce_sum(total, "loss sum")
    model.synchronize()
    params = {{n: p.detach().clone() for n, p in net.named_parameters()}}
    torch.save({{"losses": torch.stack(losses), "total": total, "params": params, "state": net.state_dict()}},
               out.format(rank))
''')


def _run_group(tmp_path, world, optimizer, pin="alloc"):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), rows=ROWS,
                                    micro=MICROBATCHES, steps=STEPS))
    out, ckpt = str(tmp_path / "rank{}.pt"), str(tmp_path / "dp.ckpt")
    procs, port = [], next(_ports)
    for rank in range(world):
        env = dict(os.environ, ROUNDPIPE_DEVICES="cpu:1", RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(script), out, ckpt, optimizer, pin], env=env))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [0] * world
    return [torch.load(out.format(r)) for r in range(world)], ckpt


def _reference(world, optimizer, steps=STEPS, model_and_opt=None):
    if model_and_opt is None:
        torch.manual_seed(0)
        net = value_model(dropout=0.3)
        model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=world * MICROBATCHES))
        if optimizer == "torch":
            opt = torch.optim.SGD(model.optim_parameters(), lr=0.05, momentum=0.9)
        else:
            opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-2)
        first = 0
    else:
        net, model, opt, first = model_and_opt
    losses = []
    for step in range(first, steps):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(world * ROWS, 8, generator=g), torch.randn(world * ROWS, 3, generator=g)
        losses.append(model.forward_backward((x,), label=y, loss_fn=mse_loss_fn(MICROBATCHES)))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    return torch.stack(losses), {n: p.detach().clone() for n, p in net.named_parameters()}


# pin_model="off": parameters left in place are broadcast one by one.
@pytest.mark.parametrize("world,optimizer,pin", [(2, "torch", "alloc"), (3, "roundpipe", "alloc"), (2, "torch", "off")])
def test_processes_equal_one_process_on_the_concatenated_batch(tmp_path, world, optimizer, pin):
    results, _ = _run_group(tmp_path, world, optimizer, pin)
    losses, params = _reference(world, optimizer)
    assert_close(sum(r["losses"] for r in results), losses, rtol=1e-6, what="summed losses")
    for r in results:
        assert torch.equal(r["total"], results[0]["total"])
        for name, t in params.items():  # (buffers stay per process)
            assert_close(r["params"][name], t, rtol=1e-6, what=name)
            assert torch.equal(r["params"][name], results[0]["params"][name]), name


TORCHRUN_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from roundpipe import RoundPipe, RoundPipeRunConfig
    from models import mse_loss_fn, value_model
    out = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's environment and store
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # other weights and seeds than rank 0's: the group copies rank 0's
    net = value_model(dropout=0.3)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch={micro}),
                      process_group=dist.group.WORLD)
    opt = torch.optim.SGD(model.optim_parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range({steps}):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(world * {rows}, 8, generator=g), torch.randn(world * {rows}, 3, generator=g)
        mine = slice(rank * {rows}, (rank + 1) * {rows})
        losses.append(model.forward_backward((x[mine],), label=y[mine], loss_fn=mse_loss_fn({micro})))
        model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
    params = {{n: p.detach().clone() for n, p in net.named_parameters()}}
    torch.save({{"losses": torch.stack(losses), "params": params}}, out.format(rank))
    dist.destroy_process_group()
''')


def test_torchrun_with_a_torch_distributed_group(tmp_path):
    """Launched by torchrun, RoundPipe takes torch.distributed's own c10d
    group (as DDP does) and equals one process on the concatenated batch."""
    script = tmp_path / "torchrun_train.py"
    script.write_text(TORCHRUN_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), rows=ROWS,
                                             micro=MICROBATCHES, steps=STEPS))
    out = str(tmp_path / "rank{}.pt")
    env = dict(os.environ, ROUNDPIPE_DEVICES="cpu:1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(next(_ports)), str(script), out]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    results = [torch.load(out.format(r)) for r in range(2)]
    losses, params = _reference(2, "torch")
    assert_close(sum(r["losses"] for r in results), losses, rtol=1e-6, what="summed losses")
    for r in results:
        for name, t in params.items():
            assert_close(r["params"][name], t, rtol=1e-6, what=name)
            assert torch.equal(r["params"][name], results[0]["params"][name]), name


def test_checkpoint_of_two_processes_resumes_in_one(tmp_path):
    results, ckpt = _run_group(tmp_path, 2, "roundpipe")

    def loaded(seed):  # other initial weights and seed, which the checkpoint replaces
        torch.manual_seed(seed)
        net = value_model(dropout=0.3)
        model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=2 * MICROBATCHES))
        opt = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-2)
        assert roundpipe.load_checkpoint(ckpt, model, optimizer=opt)["step"] == STEPS
        return net, model, opt

    net, model, _ = loaded(9)
    model.synchronize()
    for name, t in results[0]["state"].items():  # rank 0's state, buffers included
        assert torch.equal(net.state_dict()[name], t), name
    # A fresh resume continues like the uninterrupted one-process run.
    net, model, opt = loaded(10)
    _, resumed = _reference(2, "roundpipe", steps=STEPS + 2, model_and_opt=(net, model, opt, STEPS))
    _, uninterrupted = _reference(2, "roundpipe", steps=STEPS + 2)
    for name, t in uninterrupted.items():
        assert_close(resumed[name], t, rtol=1e-6, what=name)


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        roundpipe.distributed.init_process_group("file://" + str(tmp_path / "s"), rank=2, world_size=2)
    with pytest.raises(ValueError, match="init_method must be"):
        roundpipe.distributed.init_process_group("nccl://x", rank=0, world_size=1)
    with pytest.raises(TypeError, match="timeout must be"):
        roundpipe.distributed.init_process_group(rank=0, world_size=1, timeout="soon")
    with pytest.raises(ValueError, match="timeout must be positive"):
        roundpipe.distributed.init_process_group(rank=0, world_size=1, timeout=timedelta(0))
    with pytest.raises(TypeError, match="process_group must be"):
        RoundPipe(value_model(), process_group="gloo")
    with pytest.raises(ValueError, match="gradient_reduction must be"):
        RoundPipe(value_model(), gradient_reduction="avg")
    group = roundpipe.distributed.init_process_group("file://" + str(tmp_path / "one"), rank=0, world_size=1)
    assert (group.rank, group.world_size) == (0, 1)
    first = RoundPipe(value_model(), process_group=group)
    with pytest.raises(ValueError, match="already serves model"):
        RoundPipe(value_model(), process_group=group)
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        group.all_reduce_sum(torch.ones(4, 4).t(), "x")
    del first


def test_the_example_runs_in_two_processes(tmp_path):
    """examples/data_parallel.py --nproc 2 --steps 2: the processes get
    `--steps 2` (the count of --nproc is not taken out of other flags)."""
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "data_parallel.py")
    env = dict(os.environ, ROUNDPIPE_DEVICES="cpu:1", MASTER_PORT=str(next(_ports)))
    run = subprocess.run([sys.executable, example, "--nproc", "2", "--steps", "2", "--batch", "8",
                          "--checkpoint", str(tmp_path / "dp.ckpt")],
                         env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "dp.ckpt").exists()
