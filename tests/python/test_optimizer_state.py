"""The optimizer-state switch (roundpipe.optimizer_state) and
RoundPipeConfig(optimizer_state=...) of the Trainer integration: argument
validation; the compact state on a bf16 model (bf16 optimizer copies and
gradients, 8-bit AdamW moments) training through RoundPipe about as well as
fp32 copies with torch.optim.AdamW; and the compact state through Trainer on
fp32 and bf16 models."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import roundpipe  # noqa: E402
from roundpipe import optimizer_state  # noqa: E402
from roundpipe.integrations.transformers import RoundPipeConfig, RoundPipeTrainer  # noqa: E402

import hf_models  # noqa: E402


@pytest.mark.parametrize("value", ["int8", "bf16", "", None, "COMPACT"])
def test_a_bad_optimizer_state_is_an_error_naming_the_choices(value):
    with pytest.raises(ValueError, match="optimizer_state must be 'fp32' or 'compact'"):
        RoundPipeConfig(optimizer_state=value)
    with pytest.raises(ValueError, match="optimizer_state must be 'fp32' or 'compact'"):
        optimizer_state.adamw([torch.zeros(2, requires_grad=True)], value)


def test_compact_copies_take_the_model_dtype():
    net = torch.nn.Linear(4, 4)
    assert optimizer_state.optim_dtype_for("t", net, "compact") == torch.float32
    assert optimizer_state.optim_dtype_for("t", net.to(torch.bfloat16), "compact") == torch.bfloat16
    assert optimizer_state.optim_dtype_for("t", net, "fp32") == torch.float32


def test_compact_refuses_fp16_and_mixed_models_with_the_fix():
    with pytest.raises(ValueError, match="fp16 model.*bf16"):
        optimizer_state.optim_dtype_for("t", torch.nn.Linear(4, 4).half(), "compact")
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(ValueError, match="mix.*optim_dtype explicitly"):
        optimizer_state.optim_dtype_for("t", mixed, "compact")


def test_adamw_picks_8bit_moments_for_compact():
    p = [torch.zeros(8, requires_grad=True)]
    assert type(optimizer_state.adamw(p, "fp32", lr=1e-3)) is roundpipe.optim.AdamW
    assert type(optimizer_state.adamw(p, "compact", lr=1e-3)) is roundpipe.optim.AdamW8bit


def mlp(seed=0):
    """A bf16 classifier whose two larger weights (8192 and 16384 elements)
    get 8-bit moments; the biases and the last weight keep fp32 ones."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                              torch.nn.GELU(), torch.nn.Linear(128, 16))
    return net.to(torch.bfloat16)


def teacher_batches(steps, rows=64, seed=0):
    """Fresh inputs each step, labelled by one fixed random two-layer teacher:
    the loss falls steadily but stays well above zero, so final losses
    compare by ratio."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(64, 64, generator=g), torch.randn(64, 16, generator=g)
    xs = [torch.randn(rows, 64, generator=g) for _ in range(steps)]
    return [(x.to(torch.bfloat16), (torch.tanh(x @ w1) @ w2).argmax(1)) for x in xs]


def train_mlp(state, steps=120):
    """Trains mlp() through RoundPipe with the optimizer state's copies and
    AdamW (fp32: fp32 copies and torch.optim.AdamW, as a plain PyTorch run
    would); returns the losses, the copies and the dtypes of their .grad seen
    inside step_fn."""
    net = mlp()
    model = roundpipe.RoundPipe(net, optim_dtype=optimizer_state.optim_dtype_for("t", net, state),
                                model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=2))
    with roundpipe.OptimizerCtx():
        copies = list(model.parameters())
    kwargs = dict(lr=3e-3, weight_decay=0.01)
    opt = (optimizer_state.adamw(copies, state, **kwargs) if state == "compact"
           else torch.optim.AdamW(copies, **kwargs))
    grad_dtypes = set()

    def step_fn():
        grad_dtypes.update(p.grad.dtype for p in copies)
        opt.step()
        opt.zero_grad()

    losses = []
    for x, y in teacher_batches(steps):
        loss = model.forward_backward(
            input_args=(x,), label=y, loss_fn=lambda out, lab: torch.nn.functional.cross_entropy(out.float(), lab) / 2)
        losses.append(float(loss))
        model.step(step_fn)
    model.synchronize()
    return losses, copies, grad_dtypes, opt


def test_compact_trains_a_bf16_model_with_bf16_copies_as_well_as_fp32_adamw():
    losses, copies, grad_dtypes, opt = train_mlp("compact")
    assert type(opt) is roundpipe.optim.AdamW8bit
    assert copies and all(p.dtype == torch.bfloat16 for p in copies)
    # One bf16 gradient per copy: the engine sums the microbatches' gradients
    # in bf16 rather than keeping an fp32 sum beside the copy.
    assert grad_dtypes == {torch.bfloat16}
    big = max(copies, key=lambda p: p.numel())
    assert opt.state[big]["exp_avg"].dtype == torch.uint8
    ref_losses, ref_copies, ref_grad_dtypes, _ = train_mlp("fp32")
    assert all(p.dtype == torch.float32 for p in ref_copies) and ref_grad_dtypes == {torch.float32}
    final, ref_final = sum(losses[-20:]) / 20, sum(ref_losses[-20:]) / 20
    assert final < 0.7 * losses[0], losses
    assert abs(final / ref_final - 1) <= 0.03, (final, ref_final)


def lm_dataset(rows=32, length=16, seed=0):
    """Rows of a short repeated pattern: a loss that falls within a few steps."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        start = int(torch.randint(0, 8, (1,), generator=g))
        ids = [(start + k) % 8 + 10 for k in range(length)]
        out.append({"input_ids": ids, "attention_mask": [1] * length, "labels": ids})
    return datasets.Dataset.from_list(out)


def trainer(tmp_path, model, config, **overrides):
    kwargs = dict(per_device_train_batch_size=8, max_steps=12, learning_rate=1e-2, warmup_steps=0,
                  weight_decay=0.01, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                  seed=0, disable_tqdm=True)
    kwargs.update(overrides)
    args = transformers.TrainingArguments(str(tmp_path), **kwargs)
    return RoundPipeTrainer(model=model, args=args, train_dataset=lm_dataset(), roundpipe_config=config)


def test_compact_trains_an_fp32_model_with_fp32_copies_and_8bit_moments(tmp_path):
    t = trainer(tmp_path, hf_models.model("llama"), RoundPipeConfig(optimizer_state="compact"))
    t.train()
    inner = t._inner_optimizer()
    assert type(inner) is roundpipe.optim.AdamW8bit
    # Trainer's parameter groups are kept: weight decay off for norms.
    assert sorted(g["weight_decay"] for g in inner.param_groups) == [0.0, 0.01]
    copies = [p for g in inner.param_groups for p in g["params"]]
    assert copies and all(p.dtype == torch.float32 for p in copies)
    embed = max(copies, key=lambda p: p.numel())
    assert inner.state[embed]["exp_avg"].dtype == torch.uint8
    losses = [r["loss"] for r in t.state.log_history if "loss" in r]
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses


def test_compact_conflicts_with_another_optimizer(tmp_path):
    t = trainer(tmp_path, hf_models.model("llama"), RoundPipeConfig(optimizer_state="compact"), optim="sgd")
    with pytest.raises(ValueError, match="AdamW8bit, but optim='sgd'"):
        t.create_optimizer()


def test_compact_refuses_an_fp16_model_when_wrapping(tmp_path):
    t = trainer(tmp_path, hf_models.model("llama").half(), RoundPipeConfig(optimizer_state="compact"))
    with pytest.raises(ValueError, match="RoundPipeConfig: optimizer_state='compact' is not supported for an fp16"):
        t.roundpipe_model


def test_compact_trains_a_bf16_model_through_trainer_with_bf16_copies(tmp_path):
    def run(config, out):
        t = trainer(out, hf_models.model("llama").to(torch.bfloat16), config)
        t.train()
        inner = t._inner_optimizer()
        copies = [p for g in inner.param_groups for p in g["params"]]
        return inner, copies, [r["loss"] for r in t.state.log_history if "loss" in r]

    inner, copies, losses = run(RoundPipeConfig(optimizer_state="compact"), tmp_path / "compact")
    assert type(inner) is roundpipe.optim.AdamW8bit
    assert copies and all(p.dtype == torch.bfloat16 for p in copies)
    assert inner.state[max(copies, key=lambda p: p.numel())]["exp_avg"].dtype == torch.uint8
    assert sum(losses[-3:]) / 3 < 0.7 * losses[0], losses
    # The same bf16 model with fp32 copies and Trainer's own AdamW.
    _, ref_copies, ref_losses = run(RoundPipeConfig(optim_dtype=torch.float32), tmp_path / "fp32")
    assert all(p.dtype == torch.float32 for p in ref_copies)
    final, ref_final = sum(losses[-3:]) / 3, sum(ref_losses[-3:]) / 3
    assert abs(final / ref_final - 1) <= 0.1, (losses, ref_losses)
