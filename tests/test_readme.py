"""The README's Python examples run as written (on the CPU through the interpreter, or on the GPU)."""

import pathlib
import re

import pytest
import torch
from conftest import ON_GPU

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(index, monkeypatch):
    if not ON_GPU:
        # On the CPU, Inductor would generate and compile C++ for the surrounding PyTorch ops;
        # aot_eager traces the same graph (custom ops, autograd) without that.
        real_compile = torch.compile
        monkeypatch.setattr(torch, "compile", lambda model, **kw: real_compile(model, backend="aot_eager", **kw))
    torch._dynamo.reset()
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": "readme"})


def test_readme_has_the_examples():
    text = "\n".join(BLOCKS)
    for api in ("flash_attn_func", "attention", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                "merge_attn_states",
                "torch.compile", "backward()"):
        assert api in text
