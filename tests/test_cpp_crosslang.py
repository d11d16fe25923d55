"""Cross-language tests: the same scenarios through the C++ API and the Python API give bitwise
identical tensors and the same messages (apart from how each surface names a param and a
checkpoint).

A fixed sequence of mixed-precision steps (``tests/cpp/crosslang_sequence.cpp``, built as
``ampfuse_crosslang`` by ``make build``), and cases of the engine's rules
(``tests/cpp/crosslang_cases.cpp``, ``ampfuse_crosslang_cases``): exact-tie masters through form
switches and checkpoints of the other form, master_weights off and on again, a checkpoint loaded
into other precision options, the gradient checks across groups, bad scaler checkpoint entries,
bad partial-sum entries of a mid-window accumulator checkpoint, bad state entries of an optimizer
checkpoint.

The sequence (CPU): bf16 params, ``AdamW`` with fp32 masters, a ``GradScaler`` with hysteresis and
a short growth interval, an inf and a NaN injected, ``unscale_and_clip_`` on some iterations; then
a ``GradAccumulator`` (2 micro-batches, clipping) over three windows, one of them overflowing; then
a run with 16-bit remainders and bf16 moments, windows of 3 with overflows at seeded places, whose
checkpoint taken inside an overflowed window is loaded into fresh objects by each surface's own
checkpoint API; then 8-bit moments (uint8 and e5m2) with remainders, an overflow and an optimizer
checkpoint; then SGD momentum on bf16 params rounded stochastically (no master), an overflow and a
checkpoint loaded into an optimizer of another seed. The C++ program writes its inputs too, so both
sides start from the same bits.
"""

from __future__ import annotations

import copy
import math
import os
import re
import subprocess

import pytest
import torch
import torch.jit._pickle

import ampfuse

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_NUM_PARAMS = 3


def _binary(name: str = "ampfuse_crosslang") -> str:
    build_dir = os.environ.get("AMPFUSE_CPP_BUILD_DIR", os.path.join(_ROOT, "build"))
    path = os.path.join(build_dir, "tests", "cpp", name)
    if not os.path.exists(path):
        pytest.fail(
            f"{path} does not exist: build the C++ tests first (`make build`, or set "
            "AMPFUSE_CPP_BUILD_DIR to the CMake build directory)."
        )
    return path


@pytest.fixture(scope="module")
def cpp_results(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("crosslang") / "cpp.pt"
    subprocess.run([_binary(), str(out)], check=True, timeout=120)
    # torch::pickle_save tags the typed dict with torch.jit._pickle.restore_type_tag.
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return torch.load(out)


def _loss(params: list[torch.Tensor], xs: list[torch.Tensor]) -> torch.Tensor:
    loss = torch.zeros(())
    for p, x in zip(params, xs):
        loss = loss + (p.float() * x).sum()
    return loss


def _record_params(res: dict[str, torch.Tensor], prefix: str, params: list[torch.Tensor], opt) -> None:
    """Each param and its AdamW state under `prefix`, as the C++ program records them."""
    for i, p in enumerate(params):
        state = opt.state[p]
        res[f"{prefix}param/{i}"] = p.detach().clone()
        for key, name in (("master_param", "master"), ("master_remainder", "remainder")):
            if key in state:
                res[f"{prefix}{name}/{i}"] = state[key].clone()
        for key in ("exp_avg", "exp_avg_sq", "step"):
            res[f"{prefix}{key}/{i}"] = state[key].clone()


def _run_python(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    res: dict[str, torch.Tensor] = {}
    params = [d[f"init/{i}"].clone().requires_grad_(True) for i in range(_NUM_PARAMS)]
    opt = ampfuse.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
    scaler = ampfuse.GradScaler("cpu", init_scale=1024.0, growth_interval=2, hysteresis=2)
    for step in range(8):
        xs = [d[f"x/{step}/{i}"] for i in range(_NUM_PARAMS)]
        scaler.scale(_loss(params, xs)).backward()
        if step % 3 == 1:
            res[f"norm/{step}"] = scaler.unscale_and_clip_(opt, 0.5).clone()
        scaler.step(opt)
        scaler.update()
        res[f"scale/{step}"] = scaler._scale.clone()
        res[f"found_inf/{step}"] = scaler.last_found_inf.clone()
        opt.zero_grad()

    acc = ampfuse.GradAccumulator(torch.nn.Module(), opt, scaler, steps=2, max_grad_norm=1.0)
    for k in range(6):
        xs = [d[f"x2/{k}/{i}"] for i in range(_NUM_PARAMS)]
        with acc.accumulate():
            acc.backward(_loss(params, xs))
        res[f"scale2/{k}"] = scaler._scale.clone()

    res.update(_run_python_resumed(d))
    res.update(_run_python_8bit(d))
    res.update(_run_python_stochastic(d))
    _record_params(res, "out/", params, opt)
    res["out/scale"] = scaler._scale.clone()
    res["out/growth_tracker"] = torch.tensor(scaler._get_growth_tracker())
    res["out/stats"] = scaler._stats.clone()
    return res


_MICRO3, _RESUME_AFTER3 = 16, 7


def _run_python_resumed(d: dict[str, torch.Tensor], resume: bool = True) -> dict[str, torch.Tensor]:
    """Phase 3: remainders and bf16 moments, windows of 3 with seeded overflows, and a
    mid-window checkpoint loaded into a fresh optimizer, scaler and accumulator (or, with
    ``resume=False``, the same run without the checkpoint)."""
    res: dict[str, torch.Tensor] = {}

    def build(params: list[torch.Tensor]):
        opt = ampfuse.optim.AdamW(params, lr=3e-3, weight_decay=0.01, master_weights="remainder",
                                  state_dtype=torch.bfloat16)
        scaler = ampfuse.GradScaler("cpu", init_scale=256.0, growth_interval=2)
        return opt, scaler, ampfuse.GradAccumulator(torch.nn.Module(), opt, scaler, steps=3, max_grad_norm=0.7)

    params = [d[f"init3/{i}"].clone().requires_grad_(True) for i in range(_NUM_PARAMS)]
    opt, scaler, acc = build(params)
    for k in range(_MICRO3):
        xs = [d[f"x3/{k}/{i}"] for i in range(_NUM_PARAMS)]
        with acc.accumulate():
            acc.backward(_loss(params, xs))
        res[f"scale3/{k}"] = scaler._scale.clone()
        if resume and k == _RESUME_AFTER3:
            saved = copy.deepcopy(acc.state_dict())
            params = [p.detach().clone().requires_grad_(True) for p in params]
            opt, scaler, acc = build(params)
            acc.load_state_dict(saved)
    _record_params(res, "out3/", params, opt)
    res["out3/scale"] = scaler._scale.clone()
    res["out3/stats"] = scaler._stats.clone()
    res["out3/windows"] = torch.tensor(acc.windows)
    return res


def _scaled_run_with_checkpoint(d, inputs: str, params, build, init_scale: float, steps: int, checkpoint_after: int):
    """Two params stepped through an ampfuse scaler on the C++ program's inputs ``<inputs>/<step>/<i>``;
    after step ``checkpoint_after`` the optimizer's state_dict is loaded into a fresh optimizer
    (``build(params, first=False)``) over copies of the params. Returns the params and optimizer."""
    opt = build(params, True)
    scaler = ampfuse.GradScaler("cpu", init_scale=init_scale)
    for step in range(steps):
        scaler.scale(_loss(params, [d[f"{inputs}/{step}/{i}"] for i in range(2)])).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if step == checkpoint_after:
            saved = copy.deepcopy(opt.state_dict())
            params = [p.detach().clone().requires_grad_(True) for p in params]
            opt = build(params, False)
            opt.load_state_dict(saved)
    return params, opt


def _run_python_8bit(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phase 4: uint8 / e5m2 moments with remainders, an overflow, an optimizer checkpoint."""
    res: dict[str, torch.Tensor] = {}
    params = [d[f"init4/{i}"].clone().requires_grad_(True) for i in range(2)]

    def build(ps, first=True):
        return ampfuse.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, master_weights="remainder",
                                   state_dtype=torch.uint8, exp_avg_sq_dtype=torch.float8_e5m2)

    params, opt = _scaled_run_with_checkpoint(d, "x4", params, build, 512.0, steps=6, checkpoint_after=3)
    for i, p in enumerate(params):
        state = opt.state[p]
        res[f"out4/param/{i}"] = p.detach().clone()
        res[f"out4/remainder/{i}"] = state["master_remainder"].clone()
        for key in ("exp_avg", "exp_avg_sq"):
            res[f"out4/{key}/{i}"] = state[key].view(torch.uint8).clone()
            if key + "_absmax" in state:
                res[f"out4/{key}_absmax/{i}"] = state[key + "_absmax"].clone()
        res[f"out4/step/{i}"] = state["step"].clone()
    return res


def _run_python_stochastic(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phase 5: SGD momentum, bf16 params rounded stochastically with seed 123, an overflow, and
    an optimizer checkpoint loaded into an optimizer built with another seed."""
    res: dict[str, torch.Tensor] = {}
    params = [d[f"init5/{i}"].clone().requires_grad_(True) for i in range(2)]

    def build(ps, first):
        return ampfuse.optim.SGD(ps, lr=1e-3, momentum=0.9, master_weights="stochastic", rounding_seed=123 if first else 0)

    params, opt = _scaled_run_with_checkpoint(d, "x5", params, build, 256.0, steps=5, checkpoint_after=2)
    for i, p in enumerate(params):
        res[f"out5/param/{i}"] = p.detach().clone()
        res[f"out5/momentum_buffer/{i}"] = opt.state[p]["momentum_buffer"].clone()
        res[f"out5/step/{i}"] = opt.state[p]["step"].clone()
    return res


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_cpp_and_python_give_bitwise_identical_tensors(cpp_results):
    py = _run_python(cpp_results)
    compared = [k for k in cpp_results
                if not (k.startswith("init") or k.startswith("x") or k == "faults3")]
    assert set(compared) == set(py), sorted(set(compared) ^ set(py))
    for key in sorted(compared):
        a, b = cpp_results[key], py[key]
        assert a.dtype == b.dtype and a.shape == b.shape, (key, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(_bits(a), _bits(b)), (key, a, b)


def test_a_mid_window_resume_gives_the_bits_of_the_run_without_it(cpp_results):
    resumed, straight = _run_python_resumed(cpp_results), _run_python_resumed(cpp_results, resume=False)
    assert set(resumed) == set(straight)
    for key in sorted(resumed):
        assert torch.equal(_bits(resumed[key]), _bits(straight[key])), key


def test_the_sequence_exercises_skips_growth_and_clipping(cpp_results):
    # Guards the sequence itself: if it stopped overflowing or growing, the parity test above
    # would cover less than it claims.
    found = [float(cpp_results[f"found_inf/{s}"]) for s in range(8)]
    assert found == [0, 0, 0, 1, 1, 0, 1, 0]
    scales = [float(cpp_results[f"scale/{s}"]) for s in range(8)]
    assert scales == [1024, 2048, 2048, 2048, 1024, 1024, 512, 512]  # hysteresis 2 absorbs one
    assert [float(cpp_results[f"scale2/{k}"]) for k in range(6)] == [512, 1024, 1024, 1024, 1024, 1024]
    assert cpp_results["out/stats"].tolist() == [11, 4, 2, 0]  # updates, overflows, backoffs, floor
    assert all(float(cpp_results[f"out/step/{i}"]) == 7 for i in range(_NUM_PARAMS))
    assert 0.5 < float(cpp_results["norm/1"]) < float("inf")  # clipping was active
    faults = cpp_results["faults3"].tolist()
    assert faults[6] != 0 and sum(f != 0 for f in faults) >= 2  # the checkpointed window overflowed
    assert float(cpp_results["out3/windows"]) == _MICRO3 // 3
    assert 0 < cpp_results["out3/stats"][1] < _MICRO3 // 3  # some windows skipped, some stepped
    assert cpp_results["out3/remainder/0"].dtype == torch.int16
    assert cpp_results["out3/exp_avg/0"].dtype == torch.bfloat16
    # phase 4: the big param's moments are 8-bit codes with absmax, the small one's fp32; the
    # overflowed step was skipped
    assert cpp_results["out4/exp_avg/0"].shape == (80, 64) and cpp_results["out4/exp_avg_absmax/0"].shape == (20,)
    assert "out4/exp_avg_absmax/1" not in cpp_results and cpp_results["out4/exp_avg/1"].numel() == 33 * 4
    assert float(cpp_results["out4/step/0"]) == 5
    # phase 5: stochastic rounding, the overflowed step skipped
    assert float(cpp_results["out5/step/0"]) == 4 and cpp_results["out5/param/0"].dtype == torch.bfloat16
    assert cpp_results["out/master/0"].dtype == torch.float32
    assert cpp_results["out/param/0"].dtype == torch.bfloat16


# ---- the engine's rules, case by case -----------------------------------------------------------


@pytest.fixture(scope="module")
def cpp_cases(tmp_path_factory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("crosslang") / "cases.pt"
    subprocess.run([_binary("ampfuse_crosslang_cases"), str(out)], check=True, timeout=120)
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return torch.load(out)


def _message(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what is compared
        return str(e)
    return ""


def _master(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    st = opt.state[p]
    if "master_remainder" in st:
        return ampfuse.optim.join_master(p.detach(), st["master_remainder"])
    return st["master_param"].clone()


def _zero_step(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
    p.grad = torch.zeros_like(p)
    opt.step()


def _ties(d: dict) -> dict:
    res = {}
    masters = d["in/ties"]
    p = masters.to(torch.bfloat16).requires_grad_(True)
    opt = ampfuse.optim.SGD([p], lr=0.0)
    _zero_step(opt, p)
    opt.state[p]["master_param"].copy_(masters)
    opt.param_groups[0]["master_weights"] = "remainder"
    _zero_step(opt, p)
    res["ties/remainder/param"], res["ties/remainder/master"] = p.detach().clone(), _master(opt, p)
    opt.param_groups[0]["master_weights"] = True
    _zero_step(opt, p)
    res["ties/back/param"], res["ties/back/master"] = p.detach().clone(), _master(opt, p)
    for from_remainder in (True, False):
        key = "ties/load_into_fp32" if from_remainder else "ties/load_into_remainder"
        opt.param_groups[0]["master_weights"] = "remainder" if from_remainder else True
        _zero_step(opt, p)
        sd = copy.deepcopy(opt.state_dict())
        q = p.detach().clone().requires_grad_(True)
        other = ampfuse.optim.SGD([q], lr=0.0, master_weights=True if from_remainder else "remainder")
        other.load_state_dict(sd)
        _zero_step(other, q)
        res[f"{key}/param"], res[f"{key}/master"] = q.detach().clone(), _master(other, q)
    return res


def _master_weights_off_and_on(d: dict) -> dict:
    p = d["in/off_on/init"].clone().requires_grad_(True)
    opt = ampfuse.optim.AdamW([p], lr=1e-2, master_weights="remainder")
    for k in range(5):
        if k == 2:
            opt.param_groups[0]["master_weights"] = False
        if k == 4:
            opt.param_groups[0]["master_weights"] = "remainder"
        p.grad = d[f"in/off_on/grad/{k}"].clone()
        opt.step()
    return {"off_on/param": p.detach().clone(), "off_on/master": _master(opt, p),
            "off_on/exp_avg": opt.state[p]["exp_avg"].clone()}


def _load_keeps_own_options(d: dict) -> dict:
    a = d["in/own/init"].clone().requires_grad_(True)
    without = ampfuse.optim.AdamW([a], lr=0.05, master_weights=False, state_dtype=torch.bfloat16)
    for k in range(2):
        a.grad = d[f"in/own/grad/{k}"].clone()
        without.step()
    sd = copy.deepcopy(without.state_dict())
    b = a.detach().clone().requires_grad_(True)
    with_ = ampfuse.optim.AdamW([b], lr=1e-3)
    with_.load_state_dict(sd)
    b.grad = d["in/own/grad/2"].clone()
    with_.step()
    g = with_.param_groups[0]
    return {"own/keeps_master": "master_param" in with_.state[b], "own/fp32_state": g["state_dtype"] == torch.float32,
            "own/lr": g["lr"], "own/param": b.detach().clone(), "own/master": _master(with_, b),
            "own/exp_avg": with_.state[b]["exp_avg"].clone()}


def _grad_checks_across_groups(d: dict) -> dict:
    res = {}
    for k in range(2):
        p0 = torch.ones(4).to(torch.bfloat16).requires_grad_(True)
        p1 = torch.ones(3).to(torch.bfloat16).requires_grad_(True)
        opt = ampfuse.optim.AdamW([{"params": [p0]}, {"params": [p1]}], lr=0.1)
        grads = {p0: torch.ones(4).to(torch.bfloat16), p1: torch.ones(3).to(torch.float16) if k == 0 else p1.detach()}
        before = p0.detach().clone()
        res[f"grads/{k}/message"] = _message(lambda: opt.step(grads=grads))
        res[f"grads/{k}/unchanged"] = torch.equal(p0.detach(), before) and len(opt.state) == 0
    return res


_GOOD_SCALER = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100, "_growth_tracker": 0}
_BAD_SCALER = [("backoff_factor", 0.0), ("backoff_factor", -0.5), ("backoff_factor", math.nan), ("scale", "x"),
               ("growth_interval", 2.5), ("scale", -1.0)]


def _bad_scaler_entries(d: dict) -> dict:
    res = {}
    for k, (key, value) in enumerate(_BAD_SCALER):
        scaler = ampfuse.GradScaler("cpu", init_scale=8.0, growth_interval=7)
        res[f"scaler/{k}/message"] = _message(lambda: scaler.load_state_dict(dict(_GOOD_SCALER, **{key: value})))
        res[f"scaler/{k}/unchanged"] = (scaler.get_scale() == 8.0 and scaler.get_growth_interval() == 7
                                        and scaler.get_backoff_factor() == 0.5)
    return res


def _accumulator_load_checks_the_scaler_first(d: dict) -> dict:
    res = {}
    for k, bad in enumerate([-1.0, math.nan, math.inf, "x"]):
        a = torch.ones(4).to(torch.bfloat16).requires_grad_(True)
        source = ampfuse.optim.AdamW([a], lr=0.05)
        for _ in range(3):
            _zero_step(source, a)
        sd = {"steps": 2, "micro_step": 0, "windows": 3, "optimizer": copy.deepcopy(source.state_dict()),
              "scaler": dict(_GOOD_SCALER, scale=bad)}
        b = torch.full((4,), 2.0).to(torch.bfloat16).requires_grad_(True)
        target = ampfuse.optim.AdamW([b], lr=0.01)
        _zero_step(target, b)
        scaler = ampfuse.GradScaler("cpu", init_scale=8.0)
        acc = ampfuse.GradAccumulator(torch.nn.Module(), target, scaler, steps=2)
        master = target.state[b]["master_param"].clone()
        res[f"acc/{k}/message"] = _message(lambda: acc.load_state_dict(sd))
        st = target.state[b]
        res[f"acc/{k}/unchanged"] = (target.param_groups[0]["lr"] == 0.01 and float(st["step"]) == 1.0
                                     and torch.equal(st["master_param"], master) and scaler.get_scale() == 8.0)
    return res


def _idle_param_state_follows_options(d: dict) -> dict:
    a = d["in/idle/a"].clone().requires_grad_(True)
    b = d["in/idle/b"].clone().requires_grad_(True)
    opt = ampfuse.optim.AdamW([a, b], lr=1e-2)
    for k in range(3):
        a.grad = d[f"in/idle/grad_a/{k}"].clone()
        if k < 2:
            b.grad = d[f"in/idle/grad_b/{k}"].clone()
        else:
            b.grad = None
            opt.param_groups[0].update(state_dtype=torch.bfloat16, master_weights="remainder")
        opt.step()
    st = opt.state[b]
    return {"idle/b_exp_avg": st["exp_avg"].clone(), "idle/b_remainder_form": "master_remainder" in st,
            "idle/b_master": _master(opt, b)}


def _accumulator_checkpoint_entries(d: dict) -> dict:
    res = {}
    for k in range(7):
        a = torch.ones(4).to(torch.bfloat16).requires_grad_(True)
        b = torch.ones(3).requires_grad_(True)
        source = ampfuse.optim.AdamW([a, b], lr=0.05)
        sd = {"steps": 2, "micro_step": 1, "windows": 0, "optimizer": copy.deepcopy(source.state_dict()),
              "buffers": {"cpu": torch.zeros(3) if k == 2 else torch.full((4,), 0.5)},
              "found_inf": {"cpu": torch.zeros(2) if k == 3 else torch.zeros(())},
              "has_grad": [True, False] if k == 4 else [True],
              "grads": {1: torch.zeros(2) if k == 5 else torch.full((3,), 0.25)}}
        if k != 0:
            sd["buffered"] = [1 if k == 1 else 0]
        c = torch.ones(4).to(torch.bfloat16).requires_grad_(True)
        dd = torch.ones(3).requires_grad_(True)
        target = ampfuse.optim.AdamW([c, dd], lr=0.01)
        acc = ampfuse.GradAccumulator(torch.nn.Module(), target, None, steps=2)
        key = f"acc_checkpoint/{k}"
        message = _message(lambda: acc.load_state_dict(sd))
        if k == 6:
            res[f"{key}/loaded"] = acc.micro_step == 1 and target.param_groups[0]["lr"] == 0.05
            res[f"{key}/grad"] = dd.grad.clone()
            assert message == "", message
        else:
            res[f"{key}/message"] = message
            res[f"{key}/unchanged"] = acc.micro_step == 0 and target.param_groups[0]["lr"] == 0.01 and dd.grad is None
    return res


def _optimizer_checkpoint_entries(d: dict) -> dict:
    res = {}
    for k in range(7):
        def bad(which, good, spoiled):
            return spoiled if k == which else good
        a_state = {"step": bad(3, torch.full((), 3.0), torch.zeros(2)),
                   "exp_avg": bad(1, torch.full((4,), 0.5), torch.zeros(3, 3)),
                   "exp_avg_sq": torch.full((4,), 0.25),
                   "master_param": bad(5, torch.full((4,), 1.5), torch.zeros(2))}
        if k == 4:
            a_state["master_remainder"] = torch.zeros(4, dtype=torch.int16)
        b_state = {"step": bad(6, torch.full((), 3.0), 2.0), "exp_avg": torch.full((3,), 0.5),
                   "exp_avg_sq": bad(2, torch.full((3,), 0.25), torch.zeros(3, dtype=torch.int64))}
        sd = {"state": {0: a_state, 1: b_state}, "param_groups": [{"params": [0, 1], "lr": 0.05}]}
        a = torch.ones(4).to(torch.bfloat16).requires_grad_(True)
        b = torch.ones(3).requires_grad_(True)
        target = ampfuse.optim.AdamW([a, b], lr=0.01)
        a.grad, b.grad = torch.zeros_like(a), torch.zeros_like(b)
        target.step()
        key = f"opt_checkpoint/{k}"
        res[f"{key}/message"] = _message(lambda: target.load_state_dict(sd))
        sa, sb = target.state[a], target.state[b]
        if k in (0, 6):
            assert res[f"{key}/message"] == "", res[f"{key}/message"]
            del res[f"{key}/message"]
            res[f"{key}/loaded"] = target.param_groups[0]["lr"] == 0.05
            res[f"{key}/a_exp_avg"] = sa["exp_avg"].clone()
            res[f"{key}/a_master"] = sa["master_param"].clone()
            res[f"{key}/b_step"] = sb["step"].clone()
        else:
            res[f"{key}/unchanged"] = (target.param_groups[0]["lr"] == 0.01 and float(sa["step"]) == 1.0
                                       and sb["exp_avg_sq"].dtype == torch.float32)
    a = torch.ones(4).requires_grad_(True)
    sgd = ampfuse.optim.SGD([a], lr=0.01, momentum=0.9)
    sgd.load_state_dict({"state": {0: {"momentum_buffer": torch.full((4,), 0.5)}},
                         "param_groups": [{"params": [0], "lr": 0.05}]})
    res["opt_checkpoint/sgd_step"] = sgd.state[a]["step"].clone()
    return res


def _group_hyper_entries(d: dict) -> dict:
    cases = {
        "sgd_lr": ("SGD", {}, "lr", -1.0), "sgd_momentum": ("SGD", {}, "momentum", -0.5),
        "sgd_weight_decay": ("SGD", {}, "weight_decay", -1.0), "sgd_nesterov": ("SGD", {}, "nesterov", True),
        "adam_beta1": ("Adam", {}, "betas", (1.0, 0.9)), "adam_beta2": ("Adam", {}, "betas", (0.9, -0.1)),
        "adamw_eps": ("AdamW", {}, "eps", -1.0), "adamw_weight_decay": ("AdamW", {}, "weight_decay", -0.01),
        "adamw_state_dtype": ("AdamW", {}, "state_dtype", torch.float16),
    }
    res = {}
    for name, (cls, kw, key, value) in cases.items():
        p = torch.ones(3).requires_grad_(True)
        opt = getattr(ampfuse.optim, cls)([p], lr=0.1, **kw)  # built valid, then edited, as a user may
        opt.param_groups[0][key] = value
        p.grad = torch.zeros_like(p)
        res[f"group_hyper/{name}"] = _message(opt.step)
    return res


def _accumulator_counter_entries(d: dict) -> dict:
    bad = [None, ("steps", 5), ("micro_step", 2), ("micro_step", -1.5), ("windows", -3), ("skipped_windows_host", -1)]
    res = {}
    for k, spoil in enumerate(bad):
        a = torch.ones(3).requires_grad_(True)
        source = ampfuse.optim.AdamW([a], lr=0.05)
        sd = {"steps": 2, "micro_step": 0, "windows": 4, "skipped_windows_host": 1,
              "optimizer": copy.deepcopy(source.state_dict())}
        if spoil is not None:
            sd[spoil[0]] = spoil[1]
        b = torch.ones(3).requires_grad_(True)
        target = ampfuse.optim.AdamW([b], lr=0.01)
        acc = ampfuse.GradAccumulator(torch.nn.Module(), target, None, steps=2)
        key = f"acc_counters/{k}"
        message = _message(lambda: acc.load_state_dict(sd))
        if spoil is None:
            res[f"{key}/loaded"] = (message == "" and acc.windows == 4 and acc.skipped_windows_host == 1
                                    and target.param_groups[0]["lr"] == 0.05)
        else:
            res[f"{key}/message"] = message
            res[f"{key}/unchanged"] = acc.windows == 0 and target.param_groups[0]["lr"] == 0.01
    return res


def _replaced_param_restarts_master(d: dict) -> dict:
    res = {}
    for form, key in ((True, "replaced/float"), ("remainder", "replaced/remainder")):
        p = d[f"in/{key}/init"].clone().requires_grad_(True)
        opt = ampfuse.optim.AdamW([p], lr=1e-2, master_weights=form)
        for k in range(3):
            p.grad = d[f"in/{key}/grad/{k}"].clone()
            opt.step()
        p.data = p.detach().clone()  # the same values, other memory
        p.grad = d[f"in/{key}/grad/3"].clone()
        opt.step()
        res[f"{key}/param"], res[f"{key}/master"] = p.detach().clone(), _master(opt, p)
    return res


def _two_keepers_of_one_master(d: dict) -> dict:
    shared = d["in/keepers/shared"].clone().requires_grad_(True)
    own = d["in/keepers/own"].clone().requires_grad_(True)
    first = ampfuse.optim.AdamW([own, shared], lr=1e-3)
    second = ampfuse.optim.SGD([shared], lr=1e-3, momentum=0.9)
    shared.grad, own.grad = d["in/keepers/grad_shared"].clone(), d["in/keepers/grad_own"].clone()
    first.step()
    first.step()
    second.step()
    before, master = shared.detach().clone(), first.state[shared]["master_param"].clone()
    res = {"keepers/message": _without_ids(_message(first.step))}
    res["keepers/unchanged"] = (torch.equal(_bits(shared.detach()), _bits(before))
                                and torch.equal(_bits(first.state[shared]["master_param"]), _bits(master)))
    second.step()
    first.sync_masters_from_params()
    first.step()
    res["keepers/back_message"] = _without_ids(_message(second.step))
    res["keepers/shared"], res["keepers/master"] = shared.detach().clone(), first.state[shared]["master_param"].clone()
    return res


def _without_ids(message: str) -> str:
    """A message with the object addresses it names replaced (they differ between runs)."""
    return re.sub(r"\(id 0x[0-9a-f]+\)", "(id ...)", message)


_CASES = [_ties, _master_weights_off_and_on, _load_keeps_own_options, _grad_checks_across_groups,
          _bad_scaler_entries, _accumulator_load_checks_the_scaler_first, _idle_param_state_follows_options,
          _accumulator_checkpoint_entries, _optimizer_checkpoint_entries, _group_hyper_entries,
          _accumulator_counter_entries, _replaced_param_restarts_master, _two_keepers_of_one_master]


def _as_python_names(message: str) -> str:
    """A C++ message in the Python surface's names (params, checkpoints)."""
    message = re.sub(r"param_groups\(\)\[(\d+)\]\.params\(\)\[(\d+)\]", r"param_groups[\1]['params'][\2]", message)
    # a group's option (the C++ cases build one group): "AdamW: betas[0]" is param_groups[0]['betas'][0]
    message = re.sub(r"^(?:SGD|Adam|AdamW): (?=nesterov)", "param_groups[0]: ", message)
    message = re.sub(r"^(?:SGD|Adam|AdamW): (\w+)", r"param_groups[0]['\1']", message)
    message = re.sub(r"\b(buffers|found_inf)/0\b", r"\1['cpu']", message)  # the cases run on the CPU
    message = re.sub(r"\bgrads/(\d+)", r"grads[\1]", message)
    message = message.replace("The checkpoint was saved with", "state_dict was saved with")
    message = _without_ids(message)
    return message.replace("the checkpoint's", "the state dict's")


@pytest.mark.parametrize("case", _CASES, ids=[c.__name__.lstrip("_") for c in _CASES])
def test_engine_case_is_the_same_in_cpp_and_python(cpp_cases, case):
    assert cpp_cases[f"error/{case.__name__.lstrip('_')}"] == "", "the C++ case threw"
    py = case(cpp_cases)
    for key, value in py.items():
        cpp = cpp_cases[key]
        if isinstance(value, torch.Tensor):
            assert cpp.dtype == value.dtype and cpp.shape == value.shape, key
            assert torch.equal(_bits(cpp), _bits(value)), (key, cpp, value)
        elif isinstance(value, str):
            assert value, f"{key}: Python raised nothing"
            assert _as_python_names(cpp) == value, key
        else:
            assert cpp == value, (key, cpp, value)
        if key.endswith("/unchanged"):
            assert value is True, f"{key}: the refused call changed state"


def test_tie_masters_keep_every_bit_through_form_switches_and_checkpoints(cpp_cases):
    masters = _bits(cpp_cases["in/ties"])
    for key in ("remainder", "back", "load_into_fp32", "load_into_remainder"):
        assert torch.equal(_bits(cpp_cases[f"ties/{key}/master"]), masters), key
    # the fp32 form holds params rounded half to even, the remainder form ties away from zero
    rne = cpp_cases["in/ties"].to(torch.bfloat16)
    assert torch.equal(_bits(cpp_cases["ties/back/param"]), _bits(rne))
    assert not torch.equal(_bits(cpp_cases["ties/remainder/param"]), _bits(rne))


def test_a_checkpoint_without_masters_leaves_the_optimizers_masters_on(cpp_cases):
    assert cpp_cases["own/keeps_master"] is True and cpp_cases["own/fp32_state"] is True
    assert cpp_cases["own/lr"] == 0.05  # the hyper-parameters come from the checkpoint
    assert cpp_cases["own/master"].dtype == torch.float32
