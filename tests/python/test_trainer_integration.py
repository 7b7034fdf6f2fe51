"""Hugging Face Trainer and TRL's SFTTrainer with roundpipe underneath
(roundpipe.integrations.transformers; docs/hf.md, "With Trainer"), against the
same trainers without roundpipe on tiny random Llama and Qwen3 models (CPU
devices, fp32): synchronous steps equal plain Trainer (losses, grad norms,
learning rates, final parameters, evaluation and prediction; 1e-5 relative)
with gradient accumulation, warm-up + cosine schedule, weight decay and
clipping; the default asynchronous step equals plain Trainer with the one-step
delay applied; SFTTrainer with packing off and on; a peft LoRA model;
checkpoints in Trainer's format, resume_from_checkpoint and
load_best_model_at_end; a failing step raised by train(); refused arguments."""
import os
import subprocess
import sys

import pytest
import torch

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from roundpipe.integrations.transformers import RoundPipeConfig, RoundPipeTrainer  # noqa: E402

TOLERANCE = 1e-5
VOCAB = 128
SEQ = 16


def tiny_model(family="llama", seed=0):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if family == "llama":
        config = transformers.LlamaConfig(tie_word_embeddings=False, **common)
    elif family == "mistral":  # no preset of its own: the generic decoder preset
        config = transformers.MistralConfig(tie_word_embeddings=False, sliding_window=6, head_dim=8, **common)
    else:
        config = transformers.Qwen3Config(tie_word_embeddings=True, head_dim=8, **common)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def lm_dataset(rows=16, seed=0):
    """Token rows of SEQ tokens, a third of them left-padded."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        mask = torch.ones(SEQ, dtype=torch.long)
        if i % 3 == 0:
            mask[:5] = 0
        out.append({"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                    "labels": ids.masked_fill(mask == 0, -100).tolist()})
    return datasets.Dataset.from_list(out)


def training_args(output_dir, **overrides):
    kwargs = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
                  max_steps=4, learning_rate=2e-2, warmup_steps=1, lr_scheduler_type="cosine",
                  max_grad_norm=0.5, weight_decay=0.01, logging_steps=1, save_strategy="no", report_to=[],
                  use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)
    kwargs.update(overrides)
    return transformers.TrainingArguments(str(output_dir), **kwargs)


def rel(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def step_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def assert_same_logs(ours, plain, keys=("loss", "grad_norm", "learning_rate")):
    ours, plain = step_logs(ours), step_logs(plain)
    assert len(ours) == len(plain) > 0
    for a, b in zip(ours, plain):
        assert a["step"] == b["step"]
        for key in keys:
            assert rel(a[key], b[key]) <= TOLERANCE, f"step {a['step']} {key}: {a[key]} vs {b[key]}"


def assert_same_parameters(ours, plain, what="final parameters"):
    ours, plain = dict(ours), dict(plain)
    assert ours.keys() == plain.keys()
    worst = max(rel(ours[name], plain[name]) for name in plain)
    assert worst <= TOLERANCE, f"{what} differ: {worst:.2e}"


def trained_parameters(trainer):
    """The newest parameters of a RoundPipeTrainer's model (after the last step)."""
    trainer.roundpipe_model.synchronize()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def parameters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------------------
# Trainer, synchronous steps: plain Trainer's numbers.

@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_synchronous_steps_equal_plain_trainer(tmp_path, family):
    train, held_out = lm_dataset(), lm_dataset(rows=6, seed=1)
    args = dict(include_num_input_tokens_seen=True)
    plain = transformers.Trainer(model=tiny_model(family), args=training_args(tmp_path / "plain", **args),
                                 train_dataset=train, eval_dataset=held_out)
    plain.train()
    ours = RoundPipeTrainer(model=tiny_model(family), args=training_args(tmp_path / "ours", **args),
                            train_dataset=train, eval_dataset=held_out,
                            roundpipe_config=RoundPipeConfig(is_async=False, num_microbatch=2))
    ours.train()
    assert_same_logs(ours, plain, keys=("loss", "grad_norm", "learning_rate", "num_input_tokens_seen"))
    assert all(entry["train_tokens_per_second"] > 0 for entry in step_logs(ours))
    first, last = step_logs(plain)[0], step_logs(plain)[-1]
    assert first["grad_norm"] > 0.5 and last["learning_rate"] < 2e-2  # clipping and the schedule act
    assert_same_parameters(trained_parameters(ours), parameters(plain.model))
    # Evaluation and prediction of the trained model.
    ours_eval, plain_eval = ours.evaluate(), plain.evaluate()
    assert rel(ours_eval["eval_loss"], plain_eval["eval_loss"]) <= TOLERANCE
    ours_pred, plain_pred = ours.predict(held_out), plain.predict(held_out)
    assert ours_pred.predictions.shape == plain_pred.predictions.shape == (6, SEQ, VOCAB)
    assert rel(ours_pred.predictions, plain_pred.predictions) <= TOLERANCE


# ---------------------------------------------------------------------------
# Trainer, asynchronous steps: plain Trainer with the one-step delay applied.

class OneStepDelay:
    """A plain trainer whose optimizer updates copies of the parameters, and
    whose model holds the copies from before the latest step: the batches
    after step k run at θ_{k-1} and their gradients update θ_k (the one-step
    delay, as test_async_and_errors.reference_delayed). ``newest[k - 1]`` is
    θ_k, by parameter name."""

    def create_optimizer(self, model=None):
        super().create_optimizer(model)
        inner = self.optimizer
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        pairs = []
        for group in inner.param_groups:
            copies = [p.detach().clone().requires_grad_() for p in group["params"]]
            pairs += zip(group["params"], copies)
            group["params"] = copies
        self.newest = []
        real_step = inner.step

        def delayed_step(*args, **kwargs):
            with torch.no_grad():
                for p, c in pairs:
                    c.grad = p.grad
                    p.copy_(c)  # the next batches see the copies from before this step
            real_step(*args, **kwargs)
            for _, c in pairs:
                c.grad = None
            self.newest.append({name_of[id(p)]: c.detach().clone() for p, c in pairs})

        inner.step = delayed_step
        return inner

    def use_newest(self):
        """The model takes the last step's parameters (as a synchronize would)."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name in self.newest[-1]:
                    p.copy_(self.newest[-1][name])


class DelayedTrainer(OneStepDelay, transformers.Trainer):
    pass


def test_asynchronous_steps_equal_plain_trainer_with_the_one_step_delay(tmp_path):
    train = lm_dataset()
    args = dict(max_steps=5)
    plain = DelayedTrainer(model=tiny_model("llama"), args=training_args(tmp_path / "plain", **args),
                           train_dataset=train)
    plain.train()
    ours = RoundPipeTrainer(model=tiny_model("llama"), args=training_args(tmp_path / "ours", **args),
                            train_dataset=train, roundpipe_config=RoundPipeConfig(num_microbatch=2))
    assert ours._roundpipe_config.is_async  # the default
    ours.train()
    assert_same_logs(ours, plain)
    assert len(plain.newest) == 5
    assert_same_parameters(trained_parameters(ours), plain.newest[-1])
    # Not the synchronous run: the delay is there.
    sync = transformers.Trainer(model=tiny_model("llama"), args=training_args(tmp_path / "sync", **args),
                                train_dataset=train)
    sync.train()
    assert rel(step_logs(ours)[-1]["loss"], step_logs(sync)[-1]["loss"]) > 1e-4


# ---------------------------------------------------------------------------
# A peft LoRA model.

@pytest.mark.parametrize("is_async", [False, True])
def test_lora_model_equals_plain_trainer(tmp_path, is_async):
    peft = pytest.importorskip("peft")

    def lora():
        base = tiny_model("qwen3")
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:  # peft starts it at zero: give the adapters gradients everywhere
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        return model

    train = lm_dataset()
    plain_model, our_model = lora(), lora()
    frozen = {n: p.clone() for n, p in our_model.named_parameters() if not p.requires_grad}
    plain = (DelayedTrainer if is_async else transformers.Trainer)(
        model=plain_model, args=training_args(tmp_path / "plain"), train_dataset=train)
    plain.train()
    ours = RoundPipeTrainer(model=our_model, args=training_args(tmp_path / "ours"), train_dataset=train,
                            roundpipe_config=RoundPipeConfig(is_async=is_async, num_microbatch=2))
    ours.train()
    assert all("lora_" in n for n, _ in ours.roundpipe_model.optim_named_parameters())
    assert_same_logs(ours, plain)
    trained = trained_parameters(ours)
    assert trained and all("lora_" in n for n in trained)
    assert_same_parameters(trained, plain.newest[-1] if is_async else parameters(plain_model))
    assert all(torch.equal(p, frozen[n]) for n, p in our_model.named_parameters() if not p.requires_grad)
    ours.save_model(str(tmp_path / "adapter"))
    assert os.path.isfile(tmp_path / "adapter" / "adapter_model.safetensors")


# ---------------------------------------------------------------------------
# Checkpoints and resume_from_checkpoint.

def test_qlora_equals_plain_trainer_on_the_dequantized_weights(tmp_path):
    """RoundPipeConfig(frozen_weights="nf4"): the frozen linears packed; the
    run equals plain Trainer on a model holding their dequantized values."""
    peft = pytest.importorskip("peft")
    from roundpipe.packed import PackedLinear, pack_frozen_linears

    def lora():
        model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, lora_alpha=8,
                                                                          target_modules=["q_proj", "v_proj"]))
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        return model

    train = lm_dataset()
    our_model, plain_model = lora(), lora()
    head = our_model.get_output_embeddings()
    pack_frozen_linears(our_model, "nf4", skip=(head,))  # here, to give the plain model the same values
    plain_modules = dict(plain_model.named_modules())
    with torch.no_grad():
        for name, m in our_model.named_modules():
            if isinstance(m, PackedLinear):
                plain_modules[name].weight.copy_(m.dequantized_weight())
    plain = transformers.Trainer(model=plain_model, args=training_args(tmp_path / "plain"), train_dataset=train)
    plain.train()
    ours = RoundPipeTrainer(model=our_model, args=training_args(tmp_path / "ours"), train_dataset=train,
                            roundpipe_config=RoundPipeConfig(is_async=False, num_microbatch=2,
                                                             frozen_weights="nf4"))
    ours.train()
    assert sum(isinstance(m, PackedLinear) for m in our_model.modules()) == 2 * 7  # 2 blocks x 7 linears
    assert_same_logs(ours, plain)
    assert_same_parameters(trained_parameters(ours), parameters(plain_model))
    with pytest.raises(ValueError, match="frozen_weights must be one of"):
        RoundPipeConfig(frozen_weights="q4")


@pytest.mark.parametrize("is_async", [False, True])
def test_resume_from_checkpoint_continues_the_run(tmp_path, is_async):
    train = lm_dataset()
    config = RoundPipeConfig(is_async=is_async, num_microbatch=2)
    args = dict(max_steps=4, save_strategy="steps", save_steps=2)
    whole = RoundPipeTrainer(model=tiny_model("llama"), args=training_args(tmp_path / "whole", **args),
                             train_dataset=train, roundpipe_config=config)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    for name in ("model.safetensors", "config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth",
                 "trainer_state.json"):
        assert os.path.isfile(checkpoint / name), name
    assert os.path.isfile(checkpoint / "roundpipe_state.pt") == is_async
    # The checkpoint's weights are the model after step 2, in Hugging Face format.
    saved = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert saved.config.model_type == "llama"

    resumed = RoundPipeTrainer(model=tiny_model("llama", seed=7), args=training_args(tmp_path / "whole", **args),
                               train_dataset=train, roundpipe_config=config)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    tolerance = 0.0 if is_async else TOLERANCE  # asynchronous: bitwise, as roundpipe's own resume
    tail = [e for e in step_logs(resumed) if e["step"] > 2]
    assert [e["step"] for e in tail] == [3, 4]
    for a, b in zip(tail, step_logs(whole)[2:]):
        assert rel(a["loss"], b["loss"]) <= tolerance, (a, b)
        assert rel(a["grad_norm"], b["grad_norm"]) <= tolerance, (a, b)
    ours, want = trained_parameters(resumed), trained_parameters(whole)
    worst = max(rel(ours[n], want[n]) for n in want)
    assert worst <= tolerance, f"final parameters differ: {worst:.2e}"


def test_saved_weights_are_the_newest_step_with_asynchronous_steps(tmp_path):
    train, args = lm_dataset(), dict(max_steps=3, save_strategy="steps", save_steps=2)
    plain = DelayedTrainer(model=tiny_model("llama"), args=training_args(tmp_path / "plain", **args),
                           train_dataset=train)
    plain.train()
    ours = RoundPipeTrainer(model=tiny_model("llama"), args=training_args(tmp_path / "ours", **args),
                            train_dataset=train, roundpipe_config=RoundPipeConfig(num_microbatch=2))
    ours.train()
    # Written while step 3 was in flight, with the devices one step behind.
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours" / "checkpoint-2")
    assert_same_parameters(parameters(saved), plain.newest[1], "checkpoint-2 weights")
    # After train() the model holds the last step's weights, and save_model writes them.
    assert_same_parameters(parameters(ours.model), plain.newest[2], "the model after train()")
    ours.save_model(str(tmp_path / "final"))
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert_same_parameters(parameters(saved), plain.newest[2], "save_model weights")


def test_load_best_model_at_end_loads_the_best_checkpoint(tmp_path):
    args = training_args(tmp_path, max_steps=3, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                         save_steps=1, load_best_model_at_end=True)
    trainer = RoundPipeTrainer(model=tiny_model("llama"), args=args, train_dataset=lm_dataset(),
                               eval_dataset=lm_dataset(rows=6, seed=1),
                               roundpipe_config=RoundPipeConfig(num_microbatch=2))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert not best.endswith("checkpoint-3")  # not the last step's weights: the load has work to do
    want = parameters(transformers.AutoModelForCausalLM.from_pretrained(best))
    trainer.save_model(str(tmp_path / "final"))
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert_same_parameters(parameters(saved), want, "save_model weights")
    assert rel(trainer.evaluate()["eval_loss"], trainer.state.best_metric) <= TOLERANCE


# ---------------------------------------------------------------------------
# TRL's SFTTrainer, packing off and on.

def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def text_dataset(rows=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, SEQ - 2, (rows,), generator=g)
    return datasets.Dataset.from_list([
        {"text": " ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (int(n),), generator=g))} for n in lengths])


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("packing", [False, True])
def test_sft_trainer_equals_plain_sft_trainer(tmp_path, packing, is_async):
    sft_trainer_equals_plain_sft_trainer(tmp_path, packing, is_async, "qwen3")


def test_sft_trainer_on_an_architecture_without_a_preset(tmp_path):
    sft_trainer_equals_plain_sft_trainer(tmp_path, True, True, "mistral")


def sft_trainer_equals_plain_sft_trainer(tmp_path, packing, is_async, family):
    trl = pytest.importorskip("trl")
    from roundpipe.integrations.transformers import RoundPipeSFTTrainer
    train, held_out = text_dataset(), text_dataset(rows=4, seed=1)

    def sft_args(name):
        return trl.SFTConfig(str(tmp_path / name), packing=packing, max_length=SEQ, per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, gradient_accumulation_steps=2, max_steps=3,
                             learning_rate=2e-2, warmup_steps=1, lr_scheduler_type="cosine", max_grad_norm=0.5,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             bf16=False, disable_tqdm=True, dataset_num_proc=None)

    plain_class = type("DelayedSFTTrainer", (OneStepDelay, trl.SFTTrainer), {}) if is_async else trl.SFTTrainer
    plain = plain_class(model=tiny_model(family), args=sft_args("plain"), train_dataset=train,
                        eval_dataset=held_out, processing_class=tiny_tokenizer())
    plain.train()
    ours = RoundPipeSFTTrainer(model=tiny_model(family), args=sft_args("ours"), train_dataset=train,
                               eval_dataset=held_out, processing_class=tiny_tokenizer(),
                               roundpipe_config=RoundPipeConfig(is_async=is_async, num_microbatch=2))
    ours.train()
    assert_same_logs(ours, plain, keys=("loss", "grad_norm", "learning_rate", "num_tokens"))
    if is_async:
        assert_same_parameters(trained_parameters(ours), plain.newest[-1])
        plain.use_newest()  # ours evaluates the newest parameters
    else:
        assert_same_parameters(trained_parameters(ours), parameters(plain.model))
    ours_eval, plain_eval = ours.evaluate(), plain.evaluate()
    for key in ("eval_loss", "eval_mean_token_accuracy", "eval_entropy"):
        assert rel(ours_eval[key], plain_eval[key]) <= TOLERANCE, key


# ---------------------------------------------------------------------------
# What roundpipe cannot honour: clear errors naming the argument.

@pytest.mark.parametrize("name, value", [("deepspeed", "ds_config.json"), ("fsdp", "full_shard"), ("fp16", True),
                                         ("torch_compile", True), ("label_smoothing_factor", 0.1),
                                         ("optim", "schedule_free_adamw"), ("torch_empty_cache_steps", 4)])
def test_arguments_roundpipe_cannot_honour_are_errors_naming_them(tmp_path, name, value):
    args = training_args(tmp_path)
    setattr(args, name, value)  # TrainingArguments(deepspeed=...) itself needs deepspeed installed
    with pytest.raises(ValueError, match=f"`{name}` cannot be used with roundpipe"):
        RoundPipeTrainer(model=tiny_model(), args=args, train_dataset=lm_dataset(rows=4))


def test_sft_arguments_roundpipe_cannot_honour_are_errors_naming_them(tmp_path):
    trl = pytest.importorskip("trl")
    from roundpipe.integrations.transformers import RoundPipeSFTTrainer
    for name, value in (("activation_offloading", True), ("loss_type", "dft")):
        args = trl.SFTConfig(str(tmp_path), max_length=SEQ, report_to=[], use_cpu=True, bf16=False,
                             **{name: value})
        with pytest.raises(ValueError, match=f"`{name}.*` cannot be used with roundpipe"):
            RoundPipeSFTTrainer(model=tiny_model("qwen3"), args=args, train_dataset=text_dataset(rows=4),
                                processing_class=tiny_tokenizer())


def test_overridden_compute_loss_and_foreign_optimizer_are_errors(tmp_path):
    class Custom(RoundPipeTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(ValueError, match="`compute_loss` is overridden"):
        Custom(model=tiny_model(), args=training_args(tmp_path), train_dataset=lm_dataset(rows=4))
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = RoundPipeTrainer(model=model, args=training_args(tmp_path), train_dataset=lm_dataset(rows=4),
                               optimizers=(optimizer, None))
    with pytest.raises(ValueError, match="`optimizers` must be built over"):
        trainer.train()
    with pytest.raises(TypeError, match="roundpipe_config must be a RoundPipeConfig"):
        RoundPipeTrainer(model=tiny_model(), args=training_args(tmp_path), roundpipe_config={"is_async": False})


# ---------------------------------------------------------------------------
# A step that fails on the optimizer thread: train() raises its error.

class StepFailed(RuntimeError):
    pass


@pytest.mark.timeout(120)  # a lost error would leave train() waiting for the step
@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("part, at_step", [("optimizer", 2), ("optimizer", 3), ("scheduler", 3)])
def test_a_failing_step_is_raised_by_train(tmp_path, is_async, part, at_step):
    # No log line waits for the steps: the last step's error must still reach train().
    trainer = RoundPipeTrainer(model=tiny_model(), args=training_args(tmp_path, max_steps=3, logging_steps=10),
                               train_dataset=lm_dataset(),
                               roundpipe_config=RoundPipeConfig(is_async=is_async, num_microbatch=2))
    optimizer = trainer.create_optimizer()
    if part == "optimizer":
        real_step, steps = optimizer.step, []

        def failing_step(*args, **kwargs):
            steps.append(None)
            if len(steps) == at_step:
                raise StepFailed(f"optimizer failed at step {at_step}")
            return real_step(*args, **kwargs)

        optimizer.step = failing_step
    else:
        def lr_factor(step):
            if step == at_step:
                raise StepFailed(f"scheduler failed at step {at_step}")
            return 1.0

        trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    with pytest.raises(StepFailed, match=f"{part} failed at step {at_step}"):
        trainer.train()


def test_importing_the_integration_does_not_import_trl():
    code = ("import sys, roundpipe, roundpipe.integrations; "
            "assert not {'transformers', 'trl', 'datasets'} & set(sys.modules); "
            "import roundpipe.integrations.transformers; assert 'trl' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_example_runs_and_prints_trainer_logs(tmp_path):
    example = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "trainer_sft.py")
    done = subprocess.run([sys.executable, example, "--steps", "3", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = [line for line in done.stdout.splitlines() if line.startswith("{'loss'")]
    assert len(logs) == 3 and all("'grad_norm'" in line and "'learning_rate'" in line for line in logs), done.stdout
    assert "'eval_loss'" in done.stdout and os.path.isfile(tmp_path / "model.safetensors")
