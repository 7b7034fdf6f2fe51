"""The README's Python examples run as written and compute what plain
PyTorch computes: forward_backward sums the microbatch losses, so each
example divides its loss so that the sum is the batch's loss, whatever the
device count (the default microbatch count follows it)."""
import os
import re

import torch
import transformers

from models import assert_close

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def python_blocks():
    with open(README, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_the_training_loop_computes_the_batch_mean_loss():
    block = next(b for b in python_blocks() if "from roundpipe import RoundPipe" in b)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 512, generator=g), torch.randint(0, 10, (12,), generator=g)
    namespace = {"batches": [(x, y)]}
    torch.manual_seed(0)
    exec(compile(block, README, "exec"), namespace)
    model = namespace["model"]
    model.synchronize()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    ref_loss = torch.nn.functional.cross_entropy(ref(x), y)
    assert_close(namespace["loss"], ref_loss.detach(), rtol=1e-5, what="the README's loss")


def test_the_hugging_face_example_computes_the_batch_loss(tmp_path):
    block = next(b for b in python_blocks() if "wrap_model_to_roundpipe" in b)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (6, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[:2, :3] = 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    namespace = {"torch": torch, "transformers": transformers, "path": str(tmp_path), "ids": ids, "mask": mask}
    exec(compile("import roundpipe\n" + block, README, "exec"), namespace)
    ref_loss = ref(input_ids=ids, attention_mask=mask, labels=namespace["labels"]).loss
    assert_close(namespace["loss"], ref_loss.detach(), rtol=1e-5, what="the README's Hugging Face loss")
