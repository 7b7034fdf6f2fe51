"""Bad-input catalog (docs/guide.md, "6b. Reliability checks"): every public
entry point, each invalid argument, gets a clear error of the right type whose
message says what was wrong; nothing crashes or hangs, and the model's state
(parameters, gradients, optimizer copies) is exactly as before. The model
still trains afterwards."""
import math

import pytest
import torch
from torch import nn

import roundpipe
from roundpipe import (GradScaler, ModelExecutePlan, OptimizerCtx, RoundPipe, RoundPipeRunConfig, data,
                       presets, safetensors)
from roundpipe.optim import SGD, Adam


def mse(out, y):
    return torch.nn.functional.mse_loss(out, y)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model = RoundPipe(net, name="catalog")
    with OptimizerCtx():
        opt = Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    model.forward_backward((x,), label=y, loss_fn=mse)
    model.step(lambda: (opt.step(), opt.zero_grad()))
    model.forward_backward((x,), label=y, loss_fn=mse)  # pending gradients
    model.synchronize()
    return model, net, opt, x, y


def state_of(model, net):
    model.synchronize()
    out = {f"param {n}": p.detach().clone() for n, p in net.named_parameters()}
    out.update({f"grad {n}": p.grad.clone() for n, p in net.named_parameters() if p.grad is not None})
    out.update({f"copy {n}": p.detach().clone() for n, p in model.optim_named_parameters()})
    return out


def cases(tmp):
    """(what, call, exception type, regex the message must match)."""
    bad_net = nn.Sequential(nn.Linear(3, 3))
    return [
        ("RoundPipe(non-module)", lambda m, x, y: RoundPipe(42), TypeError, "torch.nn.Module"),
        ("RoundPipe(empty)", lambda m, x, y: RoundPipe(nn.Sequential()), ValueError, "no layers"),
        ("RoundPipe(optim_dtype=str)", lambda m, x, y: RoundPipe(bad_net, optim_dtype="fp32"), TypeError,
         "optim_dtype"),
        ("RoundPipe(pin_model=bad)", lambda m, x, y: RoundPipe(bad_net, pin_model="yes"), ValueError, "pin_model"),
        ("RoundPipe(model_run_config=dict)", lambda m, x, y: RoundPipe(bad_net, model_run_config={}), TypeError,
         "RoundPipeRunConfig"),
        ("forward_backward(input_args=tensor)", lambda m, x, y: m.forward_backward(x, label=y, loss_fn=mse),
         TypeError, "tuple"),
        ("forward_backward(input_kwargs=list)",
         lambda m, x, y: m.forward_backward((x,), input_kwargs=[1], label=y, loss_fn=mse), TypeError, "dict"),
        ("forward_backward(loss_fn=3)", lambda m, x, y: m.forward_backward((x,), label=y, loss_fn=3), TypeError,
         "callable"),
        ("forward_backward(wrong input width)",
         lambda m, x, y: m.forward_backward((torch.randn(6, 5),), label=y, loss_fn=mse), RuntimeError,
         "RoundPipe model 'catalog'.*layer 0"),
        ("forward_backward(loss_fn returns str)",
         lambda m, x, y: m.forward_backward((x,), label=y, loss_fn=lambda o, l: "nope"), Exception,
         "loss_fn"),
        ("forward_backward(loss_fn raises)",
         lambda m, x, y: m.forward_backward((x,), label=y, loss_fn=lambda o, l: 1 / 0), ZeroDivisionError,
         "division by zero"),
        ("forward(bad plan)",
         lambda m, x, y: m.forward(x, roundpipe_run_config=RoundPipeRunConfig(
             execute_plan=ModelExecutePlan(fwd_plan=[range(0, 99)]))), ValueError, "plan|layer"),
        ("RoundPipeRunConfig(num_microbatch=0)", lambda m, x, y: RoundPipeRunConfig(num_microbatch=0), ValueError,
         "from 1 to"),
        ("RoundPipeRunConfig(num_microbatch=1.5)", lambda m, x, y: RoundPipeRunConfig(num_microbatch=1.5),
         TypeError, "int"),
        ("RoundPipeRunConfig(recompute_grain=bad)", lambda m, x, y: RoundPipeRunConfig(recompute_grain="op"),
         ValueError, "recompute_grain"),
        ("RoundPipeRunConfig(requires_grad=str)", lambda m, x, y: RoundPipeRunConfig(requires_grad="yes"),
         TypeError, "requires_grad"),
        ("step(None)", lambda m, x, y: m.step(None), (TypeError, ValueError), "step_fn"),
        ("train(str)", lambda m, x, y: m.train("yes"), ValueError, "boolean"),
        ("load_state_dict(unknown key)", lambda m, x, y: m.load_state_dict({"bogus": torch.zeros(1)}),
         (RuntimeError, KeyError, ValueError), "bogus"),
        ("ModelExecutePlan.auto(bad run_type)", lambda m, x, y: ModelExecutePlan.auto("bogus", m), ValueError,
         "run_type"),
        ("ModelExecutePlan.auto(no models)", lambda m, x, y: ModelExecutePlan.auto("train"), ValueError,
         "at least one model"),
        ("set_sync_warmup_steps(str)", lambda m, x, y: roundpipe.set_sync_warmup_steps("3"), TypeError, "int"),
        ("GradScaler.set_growth_factor(0.5)", lambda m, x, y: GradScaler().set_growth_factor(0.5), ValueError,
         "growth"),
        ("Adam(lr=-1)", lambda m, x, y: Adam([torch.zeros(2, requires_grad=True)], lr=-1.0), ValueError, "learning rate"),
        ("SGD(momentum=-1)", lambda m, x, y: SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=-1.0),
         ValueError, "momentum"),
        ("presets.make_decoder(str)", lambda m, x, y: presets.make_decoder("llama"), TypeError, "DecoderConfig"),
        ("presets.config_from_hf(unknown type)",
         lambda m, x, y: presets.config_from_hf({"model_type": "gpt2", "vocab_size": 8, "hidden_size": 8,
                                                 "intermediate_size": 8, "num_hidden_layers": 1,
                                                 "num_attention_heads": 1}), ValueError, "model_type"),
        ("presets.apply_lora(non-preset)", lambda m, x, y: presets.apply_lora(bad_net), TypeError, "make_decoder"),
        ("presets.load_config(missing)", lambda m, x, y: presets.load_config(tmp / "none.json"), ValueError,
         "cannot read"),
        ("safetensors.save_file(non-tensor)", lambda m, x, y: safetensors.save_file({"a": 3}, tmp / "a.st"),
         TypeError, "torch.Tensor"),
        ("safetensors.load_file(missing)", lambda m, x, y: safetensors.load_file(tmp / "missing.st"),
         (ValueError, RuntimeError, OSError), "missing.st"),
        ("data.TokenBatcher(seq_len=0)", lambda m, x, y: data.TokenBatcher(torch.arange(100), seq_len=0),
         ValueError, "seq_len"),
        ("load_checkpoint(missing)", lambda m, x, y: roundpipe.load_checkpoint(tmp / "missing.ckpt", m),
         ValueError, "missing.ckpt"),
        ("save_checkpoint(directory missing)",
         lambda m, x, y: roundpipe.save_checkpoint(tmp / "no" / "dir" / "c.ckpt", m), (ValueError, OSError,
                                                                                       RuntimeError), "dir"),
        ("load_checkpoint(garbage)",
         lambda m, x, y: ((tmp / "garbage.ckpt").write_bytes(b"x" * 100),
                          roundpipe.load_checkpoint(tmp / "garbage.ckpt", m)), ValueError, "garbage.ckpt"),
    ]


def test_every_bad_input_gets_a_clear_error_and_changes_nothing(setup, tmp_path):
    model, net, opt, x, y = setup
    before = state_of(model, net)
    problems = []
    for what, call, exc, pattern in cases(tmp_path):
        try:
            call(model, x, y)
            problems.append(f"{what}: no error")
        except exc as e:
            import re
            if not re.search(pattern, str(e)):
                problems.append(f"{what}: message {str(e)[:300]!r} does not match {pattern!r}")
        except Exception as e:  # noqa: BLE001 - the wrong type is what we report
            problems.append(f"{what}: {type(e).__name__} instead of {exc}: {str(e)[:200]}")
        after = state_of(model, net)
        changed = [k for k in before if k not in after or not torch.equal(before[k], after[k])]
        if changed or len(after) != len(before):
            problems.append(f"{what}: changed {changed or 'the set of tensors'}")
            before = after
    assert not problems, "\n".join(problems)
    # Still trains.
    loss = model.forward_backward((x,), label=y, loss_fn=mse)
    assert math.isfinite(float(loss))
    model.step(lambda: (opt.step(), opt.zero_grad()))
    model.synchronize()
