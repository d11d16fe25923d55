"""The documents: every Python snippet of the README and the manual runs, and the README's results
block is what benchmarks/report.py generates (``make docs`` builds the manual with warnings as errors).

A snippet runs on the CPU, in a namespace that holds a small model and what training code names
without defining (``model``, ``loader``, ``loss_fn``, ``optimizer``, ...); the snippets of one page
run in order and share it, as a reader reads them. A CUDA snippet runs with ``"cuda"`` read as
``"cpu"`` (ampfuse's CPU and CUDA kernels have one contract). A snippet that needs several
processes, a framework's trainer or a GPU is marked in the text just above it with

    <!-- snippet: twin tests/<file>.py::<test name> -->

and the test named there, which runs the same code, must exist.
"""

from __future__ import annotations

import ast
import os
import re
import sys

import pytest
import torch
from torch import nn

import ampfuse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES = ["README.md"] + sorted(
    os.path.relpath(os.path.join(d, f), ROOT)
    for d, _, files in os.walk(DOCS) if "_build" not in d and "_generated" not in d
    for f in files if f.endswith(".md")
)
FENCE = re.compile(r"(?:<!-- snippet: (?P<mark>[^>]*?) -->\s*\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```", re.M | re.S)


def snippets(page: str) -> list[tuple[int, str | None, str]]:
    """(line, mark, code) of each ```python block of ``page``."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    return [(text.count("\n", 0, m.start("code")) + 1, m.group("mark"), m.group("code"))
            for m in FENCE.finditer(text) if m.group("lang") == "python"]


class Model(nn.Module):
    """A small model with the shape docs snippets assume: ``blocks``, a forward of one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.head.weight.dtype)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def namespace() -> dict:
    torch.manual_seed(0)
    model = Model()
    gen = torch.Generator().manual_seed(0)
    loader = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(4)]
    optimizer = ampfuse.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return {
        "torch": torch, "nn": nn, "ampfuse": ampfuse, "Model": Model, "model": model, "loader": loader,
        "loss_fn": loss_fn, "optimizer": optimizer, "lr_scheduler": scheduler, "scheduler": scheduler,
        "scaler": ampfuse.GradScaler("cpu"),
        "accum_steps": 2, "log": lambda *args: None,
        "make_scheduler": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    }


def on_cpu(code: str) -> str:
    return code.replace('"cuda"', '"cpu"').replace(".cuda()", "")


def twin_exists(mark: str) -> bool:
    m = re.fullmatch(r"twin (?P<file>tests/[\w/]+\.py)::(?P<test>\w+)", mark)
    if not m:
        return False
    path = os.path.join(ROOT, m.group("file"))
    if not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == m.group("test") for n in ast.walk(tree))


@pytest.mark.parametrize("page", PAGES)
def test_python_snippets_run(page):
    ns = namespace()
    for line, mark, code in snippets(page):
        if mark is not None:
            assert twin_exists(mark), f"{page}:{line}: the snippet's mark {mark!r} names no existing test"
            ast.parse(code)  # it is at least Python
            continue
        try:
            exec(compile(on_cpu(code), f"{page}:{line}", "exec"), ns)
        except Exception as e:  # the page and line of the snippet, then the error
            raise AssertionError(f"the snippet at {page}:{line} raised {type(e).__name__}: {e}") from e


def test_readme_results_block_is_generated():
    """The README's results table is benchmarks/report.py's output for the newest results."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import report
    finally:
        sys.path.pop(0)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert report.readme_block(os.path.join(ROOT, "README.md")) in text
