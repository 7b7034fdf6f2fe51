"""Every code example of the user's pages (training loop; GradScaler) runs
verbatim on roundpipe, completed only by a small model, data and loss defined
here, and trains: the loss goes down over 30 steps.

The examples are kept exactly as written. Two are fragments (a `loss_fn=`
argument) and are placed inside a forward_backward call; the return_outputs
example writes `...` for "your arguments", which is replaced by them.
"""
import textwrap

import pytest
import torch

import roundpipe
from roundpipe import RoundPipe, RoundPipeRunConfig, OptimizerCtx, GradScaler
from conftest import classification_data, classifier

# ---- the examples, verbatim ------------------------------------------------

FORWARD_BACKWARD = '''
loss = model.forward_backward(
    input_args=(images,),
    input_kwargs={},
    label=labels,
    loss_fn=my_loss_fn,
    return_outputs=False,
    run_config=RoundPipeRunConfig(),
)
'''

FORWARD_BACKWARD_KWARGS = '''
loss = model.forward_backward(
    input_kwargs={"input_ids": ids, "attention_mask": mask},
    label=labels,
    loss_fn=my_loss_fn,
)
'''

LOSS_FN_MEAN = '''loss_fn=lambda outputs, labels: criterion(outputs, labels) / num_microbatch'''

LOSS_FN_SCALER = '''loss_fn=lambda outputs, labels: scaler.scale(
    criterion(outputs.float(), labels)
) / num_microbatch'''

RETURN_OUTPUTS = '''
# 只需要 loss
loss = model.forward_backward(...)

# 同时需要输出（如计算准确率）
loss, outputs = model.forward_backward(..., return_outputs=True)
'''

STEP = '''
def step_fn():
    optimizer.step()
    optimizer.zero_grad()

model.step(step_fn)
'''

STEP_PATTERNS = '''
# 基本用法
def step_fn():
    optimizer.step()
    optimizer.zero_grad()

model.step(step_fn)

# 配合 GradScaler
def step_fn():
    scaler.step(optimizer)
    optimizer.zero_grad()

model.step(step_fn)

# 配合梯度裁剪
def step_fn():
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]['params'], max_norm=1.0)
    scaler.step(optimizer)
    optimizer.zero_grad()

model.step(step_fn)
'''

SYNCHRONIZE = '''
# 1. 评估前：确保模型参数是最新的
model.synchronize()
model.eval()
with torch.no_grad():
    output = model(test_data)

# 2. 保存 checkpoint 前
model.synchronize()
torch.save(model.model.state_dict(), "checkpoint.pt")

# 3. 需要检查梯度时
model.synchronize()
for name, param in model.model.named_parameters():
    if param.grad is not None:
        print(f"{name}: grad norm = {param.grad.norm()}")
'''

EVALUATION = '''
model.synchronize()  # 确保参数是最新的
model.eval()

correct, total = 0, 0
with torch.no_grad():
    for images, labels in test_loader:
        images = images.to(torch.float16)
        outputs = model(images)  # 使用 forward()，不需要反向传播
        _, predicted = outputs.max(1)
        correct += predicted.eq(labels).sum().item()
        total += labels.size(0)

accuracy = correct / total
model.train()  # 切回训练模式
'''

FORWARD_CALLS = '''
# 以下两种方式等价
output = model(x, attention_mask=mask)
output = model.forward(x, attention_mask=mask)

# 也可以通过 run_config 覆盖配置
output = model(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2))

# 输出同样支持 backward
loss = criterion(output, labels)
loss.backward()
'''

MIXED_PRECISION_LOOP = '''
from roundpipe import RoundPipe, OptimizerCtx, GradScaler
from roundpipe.optim import Adam

model = RoundPipe(my_model.to(torch.float16), optim_dtype=torch.float32)
with OptimizerCtx():
    optimizer = Adam(model.parameters(), lr=1e-3)
scaler = GradScaler()

for data, labels in dataloader:
    # 1. forward_backward：在 loss_fn 中调用 scaler.scale()
    loss = model.forward_backward(
        input_args=(data.to(torch.float16),),
        label=labels,
        loss_fn=lambda outputs, labels: scaler.scale(
            criterion(outputs.float(), labels)
        ) / num_microbatch,
    )

    # 2. step：在 step_fn 中调用 scaler.step()
    model.step(lambda: (
        scaler.step(optimizer),
        optimizer.zero_grad(),
    ))

    # 3. update：更新缩放因子
    scaler.update()

    # 获取真实 loss 值（除以缩放因子）
    real_loss = loss.item() / scaler.get_scale()
'''

USE_ROUNDPIPE_SCALER = '''
# ✅ 正确：使用 RoundPipe 的 GradScaler
from roundpipe import GradScaler
scaler = GradScaler()
'''

MANUAL_UNSCALE = '''
def step_fn():
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]['params'], max_norm=1.0)
    scaler.step(optimizer)
    optimizer.zero_grad()

model.step(step_fn)
'''

# ---- what the test supplies --------------------------------------------------

STEPS = 30
NUM_MICROBATCH = 3


class MaskedInput(torch.nn.Module):
    """First layer of a "HuggingFace-like" model: input_ids (here features)
    and an optional attention_mask that zeroes masked features."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.proj = torch.nn.Linear(n_in, n_out)

    def forward(self, x=None, attention_mask=None, input_ids=None):
        x = input_ids if x is None else x
        if attention_mask is not None:
            x = x * attention_mask
        return self.proj(x)


def batches(n_batches, batch=24, dtype=torch.float32, seed=0):
    x, y = classification_data(n=n_batches * batch, seed=seed)
    return [(x[i * batch:(i + 1) * batch].to(dtype), y[i * batch:(i + 1) * batch]) for i in range(n_batches)]


def namespace(model=None, optimizer_cls=torch.optim.Adam, lr=1e-2):
    net = model if model is not None else classifier()
    rp = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH))
    with OptimizerCtx():
        optimizer = optimizer_cls(rp.parameters(), lr=lr)
    criterion = torch.nn.CrossEntropyLoss()
    ns = dict(torch=torch, roundpipe=roundpipe, RoundPipe=RoundPipe, RoundPipeRunConfig=RoundPipeRunConfig,
              OptimizerCtx=OptimizerCtx, GradScaler=GradScaler, model=rp, optimizer=optimizer,
              criterion=criterion, num_microbatch=NUM_MICROBATCH, scaler=GradScaler(),
              my_loss_fn=lambda outputs, labels: criterion(outputs, labels) / NUM_MICROBATCH)
    return ns


def run(code, ns):
    exec(compile(textwrap.dedent(code), "<example>", "exec"), ns)


def train(ns, forward_code, step_code=STEP, data=None, before=None):
    """Runs forward_code (+ step_code) for STEPS batches; returns the losses."""
    losses = []
    for i, (images, labels) in enumerate(data or batches(STEPS)):
        ns.update(images=images, labels=labels, ids=images, mask=torch.ones_like(images))
        if before:
            before(ns, i)
        run(forward_code, ns)
        loss = ns["loss"]
        losses.append(loss.item() / (ns["scaler"].get_scale() if "scaler.scale" in forward_code else 1.0))
        run(step_code, ns)
        if "scaler.update" not in forward_code and "scaler." in step_code:
            ns["scaler"].update()
    ns["model"].synchronize()
    return losses


def assert_trains(losses):
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, f"loss did not go down: {losses}"


def test_forward_backward_example():
    assert_trains(train(namespace(), FORWARD_BACKWARD))


def test_forward_backward_kwargs_example():
    model = torch.nn.Sequential(MaskedInput(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    assert_trains(train(namespace(model), FORWARD_BACKWARD_KWARGS))


def test_mean_loss_fragment():
    code = "loss = model.forward_backward(input_args=(images,), label=labels,\n" + LOSS_FN_MEAN + ")\n"
    assert_trains(train(namespace(), code))


def test_scaled_loss_fragment():
    code = "loss = model.forward_backward(input_args=(images,), label=labels,\n" + LOSS_FN_SCALER + ")\n"
    step = "model.step(lambda: (scaler.step(optimizer), optimizer.zero_grad()))\n"
    assert_trains(train(namespace(), code, step))


def test_return_outputs_example():
    code = RETURN_OUTPUTS.replace("...", "input_args=(images,), label=labels, loss_fn=my_loss_fn")
    ns = namespace()
    losses = train(ns, code)
    assert_trains(losses)
    assert ns["outputs"].shape == (24, 4)


def test_step_patterns_example():
    ns = namespace()
    assert_trains(train(ns, FORWARD_BACKWARD, STEP_PATTERNS))


def test_manual_unscale_example_with_a_scaler_equals_an_unscaled_twin():
    """The unscale_ + clip + step example with SGD, which feels every factor
    of its gradients: the scaled run equals a twin whose scaler is disabled
    (scales by powers of two are exact). Gradients clipped while still
    scaled, or unscaled twice, would not."""
    code = "loss = model.forward_backward(input_args=(images,), label=labels,\n" + LOSS_FN_SCALER + ")\n"
    torch.manual_seed(11)
    net = classifier()
    twin_net = classifier()
    twin_net.load_state_dict(net.state_dict())
    start = [p.clone() for p in net.parameters()]
    ns = namespace(net, optimizer_cls=torch.optim.SGD, lr=0.02)
    twin = namespace(twin_net, optimizer_cls=torch.optim.SGD, lr=0.02)
    twin["scaler"] = GradScaler(enabled=False)
    losses, twin_losses = train(ns, code, MANUAL_UNSCALE), train(twin, code, MANUAL_UNSCALE)
    assert ns["scaler"].get_scale() > 1.0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(twin_losses), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(net.named_parameters(), twin_net.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert all(not torch.equal(p, q) for p, q in zip(start, net.parameters()))  # it trained


def test_synchronize_and_evaluation_examples(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns = namespace(classifier().to(torch.float16))
    ns["model"] = RoundPipe(ns["model"].model, optim_dtype=torch.float32)
    with OptimizerCtx():
        ns["optimizer"] = roundpipe.optim.Adam(ns["model"].parameters(), lr=1e-2)
    code = ("loss = model.forward_backward(input_args=(images,), label=labels,\n" + LOSS_FN_SCALER + ")\n")
    assert_trains(train(ns, code, MANUAL_UNSCALE, data=batches(STEPS, dtype=torch.float16)))
    ns["test_data"] = batches(1, dtype=torch.float16, seed=1)[0][0]
    # Leave gradients pending, for the gradient-inspection part.
    ns["my_loss_fn"] = lambda outputs, labels: ns["criterion"](outputs.float(), labels) / NUM_MICROBATCH
    run(FORWARD_BACKWARD, dict(ns, images=ns["test_data"], labels=torch.zeros(24, dtype=torch.long)))
    run(SYNCHRONIZE, ns)
    assert ns["output"].dtype == torch.float16 and ns["output"].shape == (24, 4)
    assert (tmp_path / "checkpoint.pt").exists()
    assert torch.load(tmp_path / "checkpoint.pt").keys() == ns["model"].model.state_dict().keys()
    assert "grad norm" in capsys.readouterr().out
    ns["test_loader"] = batches(4, seed=2)
    run(EVALUATION, ns)
    assert ns["total"] == 96 and ns["accuracy"] > 0.4
    assert ns["model"].training


def test_forward_calls_example():
    model = torch.nn.Sequential(MaskedInput(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ns = namespace(model)
    x, labels = batches(1)[0]
    ns.update(x=x, labels=labels, mask=(torch.rand(24, 8) > 0.3).float())
    run(FORWARD_CALLS, ns)
    expected = model[2](model[1](model[0](x)))  # the last call: no mask, 2 microbatches
    torch.testing.assert_close(ns["output"], expected, rtol=1e-5, atol=1e-6)
    ns["model"].synchronize()
    assert all(p.grad is not None for p in model.parameters())
    # The examples train too: forward() + loss.backward() + step.
    losses = []
    for images, labels in batches(STEPS):
        ns.update(x=images, labels=labels, mask=torch.ones_like(images))
        run(FORWARD_CALLS, ns)
        losses.append(ns["loss"].item())
        run(STEP, ns)
    assert_trains(losses)


def test_mixed_precision_loop_example():
    ns = dict(torch=torch, my_model=classifier(), criterion=torch.nn.CrossEntropyLoss(),
              num_microbatch=NUM_MICROBATCH, dataloader=batches(STEPS))
    real_losses = []

    class Recording(list):
        def __iter__(self):
            for item in list.__iter__(self):
                yield item
                if "real_loss" in ns:
                    real_losses.append(ns["real_loss"])

    ns["dataloader"] = Recording(batches(STEPS))
    run(MIXED_PRECISION_LOOP, ns)
    assert len(real_losses) == STEPS
    assert_trains(real_losses)
    assert ns["model"].model[0].weight.dtype == torch.float16
    assert ns["scaler"].get_scale() > 0


def test_roundpipe_scaler_example():
    ns = dict(torch=torch)
    run(USE_ROUNDPIPE_SCALER, ns)
    assert isinstance(ns["scaler"], GradScaler) and ns["scaler"].get_scale() == 2.0 ** 16
