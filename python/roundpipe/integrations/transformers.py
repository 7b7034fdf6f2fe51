"""Hugging Face ``Trainer`` and TRL's ``SFTTrainer`` with roundpipe underneath
(docs/hf.md, "With Trainer").

Replace the trainer class, keep the rest of the script::

    from roundpipe.integrations.transformers import RoundPipeTrainer   # or RoundPipeSFTTrainer

    trainer = RoundPipeTrainer(model=model, args=TrainingArguments(...), train_dataset=train)
    trainer.train()

The model (as loaded: ``from_pretrained``, a peft model) is wrapped with
``wrap_model_to_roundpipe`` when training or evaluation first needs it; its
weights stay in host memory and are the wrapped model's master copy. Each of
Trainer's optimizer steps is a ``forward_backward`` per accumulated batch and
one ``step`` whose ``step_fn`` clips to ``max_grad_norm``, steps the
optimizer and the scheduler and zeroes the gradients on roundpipe's optimizer
thread (asynchronous by default: the one-step delay of ``RoundPipe.step``).
Evaluation, prediction, logging, callbacks, checkpoints and
``resume_from_checkpoint`` work as with Trainer. Arguments roundpipe cannot
honour (``deepspeed``, ``fsdp``, ``fp16``, ...) raise a ValueError naming them.

This module imports transformers; ``RoundPipeSFTTrainer`` imports trl when it
is first used.
"""
import dataclasses
import os
import threading
from typing import Any, Dict, Optional

import torch
import transformers

from .._model import RoundPipe
from ..auto import wrap_model_to_roundpipe
from ..packed import FORMATS
from ..checkpoint import load_checkpoint, save_checkpoint
from .. import optimizer_state as _optimizer_state
from .. import optim as _optim
from ..optimizer_ctx import OptimizerCtx
from ..run_config import RoundPipeRunConfig

__all__ = ["RoundPipeConfig", "RoundPipeTrainerMixin", "RoundPipeTrainer", "RoundPipeSFTTrainer"]

# A checkpoint's roundpipe state (written with asynchronous steps): the
# parameters the devices see and the optimizer copies one step ahead, so that
# a resumed run keeps the one-step delay exactly.
ROUNDPIPE_STATE_NAME = "roundpipe_state.pt"


@dataclasses.dataclass
class RoundPipeConfig:
    """How a RoundPipe trainer runs the model.

    - ``is_async``: the optimizer step runs on the optimizer thread while the
      next batch computes (default ``True``; the one-step delay of
      ``RoundPipe.step``).
      ``False``: every step waits, and training equals plain Trainer.
    - ``num_microbatch``: microbatches per batch (default: devices + 1).
    - ``optim_dtype``: dtype of the optimizer copies (e.g. ``torch.float32``
      for a bf16 model).
    - ``optimizer_state``: ``"fp32"`` (default: Trainer's optimizer, as
      ``TrainingArguments.optim`` chooses it) or ``"compact"``:
      ``roundpipe.optim.AdamW8bit`` (8-bit moments) with Trainer's learning
      rate, betas, epsilon and weight decay, and optimizer copies in the
      model's dtype (bf16 for a bf16 model) unless ``optim_dtype`` is given
      (roundpipe.optimizer_state).
    - ``frozen_weights``: ``"nf4"``, ``"fp4"`` or ``"int8"`` keeps a LoRA
      model's frozen linear weights packed (QLoRA, roundpipe.packed);
      default ``None``: as loaded.
    - ``wrap_kwargs``: further keywords for ``wrap_model_to_roundpipe``
      (``model_run_config``, ``pin_model``, ``sync_warmup_steps``, ...).
    """
    is_async: bool = True
    num_microbatch: Optional[int] = None
    optim_dtype: Optional[torch.dtype] = None
    optimizer_state: str = "fp32"
    frozen_weights: Optional[str] = None
    wrap_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _optimizer_state.check("RoundPipeConfig", self.optimizer_state)
        if self.frozen_weights is not None and self.frozen_weights not in FORMATS:
            raise ValueError(f"RoundPipeConfig: frozen_weights must be one of {', '.join(map(repr, FORMATS))} or "
                             f"None, got {self.frozen_weights!r}")


# TrainingArguments.optim values that ask for AdamW itself, which
# optimizer_state="compact" replaces by AdamW8bit; anything else conflicts.
_PLAIN_ADAMW = ("adamw_torch", "adamw_torch_fused")


# Trainer's loop calls optimizer.step() and lr_scheduler.step() on the main
# thread; with roundpipe they run inside the step_fn, on the optimizer thread.
_in_step_fn = threading.local()


class _StepRecord:
    """What one step_fn reports to the logs once it has run."""

    def __init__(self):
        self.done = threading.Event()
        self.grad_norm = None
        self.learning_rate = None
        self.error = None


class _LoopModel:
    """The model Trainer's training loop holds: the loop's ``zero_grad`` is
    done by the step_fn (the optimizer's gradients are the copies' ones)."""

    def __init__(self, model):
        self._model = model

    def zero_grad(self, set_to_none=True):
        pass

    def train(self, mode=True):
        return self

    def __getattr__(self, name):
        return getattr(self._model, name)


class _EvalModel:
    """The model evaluation and prediction call: the RoundPipe's forward
    (no gradients), with the logits Trainer's prediction step expects."""

    def __init__(self, roundpipe):
        self._roundpipe = roundpipe

    def __call__(self, *args, **kwargs):
        if isinstance(self._roundpipe, RoundPipe):
            kwargs.setdefault("return_logits", True)  # the presets keep only the loss otherwise
        return self._roundpipe(*args, **kwargs)

    def eval(self):
        self._roundpipe.eval()
        return self

    def train(self, mode=True):
        self._roundpipe.train(mode)
        return self

    def __getattr__(self, name):
        return getattr(self._roundpipe, name)


class _SchedulerOnStepThread:
    """Trainer's scheduler whose ``step()`` runs only inside the step_fn;
    the training loop's own call is a no-op (state dicts, learning rates and
    everything else go to the scheduler)."""

    def __init__(self, scheduler):
        self.__dict__["scheduler"] = scheduler

    def step(self, *args, **kwargs):
        if getattr(_in_step_fn, "active", False):
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)

    def __setattr__(self, name, value):
        setattr(self.scheduler, name, value)


def _refuse_arguments(who, args, compute_loss_func):
    """A ValueError naming each argument roundpipe cannot honour."""
    optim = str(getattr(args.optim, "value", args.optim))
    checks = [
        ("deepspeed", args.deepspeed, "roundpipe keeps the training state in host memory itself; use one or the other"),
        ("fsdp", args.fsdp, "roundpipe keeps the training state in host memory itself; use one or the other"),
        ("fp16", args.fp16, "load the model in bf16 (dtype=torch.bfloat16) with RoundPipeConfig(optim_dtype="
                            "torch.float32) instead of Trainer's autocast and GradScaler"),
        ("bf16", args.bf16, "load the model in bf16 (dtype=torch.bfloat16) with RoundPipeConfig(optim_dtype="
                            "torch.float32) instead of Trainer's autocast"),
        ("fp16_full_eval", args.fp16_full_eval, "evaluation runs in the model's dtype"),
        ("bf16_full_eval", args.bf16_full_eval, "evaluation runs in the model's dtype"),
        ("torch_compile", args.torch_compile, "the pipeline's layers run as they are"),
        ("use_liger_kernel", args.use_liger_kernel, "it replaces the model's forward, which the pipeline runs"),
        ("label_smoothing_factor", args.label_smoothing_factor > 0,
         "the loss is computed inside the pipeline (the logits are never materialized)"),
        ("neftune_noise_alpha", args.neftune_noise_alpha is not None, "the embedding runs inside the pipeline"),
        ("optim", optim in ("lomo", "adalomo") or optim.startswith("schedule_free"),
         f"{optim} updates the parameters in backward or swaps them for evaluation, outside the step_fn"),
        ("torch_empty_cache_steps", args.torch_empty_cache_steps is not None,
         "roundpipe manages the devices' memory itself"),
        ("activation_offloading", getattr(args, "activation_offloading", False),
         "roundpipe's backward stages recompute the activations on the devices"),
        ("lr_scheduler_type", str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
         in ("reduce_lr_on_plateau", "greedy"), "this scheduler steps on evaluation metrics, outside the step_fn"),
        ("world_size", args.world_size > 1, "one process drives all GPUs; for several machines use "
                                            "roundpipe.distributed"),
        ("compute_loss_func", compute_loss_func is not None,
         "the loss is the model's own, computed inside the pipeline"),
    ]
    refused = [f"`{name}` cannot be used with roundpipe ({why})" for name, bad, why in checks if bad]
    if refused:
        raise ValueError(f"{who}: " + "; ".join(refused))


def _is_own_compute_loss(trainer):
    allowed = {transformers.Trainer.compute_loss, *getattr(trainer, "_roundpipe_known_compute_loss", ())}
    return type(trainer).compute_loss in allowed


class RoundPipeTrainerMixin:
    """Runs a ``transformers.Trainer`` (or any subclass) with roundpipe::

        class MyTrainer(RoundPipeTrainerMixin, SomeTrainer):
            pass

        trainer = MyTrainer(model=model, args=args, train_dataset=train,
                            roundpipe_config=RoundPipeConfig(is_async=True, num_microbatch=4))

    ``roundpipe_config`` (a :class:`RoundPipeConfig`, optional) is the only
    new argument. ``trainer.roundpipe_model`` is the wrapped model. The
    training loss is the model's own (``labels`` in the batch, summed over
    microbatches as Trainer sums over accumulated batches); a subclass'
    ``compute_loss`` cannot run inside the pipeline and is refused.
    Evaluation waits for the last step (with asynchronous steps the step
    after it then sees the newest parameters, as after ``synchronize()``);
    logging waits for the step it reports; checkpoints wait for the step in
    flight and do not change the run. When ``train()`` returns, the model
    holds the trained weights. An error in a step (the optimizer, the
    scheduler) is raised by ``train()``, at the latest when training ends.
    """

    def __init__(self, *args: Any, roundpipe_config: Optional[RoundPipeConfig] = None, **kwargs: Any) -> None:
        if roundpipe_config is None:
            roundpipe_config = RoundPipeConfig()
        if not isinstance(roundpipe_config, RoundPipeConfig):
            raise TypeError(f"{type(self).__name__}: roundpipe_config must be a RoundPipeConfig, "
                            f"got {type(roundpipe_config).__name__}")
        self._roundpipe_config = roundpipe_config
        self._roundpipe = None
        self._roundpipe_last_step = None
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if isinstance(given, transformers.TrainingArguments):  # before Trainer acts on them (deepspeed, fsdp)
            _refuse_arguments(type(self).__name__, given, kwargs.get("compute_loss_func"))
        super().__init__(*args, **kwargs)
        _refuse_arguments(type(self).__name__, self.args, self.compute_loss_func)
        if not _is_own_compute_loss(self):
            raise ValueError(f"{type(self).__name__}: `compute_loss` is overridden, but with roundpipe the loss is "
                             "the model's own, computed inside the pipeline")
        if getattr(self.args, "activation_checkpointing", False) or getattr(self.args, "gradient_checkpointing", False):
            # What it asks for, recomputing activations in backward, is what
            # roundpipe's backward stages do; Trainer's own would run inside them.
            self.args.activation_checkpointing = self.args.gradient_checkpointing = False
            if getattr(self.model, "is_gradient_checkpointing", False):
                self.model.gradient_checkpointing_disable()
        if self.args.n_gpu > 1:
            # roundpipe drives every visible GPU itself: no torch.nn.DataParallel.
            self.args._n_gpu = 1
            self._train_batch_size = self.args.train_batch_size

    # ---- the wrapped model -------------------------------------------------

    @property
    def roundpipe_model(self) -> Any:
        """The model wrapped with ``wrap_model_to_roundpipe`` (made on first use)."""
        if self._roundpipe is None:
            config = self._roundpipe_config
            kwargs = dict(config.wrap_kwargs)
            if config.num_microbatch is not None:
                kwargs["model_run_config"] = RoundPipeRunConfig(num_microbatch=config.num_microbatch)
            if config.optim_dtype is not None:
                kwargs["optim_dtype"] = config.optim_dtype
            elif config.optimizer_state == "compact":
                kwargs["optim_dtype"] = _optimizer_state.optim_dtype_for(
                    f"{type(self).__name__}: RoundPipeConfig", self.model, "compact")
            if config.frozen_weights is not None:
                kwargs["frozen_weights"] = config.frozen_weights
            kwargs.setdefault("name", type(self.model).__name__)
            self._roundpipe = wrap_model_to_roundpipe(self.model, **kwargs)
        return self._roundpipe

    def _move_model_to_device(self, model, device):
        pass  # the weights stay in host memory: they are roundpipe's master copy

    def _prepare_input(self, data):
        # The pipeline takes its inputs in host memory and uploads them itself.
        if isinstance(data, torch.Tensor):
            return data.cpu()
        return super()._prepare_input(data)

    def _wrap_model(self, model, training=True, dataloader=None):
        if training:
            return _LoopModel(self.model)
        self._wait_for_step()
        self.roundpipe_model.synchronize()  # evaluate the newest parameters
        return _EvalModel(self.roundpipe_model)

    # ---- optimizer and scheduler -------------------------------------------

    def create_optimizer(self, model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        roundpipe_model = self.roundpipe_model
        if self.optimizer is None:
            compact = self._roundpipe_config.optimizer_state == "compact"
            saved = getattr(self, "optimizer_cls_and_kwargs", None)
            if compact:
                # Trainer still builds the parameter groups (weight decay off
                # for biases and norms); only the optimizer class differs.
                optim = str(getattr(self.args.optim, "value", self.args.optim))
                if saved is not None or optim not in _PLAIN_ADAMW:
                    asked = saved[0].__name__ if saved is not None else f"optim={optim!r}"
                    raise ValueError(f"{type(self).__name__}: RoundPipeConfig(optimizer_state='compact') uses "
                                     f"roundpipe.optim.AdamW8bit, but {asked} asks for another optimizer; leave "
                                     "TrainingArguments.optim at adamw_torch or use optimizer_state='fp32'")
                self.optimizer_cls_and_kwargs = (_optim.AdamW8bit, {
                    "lr": self.args.learning_rate, "betas": (self.args.adam_beta1, self.args.adam_beta2),
                    "eps": self.args.adam_epsilon})
            try:
                with OptimizerCtx():  # the optimizer over the copies the optimizer thread updates
                    super().create_optimizer(roundpipe_model)
            finally:
                if compact:
                    self.optimizer_cls_and_kwargs = saved
        else:
            copies = {id(p) for p in roundpipe_model.optim_parameters()}
            if any(id(p) not in copies for group in self.optimizer.param_groups for p in group["params"]):
                raise ValueError(f"{type(self).__name__}: the optimizer passed as `optimizers` must be built over "
                                 "trainer.roundpipe_model.optim_parameters() (or inside `with "
                                 "roundpipe.OptimizerCtx():`); or pass `optimizer_cls_and_kwargs` instead")
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
        if isinstance(self.lr_scheduler, _SchedulerOnStepThread):
            self.lr_scheduler = self.lr_scheduler.scheduler
        super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler = _SchedulerOnStepThread(self.lr_scheduler)
        # Trainer's loop calls optimizer.step(): that queues the roundpipe step.
        # (Marked as the scheduler marks its own wrapper, which it replaces.)
        def queue_step(*args, **kwargs):
            self.optimizer.__dict__["_opt_called"] = True
            self._queue_step()
        queue_step._wrapped_by_lr_sched = True
        self.optimizer.__dict__["step"] = queue_step
        return self.lr_scheduler

    def _inner_optimizer(self):
        # accelerate's wrapper steps only when its gradient state says so, which
        # the main thread has moved on by the time an asynchronous step_fn runs.
        return getattr(self.optimizer, "optimizer", self.optimizer)

    # ---- one optimizer step ------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        roundpipe_model = self.roundpipe_model
        if not roundpipe_model.training:
            roundpipe_model.train()
        inputs = self._roundpipe_inputs(self._prepare_inputs(inputs))
        if "labels" not in inputs:
            raise ValueError(f"{type(self).__name__}: the training batches need `labels`: the loss is the model's "
                             "own, computed inside the pipeline")
        labels = inputs["labels"]
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            # The model divides by the tokens of all accumulated batches: the
            # microbatches' losses add up to Trainer's loss of this batch.
            inputs["num_items_in_batch"] = num_items_in_batch.cpu() if torch.is_tensor(num_items_in_batch) \
                else num_items_in_batch

            def loss_fn(outputs, _):
                return outputs.loss
        else:
            # Each microbatch's mean loss, weighted by its share of the rows,
            # and divided over the accumulated batches as Trainer does.
            rows, steps = labels.shape[0], self.current_gradient_accumulation_steps

            def loss_fn(outputs, labels_m):
                return outputs.loss * (labels_m.shape[0] / (rows * steps))
        loss = roundpipe_model.forward_backward(input_kwargs=inputs, label=labels, loss_fn=loss_fn)
        return loss.to(self.args.device)

    def _roundpipe_inputs(self, inputs):
        """The keywords of the pipelined forward (SFTTrainer adds its own)."""
        return dict(inputs)

    def _clip_grad_norm(self, model):
        return None  # clipped in the step_fn

    def _get_grad_norm(self, model, grad_norm=None):
        # Called just before optimizer.step(): the record the next step fills.
        self._roundpipe_last_step = _StepRecord()
        return self._roundpipe_last_step

    def _queue_step(self):
        record = self._roundpipe_last_step
        if record is None or record.done.is_set():
            record = self._roundpipe_last_step = _StepRecord()
        optimizer, scheduler, max_norm = self._inner_optimizer(), self.lr_scheduler, self.args.max_grad_norm
        params = [p for group in optimizer.param_groups for p in group["params"]]

        def step_fn():
            _in_step_fn.active = True
            try:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm and max_norm > 0 else float("inf"))
                record.grad_norm = norm.item()
                record.learning_rate = self._get_learning_rate()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            except BaseException as error:
                record.error = error
                raise
            finally:
                _in_step_fn.active = False
                record.done.set()

        roundpipe_model = self.roundpipe_model
        is_async = self._roundpipe_config.is_async and isinstance(roundpipe_model, RoundPipe)
        try:
            roundpipe_model.step(step_fn, is_async=is_async)
        except BaseException:
            record.done.set()
            raise

    def _wait_for_step(self, record=None):
        """Waits for a queued step_fn (the last one by default), and raises
        its error if it failed. Not a synchronize: the parameters the next
        call sees stay as the one-step delay says."""
        record = record or self._roundpipe_last_step
        if record is None:
            return
        record.done.wait()
        if record.error is not None:
            self.roundpipe_model.synchronize()  # raises it, naming the model and the step
            raise record.error  # an earlier call reported it already

    # ---- logging, evaluation, checkpoints ----------------------------------

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                                 learning_rate=None):
        if isinstance(grad_norm, _StepRecord):
            if self.control.should_log or self.control.should_evaluate or self.control.should_save:
                self._wait_for_step(grad_norm)  # its grad norm and learning rate go into the log
                grad_norm, learning_rate = grad_norm.grad_norm, grad_norm.learning_rate
            else:
                grad_norm = None
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                                         learning_rate=learning_rate)

    def _latest_state_dict(self):
        """The model's state dict with the newest optimizer result (the
        optimizer copies cast to the model's dtype), without synchronizing."""
        self._wait_for_step()
        roundpipe_model = self.roundpipe_model
        masters = dict(torch.nn.Module.named_parameters(roundpipe_model, remove_duplicate=False))
        copy_of = {id(masters[name]): copy for name, copy in roundpipe_model.optim_named_parameters()}
        state = self.model.state_dict()
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) in copy_of and name in state:
                state[name] = copy_of[id(p)].detach().to(p.dtype)
        return state

    def _save(self, output_dir=None, state_dict=None):
        if state_dict is None and self._roundpipe is not None:
            state_dict = self._latest_state_dict()
        super()._save(output_dir, state_dict=state_dict)

    def _save_checkpoint(self, model, trial):
        self._wait_for_step()  # optimizer and scheduler states belong to the optimizer thread until then
        super()._save_checkpoint(model, trial)
        if self._roundpipe_config.is_async and isinstance(self._roundpipe, RoundPipe) and self.args.should_save:
            folder = f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            path = os.path.join(self._get_output_dir(trial=trial), folder, ROUNDPIPE_STATE_NAME)
            save_checkpoint(path, self._roundpipe, step=self.state.global_step)

    def _finalize_training(self, *args, **kwargs):
        # The last step_fn's error reaches train(), and the model holds the
        # trained weights, before the final logs and callbacks.
        if self._roundpipe is not None:
            self._roundpipe.synchronize()
        return super()._finalize_training(*args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._copies_follow_the_model()

    def _load_best_model(self):
        super()._load_best_model()
        self._copies_follow_the_model()

    def _copies_follow_the_model(self):
        """After Trainer loaded weights into the model in place: the optimizer
        copies (what the next step and save_model start from) take them too."""
        if self._roundpipe is not None:
            self._roundpipe.load_state_dict(self.model.state_dict(), strict=False)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, ROUNDPIPE_STATE_NAME) if checkpoint is not None else None
        if path is not None and os.path.isfile(path) and isinstance(self._roundpipe, RoundPipe):
            load_checkpoint(path, self._roundpipe)  # the delayed parameters, the copies and the random streams


class RoundPipeTrainer(RoundPipeTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with roundpipe underneath: the same
    arguments, plus ``roundpipe_config`` (:class:`RoundPipeConfig`)::

        trainer = RoundPipeTrainer(model=model, args=TrainingArguments(...), train_dataset=train)
        trainer.train()

    See :class:`RoundPipeTrainerMixin` for what changes.
    """


# Padding-free packing's flash-attention lengths of a whole batch: the model
# derives the sequences from position_ids, per microbatch.
_PACKED_LENGTH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _sft_trainer_class():
    import trl
    from trl.trainer.utils import FusedCausalLMOutput

    class _SFTEvalModel(_EvalModel):
        """SFTTrainer's evaluation asks for its fused LM head's outputs:
        computed here from the pipeline's logits."""

        def __call__(self, *args, fused_lm_head=False, **kwargs):
            for key in _PACKED_LENGTH_KEYS:
                kwargs.pop(key, None)
            out = super().__call__(*args, **kwargs)
            if not fused_lm_head:
                return out
            labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
            logits = out.logits.float() if shift is not None else out.logits[:, :-1].float()
            labels = shift if shift is not None else labels[:, 1:]
            mask = labels != -100
            log_softmax = logits.log_softmax(-1)
            log_probs = log_softmax.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0)
            entropy = -(log_softmax.exp() * log_softmax).sum(-1).masked_fill(~mask, 0)
            is_top1 = (logits.argmax(-1) == labels) & mask
            return FusedCausalLMOutput(loss=out.loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1,
                                       label_mask=mask, aux_loss=getattr(out, "aux_loss", None))

    class RoundPipeSFTTrainer(RoundPipeTrainerMixin, trl.SFTTrainer):
        """TRL's ``SFTTrainer`` with roundpipe underneath: the same arguments,
        plus ``roundpipe_config`` (:class:`RoundPipeConfig`)::

            trainer = RoundPipeSFTTrainer(model=model, args=SFTConfig(...), train_dataset=train,
                                          processing_class=tokenizer)
            trainer.train()

        Packing, completion-only and assistant-only losses work (they are
        labels). The training logs have the loss, learning rate, grad norm
        and token count, not the entropy and token accuracy (the pipeline
        never builds the training logits); evaluation logs have them.
        """

        _roundpipe_known_compute_loss = (trl.SFTTrainer.compute_loss,)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.args.loss_type != "nll":
                raise ValueError(f"RoundPipeSFTTrainer: `loss_type={self.args.loss_type!r}` cannot be used with "
                                 "roundpipe (the loss is the model's own negative log-likelihood)")

        def _roundpipe_inputs(self, inputs):
            inputs = dict(inputs)
            inputs.pop("use_cache", None)
            for key in _PACKED_LENGTH_KEYS:
                inputs.pop(key, None)
            if self.aux_loss_enabled:
                inputs["output_router_logits"] = True
            # SFTTrainer's token count, which its compute_loss keeps for the logs.
            if "attention_mask" in inputs:
                self._total_train_tokens += int(inputs["attention_mask"].sum())
            elif "position_ids" in inputs:
                self._total_train_tokens += inputs["position_ids"].size(1)
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
            return inputs

        def _wrap_model(self, model, training=True, dataloader=None):
            wrapped = super()._wrap_model(model, training, dataloader)
            return _SFTEvalModel(wrapped._roundpipe) if isinstance(wrapped, _EvalModel) else wrapped

    return RoundPipeSFTTrainer


def __getattr__(name):
    # RoundPipeSFTTrainer imports trl: only when asked for.
    if name == "RoundPipeSFTTrainer":
        cls = _sft_trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
