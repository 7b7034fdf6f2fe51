"""wrap_model_to_roundpipe against transformers (SPEC 4.8): on tiny random
models of the four families, in processes with 1 and 3 CPU devices, the
logits, the loss (padding; whole-batch mean and num_items_in_batch over
microbatches; the load-balancing loss of the MoE families), every gradient,
and every parameter after three optimizer steps, fp32, 1e-5 relative."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import roundpipe
from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe

import hf_models

TOLERANCE = 1e-5

SCRIPT = textwrap.dedent('''
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    import hf_models
    from roundpipe import OptimizerCtx, RoundPipeRunConfig, get_num_devices, wrap_model_to_roundpipe
    torch.set_num_threads(1)

    def rel(a, b):
        a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
        return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    report = {{"devices": get_num_devices()}}
    for family in hf_models.FAMILIES:
        hf, ref = hf_models.model(family), hf_models.model(family)
        ids, mask, labels = hf_models.batch()
        model = wrap_model_to_roundpipe(hf, model_run_config=RoundPipeRunConfig(num_microbatch=3))
        model.model[-1].chunk_tokens = 7  # several loss chunks per microbatch
        worst = {{}}
        # The load-balancing loss is not additive over microbatches: the
        # whole batch's cross-entropy with it off, and it on one microbatch.
        moe = {{"output_router_logits": False}} if family in ("qwen3_moe", "gpt_oss") else {{}}
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, return_logits=True, **moe)
            want = ref(input_ids=ids, attention_mask=mask, labels=labels, **moe)
        worst["logits"] = rel(out.logits, want.logits)
        worst["loss (mean over the batch)"] = rel(out.loss, want.loss)
        if moe:
            one = RoundPipeRunConfig(num_microbatch=1)
            with torch.no_grad():
                out1 = model(input_ids=ids, attention_mask=mask, labels=labels, roundpipe_run_config=one)
                want = ref(input_ids=ids, attention_mask=mask, labels=labels)
            worst["aux_loss"] = rel(out1.aux_loss, want.aux_loss)
            worst["loss with aux_loss (one microbatch)"] = rel(out1.loss, want.loss)
        with OptimizerCtx():
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        n = (labels[:, 1:] != -100).sum()
        kwargs = {{"input_ids": ids, "attention_mask": mask, "labels": labels, "num_items_in_batch": n}}
        worst["loss (num_items_in_batch)"] = worst["every gradient"] = 0.0
        for step in range(3):
            loss = model.forward_backward(input_kwargs=kwargs, loss_fn=lambda o, _: o.loss)
            # The reference: forward_backward's definition (SPEC 4.1), each
            # microbatch through transformers; for the dense families also
            # the whole batch at once.
            ref_loss = 0.0
            for part in zip(*(t.tensor_split(3) for t in (ids, mask, labels))):
                chunk = dict(zip(("input_ids", "attention_mask", "labels"), part), num_items_in_batch=n)
                part_loss = ref(**chunk).loss
                part_loss.backward()
                ref_loss = ref_loss + part_loss.detach()
            if family in ("llama", "qwen3"):
                with torch.no_grad():
                    whole = ref(**kwargs).loss
                worst["loss (num_items_in_batch)"] = max(worst["loss (num_items_in_batch)"], rel(ref_loss, whole))
            worst["loss (num_items_in_batch)"] = max(worst["loss (num_items_in_batch)"], rel(loss, ref_loss))
            model.synchronize()
            for p, q in zip(hf.parameters(), ref.parameters()):
                worst["every gradient"] = max(worst["every gradient"], rel(p.grad, q.grad))
            model.step(lambda: (opt.step(), opt.zero_grad()), is_async=False)
            ref_opt.step()
            ref_opt.zero_grad()
        worst["parameters after 3 steps"] = max(rel(p, q) for p, q in zip(hf.parameters(), ref.parameters()))
        report[family] = worst
    print(json.dumps(report))
''')


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "check.py"
    path.write_text(SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    out = {}
    for n in (1, 3):
        env = dict(os.environ, ROUNDPIPE_DEVICES=f"cpu:{n}")
        done = subprocess.run([sys.executable, str(path)], env=env, check=True, timeout=600,
                              capture_output=True, text=True)
        out[n] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("devices", [1, 3])
@pytest.mark.parametrize("family", hf_models.FAMILIES)
def test_preset_matches_transformers(reports, family, devices):
    report = reports[devices]
    assert report["devices"] == devices
    worst = report[family]
    print(f"{family} on {devices} device(s): " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    assert set(worst) >= {"logits", "loss (mean over the batch)", "loss (num_items_in_batch)", "every gradient",
                          "parameters after 3 steps"}
    bad = {k: v for k, v in worst.items() if not v <= TOLERANCE}
    assert not bad, f"{family} on {devices} device(s) differs from transformers: {bad}"
