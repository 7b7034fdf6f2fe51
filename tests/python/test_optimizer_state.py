"""The optimizer-state switch (roundpipe.optimizer_state) and
RoundPipeConfig(optimizer_state=...) of the Trainer integration: argument
validation, and the compact state on an fp32 model (fp32 optimizer copies,
8-bit AdamW moments) training through Trainer."""
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
