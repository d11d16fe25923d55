"""Guarantees checked systematically: resume from any point, torch.compile of the scaler update,
the CUDA-graph capture rule of update(), and the scaler against a pure-Python model of its rule
over random sequences (hypothesis)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ampfuse
from ampfuse import grad_scaler as grad_scaler_module

# ------------------------------------------------------------------------------------------------
# resume anywhere
# ------------------------------------------------------------------------------------------------

MICRO_STEPS = 50  # 16 windows of 3 and an incomplete one, flushed
OVERFLOWS = {7, 8, 22, 40}  # micro-batches whose loss is inf


class Net(nn.Module):
    def __init__(self, mixed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12)).bfloat16()
        self.head = nn.Linear(12, 2).to(torch.float32 if mixed else torch.bfloat16)

    def forward(self, x):
        h = self.body(x.bfloat16())
        return self.head(h.to(self.head.weight.dtype)).float()


def _objects(mixed: bool):
    model = Net(mixed)
    opt = ampfuse.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**6, growth_interval=3, hysteresis=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    acc = ampfuse.GradAccumulator(model, opt, scaler, steps=3, max_grad_norm=0.5, lr_scheduler=sched)
    return model, opt, scaler, acc


def _micro_step(model, acc, k):
    g = torch.Generator().manual_seed(k)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
    with acc.accumulate():
        loss = nn.functional.mse_loss(model(x), y)
        acc.backward(loss * (math.inf if k in OVERFLOWS else 1.0))


def _save(model, acc) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "acc": acc.state_dict()}, buf)
    return buf.getvalue()


def _end_state(model, opt, scaler, acc):
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, (p, st_) in enumerate(opt.state.items()):
        for key, v in st_.items():
            out[f"opt.{i}.{key}"] = v.clone()
    out["scaler"] = scaler.state_dict()
    out["acc"] = (acc.windows, acc.skipped_windows_host, opt.param_groups[0]["lr"])
    return out


@pytest.mark.parametrize("mixed", [False, True], ids=["bf16", "mixed-fp32-bf16"])
def test_resume_from_every_step_boundary_and_mid_window(mixed):
    """A checkpoint (model + accumulator, which holds the optimizer, scaler and scheduler) taken
    before every micro-batch of a 50-micro-batch run -- at window boundaries and inside windows,
    after skipped windows too -- resumes into fresh objects to a bitwise identical end state."""
    model, opt, scaler, acc = _objects(mixed)
    checkpoints = []
    for k in range(MICRO_STEPS):
        checkpoints.append(_save(model, acc))
        _micro_step(model, acc, k)
    acc.flush()
    reference = _end_state(model, opt, scaler, acc)
    assert acc.skipped_windows_host >= 2
    for k, blob in enumerate(checkpoints):
        model, opt, scaler, acc = _objects(mixed)
        ck = torch.load(io.BytesIO(blob), weights_only=False)
        model.load_state_dict(ck["model"])
        acc.load_state_dict(ck["acc"])
        for j in range(k, MICRO_STEPS):
            _micro_step(model, acc, j)
        acc.flush()
        end = _end_state(model, opt, scaler, acc)
        assert end.keys() == reference.keys(), k
        for key, v in reference.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(end[key], v), (k, key)
            else:
                assert end[key] == v, (k, key)


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------


def _scaled_backward(model, opt, scaler, k):
    g = torch.Generator().manual_seed(k)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(torch.randn(5, 4, generator=g)), torch.randn(5, 2, generator=g))
    scaler.scale(loss * (math.inf if k in (3, 4, 9) else 1.0)).backward()


def test_compiled_update_has_no_graph_break_and_equals_eager():
    """update() compiles with fullgraph=True (no graph break: the floor polling stays out of the
    graph), and a run with the compiled update equals the eager run bitwise."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = ampfuse.GradScaler("cpu", init_scale=8.0, growth_interval=2, hysteresis=2, min_scale=1.0)
        update = torch.compile(scaler.update, backend="aot_eager", fullgraph=True) if compiled else scaler.update
        for k in range(12):
            _scaled_backward(model, opt, scaler, k)
            scaler.unscale_and_clip_(opt, 1.0)
            scaler.step(opt)
            update()
        runs.append((scaler.get_scale(), scaler._growth_tracker.item(), scaler.stats()["skipped"].item(),
                     [p.detach().clone() for p in model.parameters()]))
    (s1, g1, k1, p1), (s2, g2, k2, p2) = runs
    assert (s1, g1, k1) == (s2, g2, k2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))


def test_compiled_training_step_equals_eager():
    """The whole scaler + fused optimizer step (unscale_and_clip_, step, update) compiled with
    aot_eager equals the eager step bitwise."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = ampfuse.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = ampfuse.GradScaler("cpu", init_scale=8.0, growth_interval=2)

        def step():
            scaler.unscale_and_clip_(opt, 1.0)
            scaler.step(opt)
            scaler.update()

        fn = torch.compile(step, backend="aot_eager") if compiled else step
        for k in range(8):
            _scaled_backward(model, opt, scaler, k)
            fn()
        runs.append((scaler.get_scale(), [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_compiled_steps_of_optimizers_with_other_hyper_parameters_equal_eager():
    """Compiling the step of optimizers whose groups hold other numbers (here each its own lr)
    one after the other: torch.compile makes such numbers symbolic on the second one, and the
    group's checks still run on their values; every compiled run equals its eager run bitwise."""
    for lr, state_dtype in ((0.1, torch.float32), (0.2, torch.float32), (0.3, torch.uint8)):
        runs = []
        for compiled in (False, True):
            torch.manual_seed(0)
            p = torch.randn(64, 96, requires_grad=True)
            opt = ampfuse.optim.AdamW([p], lr=lr, state_dtype=state_dtype)
            step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
            for k in range(2):
                p.grad = torch.randn(64, 96, generator=torch.Generator().manual_seed(k))
                step()
            runs.append((p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}))
        assert torch.equal(runs[0][0], runs[1][0])
        assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def _mlp_training_step(fused_torch: bool):
    """A small bf16 MLP's training step (forward, scaled backward, unscale and clip, step, update,
    zero_grad) with ampfuse's AdamW and GradScaler, or torch's fused AdamW and GradScaler."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    if fused_torch:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    else:
        opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = ampfuse.GradScaler("cpu", init_scale=8.0)

    def step():
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if fused_torch:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    return model, step


def test_compiled_training_step_breaks_no_more_than_torchs_fused_adamw_and_equals_eager():
    """The steady-state training step (after a first, eager one) traced by torch._dynamo: ampfuse's
    AdamW and GradScaler give no more graphs and graph breaks than torch's fused AdamW and
    GradScaler in the same step (the optimizer's step is traced into the graph: it has no break of
    its own), and compiled steps equal eager steps bitwise."""
    counts = {}
    for fused_torch in (True, False):
        torch._dynamo.reset()
        _, step = _mlp_training_step(fused_torch)
        step()
        explained = torch._dynamo.explain(step)()
        counts[fused_torch] = (explained.graph_count, explained.graph_break_count)
    assert counts[False][0] <= counts[True][0] and counts[False][1] <= counts[True][1], counts
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        model, step = _mlp_training_step(False)
        fn = torch.compile(step, backend="aot_eager") if compiled else step
        for _ in range(4):
            fn()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_compiled_step_refuses_a_bad_group_value_before_any_group_steps():
    """A compiled step is traced for its groups' values: a value changed to one the step op refuses
    (the second group's lr, its stochastic-rounding seed) is refused when the step is traced again,
    before any group steps."""
    torch._dynamo.reset()
    p = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    q = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    opt = ampfuse.optim.AdamW([{"params": [p]}, {"params": [q]}], lr=0.1, master_weights="stochastic")
    step = torch.compile(opt.step, backend="aot_eager")
    for _ in range(2):
        p.grad, q.grad = torch.randn(64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
        step()
    for key, value, message in (("lr", -1.0, "lr must be >= 0"),
                                 ("rounding_seed", -5, r"rounding_seed must be in \[0, 2\*\*53\)")):
        good = opt.param_groups[1][key]
        opt.param_groups[1][key] = value
        before = [p.detach().clone(), q.detach().clone(), *(t.clone() for t in opt.state[p].values())]
        with pytest.raises(Exception, match=message):
            step()
        after = [p.detach(), q.detach(), *opt.state[p].values()]
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        opt.param_groups[1][key] = good


# ------------------------------------------------------------------------------------------------
# CUDA graphs: what update() does while a capture is under way
# ------------------------------------------------------------------------------------------------


def test_update_does_not_poll_or_copy_during_capture(monkeypatch):
    """During CUDA-graph capture update() queries no event and copies nothing to the host (both
    are illegal in a capture); it polls again once the capture is over. The decision is tested
    here on the CPU by reporting a capture; the capture itself runs in the GPU suite."""
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0, min_scale=1.0, backoff_factor=0.5)
    model = nn.Linear(4, 2)
    opt = ampfuse.optim.SGD(model.parameters(), lr=0.1)
    polled = []
    real_poll, real_copy = scaler._poll_min_scale, scaler._post_stats_copy
    monkeypatch.setattr(scaler, "_poll_min_scale", lambda blocking: (polled.append(blocking), real_poll(blocking)))
    monkeypatch.setattr(scaler, "_post_stats_copy", lambda: (polled.append("copy"), real_copy()))
    monkeypatch.setattr(grad_scaler_module, "capturing", lambda device: True)
    for k in range(3):
        _scaled_backward(model, opt, scaler, 3)  # overflows: the scale hits its floor
        scaler.step(opt)
        scaler.update()
    assert polled == []
    monkeypatch.setattr(grad_scaler_module, "capturing", lambda device: False)
    _scaled_backward(model, opt, scaler, 3)
    scaler.step(opt)
    with pytest.warns(RuntimeWarning, match="hit its floor"):
        scaler.update()
    assert polled and polled[0] is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_graph_capture_of_scale_backward_step_update():
    """scale -> backward -> unscale_and_clip_ -> step -> update captured in one CUDA graph with
    the default options (on_min_scale="warn"), replayed: the same result as eager."""
    torch.manual_seed(0)
    model = nn.Linear(16, 4).cuda().half()
    opt = ampfuse.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), capturable=True)
    scaler = ampfuse.GradScaler("cuda", init_scale=2.0**10)
    x = torch.randn(8, 16, device="cuda").half()
    y = torch.randn(8, 4, device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        scaler.scale(nn.functional.mse_loss(model(x).float(), y)).backward()
        scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    before = opt.state[model.weight]["step"].item()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert opt.state[model.weight]["step"].item() == before + 3
    assert torch.isfinite(model.weight).all()


# ------------------------------------------------------------------------------------------------
# property tests: the scaler against a pure-Python model of its rule
# ------------------------------------------------------------------------------------------------

FLT_MIN = float(np.finfo(np.float32).tiny)
FLT_MAX = float(np.finfo(np.float32).max)


@np.errstate(over="ignore")
def reference_scaler(init, growth, backoff, interval, hysteresis, consecutive, min_scale, max_scale, found_seq):
    """The scale after each update: torch's rule (double arithmetic, fp32 rounding, no growth to
    inf) plus hysteresis and [max(min_scale, FLT_MIN), max_scale] bounds."""
    floor = max(min_scale or 0.0, FLT_MIN)
    ceil = max_scale if max_scale is not None and math.isfinite(max_scale) else FLT_MAX
    s = np.float32(min(max(init, min_scale if min_scale is not None else -math.inf), max_scale if max_scale is not None else math.inf))
    tracker, left = 0, hysteresis
    out = []
    for found in found_seq:
        if found:
            tracker = 0
            left = max(left - 1, 0)
            if left == 0:
                ns = np.float32(np.float64(s) * backoff)
                if not ns >= floor:
                    ns = np.float32(floor)
                s = min(ns, np.float32(ceil))
        else:
            if consecutive:
                left = hysteresis
            if tracker + 1 == interval:
                ns = np.float32(np.float64(s) * growth)
                if np.isfinite(ns):
                    s = ns if ns <= np.float32(ceil) else max(s, np.float32(ceil))
                tracker = 0
                left = hysteresis
            else:
                tracker += 1
        out.append(float(s))
    return out


@settings(max_examples=60)
@given(
    init=st.sampled_from([1.0, 2.0**-10, 2.0**16, 3.0e38, 7.5]),
    growth=st.sampled_from([2.0, 1.5, 1.0001, 4.0]),
    backoff=st.sampled_from([0.5, 0.25, 0.9]),
    interval=st.integers(1, 5),
    hysteresis=st.integers(1, 4),
    consecutive=st.booleans(),
    bounds=st.sampled_from([(None, None), (1.0, None), (None, 2.0**20), (2.0**-4, 2.0**12), (0.0, math.inf)]),
    found_seq=st.lists(st.booleans(), min_size=1, max_size=60),
)
def test_scaler_matches_the_reference_rule(init, growth, backoff, interval, hysteresis, consecutive, bounds, found_seq):
    min_scale, max_scale = bounds
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # clamped init_scale, floor hits
        scaler = ampfuse.GradScaler("cpu", init_scale=init, growth_factor=growth, backoff_factor=backoff,
                                    growth_interval=interval, hysteresis=hysteresis, consecutive_hysteresis=consecutive,
                                    min_scale=min_scale, max_scale=max_scale, on_min_scale="ignore")
        p = torch.zeros(3, requires_grad=True)
        opt = ampfuse.optim.SGD([p], lr=0.0)
        got = []
        for found in found_seq:
            scaler.scale(torch.ones(()))
            p.grad = torch.full((3,), math.inf if found else 1.0)
            scaler.step(opt)
            scaler.update()
            got.append(scaler.get_scale())
    expected = reference_scaler(init, growth, backoff, interval, hysteresis, consecutive, min_scale, max_scale, found_seq)
    assert got == expected
    stats = scaler.stats()
    assert stats["updates"].item() == len(found_seq) and stats["skipped"].item() == sum(found_seq)
