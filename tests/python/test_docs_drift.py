"""The pages say what the code does: trace.md's layout table names every
event category the trace renderer knows, the pages that point to
build/roundpipe-sim say how to build it, and hf.md states which outputs
carry `.logits` with labels. (train.md's sample output is checked against
the command itself in tests/cli/test_train.sh.)"""
import os
import re
import warnings

import torch
import transformers

from roundpipe import AutoRoundPipe, wrap_model_to_roundpipe
from roundpipe.trace_svg import KINDS

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_the_trace_layout_table_lists_every_category():
    layout = read("docs/trace.md").split("### Layout", 1)[1]
    rows = [line for line in layout.splitlines() if line.startswith("| `")]
    in_table = {cat for row in rows for cat in re.findall(r"`([a-z]+)`", row.split("|")[2])}
    jobs = {"forward", "fused", "backward"}  # colours of compute bars by job, not categories
    categories = {key for key, _, _ in KINDS} - jobs
    assert categories <= in_table, f"missing from docs/trace.md's layout table: {sorted(categories - in_table)}"


def test_the_pages_that_name_the_simulator_say_how_to_build_it():
    assert "roundpipe_executable(roundpipe-sim" in read("CMakeLists.txt")
    assert "roundpipe-sim" not in read("scripts/run-example")  # the main job does not build it
    for page in ("README.md", "docs/trace.md"):
        text = read(page)
        assert "build/roundpipe-sim" in text
        assert "cmake --build build --target roundpipe-sim" in text, page


def test_logits_with_labels_are_as_hf_md_says():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        preset = wrap_model_to_roundpipe(transformers.LlamaForCausalLM(config))
        split = wrap_model_to_roundpipe(transformers.LlamaForCausalLM(config), use_sequential_preset=False,
                                        lower_threshold=1000)
    assert isinstance(split, AutoRoundPipe)
    with torch.no_grad():
        assert preset(input_ids=ids, labels=ids).logits is None
        assert preset(input_ids=ids, labels=ids, return_logits=True).logits.shape == (2, 8, 64)
        assert split(input_ids=ids, labels=ids).logits.shape == (2, 8, 64)
    page = " ".join(read("docs/hf.md").split())
    assert "`.logits` only without labels or with `return_logits=True`" in page
    assert "A model without a preset (see \"Other models\") returns its own output, which has `.logits` with " \
           "labels too" in page
