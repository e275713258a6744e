"""README.md's Python example (between its python-example markers) runs as printed and trains: its
backward gives the layer a finite, nonzero gradient and its optimizer step changes the weights."""
import os
import re

import torch

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def test_readme_example():
    text = open(README, encoding="utf-8").read()
    m = re.search(r"<!-- python-example:begin -->\n```python\n(.*?)```\n<!-- python-example:end -->", text, re.S)
    assert m, "README.md has no python-example block"
    lines = m.group(1).strip().splitlines()
    assert lines[-1].strip() == "opt.step()", "the example ends with its optimizer step"
    torch.manual_seed(0)
    scope = {}
    exec("\n".join(lines[:-1]), scope)  # up to the backward
    grad = scope["proj"].weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    before = scope["proj"].weight.detach().clone()
    exec(lines[-1], scope)
    assert not torch.equal(before, scope["proj"].weight)
