"""Regression tests of the accumulator, the scaler and the precision options, one per defect, plus
property-based tests of the accumulator against torch's own loop and of the precision options'
conversions. FSDP2/DTensor remainder masters are tested with the distributed suite."""

from __future__ import annotations

import copy
import io
import re
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ampfuse
from ampfuse.optim import StepScaling, join_master

_FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


# ------------------------------------------------------------------------------------------------
# 1, 2: the accumulator's set of params is decided at every window, not once
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,opt_cls,fp32_acc", [(torch.float32, ampfuse.optim.SGD, True),
                                                    (torch.float32, torch.optim.SGD, True),
                                                    (torch.bfloat16, torch.optim.SGD, False),
                                                    (torch.bfloat16, torch.optim.SGD, True)])
def test_param_frozen_mid_window_is_stepped_once(dtype, opt_cls, fp32_acc):
    """(1) requires_grad_(False) inside a window: the window's gradient is applied once, then the
    param stays where it is (torch's loop: zero_grad() at the window end)."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(4).to(dtype))
    b = nn.Parameter(torch.randn(4).to(dtype))
    opt = opt_cls([a, b], lr=0.1)
    acc = ampfuse.GradAccumulator(nn.Module(), opt, None, steps=2, fp32_accumulation=fp32_acc)
    x = torch.ones(4, dtype=dtype)
    history = []
    for window in range(3):
        for micro in range(2):
            with acc.accumulate():
                loss = (a * x).sum() + (b * x).sum() if a.requires_grad else (b * x).sum()
                acc.backward(loss)
            if window == 0 and micro == 0:
                a.requires_grad_(False)
        history.append(a.detach().clone())
    assert a.grad is None
    torch.testing.assert_close(history[1], history[0], atol=0, rtol=0)
    torch.testing.assert_close(history[2], history[0], atol=0, rtol=0)


def test_layer_unfrozen_later_is_summed_in_fp32():
    """(2) A bf16 param frozen when the accumulator was built and unfrozen later (at a window
    start, or inside a window) is summed in fp32 like the others."""
    p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16), requires_grad=False)
    opt = ampfuse.optim.SGD([p], lr=1.0, master_weights=True)
    acc = ampfuse.GradAccumulator(nn.Module(), opt, None, steps=4)
    # per micro-batch gradients (times 1/steps): 1 then three times 2**-9; bf16 sums lose them
    coefs = [4.0, 4 * 2.0**-9, 4 * 2.0**-9, 4 * 2.0**-9]
    for unfreeze_at in (0, 1):
        with torch.no_grad():
            p.zero_()
        opt.state.clear()
        p.requires_grad_(False)
        for micro, c in enumerate(coefs):
            if micro == unfreeze_at:
                p.requires_grad_(True)
            with acc.accumulate():
                loss = (p.float() * c).sum() if p.requires_grad else torch.zeros((), requires_grad=True)
                acc.backward(loss)
        expected = -sum(c / 4 for c in coefs[unfreeze_at:])
        master = opt.state[p]["master_param"]
        torch.testing.assert_close(master, torch.full((3,), expected, dtype=torch.float32), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------
# 3, 4: precision options on load and between the two master forms
# ------------------------------------------------------------------------------------------------


def _adamw_step(opt, params):
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    opt.step()


def test_load_state_dict_keeps_the_optimizers_precision_options():
    """(3) The options the optimizer has win over the checkpoint's; its state is converted."""
    p0 = nn.Parameter(torch.randn(8).to(torch.bfloat16))
    plain = ampfuse.optim.AdamW([p0], lr=0.1)
    _adamw_step(plain, [p0])
    sd = _roundtrip(plain.state_dict())

    p1 = nn.Parameter(p0.detach().clone())
    small = ampfuse.optim.AdamW([p1], lr=0.1, master_weights="remainder", state_dtype=torch.bfloat16)
    small.load_state_dict(sd)
    assert small.param_groups[0]["master_weights"] == "remainder"
    assert small.param_groups[0]["state_dtype"] == torch.bfloat16
    _adamw_step(small, [p1])
    st1 = small.state[p1]
    assert "master_param" not in st1 and st1["master_remainder"].dtype == torch.int16
    assert st1["exp_avg"].dtype == torch.bfloat16 and st1["exp_avg_sq"].dtype == torch.bfloat16

    # the reverse: a remainder/bf16 checkpoint into an fp32-master/fp32-state optimizer
    sd_small = _roundtrip(small.state_dict())
    p2 = nn.Parameter(p1.detach().clone())
    big = ampfuse.optim.AdamW([p2], lr=0.1)
    big.load_state_dict(sd_small)
    assert big.param_groups[0]["master_weights"] == "auto"
    assert big.param_groups[0]["state_dtype"] == torch.float32
    _adamw_step(big, [p2])
    assert big.state[p2]["exp_avg"].dtype == torch.float32
    assert big.state[p2]["master_param"].dtype == torch.float32


def _tie_setup(n=4096):
    """An SGD (lr=0, so a step only re-syncs masters) over a bf16 param whose fp32 masters are
    all exact ties (low 16 bits 0x8000), in the fp32-master form (param = round-half-even)."""
    torch.manual_seed(3)
    p = nn.Parameter(torch.randn(n).to(torch.bfloat16))
    opt = ampfuse.optim.SGD([p], lr=0.0, master_weights=True)
    p.grad = torch.zeros_like(p)
    opt.step()
    hi = (p.detach().view(torch.int16).to(torch.int32) << 16) | 0x8000
    master = hi.view(torch.float32)
    with torch.no_grad():
        opt.state[p]["master_param"].copy_(master)
        p.copy_(master.to(torch.bfloat16))
    return p, opt, master.clone()


def _master_of(opt, p):
    st = opt.state[p]
    return join_master(p.detach(), st["master_remainder"]) if "master_remainder" in st else st["master_param"]


def test_tie_masters_survive_switching_the_master_form():
    """(4) True -> "remainder" -> True keeps every master bit for bit, ties included."""
    p, opt, master = _tie_setup()
    opt.step()
    assert torch.equal(_bits(_master_of(opt, p)), _bits(master))
    opt.param_groups[0]["master_weights"] = "remainder"
    opt.step()
    assert torch.equal(_bits(_master_of(opt, p)), _bits(master))
    opt.param_groups[0]["master_weights"] = True
    opt.step()
    assert torch.equal(_bits(_master_of(opt, p)), _bits(master))


def test_tie_masters_survive_checkpoints_of_the_other_form():
    """(4) A checkpoint saved in one master form loads into the other with every master exact."""
    p, opt, master = _tie_setup()
    opt.param_groups[0]["master_weights"] = "remainder"
    opt.step()
    sd = _roundtrip(opt.state_dict())
    torch.testing.assert_close(sd["state"][0]["master_param"], master, atol=0, rtol=0)
    # remainder form -> fp32 masters (the model's bf16 weights come from the remainder form)
    q = nn.Parameter(p.detach().clone())
    opt_f = ampfuse.optim.SGD([q], lr=0.0, master_weights=True)
    opt_f.load_state_dict(sd)
    q.grad = torch.zeros_like(q)
    opt_f.step()
    assert torch.equal(_bits(_master_of(opt_f, q)), _bits(master))
    # fp32 masters -> remainder form
    sd_f = _roundtrip(opt_f.state_dict())
    r = nn.Parameter(q.detach().clone())
    opt_r = ampfuse.optim.SGD([r], lr=0.0, master_weights="remainder")
    opt_r.load_state_dict(sd_f)
    r.grad = torch.zeros_like(r)
    opt_r.step()
    assert torch.equal(_bits(_master_of(opt_r, r)), _bits(master))


def test_master_weights_false_drops_the_master():
    """(smaller) True -> False -> True: the master restarts from the param, not a stale one."""
    p = nn.Parameter(torch.full((4,), 1.0, dtype=torch.bfloat16))
    opt = ampfuse.optim.SGD([p], lr=2.0**-12, master_weights=True)
    p.grad = torch.ones_like(p)
    opt.step()  # master 1 - 2**-12, param 1.0
    opt.param_groups[0]["master_weights"] = False
    opt.step()  # updated directly: param 1.0 (the step is below half an ulp)
    assert "master_param" not in opt.state[p]
    opt.param_groups[0]["master_weights"] = True
    opt.step()
    torch.testing.assert_close(opt.state[p]["master_param"], torch.full((4,), 1.0 - 2.0**-12), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------
# 6, 7, 9, 10, 11, 12: the step's checks
# ------------------------------------------------------------------------------------------------


def test_step_grads_with_unknown_keys_is_an_error():
    """(6) A key that is not one of the optimizer's params (p.detach()) is refused, by the
    optimizer and by the scaler, before anything changes."""
    p = nn.Parameter(torch.randn(4))
    opt = ampfuse.optim.AdamW([p], lr=0.1)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="grads has a key that is not a parameter of this optimizer"):
        opt.step(grads={p.detach(): torch.ones(4)})
    scaler = ampfuse.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="grads has a key that is not a parameter"):
        scaler.step(opt, grads={p.detach(): torch.ones(4)})
    assert torch.equal(p, before) and len(opt.state) == 0


def _two_groups():
    a = nn.Parameter(torch.randn(4))
    b = nn.Parameter(torch.randn(4))
    opt = ampfuse.optim.Adam([{"params": [a]}, {"params": [b]}], lr=0.1)
    a.grad = torch.ones(4)
    b.grad = torch.ones(4)
    return a, b, opt


@pytest.mark.parametrize("case", ["bf16_grad", "beta2_one", "grad_is_param", "grad_is_param_cached_plan"])
def test_a_refused_step_changes_nothing(case):
    """(7) What the kernel would refuse in a later group is refused before any group steps."""
    a, b, opt = _two_groups()
    grads = None
    if case == "grad_is_param_cached_plan":
        opt.step()  # the plan is built and cached
    before_a, n_state = a.detach().clone(), len(opt.state)
    step_a = opt.state[a]["step"].clone() if a in opt.state else None
    if case == "bf16_grad":
        grads = {b: torch.ones(4, dtype=torch.bfloat16)}
    elif case == "beta2_one":
        opt.param_groups[1]["betas"] = (0.9, 1.0)
    else:
        b.grad = b.detach()
    with pytest.raises((RuntimeError, ValueError)) as info:
        opt.step(grads=grads)
    # nothing changed (group 0 not stepped, no state created), and the error names group 1
    assert torch.equal(a, before_a) and len(opt.state) == n_state
    if step_a is not None:
        assert torch.equal(opt.state[a]["step"], step_a)
    assert re.search(r"param_groups\[1\]", str(info.value)), str(info.value)
    # fixing the cause and stepping again steps group 0 once
    ref_a = nn.Parameter(before_a.clone())
    ref = ampfuse.optim.Adam([ref_a], lr=0.1)
    if step_a is not None:
        ref.load_state_dict({"state": {0: copy.deepcopy(dict(opt.state[a]))}, "param_groups": ref.state_dict()["param_groups"]})
    ref_a.grad = torch.ones(4)
    ref.step()
    opt.param_groups[1]["betas"] = (0.9, 0.999)
    b.grad = torch.ones(4)
    opt.step()
    assert torch.equal(a, ref_a)


def test_step_scaling_fields_are_checked_first():
    """(9) A malformed StepScaling field is named, and refused before state is created."""
    p = nn.Parameter(torch.randn(4))
    p.grad = torch.ones(4)
    opt = ampfuse.optim.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match=r"scaling\.grad_scale must be a 1-element tensor"):
        opt.step(scaling=StepScaling(grad_scale=torch.ones(2)))
    with pytest.raises(TypeError, match=r"scaling\.found_inf must be a 1-element tensor"):
        opt.step(scaling=StepScaling(found_inf=0.0))
    assert len(opt.state) == 0


def test_numpy_scalar_lr_is_accepted():
    """(10) lr=np.float32(0.1) steps as lr=0.1 (torch accepts numpy scalars)."""
    results = []
    for lr in (np.float32(0.1), float(np.float32(0.1))):
        p = nn.Parameter(torch.ones(4))
        opt = ampfuse.optim.Adam([p], lr=lr)
        p.grad = torch.full((4,), 0.5)
        opt.step()
        results.append(p.detach().clone())
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)


@pytest.mark.parametrize("copied", [False, True])
def test_converted_model_is_refused_with_fp32_gradients(copied):
    """(11) The "was Y when the optimizer was built" check holds when the plan is cached (fp32
    gradients) and for a deep-copied optimizer."""
    p = nn.Parameter(torch.randn(4).to(torch.bfloat16))
    opt = ampfuse.optim.AdamW([p], lr=0.1)
    opt.step(grads={p: torch.ones(4)})
    if copied:
        opt = copy.deepcopy(opt)
        p = opt.param_groups[0]["params"][0]
    p.data = p.data.to(torch.float16)
    before = p.detach().clone()
    with pytest.raises(RuntimeError, match="has dtype torch.float16 but was torch.bfloat16 when the optimizer was built"):
        opt.step(grads={p: torch.ones(4)})
    assert torch.equal(p, before)


def test_state_holds_non_dict_values_under_other_keys():
    """(12) As torch allows: opt.state["test"] = 1 (a state_dict pre-hook), True from a
    load_state_dict post-hook; stepping, saving and loading still work."""
    p = nn.Parameter(torch.randn(4))
    opt = ampfuse.optim.SGD([p], lr=0.1, momentum=0.9)
    opt.register_state_dict_pre_hook(lambda o: o.state.__setitem__("test", 1))
    opt.register_load_state_dict_post_hook(lambda o: o.state.__setitem__("loaded", True))
    p.grad = torch.ones(4)
    opt.step()
    sd = opt.state_dict()
    assert sd["state"]["test"] == 1
    opt.load_state_dict(sd)
    assert opt.state["loaded"] is True and opt.state["test"] == 1
    opt.step()
    copy.deepcopy(opt)


def test_deprecated_scaler_classes_warn():
    """(13) As torch's deprecated torch.cpu.amp/torch.cuda.amp GradScaler classes do."""
    for cls, device in ((ampfuse.cpu.amp.GradScaler, "cpu"), (ampfuse.cuda.amp.GradScaler, "cuda")):
        with pytest.warns(FutureWarning, match=rf"torch.{device}.amp.GradScaler\(args...\)` is deprecated"):
            cls(enabled=False)


# ------------------------------------------------------------------------------------------------
# 8: GradAccumulator.load_state_dict checks everything first
# ------------------------------------------------------------------------------------------------


def test_accumulator_load_checks_everything_first():
    p = nn.Parameter(torch.randn(4))
    opt = ampfuse.optim.SGD([p], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    acc = ampfuse.GradAccumulator(nn.Module(), opt, None, steps=2, lr_scheduler=sched)
    for _ in range(2):
        with acc.accumulate():
            acc.backward((p * 2).sum())
    good = acc.state_dict()
    other = copy.deepcopy(good)
    other["optimizer"]["param_groups"][0]["lr"] = 123.0
    before = copy.deepcopy(opt.state_dict())
    for key, value in (("lr_scheduler", 7), ("windows", "3"), ("windows", 1.5)):
        bad = dict(other, **{key: value})
        with pytest.raises(Exception) as info:  # noqa: PT011 - the type is checked below
            acc.load_state_dict(bad)
        # nothing was loaded (the optimizer's lr is still its own), and the error names the entry
        assert opt.param_groups[0]["lr"] == before["param_groups"][0]["lr"]
        assert info.type is ValueError and f"state dict's {key}" in str(info.value), repr(info.value)
    acc.load_state_dict(good)


def test_mid_window_checkpoint_records_the_buffered_params():
    """(2, checkpoints) A bf16 param unfrozen inside a window is buffered after the others; the
    checkpoint records which params the buffers hold, so an accumulator built afterwards (which
    would buffer them in param order) loads each sum into its own param."""
    def run(checkpoint):
        torch.manual_seed(5)
        a = nn.Parameter(torch.randn(4).to(torch.bfloat16), requires_grad=False)
        b = nn.Parameter(torch.randn(4).to(torch.bfloat16))
        opt = ampfuse.optim.SGD([a, b], lr=0.5)
        acc = ampfuse.GradAccumulator(nn.Module(), opt, None, steps=4)
        for micro in range(4):
            if micro == 1:
                a.requires_grad_(True)
            if micro == 2 and checkpoint:
                sd = _roundtrip(acc.state_dict())
                assert sd["buffered"] == [1, 0]
                acc = ampfuse.GradAccumulator(nn.Module(), opt, None, steps=4)
                acc.load_state_dict(sd)
            with acc.accumulate():
                loss = (b.float() * (micro + 5)).sum()
                if a.requires_grad:
                    loss = loss + (a.float() * (micro + 1) * 64).sum()
                acc.backward(loss)
        return [opt.state[x]["master_param"].clone() for x in (a, b)]

    for r, g in zip(run(False), run(True)):
        assert torch.equal(r, g)


def test_mid_window_checkpoint_without_the_buffered_params_is_refused():
    """A mid-window checkpoint must say which params its buffers hold; one without that entry is
    refused with nothing changed."""
    g = nn.Parameter(torch.randn(3))
    b = nn.Parameter(torch.randn(4).to(torch.bfloat16))
    opt = ampfuse.optim.SGD([g, b], lr=0.5)
    acc = ampfuse.GradAccumulator(nn.Module(), opt, None, steps=2)
    with acc.accumulate():
        acc.backward((g * 2).sum() + (b.float() * 3).sum())
    sd = _roundtrip(acc.state_dict())
    old = {k: v for k, v in sd.items() if k != "buffered"}
    fresh = ampfuse.GradAccumulator(nn.Module(), opt, None, steps=2)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="the state dict's buffered entry is missing"):
        fresh.load_state_dict(old)
    assert fresh.micro_step == 0 and opt.state_dict()["param_groups"] == before["param_groups"]


# ------------------------------------------------------------------------------------------------
# smaller items
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [ampfuse.optim.Adam, ampfuse.optim.AdamW])
@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=torch.tensor(0.01), foreach=True), "lr as a Tensor is not supported"),
    (dict(betas=(0.9, torch.tensor(0.99))), "betas must be either both floats or both Tensors"),
    (dict(betas=(torch.tensor(0.9), 0.99)), "betas must be either both floats or both Tensors"),
    (dict(betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True), r"betas\[0\] as a Tensor is not supported"),
])
def test_adam_argument_rules_as_strict_as_torch(cls, kwargs, match):
    torch_cls = getattr(torch.optim, cls.__name__)
    with pytest.raises(ValueError, match=match):
        torch_cls([nn.Parameter(torch.zeros(2))], **kwargs)
    with pytest.raises(ValueError, match=match):
        cls([nn.Parameter(torch.zeros(2))], **kwargs)


def test_scaler_step_without_gradients_returns_like_torch():
    """(smaller) torch's scaler with an optimizer that supports amp scaling returns from step()
    and raises at update()."""
    for scaler_cls in (torch.amp.GradScaler, ampfuse.GradScaler):
        s = scaler_cls("cpu")
        opt = ampfuse.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=0.1)
        s.scale(torch.ones(()))
        assert s.step(opt) is None
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
            s.update()


# ------------------------------------------------------------------------------------------------
# Beyond the list: property-based tests
# ------------------------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self, low: bool):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3, 4))
        self.b = nn.Parameter(torch.randn(4).to(torch.bfloat16) if low else torch.randn(4))
        self.c = nn.Parameter(torch.randn(0))  # zero-size
        self.unused = nn.Parameter(torch.randn(2))  # never gets a gradient
        self.tied = nn.Linear(4, 4, bias=False)
        self.tied2 = self.tied  # tied weights: one param

    def forward(self, x, use_b):
        h = x @ self.a + self.tied2(x @ self.a) + self.c.sum()
        if use_b and self.b.requires_grad:
            h = h + self.b.float()
        return h.pow(2).mean()


_MICRO = st.tuples(st.booleans(), st.sampled_from(["none", "freeze_a", "unfreeze_a", "freeze_b", "unfreeze_b"]),
                   st.booleans(), st.sampled_from([None, "same", "fresh"]))


@_FAST
@given(steps=st.integers(1, 3), low=st.booleans(), scaled=st.booleans(), fused=st.booleans(),
       micro=st.lists(_MICRO, min_size=1, max_size=9))
def test_accumulator_matches_torchs_loop(steps, low, scaled, fused, micro):
    """GradAccumulator against torch's own accumulation loop (zero_grad at the window end; bf16
    params summed in fp32 by hand) over random windows, freezing/unfreezing, params without
    gradients, zero-size and tied params, overflowing micro-batches and mid-window checkpoints."""
    torch.manual_seed(0)
    ref, mod = _Net(low), None
    mod = copy.deepcopy(ref)
    mk = (lambda ps: ampfuse.optim.SGD(ps, lr=0.05, momentum=0.5)) if fused else (
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5))
    opt_ref, opt = mk(list(ref.parameters())), mk(list(mod.parameters()))
    sc_ref = torch.amp.GradScaler("cpu", init_scale=4.0) if scaled else None
    sc = torch.amp.GradScaler("cpu", init_scale=4.0) if scaled else None
    acc = ampfuse.GradAccumulator(mod, opt, sc, steps=steps)
    sums: dict[nn.Parameter, torch.Tensor] = {}
    x = torch.randn(2, 3)
    k = 0
    for use_b, action, overflow, checkpoint in micro:
        for net in (ref, mod):
            if action != "none":
                getattr(net, action[-1]).requires_grad_(action.startswith("unfreeze"))
        loss_of = (lambda net: net(x, use_b) * (float("inf") if overflow and scaled else 1.0))
        # torch's loop
        loss = loss_of(ref) / steps
        (sc_ref.scale(loss) if scaled else loss).backward()
        for p in ref.parameters():
            if p.dtype == torch.bfloat16 and p.grad is not None:
                sums[p] = sums.get(p, torch.zeros_like(p, dtype=torch.float32)) + p.grad.float()
                p.grad = None
        k += 1
        # the accumulator
        with acc.accumulate():
            acc.backward(loss_of(mod))
        if checkpoint and acc.micro_step != 0:  # into this accumulator, or a new one built now
            sd = _roundtrip(acc.state_dict())
            if checkpoint == "fresh":
                acc = ampfuse.GradAccumulator(mod, opt, sc, steps=steps)
            acc.load_state_dict(sd)
        if k == steps:
            if fused and not scaled:  # the fused step reads the fp32 sums
                opt_ref.step(grads=dict(sums))
            else:
                for p, s in sums.items():
                    p.grad = s.to(p.dtype)
                if scaled:
                    sc_ref.step(opt_ref)
                    sc_ref.update()
                else:
                    opt_ref.step()
            sums.clear()
            opt_ref.zero_grad()
            k = 0
            assert acc.window_ended
        for (name, p), q in zip(ref.named_parameters(), mod.parameters()):
            torch.testing.assert_close(q, p, atol=0, rtol=0, msg=name)
    if scaled:
        assert sc.get_scale() == sc_ref.get_scale()


@_FAST
@given(ops=st.lists(st.sampled_from(["true", "remainder", "bf16_state", "fp32_state", "ckpt", "step", "add_group"]),
                   min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_precision_switches_keep_masters_bit_for_bit(ops, seed):
    """Switching master form and state dtype (group edits, add_param_group, checkpoints of
    either form) never changes a master: after every operation each param's master is the one an
    optimizer that never switched holds (ties included), and the trajectories agree."""
    torch.manual_seed(seed)
    base = torch.randn(64)
    tie = (base.to(torch.bfloat16).view(torch.int16).to(torch.int32) << 16) | 0x8000
    init = torch.where(torch.arange(64) % 2 == 0, tie.view(torch.float32), base)
    groups = [nn.Parameter(init.to(torch.bfloat16))]
    ref_p = nn.Parameter(init.to(torch.bfloat16))
    ref = ampfuse.optim.Adam([ref_p], lr=1e-3, master_weights=True)
    opt = ampfuse.optim.Adam([groups[0]], lr=1e-3, master_weights=True)
    with torch.no_grad():
        for o, p in ((ref, ref_p), (opt, groups[0])):
            p.grad = torch.zeros_like(p)
            o.step()  # create the masters, then make them ties
            o.state[p]["master_param"].copy_(init)
            p.copy_(init.to(torch.bfloat16))
    extra = []
    for op in ops:
        g = opt.param_groups[-1]
        if op in ("true", "remainder"):
            g["master_weights"] = True if op == "true" else "remainder"
        elif op.endswith("_state"):  # the same moments on both sides: the masters must agree
            for o in (ref, opt):
                o.param_groups[0]["state_dtype"] = torch.bfloat16 if op == "bf16_state" else torch.float32
        elif op == "ckpt":
            sd = _roundtrip(opt.state_dict())
            mw = [gr["master_weights"] for gr in opt.param_groups]
            sdt = [gr["state_dtype"] for gr in opt.param_groups]
            opt = ampfuse.optim.Adam([{"params": gr["params"], "master_weights": m, "state_dtype": d}
                                      for gr, m, d in zip(opt.param_groups, mw, sdt)], lr=1e-3)
            opt.load_state_dict(sd)
        elif op == "add_group" and not extra:
            q = nn.Parameter(torch.randn(8).to(torch.bfloat16))
            extra.append(q)
            opt.add_param_group({"params": [q], "master_weights": "remainder"})
        grad = torch.randn(64).to(torch.bfloat16) if op == "step" else torch.zeros(64, dtype=torch.bfloat16)
        for o, p in ((ref, ref_p), (opt, groups[0])):
            p.grad = grad.clone()
            if op != "step":
                o.step(scaling=StepScaling(found_inf=torch.ones(())))  # a skipped step: converts only
            else:
                o.step()
        for q in extra:
            q.grad = None
        assert torch.equal(_bits(_master_of(opt, groups[0])), _bits(_master_of(ref, ref_p))), op


@_FAST
@given(seq=st.lists(st.sampled_from([torch.float32, torch.bfloat16]), min_size=1, max_size=5), seed=st.integers(0, 99))
def test_state_dtype_switches_round_the_moments_once(seq, seed):
    """Switching state_dtype stores the moments rounded to nearest even (fp32 -> bf16) or widened
    exactly (bf16 -> fp32), for every param with state (one without a gradient at that step too,
    as the README says); the masters are untouched."""
    torch.manual_seed(seed)
    p = nn.Parameter(torch.randn(32).to(torch.bfloat16))
    q = nn.Parameter(torch.randn(16).to(torch.bfloat16))  # has state, gets no gradient later
    opt = ampfuse.optim.Adam([p, q], lr=1e-3, master_weights="remainder")
    p.grad = torch.randn(32).to(torch.bfloat16)
    q.grad = torch.randn(16).to(torch.bfloat16)
    opt.step()
    q.grad = None
    for dtype in seq:
        before = {(x, k): opt.state[x][k].clone() for x in (p, q) for k in ("exp_avg", "exp_avg_sq")}
        masters = [_master_of(opt, x).clone() for x in (p, q)]
        opt.param_groups[0]["state_dtype"] = dtype
        opt.step(scaling=StepScaling(found_inf=torch.ones(())))
        for (x, k), v in before.items():
            assert opt.state[x][k].dtype == dtype
            assert torch.equal(opt.state[x][k], v.to(dtype))
        for x, master in zip((p, q), masters):
            assert torch.equal(_bits(_master_of(opt, x)), _bits(master))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.state_dict()
