"""The whole mixed-precision step as one capturable program: ``scaler.scale`` / backward /
``unscale_and_clip_`` / ``step`` / ``update`` / ``sched.step()``, with the scaler's skip counters
and a device schedule, and overflows planted through the inputs.

- CPU, under the emulated capture (``_library.simulate_capture``: the ops take their CUDA-graph
  capture paths) and with every host read counted: the steps read nothing on the host, and N of
  them equal N eager steps bit for bit (params, masters, moments, scale, growth tracker, skip
  counters, learning rates).
- GPU: the step captured once in a CUDA graph and replayed N times equals N eager steps.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import ampfuse
from ampfuse import _library
from ampfuse import lr_scheduler as A
from conftest import HostReads, requires_cuda, scaler_counters

STEPS = 8
OVERFLOWS = {2, 5}  # the steps whose loss is made inf (the scale backs off, the step is skipped)


def _inputs(k: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + k)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    poison = torch.tensor(float("inf") if k in OVERFLOWS else 1.0)
    return x.to(device), y.to(device), poison.to(device)


class _Training:
    """A model, an ampfuse AdamW (bf16 params with remainders), an ampfuse scaler with hysteresis
    and a short growth interval, a device LinearLR, and static inputs the step reads."""

    def __init__(self, device: str) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(device, torch.bfloat16)
        self.opt = ampfuse.optim.AdamW(self.model.parameters(), lr=1e-2, master_weights="remainder")
        self.scaler = ampfuse.GradScaler(device, init_scale=2.0**10, growth_interval=2, hysteresis=1)
        self.sched = A.LinearLR(self.opt, start_factor=0.25, total_iters=6)
        self.x, self.y, self.poison = (t.clone() for t in _inputs(0, device))
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def feed(self, k: int) -> None:
        for static, value in zip((self.x, self.y, self.poison), _inputs(k, self.x.device.type)):
            static.copy_(value)

    def step(self) -> None:
        for p in self.model.parameters():
            p.grad.zero_()
        out = self.model(self.x.to(torch.bfloat16)).float()
        loss = nn.functional.mse_loss(out, self.y) * self.poison
        self.scaler.scale(loss).backward()
        self.scaler.unscale_and_clip_(self.opt, 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()

    def snapshot(self) -> dict[str, torch.Tensor]:
        out = {f"param/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for i, p in enumerate(self.model.parameters()):
            for key, value in self.opt.state[p].items():
                out[f"state/{i}/{key}"] = value.detach().clone()
        out["scale"] = self.scaler._scale.clone()
        out["growth_tracker"] = self.scaler._growth_tracker.clone()
        out["stats"] = self.scaler._stats.clone()  # updates, overflows, backoffs, floor hits
        out["lr"] = self.opt.param_groups[0]["lr"].clone()
        out["taken"] = self.sched.taken_steps.clone()
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1).cpu()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


WARMUP = 2  # eager steps first: lazy state, step plans (a capture records a warmed-up step)


def _eager(device: str) -> _Training:
    """STEPS steps run one after the other."""
    t = _Training(device)
    for k in range(STEPS):
        t.feed(k)
        t.step()
    return t


def test_the_whole_step_under_the_emulated_capture_reads_nothing_and_equals_eager():
    eager = _eager("cpu")
    captured = _Training("cpu")
    for k in range(WARMUP):
        captured.feed(k)
        captured.step()
    reads = HostReads(ignore=scaler_counters(captured.scaler))
    for k in range(WARMUP, STEPS):
        captured.feed(k)  # what a replay's caller does: new values into the static inputs
        previous = _library.simulate_capture(True)
        try:
            with reads:
                captured.step()
        finally:
            _library.simulate_capture(previous)
    assert reads.reads == []
    _assert_same(eager.snapshot(), captured.snapshot())
    snap = eager.snapshot()
    assert snap["stats"].tolist()[:2] == [STEPS, len(OVERFLOWS)]  # the overflows were planted and counted
    assert float(snap["taken"]) == STEPS - len(OVERFLOWS)


@requires_cuda
def test_cuda_graph_of_the_whole_step_replays_as_eager_steps():
    """Captured once, replayed for steps WARMUP..STEPS-1: the same bits as those steps run eagerly."""
    eager = _eager("cuda")
    captured = _Training("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(WARMUP):
            captured.feed(k)
            captured.step()
    torch.cuda.current_stream().wait_stream(side)
    before = captured.snapshot()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.step()
    # capturing ran nothing: the state is still that of the warm-up
    torch.cuda.synchronize()
    _assert_same(before, captured.snapshot())
    for k in range(WARMUP, STEPS):
        captured.feed(k)
        graph.replay()
    torch.cuda.synchronize()
    _assert_same(eager.snapshot(), captured.snapshot())


def test_capture_helpers_agree_with_a_plain_run():
    """The helper's eager step is an ordinary training step: the params move and the schedule
    counts only the steps taken (a guard on the scenario above)."""
    t = _Training("cpu")
    start = [p.detach().clone() for p in t.model.parameters()]
    with contextlib.ExitStack():
        for k in range(4):
            t.feed(k)
            t.step()
    assert any(not torch.equal(a, p) for a, p in zip(start, t.model.parameters()))
    assert float(t.sched.taken_steps) == 3  # step 2 overflowed
