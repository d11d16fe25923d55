"""Tests of the loss-scaling ops against torch's own reference ops.

Per op: sample inputs, a reference, ``_test_*`` helpers run on each device (CUDA variants skip
without a GPU), bitwise comparison where the math is the same, and ``torch.library.opcheck``.
The checks shared by every op (the optimizer and accumulation ops too) are tested here as well:
the same errors under FakeTensorMode, and clear errors for empty lists, sparse layouts, and aliased
or stride-0 tensors (refused before anything changes).
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ampfuse
from ampfuse import ops
from conftest import DEVICES

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
LAYOUTS = ["contiguous", "transposed", "sliced", "unaligned", "permuted3d", "empty", "single"]
FLT_MIN = float(np.finfo(np.float32).tiny)


def make_tensor(layout: str, n: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    """A tensor of about n elements with the given memory layout (values ~ N(0, 100^2))."""

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * 100).to(dtype).to(device)

    n = max(n, 2)
    if layout == "contiguous":
        return rnd(n)
    if layout == "transposed":
        a = max(1, int(math.sqrt(n)))
        return rnd(a, n // a + 1).t()
    if layout == "sliced":  # non-dense: a kernel must copy it
        return rnd(2 * n)[::2]
    if layout == "unaligned":  # contiguous but offset by one element
        return rnd(n + 1)[1:]
    if layout == "permuted3d":
        return rnd(3, n // 6 + 1, 2).permute(2, 0, 1)
    if layout == "empty":
        return rnd(0, 3)
    if layout == "single":
        return rnd(1)
    raise ValueError(layout)


def inject(t: torch.Tensor, positions: list[int], values: list[float]) -> None:
    flat = t.view(-1) if t.is_contiguous() else None
    for p, v in zip(positions, values):
        if t.numel() == 0:
            return
        idx = np.unravel_index(p % t.numel(), tuple(t.shape))
        if flat is not None:
            flat[p % t.numel()] = v
        else:
            t[tuple(int(i) for i in idx)] = v


def torch_reference_unscale(tensors, found_inf, inv_scale):
    """torch._amp_foreach_non_finite_check_and_unscale_ on CPU copies (the CPU kernel covers every
    dtype, bf16 included), one tensor at a time."""
    out = [t.detach().cpu().clone() for t in tensors]
    fi = found_inf.detach().cpu().clone()
    inv = inv_scale.detach().cpu()
    for t in out:
        torch._amp_foreach_non_finite_check_and_unscale_([t], fi, inv)
    return out, fi


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# unscale_check_
# ---------------------------------------------------------------------------------------------


def sample_inputs(device: str, seed: int = 0, with_nonfinite: bool = True):
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for i, (dtype, layout) in enumerate((d, l) for d in FLOAT_DTYPES for l in LAYOUTS):
        tensors.append(make_tensor(layout, 97 + 31 * i, dtype, device, gen))
    tensors.append(make_tensor("contiguous", 70001, torch.float16, device, gen))  # > one chunk
    if with_nonfinite:
        inject(tensors[3], [5], [float("nan")])
        inject(tensors[-1], [40000], [float("inf")])
    found_inf = torch.zeros(1, device=device)
    inv_scale = torch.full((1,), 1.0 / 1024, device=device)
    return tensors, found_inf, inv_scale


def _test_unscale_check_matches_torch(device, inv_value, with_nonfinite):
    tensors, found_inf, inv_scale = sample_inputs(device, with_nonfinite=with_nonfinite)
    inv_scale.fill_(inv_value)
    expected, expected_fi = torch_reference_unscale(tensors, found_inf, inv_scale)
    ops.unscale_check_(tensors, found_inf, inv_scale)
    for a, e in zip(tensors, expected):
        assert_bitwise(a, e)
    assert_bitwise(found_inf, expected_fi)
    assert found_inf.item() == (1.0 if with_nonfinite else 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inv_value", [1.0 / 1024, 1.0 / 3.0, 1.0, 3.0e-5])
@pytest.mark.parametrize("with_nonfinite", [False, True])
def test_unscale_check_matches_torch(device, inv_value, with_nonfinite):
    _test_unscale_check_matches_torch(device, inv_value, with_nonfinite)


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_check_never_resets_found_inf(device):
    tensors, found_inf, inv_scale = sample_inputs(device, with_nonfinite=False)
    found_inf.fill_(1.0)
    ops.unscale_check_(tensors, found_inf, inv_scale)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_check_empty_list(device):
    found_inf = torch.zeros(1, device=device)
    ops.unscale_check_([], found_inf, torch.ones(1, device=device))
    assert found_inf.item() == 0.0
    norm, coef = ops.unscale_check_norm_([], found_inf, torch.ones(1, device=device), max_norm=1.0)
    assert norm.item() == 0.0 and coef.item() == 1.0


def _hypothesis_case(device, data):
    n_tensors = data.draw(st.integers(1, 6), label="n_tensors")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    tensors = []
    for _ in range(n_tensors):
        dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
        layout = data.draw(st.sampled_from(LAYOUTS), label="layout")
        n = data.draw(st.integers(1, 5000), label="numel")
        t = make_tensor(layout, n, dtype, device, gen)
        k = data.draw(st.integers(0, 3), label="n_nonfinite")
        pos = data.draw(st.lists(st.integers(0, 10**6), min_size=k, max_size=k), label="pos")
        vals = data.draw(st.lists(st.sampled_from([math.inf, -math.inf, math.nan]), min_size=k, max_size=k), label="vals")
        inject(t, pos, vals)
        tensors.append(t)
    inv = data.draw(st.sampled_from([1.0, 0.5, 2.0**-16, 1.0 / 3.0, 1.0 / 65504.0]), label="inv")
    return tensors, torch.zeros(1, device=device), torch.full((1,), inv, device=device)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=150)
@given(data=st.data())
def test_unscale_check_random_nonfinite(device, data):
    tensors, found_inf, inv_scale = _hypothesis_case(device, data)
    expected, expected_fi = torch_reference_unscale(tensors, found_inf, inv_scale)
    per_tensor = torch.zeros(len(tensors), device=device)
    copies = [t.clone() for t in tensors]
    norm, _ = ops.unscale_check_norm_(copies, found_inf.clone(), inv_scale, per_tensor_found_inf=per_tensor)
    ops.unscale_check_(tensors, found_inf, inv_scale)
    for a, c, e in zip(tensors, copies, expected):
        assert_bitwise(a, e)
        assert_bitwise(c, e)
    assert_bitwise(found_inf, expected_fi)
    flags = [float((~torch.isfinite(t.double())).any()) for t in [x.cpu() for x in expected]]
    # A tensor's flag is set exactly when it held a non-finite value before unscaling.
    before = [float((~torch.isfinite(t.cpu().double() / inv_scale.item())).any()) if t.numel() else 0.0 for t in expected]
    assert per_tensor.cpu().tolist() == [max(a, b) for a, b in zip(flags, before)]


# ---------------------------------------------------------------------------------------------
# norm extras
# ---------------------------------------------------------------------------------------------


def reference_norm(tensors, inv, norm_type):
    vals = [t.detach().cpu().double().reshape(-1) * inv for t in tensors]
    cat = torch.cat(vals) if vals else torch.zeros(0, dtype=torch.float64)
    return torch.linalg.vector_norm(cat, norm_type).item() if cat.numel() else 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("write_back", [True, False])
def test_norm_matches_vector_norm(device, norm_type, write_back):
    tensors, found_inf, inv_scale = sample_inputs(device, seed=1, with_nonfinite=False)
    before = [t.clone() for t in tensors]
    expected = reference_norm(tensors, inv_scale.item(), norm_type)
    fn = ops.unscale_check_norm_ if write_back else ops.check_norm_
    norm, coef = fn(tensors, found_inf, inv_scale, norm_type=norm_type, max_norm=0.5)
    # With an fp64 tensor in the list (there are), the norm is accumulated and returned in fp64.
    assert norm.shape == () and norm.dtype == torch.float64 and norm.device.type == device
    assert coef.dtype == torch.float32
    if norm_type == 2.0:
        # fp32 accumulation of ~80k squares: within 1e-5 relative of the fp64 reference.
        assert norm.item() == pytest.approx(expected, rel=1e-5)
    else:
        # max |x * inv| is exact in fp32 (x * inv is what the kernel computes).
        assert norm.item() == max(float((t.float() * inv_scale.cpu().item()).abs().max()) if t.numel() else 0.0 for t in [b.cpu() for b in before])
    expected_coef = float(np.float32(min(1.0, (1.0 / (norm.item() + 1e-6)) * 0.5)))
    assert coef.item() == pytest.approx(expected_coef, rel=0, abs=0)
    assert found_inf.item() == 0.0
    if write_back:
        expected_t, _ = torch_reference_unscale(before, torch.zeros(1), inv_scale)
        for a, e in zip(tensors, expected_t):
            assert_bitwise(a, e)
    else:
        for a, b in zip(tensors, before):
            assert_bitwise(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_clip_matches_clip_grad_norm(device):
    """unscale + norm + clip coefficient agrees with unscale_ followed by clip_grad_norm_."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(s, generator=gen).to(device) * 64 for s in [(33, 7), (1000,), (5,), (2, 3, 4)]]
    inv = torch.full((1,), 1 / 64.0, device=device)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in params], torch.zeros(1, device=device), inv)
    ref_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    fi = torch.zeros(1, device=device)
    norm, coef = ops.unscale_check_norm_(grads, fi, inv, max_norm=1.0)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    torch._foreach_mul_(grads, coef)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g, p.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_with_nonfinite(device):
    tensors, found_inf, inv_scale = sample_inputs(device, seed=2, with_nonfinite=True)
    norm, coef = ops.check_norm_(tensors, found_inf, inv_scale, max_norm=1.0)
    assert found_inf.item() == 1.0
    assert not math.isfinite(norm.item())


def test_norm_deterministic_across_thread_counts():
    tensors, found_inf, inv_scale = sample_inputs("cpu", seed=4, with_nonfinite=False)
    old = torch.get_num_threads()
    try:
        results = []
        for n in [1, 2, old]:
            torch.set_num_threads(n)
            results.append(ops.check_norm_(tensors, found_inf, inv_scale)[0].item())
    finally:
        torch.set_num_threads(old)
    assert len(set(results)) == 1


def test_fp64_norm_beyond_the_float_range():
    """fp64 grads whose norm exceeds the float range: a finite fp64 norm, no inf flag, and the
    clip coefficient torch's clip_grad_norm_ computes."""
    grads = [torch.full((10,), 3e19, dtype=torch.float64), torch.full((4,), 2e19, dtype=torch.float64)]
    fi = torch.zeros(1)
    norm, coef = ops.check_norm_(grads, fi, torch.ones(1), max_norm=1.0)
    params = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    ref = torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert norm.dtype == torch.float64 and fi.item() == 0.0
    torch.testing.assert_close(norm, ref, rtol=1e-15, atol=0)
    torch.testing.assert_close(grads[0] * coef.double(), params[0].grad, rtol=1e-7, atol=0)


# ---------------------------------------------------------------------------------------------
# update_scale_
# ---------------------------------------------------------------------------------------------


def scale_state(device, scale=2.0**16, tracker=0):
    return (
        torch.full((1,), scale, dtype=torch.float32, device=device),
        torch.full((1,), tracker, dtype=torch.int32, device=device),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_matches_torch_10000_steps(device):
    """Each of 10,000 random steps equals torch._amp_update_scale_ applied to the same state,
    except that ampfuse clamps the scale at the smallest normal fp32 value."""
    rng = random.Random(0)
    growth, backoff, interval = 2.0, 0.5, 3
    scale, tracker = scale_state(device, 2.0**10)
    clamped = 0
    for step in range(10_000):
        if step % 2000 == 0:
            growth = rng.choice([2.0, 1.5, 1.0001, 3.7])
            backoff = rng.choice([0.5, 0.25, 0.9, 0.3333])
            interval = rng.choice([1, 2, 3, 7, 50])
        # Overflow rate varies so the scale both collapses to the floor and grows to fp32 max.
        rate = 0.9 if (step // 500) % 4 == 1 else (0.0 if (step // 500) % 4 == 3 else 0.2)
        found = torch.full((1,), 1.0 if rng.random() < rate else 0.0, device=device)
        ref_scale, ref_tracker = scale.cpu().clone(), tracker.cpu().clone()
        torch._amp_update_scale_(ref_scale, ref_tracker, found.cpu(), growth, backoff, interval)
        if ref_scale.item() < FLT_MIN:
            ref_scale.fill_(FLT_MIN)
            clamped += 1
        ops.update_scale_(scale, tracker, found, growth, backoff, interval)
        assert_bitwise(scale, ref_scale)
        assert_bitwise(tracker, ref_tracker)
    assert clamped > 0, "the sequence must exercise the floor"


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_refuses_to_grow_to_inf(device):
    scale, tracker = scale_state(device, 3.0e38)
    ops.update_scale_(scale, tracker, torch.zeros(1, device=device), 2.0, 0.5, 1)
    assert scale.item() == np.float32(3.0e38) and tracker.item() == 0


def reference_rule(state, found, p):
    """Pure-Python model of the scale rule with hysteresis and bounds (fp32 via numpy)."""
    s, g, h = state
    floor = max(p["min_scale"] or 0.0, FLT_MIN)
    ceil = p["max_scale"] if p["max_scale"] is not None else float(np.finfo(np.float32).max)
    if found:
        g = 0
        h = max(h - 1, 0)
        if h == 0:
            ns = np.float32(np.float64(s) * p["backoff"])
            if not ns >= floor:
                ns = np.float32(floor)
            s = min(ns, np.float32(ceil))
    else:
        if p["consecutive"]:
            h = p["hysteresis"]
        if g + 1 == p["interval"]:
            ns = np.float32(np.float64(s) * p["growth"])
            if np.isfinite(ns):
                s = ns if ns <= np.float32(ceil) else max(s, np.float32(ceil))
            g = 0
            h = p["hysteresis"]
        else:
            g += 1
    return np.float32(s), g, h


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "p",
    [
        dict(hysteresis=1, consecutive=False, min_scale=None, max_scale=None),
        dict(hysteresis=3, consecutive=False, min_scale=None, max_scale=None),
        dict(hysteresis=2, consecutive=True, min_scale=None, max_scale=None),
        dict(hysteresis=1, consecutive=False, min_scale=1.0, max_scale=2.0**20),
        dict(hysteresis=4, consecutive=True, min_scale=2.0**-4, max_scale=2.0**24),
    ],
    ids=["torch", "hyst3", "hyst2-consecutive", "bounds", "all"],
)
def test_update_scale_hysteresis_and_bounds(device, p):
    p = dict(p, growth=2.0, backoff=0.5, interval=5)
    rng = random.Random(1)
    scale, tracker = scale_state(device, 2.0**16)
    hyst = torch.full((1,), p["hysteresis"], dtype=torch.int32, device=device)
    stats = torch.zeros(ops.NUM_SCALE_STATS, dtype=torch.int64, device=device)
    state = (np.float32(2.0**16), 0, p["hysteresis"])
    counts = [0, 0, 0, 0]
    for step in range(3000):
        rate = 0.7 if (step // 300) % 2 else 0.05
        found = rng.random() < rate
        prev_s = state[0]
        new_state = reference_rule(state, found, p)
        counts[0] += 1
        if found:
            counts[1] += 1
            if new_state[2] == 0:
                counts[2] += 1
                raw = np.float32(np.float64(prev_s) * p["backoff"])
                floor = max(p["min_scale"] or 0.0, FLT_MIN)
                counts[3] += int(not raw >= floor)
        state = new_state
        ops.update_scale_(
            scale, tracker, torch.full((1,), float(found), device=device), p["growth"], p["backoff"], p["interval"],
            hysteresis=p["hysteresis"], hysteresis_tracker=hyst, consecutive_hysteresis=p["consecutive"],
            min_scale=p["min_scale"], max_scale=p["max_scale"], stats=stats,
        )
        assert scale.item() == state[0], step
        assert tracker.item() == state[1] and hyst.item() == state[2], step
    assert stats.cpu().tolist() == counts
    if p["min_scale"]:
        assert counts[3] > 0  # the floor was exercised


# ---------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    tensors, found_inf, inv_scale = sample_inputs(device, with_nonfinite=False)
    tensors = tensors[:6] + tensors[14:20]
    per_tensor = torch.zeros(len(tensors), device=device)
    a = torch.ops.ampfuse
    torch.library.opcheck(a.unscale_check_.default, ([t.clone() for t in tensors], found_inf.clone(), inv_scale))
    for op in (a.unscale_check_norm_.default, a.check_norm_.default):
        torch.library.opcheck(
            op,
            ([t.clone() for t in tensors], found_inf.clone(), inv_scale),
            {"norm_type": 2.0, "max_norm": 1.0, "per_tensor_found_inf": per_tensor.clone()},
        )
        torch.library.opcheck(op, ([t.clone() for t in tensors], found_inf.clone(), inv_scale), {"norm_type": math.inf})
    scale, tracker = scale_state(device)
    hyst = torch.full((1,), 2, dtype=torch.int32, device=device)
    stats = torch.zeros(4, dtype=torch.int64, device=device)
    torch.library.opcheck(a.update_scale_.default, (scale, tracker, torch.ones(1, device=device), 2.0, 0.5, 10))
    torch.library.opcheck(
        a.update_scale_.default,
        (scale, tracker, torch.zeros(1, device=device), 2.0, 0.5, 10),
        {"hysteresis": 2, "hysteresis_tracker": hyst, "consecutive_hysteresis": True, "min_scale": 1.0, "max_scale": 1e6, "stats": stats},
    )


def test_torch_compile_traces_the_ops():
    def step(grads, found_inf, inv_scale, scale, tracker):
        norm, coef = torch.ops.ampfuse.check_norm_(grads, found_inf, inv_scale, max_norm=1.0)
        torch.ops.ampfuse.update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2)
        return norm * coef

    grads = [torch.randn(10), torch.randn(3, 3)]
    eager_state = scale_state("cpu")
    compiled_state = scale_state("cpu")
    expected = step(grads, torch.zeros(1), torch.full((1,), 0.5), *eager_state)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(
        grads, torch.zeros(1), torch.full((1,), 0.5), *compiled_state
    )
    assert_bitwise(got, expected)
    for a, b in zip(eager_state, compiled_state):
        assert_bitwise(a, b)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda t: ops.sgd_step_([t(4)], [t(4)], [], [], [t()], lr=0.1, momentum=0.9),
         "momentum_buffers must have one tensor per param when momentum != 0"),
        (lambda t: ops.adam_step_([t(4)], [t(4)], [], [t(4)], [t(4)], [], [t()], lr=0.1, amsgrad=True),
         "max_exp_avg_sqs must have one tensor per param when amsgrad is set"),
        (lambda t: ops.update_scale_(t(1), t(1).int(), t(1), math.inf, 0.5, 10), "growth_factor must be a finite number > 1.0"),
        (lambda t: ops.sgd_step_([t(4)], [t(4)], [], [], [t()], lr=-1.0), "lr must be >= 0"),
    ],
    ids=["momentum-without-buffers", "amsgrad-list", "growth-inf", "negative-lr"],
)
def test_fake_kernels_reject_what_the_kernels_reject(call, message):
    """Under FakeTensorMode (what torch.compile traces with) the same checks and messages as
    the real kernels: one source of truth (the C++ validation behind the Meta kernels)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(RuntimeError, match=message):
        call(lambda *s: torch.zeros(s))
    with FakeTensorMode():
        with pytest.raises(RuntimeError, match=message):
            call(lambda *s: torch.zeros(s))


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and nothing modified.
# ---------------------------------------------------------------------------------------------


def _unscale_bad_cases(device):
    ok = lambda: [torch.randn(5, device=device), torch.randn(3, device=device).half()]  # noqa: E731
    fi = lambda: torch.zeros(1, device=device)  # noqa: E731
    inv = lambda: torch.full((1,), 0.5, device=device)  # noqa: E731
    other = "meta" if device == "cpu" else "cpu"
    return [
        ("other device", lambda: (ok() + [torch.randn(2, device=other)], fi(), inv()), r"tensors\[2\] is on"),
        ("int64", lambda: (ok() + [torch.ones(2, dtype=torch.int64, device=device)], fi(), inv()), r"tensors\[2\] has dtype torch.int64"),
        ("bool", lambda: (ok() + [torch.ones(2, dtype=torch.bool, device=device)], fi(), inv()), r"tensors\[2\] has dtype torch.bool"),
        ("complex", lambda: (ok() + [torch.ones(2, dtype=torch.complex64, device=device)], fi(), inv()), r"tensors\[2\] has dtype torch.complex64"),
        # (the emulated CUDA device holds strided tensors only)
        *([] if device == "cuemu" else [
            ("sparse", lambda: (ok() + [torch.randn(3, 3, device=device).to_sparse()], fi(), inv()), r"tensors\[2\] has layout")]),
        ("found_inf dtype", lambda: (ok(), torch.zeros(1, dtype=torch.float64, device=device), inv()), r"found_inf must be a torch.float32"),
        ("found_inf shape", lambda: (ok(), torch.zeros(2, device=device), inv()), r"found_inf must be a 1-element"),
        ("inv_scale dtype", lambda: (ok(), fi(), torch.ones(1, dtype=torch.float16, device=device)), r"inv_scale must be a torch.float32"),
        ("inv_scale shape", lambda: (ok(), fi(), torch.ones(3, device=device)), r"inv_scale must be a 1-element"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["unscale_check_", "unscale_check_norm_", "check_norm_"])
def test_unscale_bad_input(device, fn):
    for name, make, pattern in _unscale_bad_cases(device):
        tensors, found_inf, inv_scale = make()
        snapshot = [t.clone() for t in tensors if t.layout == torch.strided and t.device.type != "meta"]
        fi_before = found_inf.clone()
        with pytest.raises(RuntimeError, match=pattern):
            getattr(ops, fn)(tensors, found_inf, inv_scale)
        after = [t for t in tensors if t.layout == torch.strided and t.device.type != "meta"]
        for a, b in zip(after, snapshot):
            assert_bitwise(a, b)
        assert_bitwise(found_inf, fi_before)


@pytest.mark.parametrize("device", DEVICES)
def test_norm_bad_input(device):
    t = [torch.randn(4, device=device)]
    fi, inv = torch.zeros(1, device=device), torch.ones(1, device=device)
    with pytest.raises(RuntimeError, match="norm_type must be 2.0 or inf"):
        ops.unscale_check_norm_(t, fi, inv, norm_type=1.0)
    with pytest.raises(RuntimeError, match="max_norm must be a positive finite number"):
        ops.check_norm_(t, fi, inv, max_norm=-1.0)
    with pytest.raises(RuntimeError, match="per_tensor_found_inf must be a contiguous 1-D tensor"):
        ops.check_norm_(t, fi, inv, per_tensor_found_inf=torch.zeros(2, device=device))
    with pytest.raises(RuntimeError, match="per_tensor_found_inf must be a torch.float32"):
        ops.check_norm_(t, fi, inv, per_tensor_found_inf=torch.zeros(1, dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_update_scale_bad_input(device):
    def state():
        return scale_state(device) + (torch.zeros(1, device=device),)

    cases = [
        (dict(), lambda s, g, f: (s.double(), g, f), "scale must be a torch.float32"),
        (dict(), lambda s, g, f: (s.expand(2).clone(), g, f), "scale must be a 1-element"),
        (dict(), lambda s, g, f: (s, g.long(), f), "growth_tracker must be a torch.int32"),
        (dict(), lambda s, g, f: (s, g, f.half()), "found_inf must be a torch.float32"),
        (dict(growth_factor=1.0), None, "growth_factor must be a finite number > 1.0"),
        (dict(backoff_factor=1.0), None, r"backoff_factor must be in \(0, 1\)"),
        (dict(backoff_factor=0.0), None, r"backoff_factor must be in \(0, 1\)"),
        (dict(growth_interval=0), None, "growth_interval must be an integer in \\[1, 2147483647\\]"),
        (dict(hysteresis=0), None, "hysteresis must be an integer in \\[1, 2147483647\\]"),
        (dict(hysteresis=2), None, "hysteresis_tracker .* is required"),
        (dict(min_scale=10.0, max_scale=1.0), None, r"min_scale \(10\) must not be greater than max_scale \(1\)"),
        (dict(min_scale=-1.0), None, "min_scale must be a finite number >= 0"),
        (dict(stats=torch.zeros(3, dtype=torch.int64)), None, "stats must be a contiguous 1-D tensor of 4"),
    ]
    for kw, transform, pattern in cases:
        s, g, f = state()
        if transform is not None:
            s, g, f = transform(s, g, f)
        args = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=10)
        args.update({k: v for k, v in kw.items() if k in args})
        extra = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items() if k not in args}
        before = (s.clone(), g.clone())
        with pytest.raises(RuntimeError, match=pattern):
            ops.update_scale_(s, g, f, args["growth_factor"], args["backoff_factor"], args["growth_interval"], **extra)
        assert_bitwise(s, before[0])
        assert_bitwise(g, before[1])


def test_empty_lists_and_sparse_inputs_give_clear_messages():
    """Not the dispatcher's NotImplementedError."""
    ops.sgd_step_([], [], [], [], [], lr=0.1)
    ops.adam_step_([], [], [], [], [], [], [], lr=0.1)
    sparse = torch.zeros(3, 3).to_sparse()
    with pytest.raises(RuntimeError, match=r"accumulators\[0\] must be a strided tensor"):
        ops.accumulate_grads_([sparse], [torch.zeros(3, 3)], torch.zeros(1))
    with pytest.raises(RuntimeError, match="scale must be a strided"):
        ops.update_scale_(torch.ones(1).to_sparse(), torch.zeros(1, dtype=torch.int32), torch.zeros(1), 2.0, 0.5, 10)
    with pytest.raises(RuntimeError, match=r"grads\[0\] has layout Sparse"):
        ops.sgd_step_([torch.zeros(3, 3)], [sparse], [], [], [torch.zeros(())], lr=0.1)
    with pytest.raises(RuntimeError, match=r"params\[0\] has layout Sparse"):
        ops.adam_step_([sparse], [torch.zeros(3, 3)], [], [torch.zeros(3, 3)], [torch.zeros(3, 3)], [], [torch.zeros(())], lr=0.1)


def test_aliased_tensors_are_rejected_before_anything_changes():
    """The same tensor twice in a written list: a clear error, nothing modified."""
    t = torch.randn(5)
    before = t.clone()
    fi = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r"tensors\[0\] and tensors\[1\] share memory"):
        ops.unscale_check_([t, t], fi, torch.full((1,), 0.5))
    assert torch.equal(t, before) and fi.item() == 0
    base = torch.randn(10)
    with pytest.raises(RuntimeError, match=r"share memory"):
        ops.unscale_check_([base[:6], base[4:]], fi, torch.full((1,), 0.5))
    p = torch.randn(4)
    with pytest.raises(RuntimeError, match=r"params\[0\] and grads\[0\] share memory"):
        ops.sgd_step_([p], [p], [], [], [torch.zeros(())], lr=0.1)


@pytest.mark.parametrize("op", ["unscale_check_", "accumulate_grads_", "adam_step_"])
def test_stride0_tensor_rejected_before_anything_changes(op):
    """An expanded (stride-0) tensor the kernel would write: rejected before the other
    tensors (or step counters) change."""
    good = torch.randn(8)
    expanded = torch.randn(1).expand(8)
    before = good.clone()
    steps = [torch.zeros(()), torch.zeros(())]
    with pytest.raises(RuntimeError, match=r"\[1\] has internally overlapping memory"):
        if op == "unscale_check_":
            ops.unscale_check_([good, expanded], torch.zeros(1), torch.full((1,), 0.5))
        elif op == "accumulate_grads_":
            ops.accumulate_grads_([good, expanded], [torch.randn(8), torch.randn(8)], torch.zeros(1))
        else:
            ops.adam_step_([good, expanded], [torch.randn(8), torch.randn(8)], [], [torch.zeros(8), torch.zeros(8)],
                           [torch.zeros(8), torch.zeros(8)], [], steps, lr=0.1)
    assert torch.equal(good, before) and all(s.item() == 0 for s in steps)


def test_library_built_for_another_torch_is_refused():
    from ampfuse import _library

    with pytest.raises(ImportError, match=r"ampfuse was built against torch 2.0.0 but torch .* is installed; rebuild"):
        _library.check_build_matches({"torch_version": "2.0.0"})
    _library.check_build_matches(ampfuse.build_info())  # the real one matches


def test_library_reports_build():
    info = ampfuse.build_info()
    assert info["torch_version"] == torch.__version__.split("+")[0]
    assert "DEFAULT" in info["cpu_capabilities"]


def test_cpu_kernels_vectorised_and_parallel():
    info = ampfuse.cpu_kernel_info()
    # The kernel build matches the capability torch itself runs with (unless the suite runs the
    # emulated CUDA kernels on CPU tensors).
    expected = torch.backends.cpu.get_cpu_capability().replace("VSX", "DEFAULT").replace("ZVECTOR", "DEFAULT")
    if os.environ.get("AMPFUSE_CPU_KERNELS") == "cuda-emulated":
        expected = "cuda-emulated"
    assert info["kernels"] == expected
    if torch.get_num_threads() > 1:
        assert info["threads_used"] > 1, info


# ---- clip_coef ----------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.float64])
def test_clip_coef_is_clip_grad_norms_coefficient(norm_dtype):
    """The coefficient torch.nn.utils.clip_grad_norm_ multiplies by, bit for bit: for a float
    max_norm (reciprocal-then-multiply) and a tensor one (true division), NaN propagating."""
    norms = torch.tensor([0.0, 1e-7, 0.3, 0.999999, 1.0, 7.25, 3e38, math.inf, math.nan], dtype=norm_dtype)
    for max_norm in [0.5, 1.0, 3.7, torch.tensor(3.7), torch.tensor(0.25, dtype=torch.float64)]:
        for n in norms:
            got = ops.clip_coef(n.clone(), max_norm)
            want = torch.clamp(max_norm / (n + 1e-6), max=1.0).to(torch.float32)
            assert got.dtype == torch.float32 and got.shape == ()
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_clip_coef_opcheck():
    from torch.library import opcheck

    opcheck(torch.ops.ampfuse.clip_coef.default, (torch.tensor(2.0),), {"max_norm": 1.0})
    opcheck(torch.ops.ampfuse.clip_coef.default, (torch.tensor(2.0, dtype=torch.float64),), {"max_norm_tensor": torch.tensor(1.0)})
