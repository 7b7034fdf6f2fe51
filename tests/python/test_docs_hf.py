"""The code of docs/hf.md ("Train a Hugging Face model") runs as written,
its blocks one after another in one namespace, and its own asserts hold
(the loss halves; the saved checkpoint holds the trained weights)."""
import os
import re

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "hf.md")


def test_the_page_runs():
    with open(DOC, encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert len(blocks) >= 5
    namespace = {"__name__": "docs_hf"}
    for block in blocks:
        exec(compile(block, DOC, "exec"), namespace)
    assert namespace["losses"][-1] < namespace["losses"][0] / 2
