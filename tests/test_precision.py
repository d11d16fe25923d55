"""Precision options of the fused optimizers: 16-bit master remainders and bf16 state.

- ``master_weights="remainder"`` keeps the same fp32 master as ``master_weights=True``, bit for
  bit, over 1,000 steps with skipped steps and checkpoint round trips; its params differ from
  ``True``'s only at exact ties (rounded away from zero instead of to even).
- ``state_dtype=torch.bfloat16`` runs the fp32 math and stores the state rounded to nearest even:
  one step from bf16-representable state equals the fp32-state step with its state rounded.
- Checkpoints: fp32 state and an fp32 ``master_param`` on save, loadable by torch.optim and back.
"""

from __future__ import annotations

import math

import pytest
import torch

import ampfuse
from ampfuse import ops
from ampfuse.optim import join_master, split_master


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


def _masters(params, opt):
    out = []
    for p in params:
        st = opt.state[p]
        out.append(join_master(p.detach(), st["master_remainder"]) if "master_remainder" in st else st["master_param"])
    return out


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
    opt._ensure_state(params[0], opt.param_groups[0])  # what the next step does for each param
    st = opt.state[params[0]]
    assert "master_param" not in st and torch.equal(join_master(params[0].detach(), st["master_remainder"]), masters[0])
    assert st["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("bad, message", [
    (dict(master_weights="half"), "master_weights must be True, False, 'auto' or 'remainder'"),
    (dict(state_dtype=torch.float16), "state_dtype must be torch.float32 or torch.bfloat16"),
])
def test_bad_precision_options(bad, message):
    with pytest.raises(ValueError, match=message):
        ampfuse.optim.AdamW(_model(0), **bad)
