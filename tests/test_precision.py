"""Precision options of the fused optimizers: 16-bit master remainders and bf16 state.

- ``master_weights="remainder"`` keeps the same fp32 master as ``master_weights=True``, bit for
  bit, over 1,000 steps with skipped steps and checkpoint round trips; its params differ from
  ``True``'s only at exact ties (rounded away from zero instead of to even).
- ``state_dtype=torch.bfloat16`` runs the fp32 math and stores the state rounded to nearest even:
  one step from bf16-representable state equals the fp32-state step with its state rounded.
- Checkpoints: fp32 state and an fp32 ``master_param`` on save, loadable by torch.optim and back;
  on load the optimizer keeps its own precision options and converts the loaded state.
- Switching a group's master form or state dtype (and checkpoints of the other form) keeps every
  master bit for bit, exact ties included; state_dtype switches round the moments once.
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import ampfuse
from ampfuse import ops
from ampfuse.optim import StepScaling, join_master, split_master

_FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _rne(master: torch.Tensor) -> torch.Tensor:
    return master.to(torch.bfloat16)


def _ties(master: torch.Tensor) -> torch.Tensor:
    return (master.view(torch.int32) & 0xFFFF) == 0x8000


# ---- the split itself ---------------------------------------------------------------------------


def test_split_join_round_trip_every_low_half_pattern():
    """(param, remainder) reconstructs every fp32 value whose upper half is a normal bf16 number
    (all 65536 low halves for a set of upper halves), and the param is the master rounded to
    nearest, ties away from zero."""
    uppers = torch.tensor([0x0001, 0x0080, 0x3F80, 0x3F81, 0x4049, 0x7F7F, 0x8080, 0xBF80, 0xC2F7, 0xFF7E], dtype=torch.int64)
    lows = torch.arange(65536, dtype=torch.int64)
    bits = (uppers[:, None] << 16 | lows[None, :]).flatten()
    master = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    p, r = split_master(master)
    assert torch.equal(join_master(p, r).view(torch.int32), master.view(torch.int32))
    ties = _ties(master)
    away = p.float().abs() > master.abs()  # ties went away from zero
    assert torch.equal(p[~ties], _rne(master)[~ties])
    assert bool(away[ties].all())
    assert int(ties.sum()) == len(uppers)  # one tie per upper half


def test_join_of_edited_params_is_the_param():
    """A pair no split produces (a zero, inf or NaN param next to a remainder of the wrong sign)
    stands for the param's value, as in the kernels."""
    p = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan], dtype=torch.bfloat16)
    r = torch.tensor([-5, -5, 7, 7, 3], dtype=torch.int16)
    m = join_master(p, r)
    assert torch.equal(m.view(torch.int32), p.float().view(torch.int32))


def _tie_master() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    master = torch.randn(4, 6, generator=g) * 3
    bits = master.view(torch.int32)
    bits[0] = bits[0] & ~0xFFFF | 0x8000  # exact ties
    master[1, :3] = torch.tensor([math.inf, -0.0, math.nan])
    return master


def test_convert_master_moves_between_forms_without_losing_a_bit():
    """convert_master_ (the one conversion both surfaces use): fp32 -> remainder -> fp32 returns
    the same master bit for bit, ties included, with the param at each form's rounding; 'none'
    drops the master; a master already of the form is returned as it is."""
    convert = torch.ops.ampfuse.convert_master_
    master = _tie_master()
    p = _rne(master)
    (rem,) = convert(p, master, None, "remainder", False)
    assert torch.equal(join_master(p, rem).view(torch.int32), master.view(torch.int32))
    num = ~master.isnan()
    assert torch.equal(p[num], split_master(master)[0][num])  # ties moved away from zero
    (back,) = convert(p, None, rem, "float", False)
    assert torch.equal(back.view(torch.int32), master.view(torch.int32))
    assert torch.equal(p[num], _rne(master)[num])  # ties back to round-half-even
    assert convert(p, back, None, "float", False)[0] is back
    assert convert(p, None, rem, "remainder", False)[0] is rem
    assert convert(p, back, rem, "none", False) == []
    (fresh,) = convert(p, None, None, "float", False)
    assert torch.equal(fresh[num], p.float()[num])
    (zero,) = convert(p, None, None, "remainder", False)
    assert zero.dtype == torch.int16 and not zero.any()
    # reconcile: a loaded fp32 master whose param holds the remainder form's rounding
    p_away = split_master(master)[0]
    convert(p_away, master, None, "float", True)
    assert torch.equal(p_away[num], _rne(master)[num])
    with pytest.raises(RuntimeError, match="kind must be 'none', 'float' or 'remainder', got 'fp32'"):
        convert(p, master, None, "fp32", False)
    with pytest.raises(RuntimeError, match="the remainder form needs a torch.bfloat16 param, got torch.float16"):
        convert(master.half(), master, None, "remainder", False)


@pytest.mark.parametrize("case", ["float-from-remainder", "remainder-from-float", "float-reconcile", "none"])
def test_convert_master_opcheck(case):
    master = _tie_master()
    master[1, 2] = 1.0  # opcheck compares outputs without equal_nan (NaN: the test above)
    p, rem = split_master(master)
    args = {"float-from-remainder": (p, None, rem, "float", False),
            "remainder-from-float": (_rne(master), master, None, "remainder", False),
            "float-reconcile": (p, master, None, "float", True),
            "none": (p, master, rem, "none", False)}[case]
    torch.library.opcheck(torch.ops.ampfuse.convert_master_.default, args)


# ---- kernels: remainder == fp32 master, bf16 state == rounded fp32 state ------------------------


def _adam_inputs(n: int, seed: int, state_dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 3).to(torch.bfloat16)
    m = (torch.randn(n, generator=g) * 0.1).to(state_dtype).float()
    v = (torch.rand(n, generator=g) * 0.01).to(state_dtype).float()
    return master, grad, m, v


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_remainder_step_is_the_fp32_master_step(kind):
    n = 4099
    master, grad, m, v = _adam_inputs(n, 1)
    hi, rem = split_master(master)
    float_lists = dict(params=[_rne(master)], masters=[master.clone()], states=[m.clone(), v.clone()])
    rem_lists = dict(params=[hi.clone()], masters=[rem.clone()], states=[m.clone(), v.clone()])
    for lists in (float_lists, rem_lists):
        step = [torch.zeros(())]
        if kind == "adam":
            ops.adam_step_(lists["params"], [grad], lists["masters"], lists["states"][:1], lists["states"][1:], [], step,
                           lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, grad_scale=torch.tensor(4.0))
        else:
            ops.sgd_step_(lists["params"], [grad], lists["masters"], lists["states"][:1], step, lr=1e-2, momentum=0.9)
    new_master = float_lists["masters"][0]
    assert torch.equal(join_master(rem_lists["params"][0], rem_lists["masters"][0]).view(torch.int32), new_master.view(torch.int32))
    ties = _ties(new_master)
    assert torch.equal(rem_lists["params"][0][~ties], float_lists["params"][0][~ties])
    for a, b in zip(float_lists["states"], rem_lists["states"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("master", [None, "float", "remainder"])
def test_bf16_state_is_the_fp32_state_rounded(master):
    """From bf16-representable state, a bf16-state step computes exactly the fp32-state step (the
    params and masters bitwise) and stores its state rounded to nearest even."""
    n = 3001
    m0, grad, m, v = _adam_inputs(n, 2, torch.bfloat16)
    p_hi, rem = split_master(m0)
    results = []
    for sdtype in (torch.float32, torch.bfloat16):
        params = [p_hi.clone() if master == "remainder" else _rne(m0)]
        masters = {None: [], "float": [m0.clone()], "remainder": [rem.clone()]}[master]
        ea, eas = [m.to(sdtype, copy=True)], [v.to(sdtype, copy=True)]
        ops.adam_step_(params, [grad], masters, ea, eas, [], [torch.ones(())], lr=1e-2, weight_decay=0.01)
        results.append((params[0], masters, ea[0], eas[0]))
    (p32, ms32, ea32, eas32), (p16, ms16, ea16, eas16) = results
    assert torch.equal(p16, p32)
    for a, b in zip(ms32, ms16):
        assert torch.equal(a, b)
    assert ea16.dtype == torch.bfloat16 and torch.equal(ea16, ea32.to(torch.bfloat16))
    assert torch.equal(eas16, eas32.to(torch.bfloat16))


# ---- optimizers: 1,000 steps, skips and checkpoint round trips ----------------------------------


def _model(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 19), (257,), (16, 3, 3, 3), (1000,), (5,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in shapes]


def _grads(params, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    out = [(torch.randn(p.shape, generator=g) * 256).to(torch.bfloat16) for p in params]
    if step % 97 == 13:  # an overflow: this step is skipped (and the scale backs off)
        out[step % len(out)].view(-1)[step % 5] = math.inf
    return out


def _run(master_weights, steps: int, checkpoint_every: int, opt_cls=ampfuse.optim.AdamW, **kw):
    params = _model(0)
    opt = opt_cls(params, lr=1e-3, master_weights=master_weights, **kw)
    scaler = ampfuse.GradScaler("cpu", init_scale=256.0, growth_interval=50)
    skipped = 0
    for k in range(steps):
        scaler.scale(torch.ones(()))
        for p, g in zip(params, _grads(params, k)):
            p.grad = g
        scaler.unscale_and_clip_(opt, 50.0)
        scaler.step(opt)
        scaler.update()
        skipped += int(scaler.last_found_inf.item() != 0)
        if checkpoint_every and (k + 1) % checkpoint_every == 0:
            # round trip through a checkpoint into a fresh optimizer and scaler
            sd_opt, sd_scaler = opt.state_dict(), scaler.state_dict()
            opt = opt_cls(params, lr=1e-3, master_weights=master_weights, **kw)
            opt.load_state_dict(sd_opt)
            scaler = ampfuse.GradScaler("cpu")
            scaler.load_state_dict(sd_scaler)
    return params, opt, skipped


def _master_of(opt, p):
    st = opt.state[p]
    return join_master(p.detach(), st["master_remainder"]) if "master_remainder" in st else st["master_param"]


def _masters(params, opt):
    return [_master_of(opt, p) for p in params]


@pytest.mark.parametrize("opt_cls", [ampfuse.optim.AdamW, ampfuse.optim.SGD], ids=["adamw", "sgd"])
def test_remainder_training_bitwise_equal_to_fp32_masters(opt_cls):
    """1,000 steps, with skipped steps and a checkpoint round trip every 300: the masters of
    master_weights="remainder" equal those of master_weights=True bit for bit, and the params
    differ only where the master is an exact tie."""
    kw = {"momentum": 0.9} if opt_cls is ampfuse.optim.SGD else {}
    p_f, o_f, skipped = _run(True, 1000, 300, opt_cls, **kw)
    p_r, o_r, _ = _run("remainder", 1000, 300, opt_cls, **kw)
    assert skipped >= 10
    for pf, pr, mf, mr in zip(p_f, p_r, _masters(p_f, o_f), _masters(p_r, o_r)):
        assert torch.equal(mf.view(torch.int32), mr.view(torch.int32))
        ties = _ties(mf)
        assert torch.equal(pf[~ties], pr[~ties])
        assert torch.equal(pf, _rne(mf))
    assert all("master_remainder" in o_r.state[p] and o_r.state[p]["master_remainder"].dtype == torch.int16 for p in p_r)


def test_checkpoint_is_fp32_and_loads_into_torch_and_back():
    params = _model(3)
    opt = ampfuse.optim.AdamW(params, lr=1e-3, master_weights="remainder", state_dtype=torch.bfloat16)
    for k in range(3):
        for p, g in zip(params, _grads(params, k)):
            p.grad = g
        opt.step()
    sd = opt.state_dict()
    for i, p in enumerate(params):
        st = sd["state"][i]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq", "master_param"}
        assert st["exp_avg"].dtype == torch.float32 and st["master_param"].dtype == torch.float32
        assert torch.equal(st["exp_avg"], opt.state[p]["exp_avg"].float())
        assert torch.equal(st["master_param"], join_master(p.detach(), opt.state[p]["master_remainder"]))
    # torch.optim.AdamW on fp32 copies of the masters takes the checkpoint as its own
    masters = [torch.nn.Parameter(sd["state"][i]["master_param"].clone()) for i in range(len(params))]
    ref = torch.optim.AdamW(masters, lr=1e-3)
    ref.load_state_dict(sd)
    # and an ampfuse optimizer with other precision options takes it back: the state converted
    # at its next step (remainders rebuilt from master_param)
    again = ampfuse.optim.AdamW(params, lr=1e-3, master_weights="remainder", state_dtype=torch.bfloat16)
    again.load_state_dict(ref.state_dict())
    for p, g in zip(params, _grads(params, 9)):
        p.grad = g
    again.step()
    for p in params:
        st = again.state[p]
        assert st["exp_avg"].dtype == torch.bfloat16 and st["master_remainder"].dtype == torch.int16


def test_switching_options_converts_state():
    """Changing a group's master_weights or state_dtype between steps converts the state at the
    next step (masters exactly; bf16 state rounded once)."""
    params = _model(4)
    opt = ampfuse.optim.AdamW(params, lr=1e-3)
    for k in range(2):
        for p, g in zip(params, _grads(params, k)):
            p.grad = g
        opt.step()
    masters = [opt.state[p]["master_param"].clone() for p in params]
    opt.param_groups[0]["master_weights"] = "remainder"
    opt.param_groups[0]["state_dtype"] = torch.bfloat16
    opt._bring_state(opt.param_groups[0], params[:1], [True])  # what the next step does for each param
    st = opt.state[params[0]]
    assert "master_param" not in st and torch.equal(join_master(params[0].detach(), st["master_remainder"]), masters[0])
    assert st["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("bad, message", [
    (dict(master_weights="half"), "master_weights must be True, False, 'auto', 'remainder' or 'stochastic'"),
    (dict(state_dtype=torch.float16), r"\['state_dtype'\] must be torch.float32, torch.bfloat16, torch.uint8"),
    (dict(exp_avg_sq_dtype=torch.float16), r"\['exp_avg_sq_dtype'\] must be torch.float32, .* or None"),
    (dict(state_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8),
     r"\['exp_avg_sq_dtype'\] \(torch.uint8\) may differ from .* only when both are 8-bit"),
])
def test_bad_precision_options(bad, message):
    with pytest.raises(ValueError, match=message):
        ampfuse.optim.AdamW(_model(0), **bad)


# ---- precision options on load; switching the master form, ties included ------------------------


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _adamw_step(opt, params):
    for p in params:
        p.grad = torch.full_like(p, 0.25)
    opt.step()


def test_load_state_dict_keeps_the_optimizers_precision_options():
    """The options the optimizer has win over the checkpoint's; its state is converted."""
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


def test_tie_masters_survive_switching_the_master_form():
    """True -> "remainder" -> True keeps every master bit for bit, ties included."""
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
    """A checkpoint saved in one master form loads into the other with every master exact."""
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
    """True -> False -> True: the master restarts from the param, not a stale one."""
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


# ---- property-based: switching master form and state dtype never changes a master ---------------


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
    as the manual says); the masters are untouched."""
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
