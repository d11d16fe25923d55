"""Regression tests for the defects found by testing ampfuse as a user would (one test per defect,
each of which failed before its fix), grouped by the component they concern."""

from __future__ import annotations

import copy
import io
import math
import pickle
import warnings

import pytest
import torch
from torch import nn

import ampfuse
from ampfuse import ops


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


class TwoBranch(nn.Module):
    """Branch b is used only when asked: its params get no gradient in other windows."""

    def __init__(self, dtype=torch.bfloat16, fp32_head=False):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 4).to(dtype)
        self.b = nn.Linear(6, 4).to(dtype)
        self.head = nn.Linear(4, 2).to(torch.float32 if fp32_head else dtype)

    def forward(self, x, use_b=True):
        h = self.a(x.to(self.a.weight.dtype))
        if use_b:
            h = h + self.b(x.to(self.b.weight.dtype))
        return self.head(h.to(self.head.weight.dtype)).float()


def _batch(k, n=8):
    g = torch.Generator().manual_seed(100 + k)
    return torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g)


# ------------------------------------------------------------------------------------------------
# GradAccumulator
# ------------------------------------------------------------------------------------------------


def test_param_without_gradient_in_a_window_is_not_stepped():
    """(1) A bf16 param that had a gradient in an earlier window but none in this one is not
    stepped (AdamW's decay and momentum would move it); its .grad stays None."""
    model = TwoBranch()
    opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    acc = ampfuse.GradAccumulator(model, opt, ampfuse.GradScaler("cpu", init_scale=2.0**8), steps=2)
    for window, use_b in enumerate([True, False, False]):
        before = [p.detach().clone() for p in model.b.parameters()]
        for k in range(2):
            x, y = _batch(10 * window + k)
            with acc.accumulate():
                acc.backward(nn.functional.mse_loss(model(x, use_b), y))
        after = list(model.b.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, after)) == (not use_b), window
        assert all(p.grad is None for p in model.parameters())
    assert opt.state[model.b.weight]["step"].item() == 1 and opt.state[model.a.weight]["step"].item() == 3


@pytest.mark.parametrize("clip", [None, 0.5])
def test_accumulator_with_torch_scaler_detects_overflow_and_clips_the_sums(clip):
    """(2) Driven by torch.amp.GradScaler with an ampfuse optimizer and bf16 params: an inf
    micro-batch skips the window (no NaN, scale backed off) and clipping sees the unscaled sums."""
    runs = {}
    for kind in ("torch", "ampfuse"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).bfloat16()
        opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-2)
        cls = torch.amp.GradScaler if kind == "torch" else ampfuse.GradScaler
        scaler = cls("cpu", init_scale=2.0**8, growth_interval=1000)
        acc = ampfuse.GradAccumulator(model, opt, scaler, steps=2, max_grad_norm=clip)
        for window in range(4):
            before = [p.detach().clone() for p in model.parameters()]
            for k in range(2):
                x, y = _batch(10 * window + k)
                with acc.accumulate():
                    loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
                    acc.backward(loss * (math.inf if (window, k) == (1, 1) else 1.0))
            moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert moved == (window != 1), (kind, window)
            assert all(torch.isfinite(p).all() for p in model.parameters())
        assert scaler.get_scale() == 2.0**7
        runs[kind] = [p.detach().float() for p in model.parameters()]
    # torch's scaler reads the sums rounded to bf16 once per window; ampfuse's step reads them in fp32
    for a, b in zip(runs["torch"], runs["ampfuse"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_mid_window_checkpoint_keeps_the_fp32_params_partial_sums():
    """(3) A state_dict taken mid-window holds the .grad sums of fp32 params too: resuming from it
    is bitwise identical to not stopping."""

    def run(split):
        model = TwoBranch(fp32_head=True)
        opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-2)
        acc = ampfuse.GradAccumulator(model, opt, ampfuse.GradScaler("cpu", init_scale=2.0**8), steps=3)
        for k in range(9):
            if k == split:
                ck = _roundtrip({"acc": acc.state_dict(), "model": model.state_dict()})
                model = TwoBranch(fp32_head=True)
                model.load_state_dict(ck["model"])
                opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-2)
                acc = ampfuse.GradAccumulator(model, opt, ampfuse.GradScaler("cpu"), steps=3)
                acc.load_state_dict(ck["acc"])
            x, y = _batch(k)
            with acc.accumulate():
                acc.backward(nn.functional.mse_loss(model(x), y))
        return [p.detach().clone() for p in model.parameters()]

    ref = run(-1)
    for split in (1, 4, 8):
        for a, b in zip(ref, run(split)):
            assert torch.equal(a, b), split


@pytest.mark.parametrize("edit", ["clamp_", "load_state_dict", "data_copy", "init"])
def test_inplace_edit_of_a_low_precision_param_is_kept(edit):
    """(4) An edit of a bf16 param between steps is not undone by the next step: the param takes
    over its fp32 master (the step starts from the edited value)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16).bfloat16()
    opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    for k in range(3):
        model.weight.grad = torch.randn(16, 16).bfloat16()
        model.bias.grad = torch.randn(16).bfloat16()
        opt.step()
    w = model.weight
    with torch.no_grad():
        if edit == "clamp_":
            w.clamp_(-0.01, 0.01)
        elif edit == "load_state_dict":
            model.load_state_dict({"weight": torch.full((16, 16), 0.5).bfloat16(), "bias": model.bias.detach().clone()})
        elif edit == "data_copy":
            w.data.copy_(torch.full((16, 16), -0.25))
        else:
            nn.init.constant_(w, 0.125)
    edited = w.detach().float().clone()
    model.weight.grad = torch.zeros(16, 16).bfloat16()
    model.bias.grad = torch.zeros(16).bfloat16()
    opt.step()  # a tiny update (momentum) from the edited values
    assert (w.float() - edited).abs().max().item() < 5e-3, edit
    assert (opt.state[w]["master_param"] - edited).abs().max().item() < 5e-3
    opt.sync_masters_from_params()
    assert torch.equal(opt.state[w]["master_param"], w.float())


def test_plan_cache_follows_state_and_param_group_changes():
    """(5) The step honours state.clear(), state[p] = {}, a replaced state tensor or param, and a
    momentum switched on mid-run (matching torch, dampening included); state_dict() after a reset
    holds the new state."""
    torch.manual_seed(0)
    params = [torch.randn(10, requires_grad=True) for _ in range(3)]
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt = ampfuse.optim.SGD(params, lr=0.1, momentum=0.0, dampening=0.3)
    topt = torch.optim.SGD(ref, lr=0.1, momentum=0.0, dampening=0.3, foreach=False)

    def step(k):
        g = torch.Generator().manual_seed(k)
        for p, q in zip(params, ref):
            p.grad = torch.randn(10, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        topt.step()

    step(0)
    opt.param_groups[0]["momentum"] = topt.param_groups[0]["momentum"] = 0.9
    for k in range(1, 4):
        step(k)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], topt.state[q]["momentum_buffer"])
    # a full state reset: the next step starts the momentum again, as torch's does
    opt.state.clear()
    topt.state.clear()
    step(4)
    assert len(opt.state_dict()["state"]) == 3
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
    # a replaced state tensor and an emptied state entry are used, not the cached ones
    new_buf = torch.full((10,), 7.0)
    opt.state[params[0]]["momentum_buffer"] = new_buf
    topt.state[ref[0]]["momentum_buffer"] = new_buf.clone()
    opt.state[params[1]] = {}
    del topt.state[ref[1]]
    step(5)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
    assert opt.state[params[0]]["momentum_buffer"] is new_buf
    # a param replaced in the group
    fresh = torch.randn(10, requires_grad=True)
    opt.param_groups[0]["params"][2] = fresh
    fresh.grad = torch.ones(10)
    before = fresh.detach().clone()
    opt.step()
    assert not torch.equal(fresh, before)


def test_accumulator_keeps_working_after_an_error_at_a_window_end():
    """(6) If the window's end raises (here the scaler's on_min_scale="raise") and the caller goes
    on, the next windows step again."""
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    opt = ampfuse.optim.SGD(model.parameters(), lr=0.1)
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0, min_scale=1.0, backoff_factor=0.5, on_min_scale="raise")
    acc = ampfuse.GradAccumulator(model, opt, scaler, steps=2)
    raised = 0
    for window in range(4):
        before = model.weight.detach().clone()
        for k in range(2):
            x, y = _batch(10 * window + k)
            try:
                with acc.accumulate():
                    loss = nn.functional.mse_loss(model(x), y) * (math.inf if window in (0, 1) else 1.0)
                    acc.backward(loss)
            except RuntimeError as e:
                assert "hit its floor" in str(e)
                raised += 1
        assert acc.micro_step == 0 and acc.window_ended
        assert torch.equal(before, model.weight) == (window in (0, 1))
    assert raised == 1 and acc.windows == 4


def test_constructing_an_accumulator_leaves_direct_steps_alone():
    """(7) optimizer.step() outside the accumulator reads .grad, not the accumulator's buffers."""
    model = nn.Linear(6, 2).bfloat16()
    opt = ampfuse.optim.SGD(model.parameters(), lr=0.5)
    ampfuse.GradAccumulator(model, opt, None, steps=2)
    before = model.weight.detach().clone()
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    opt.step()
    torch.testing.assert_close(model.weight.float(), (before.float() - 0.5).bfloat16().float())


# ------------------------------------------------------------------------------------------------
# ops
# ------------------------------------------------------------------------------------------------


def test_fp64_norm_beyond_the_float_range():
    """(8) fp64 grads whose norm exceeds the float range: a finite fp64 norm, no inf flag, and the
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


def test_aliased_tensors_are_rejected_before_anything_changes():
    """(10) The same tensor twice in a written list: a clear error, nothing modified."""
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
    """(11) An expanded (stride-0) tensor the kernel would write: rejected before the other
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


# ------------------------------------------------------------------------------------------------
# GradScaler
# ------------------------------------------------------------------------------------------------


def test_scale_bounds_clamp_init_and_loaded_scale():
    """(9) init_scale and a loaded scale outside [min_scale, max_scale] are clamped (with a
    warning); a min_scale beyond the float range is refused at construction, naming min_scale."""
    with pytest.warns(UserWarning, match="init_scale 65536 is outside"):
        s = ampfuse.GradScaler("cpu", max_scale=1024.0)
    s.scale(torch.ones(()))
    assert s.get_scale() == 1024.0
    with pytest.warns(UserWarning, match="the loaded scale 1e\\+06 is outside"):
        s.load_state_dict(dict(torch.amp.GradScaler("cpu", init_scale=1e6).state_dict()))
    assert s.get_scale() == 1024.0
    with pytest.raises(ValueError, match=r"min_scale must be a finite number in \[0, 3.40282e\+38\]"):
        ampfuse.GradScaler("cpu", min_scale=1e39)


def test_failed_loads_change_nothing():
    """(12) A bad state dict raises before any part of the object changed; it stays usable."""
    s = ampfuse.GradScaler("cpu", init_scale=2.0**8, hysteresis=2)
    s.scale(torch.ones(()))
    good = s.state_dict()
    for bad in [dict(good, stats=[1, 2]), dict(good, hysteresis=0), dict(good, scale="x")]:
        with pytest.raises(ValueError):
            s.load_state_dict(bad)
        assert s.state_dict() == good
    p = [torch.randn(4, requires_grad=True)]
    opt = ampfuse.optim.Adam(p, lr=0.1)
    p[0].grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    bad["state"][0]["step"] = "abc"
    bad["param_groups"][0]["lr"] = 123.0
    with pytest.raises(ValueError, match="state 'step' of parameter 0 must be a number"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == 0.1 and opt.state[p[0]]["step"].item() == 1
    opt.step()
    model = nn.Linear(4, 2).bfloat16()
    aopt = ampfuse.optim.SGD(model.parameters(), lr=0.1)
    acc = ampfuse.GradAccumulator(model, aopt, ampfuse.GradScaler("cpu"), steps=2)
    with acc.accumulate():
        acc.backward(model(torch.randn(3, 4).bfloat16()).float().sum())
    sd = acc.state_dict()
    for key, value in [("buffers", {"cpu": torch.zeros(3)}), ("micro_step", 5)]:
        with pytest.raises(ValueError):
            acc.load_state_dict(dict(sd, **{key: value}))
        assert acc.micro_step == 1 and acc._flat[torch.device("cpu")].abs().sum() > 0


def test_failed_step_leaves_the_scaler_picklable():
    """(13) A step() that raises (before scale(), or with closure=) leaves no per-optimizer entry
    behind: the scaler pickles and deep-copies as torch's does."""
    s = ampfuse.GradScaler("cpu")
    opt = ampfuse.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        s.step(opt, closure=lambda: 0.0)
    with pytest.raises(AssertionError, match="Attempted step but _scale is None"):
        s.step(opt)
    pickle.dumps(s)
    copy.deepcopy(s)


def test_step_without_inf_checks_is_refused():
    """(14) After unscale_and_clip_, stepping an ampfuse optimizer whose params got no gradient
    changes nothing and, as torch's scaler does for optimizers with _step_supports_amp_scaling,
    update() raises torch's "No inf checks were recorded prior to update" error."""
    s = ampfuse.GradScaler("cpu")
    p = torch.zeros(2, requires_grad=True)
    opt = ampfuse.optim.AdamW([p], lr=0.1)
    s.scale(torch.ones(()))
    s.unscale_and_clip_(opt, 1.0)
    assert s.step(opt) is None
    assert torch.equal(p, torch.zeros(2)) and len(opt.state) == 0
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
        s.update()


def test_unscale_and_clip_accepts_a_tensor_max_norm():
    """(16) As clip_grad_norm_ does, with its formula (a true division for a tensor max_norm)."""
    results = []
    for max_norm in (0.3, torch.tensor(0.3)):
        for impl in ("ampfuse", "torch"):
            torch.manual_seed(1)
            model = nn.Linear(8, 4)
            opt = (ampfuse.optim.SGD if impl == "ampfuse" else torch.optim.SGD)(model.parameters(), lr=0.1)
            s = ampfuse.GradScaler("cpu", init_scale=4.0)
            s.scale(nn.functional.mse_loss(model(torch.randn(5, 8)), torch.randn(5, 4))).backward()
            if impl == "ampfuse":
                norm = s.unscale_and_clip_(opt, max_norm)
            else:
                s.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            s.step(opt)
            results.append((norm, [p.detach().clone() for p in model.parameters()]))
    for (na, pa), (nt, pt) in [(results[0], results[1]), (results[2], results[3])]:
        torch.testing.assert_close(na, nt, rtol=1e-6, atol=0)
        for a, b in zip(pa, pt):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_unscaled_grads_after_step_the_documented_way():
    """(19) With an ampfuse optimizer, scaler.step leaves .grad scaled (it never writes the
    gradients); calling unscale_ before step gives unscaled .grad, as every torch path does."""
    for unscale_first in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = ampfuse.optim.SGD(model.parameters(), lr=0.1)
        s = ampfuse.GradScaler("cpu", init_scale=8.0)
        x = torch.randn(3, 4)
        s.scale(model(x).sum()).backward()
        scaled = model.weight.grad.clone()
        if unscale_first:
            s.unscale_(opt)
        s.step(opt)
        s.update()
        expected = scaled / 8.0 if unscale_first else scaled
        torch.testing.assert_close(model.weight.grad, expected, rtol=0, atol=0)


def test_torch_cuda_amp_signature_drop_in():
    """(20) ampfuse.GradScaler's first argument is the device (a number is refused clearly);
    ampfuse.cuda.amp / ampfuse.cpu.amp.GradScaler take init_scale first, like torch's."""
    with pytest.raises(TypeError, match="first argument is the device type"):
        ampfuse.GradScaler(2.0**10)
    with pytest.warns(FutureWarning, match="is deprecated"):  # as torch's deprecated class
        s = ampfuse.cpu.amp.GradScaler(2.0**10, growth_interval=7)
    assert isinstance(s, torch.cpu.amp.GradScaler) and isinstance(s, ampfuse.GradScaler)
    s.scale(torch.ones(()))
    assert s.get_scale() == 1024.0 and s.get_growth_interval() == 7
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        c = ampfuse.cuda.amp.GradScaler(2.0**10)
    assert isinstance(c, torch.cuda.amp.GradScaler) and c._device == "cuda"
    assert c.is_enabled() == torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------
# ops: errors and compatibility
# ------------------------------------------------------------------------------------------------


def test_empty_lists_and_sparse_inputs_give_clear_messages():
    """(15) Not the dispatcher's NotImplementedError."""
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
    """(17) Under FakeTensorMode (what torch.compile traces with) the same checks and messages as
    the real kernels: one source of truth (the C++ validation behind the Meta kernels)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with pytest.raises(RuntimeError, match=message):
        call(lambda *s: torch.zeros(s))
    with FakeTensorMode():
        with pytest.raises(RuntimeError, match=message):
            call(lambda *s: torch.zeros(s))


def test_optimizers_accept_torchs_keyword_arguments():
    """(18) foreach, fused, capturable (implementation switches: accepted) and Adam's
    decoupled_weight_decay (== AdamW); differentiable=True is refused clearly."""
    p = [torch.randn(6, requires_grad=True)]
    ampfuse.optim.SGD(p, lr=0.1, foreach=True, fused=None, differentiable=False)
    ampfuse.optim.AdamW(p, foreach=False, fused=True, capturable=True)
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        ampfuse.optim.Adam(p, differentiable=True)
    runs = []
    for cls, kw in [(ampfuse.optim.Adam, dict(decoupled_weight_decay=True)), (ampfuse.optim.AdamW, {})]:
        q = [p[0].detach().clone().requires_grad_()]
        opt = cls(q, lr=0.1, weight_decay=0.1, **kw)
        for k in range(3):
            q[0].grad = torch.full((6,), float(k + 1))
            opt.step()
        runs.append(q[0].detach())
    assert torch.equal(*runs)
    torch_adam = torch.optim.Adam([torch.zeros(1, requires_grad=True)], decoupled_weight_decay=True)
    assert torch_adam.defaults["decoupled_weight_decay"]


def test_adam_decoupled_checkpoint_round_trip_with_torch():
    p = [torch.randn(6, requires_grad=True)]
    opt = ampfuse.optim.Adam(p, lr=0.1, decoupled_weight_decay=True, weight_decay=0.1)
    p[0].grad = torch.ones(6)
    opt.step()
    t = torch.optim.Adam([p[0].detach().clone().requires_grad_()], lr=0.1)
    t.load_state_dict(_roundtrip(opt.state_dict()))
    assert t.param_groups[0]["decoupled_weight_decay"]
