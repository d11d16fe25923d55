"""Device learning-rate schedules (``ampfuse.lr_scheduler``): each class against torch's twin
stepped only after the steps taken, with planted overflows; resume from a checkpoint mid-run; no
host read in ``step()``; torch's optimizers through an ampfuse scaler; the transformers schedules;
``device_twin``; bad input."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import warnings

import pytest
import torch
from torch.optim import lr_scheduler as T

import ampfuse
from ampfuse import lr_scheduler as A
from conftest import HostReads, requires_cuda, scaler_counters
from ampfuse.optim import StepScaling

STEPS = 40
SKIPS = {0, 3, 4, 11, 12, 13, 25, 39}  # overflowed steps: the first one included


def _params(n_groups=2):
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(5, generator=g).requires_grad_()] for _ in range(n_groups)]


def _groups(params, lrs=(0.1, 0.02)):
    return [{"params": ps, "lr": lr} for ps, lr in zip(params, lrs)]


# (name, torch maker, ampfuse maker): each maker takes the optimizer
CASES = [
    ("ConstantLR", lambda o: T.ConstantLR(o, factor=0.25, total_iters=7), lambda o: A.ConstantLR(o, factor=0.25, total_iters=7)),
    ("LinearLR", lambda o: T.LinearLR(o, start_factor=0.1, end_factor=0.9, total_iters=13),
     lambda o: A.LinearLR(o, start_factor=0.1, end_factor=0.9, total_iters=13)),
    ("StepLR", lambda o: T.StepLR(o, step_size=6, gamma=0.5), lambda o: A.StepLR(o, step_size=6, gamma=0.5)),
    ("MultiStepLR", lambda o: T.MultiStepLR(o, [3, 9, 9, 20], gamma=0.3), lambda o: A.MultiStepLR(o, [3, 9, 9, 20], gamma=0.3)),
    ("ExponentialLR", lambda o: T.ExponentialLR(o, gamma=0.93), lambda o: A.ExponentialLR(o, gamma=0.93)),
    ("PolynomialLR", lambda o: T.PolynomialLR(o, total_iters=20, power=2.0), lambda o: A.PolynomialLR(o, total_iters=20, power=2.0)),
    ("CosineAnnealingLR", lambda o: T.CosineAnnealingLR(o, T_max=17, eta_min=1e-3),
     lambda o: A.CosineAnnealingLR(o, T_max=17, eta_min=1e-3)),
    ("CosineAnnealingWarmRestarts", lambda o: T.CosineAnnealingWarmRestarts(o, T_0=5, T_mult=2, eta_min=1e-4),
     lambda o: A.CosineAnnealingWarmRestarts(o, T_0=5, T_mult=2, eta_min=1e-4)),
    ("CosineAnnealingWarmRestarts-1", lambda o: T.CosineAnnealingWarmRestarts(o, T_0=7),
     lambda o: A.CosineAnnealingWarmRestarts(o, T_0=7)),
    ("OneCycleLR", lambda o: T.OneCycleLR(o, max_lr=[0.5, 0.1], total_steps=40, cycle_momentum=False),
     lambda o: A.OneCycleLR(o, max_lr=[0.5, 0.1], total_steps=40, cycle_momentum=False)),
    ("OneCycleLR-three-phase-linear", lambda o: T.OneCycleLR(o, max_lr=0.4, total_steps=35, pct_start=0.25, three_phase=True,
                                                             anneal_strategy="linear", cycle_momentum=False),
     lambda o: A.OneCycleLR(o, max_lr=0.4, total_steps=35, pct_start=0.25, three_phase=True, anneal_strategy="linear",
                            cycle_momentum=False)),
    ("OneCycleLR-defaults", lambda o: T.OneCycleLR(o, max_lr=[0.5, 0.1], total_steps=40),
     lambda o: A.OneCycleLR(o, max_lr=[0.5, 0.1], total_steps=40)),
    ("LambdaLR", lambda o: T.LambdaLR(o, [lambda e: 0.97 ** e, lambda e: 1.0 / (1 + e)]),
     lambda o: A.LambdaLR(o, [lambda t: 0.97 ** t, lambda t: 1.0 / (1 + t)])),
    ("SequentialLR", lambda o: T.SequentialLR(o, [T.ConstantLR(o, factor=0.1, total_iters=4), T.ExponentialLR(o, gamma=0.9),
                                                  T.CosineAnnealingLR(o, T_max=10)], milestones=[5, 15]),
     lambda o: A.SequentialLR(o, [A.ConstantLR(o, factor=0.1, total_iters=4), A.ExponentialLR(o, gamma=0.9),
                                  A.CosineAnnealingLR(o, T_max=10)], milestones=[5, 15])),
    ("ChainedScheduler", lambda o: T.ChainedScheduler([T.ConstantLR(o, factor=0.1, total_iters=2), T.ExponentialLR(o, gamma=0.9),
                                                       T.CosineAnnealingLR(o, T_max=50)]),
     lambda o: A.ChainedScheduler([A.ConstantLR(o, factor=0.1, total_iters=2), A.ExponentialLR(o, gamma=0.9),
                                   A.CosineAnnealingLR(o, T_max=50)])),
]
IDS = [c[0] for c in CASES]


def _torch_lrs(make, steps=STEPS, skips=SKIPS):
    """torch's schedule stepped only after taken steps: its learning rates after each iteration."""
    opt = torch.optim.SGD(_groups(_params()), lr=0.1)
    sched = make(opt)
    out = []
    for k in range(steps):
        if k not in skips:
            opt.step()
            sched.step()
        out.append([float(g["lr"]) for g in opt.param_groups])
    return out


def _scaling(k, skips):
    return StepScaling(None, torch.tensor([1.0 if k in skips else 0.0]), None)


def _ampfuse_run(make, steps=STEPS, skips=SKIPS, start=0, opt=None, sched=None):
    """An ampfuse optimizer stepped every iteration (overflows skip on the device) and the device
    schedule stepped every iteration: the learning rates after each."""
    if opt is None:
        opt = ampfuse.optim.SGD(_groups(_params()), lr=0.1)
        sched = make(opt)
    out = []
    for k in range(start, steps):
        for g in opt.param_groups:
            for p in g["params"]:
                p.grad = torch.ones_like(p)
        opt.step(scaling=_scaling(k, skips))
        sched.step()
        out.append(sched.get_last_lr())
        assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx(out[-1], rel=1e-6)
    return out, opt, sched


def _close(a, b):
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert x == pytest.approx(y, rel=1e-6, abs=1e-12), k


@pytest.mark.parametrize(("name", "make_torch", "make_ours"), CASES, ids=IDS)
def test_learning_rates_equal_torchs_stepped_only_on_taken_steps(name, make_torch, make_ours):
    ours, _, _ = _ampfuse_run(make_ours)
    _close(ours, _torch_lrs(make_torch))


@pytest.mark.parametrize(("name", "make_torch", "make_ours"), CASES, ids=IDS)
def test_a_resumed_run_continues_the_schedule_exactly(name, make_torch, make_ours):
    """A checkpoint (optimizer and schedule state dicts) taken after 17 iterations, loaded into a
    fresh optimizer and schedule, gives the rest of the uninterrupted run's learning rates, bit for bit."""
    straight, _, _ = _ampfuse_run(make_ours)
    first, opt, sched = _ampfuse_run(make_ours, steps=17)
    ck = copy.deepcopy({"opt": opt.state_dict(), "sched": sched.state_dict()})
    opt2 = ampfuse.optim.SGD(_groups(_params()), lr=0.1)
    sched2 = make_ours(opt2)
    opt2.load_state_dict(ck["opt"])
    sched2.load_state_dict(ck["sched"])
    rest, _, _ = _ampfuse_run(make_ours, start=17, opt=opt2, sched=sched2)
    assert first + rest == straight


@pytest.mark.parametrize(("name", "make_torch", "make_ours"), CASES, ids=IDS)
def test_step_reads_nothing_on_the_host(name, make_torch, make_ours):
    opt = ampfuse.optim.SGD(_groups(_params()), lr=0.1)
    sched = make_ours(opt)
    for k in range(6):
        for g in opt.param_groups:
            g["params"][0].grad = torch.ones(5)
        opt.step(scaling=_scaling(k, {2}))
        with HostReads() as mode:
            sched.step()
        assert mode.reads == [], mode.reads


def test_a_torch_optimizer_with_a_tensor_lr_through_an_ampfuse_scaler():
    """torch's Adam (tensor lr) under ampfuse.GradScaler: the skip comes from the scaler's flag,
    and the learning rates are torch's schedule on the steps taken."""
    p = torch.randn(8, requires_grad=True)
    opt = torch.optim.Adam([p], lr=torch.tensor(0.05), foreach=False)
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**10)
    sched = A.ExponentialLR(opt, gamma=0.8, scaler=scaler)
    skips = {1, 2, 5}
    ours = []
    for k in range(8):
        loss = (p * p).sum() * (float("inf") if k in skips else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()
        ours.append(sched.get_last_lr())
    _close(ours, [[0.05 * 0.8**n] for n in [1, 1, 1, 2, 3, 3, 4, 5]])


def test_without_a_skip_flag_every_step_counts():
    p = torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([p], lr=torch.tensor(1.0))
    sched = A.StepLR(opt, step_size=2, gamma=0.5)
    lrs = []
    for _ in range(5):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs == [1.0, 0.5, 0.5, 0.25, 0.25]


def test_group_lr_is_one_tensor_written_in_place():
    """The optimizer's lr stays the same tensor across steps (a captured graph or a step plan
    holding it sees every value); an optimizer checkpoint's lr is replaced by it again on load."""
    opt = ampfuse.optim.AdamW([torch.zeros(4, requires_grad=True)], lr=1e-3)
    sched = A.LinearLR(opt, start_factor=0.5, total_iters=4)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and lr.dim() == 0
    for _ in range(3):
        opt.param_groups[0]["params"][0].grad = torch.ones(4)
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] is lr
    assert float(lr) == pytest.approx(1e-3 * (0.5 + 0.5 * 3 / 4))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt.param_groups[0]["lr"] is not lr
    sched.load_state_dict(sched.state_dict())
    assert opt.param_groups[0]["lr"] is sched._lr_tensors[0]


# ---- the transformers schedules and twins ------------------------------------------------------------


@pytest.mark.parametrize("name", ["linear", "cosine", "constant", "constant_with_warmup"])
def test_transformers_schedules_and_their_twins(name):
    transformers = pytest.importorskip("transformers")
    make_torch = lambda o: transformers.get_scheduler(name, o, num_warmup_steps=6, num_training_steps=30)  # noqa: E731
    expected = _torch_lrs(make_torch, steps=36)
    ours, _, _ = _ampfuse_run(lambda o: A.get_scheduler(name, o, num_warmup_steps=6, num_training_steps=30), steps=36)
    _close(ours, expected)
    # the twin of a transformers schedule that already counted 5 steps continues from there
    opt = ampfuse.optim.SGD(_groups(_params()), lr=0.1)
    sched = make_torch(opt)
    with warnings.catch_warnings():  # torch's warning for a schedule stepped before its optimizer: intended here
        warnings.simplefilter("ignore")
        for _ in range(5):
            sched.step()
    twin = A.device_twin(sched)
    rest, _, _ = _ampfuse_run(None, steps=36, start=5, opt=opt, sched=twin)
    _close(rest, [lrs for k, lrs in enumerate(_torch_lrs(make_torch, steps=36, skips=SKIPS - set(range(5)))) if k >= 5])


_NO_TWIN = ("LambdaLR", "ChainedScheduler", "OneCycleLR", "OneCycleLR-three-phase-linear", "OneCycleLR-defaults")


@pytest.mark.parametrize(("name", "make_torch", "make_ours"), [c for c in CASES if c[0] not in _NO_TWIN],
                         ids=[c[0] for c in CASES if c[0] not in _NO_TWIN])
def test_device_twin_of_each_torch_schedule(name, make_torch, make_ours):
    opt = ampfuse.optim.SGD(_groups(_params()), lr=0.1)
    twin = A.device_twin(make_torch(opt))
    ours, _, _ = _ampfuse_run(None, opt=opt, sched=twin)
    _close(ours, _torch_lrs(make_torch))


# ---- bad input ---------------------------------------------------------------------------------------


def _opt():
    return ampfuse.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)


@pytest.mark.parametrize(("make", "exc", "message"), [
    (lambda: A.StepLR(_opt(), 3).step(5), ValueError, r"StepLR.step\(epoch\) is not supported"),
    (lambda: A.OneCycleLR(torch.optim.Adagrad([torch.zeros(2, requires_grad=True)]), max_lr=0.1, total_steps=10),
     ValueError, "optimizer must support momentum or beta1"),
    (lambda: A.SequentialLR(_opt(), [A.OneCycleLR(_opt(), max_lr=0.1, total_steps=10)], []), ValueError,
     "cycles the momentum"),
    (lambda: A.OneCycleLR(_opt(), max_lr=0.1, cycle_momentum=False), ValueError, "total_steps OR"),
    (lambda: A.ChainedScheduler([A.CosineAnnealingLR(_opt(), T_max=3, eta_min=0.01)]), TypeError, "no multiplicative form"),
    (lambda: A.device_twin(T.LambdaLR(_opt(), lambda e: 1.0)), TypeError, "arbitrary function has no device twin"),
    (lambda: A.device_twin(T.ReduceLROnPlateau(_opt())), TypeError, "ReduceLROnPlateau has no device twin"),
    (lambda: A.StepLR(_opt(), 3, scaler=torch.amp.GradScaler("cpu")), TypeError, "scaler must be an ampfuse.GradScaler"),
    (lambda: A.get_scheduler("polynomial", _opt(), 1, 2), ValueError, "name must be one of"),
    (lambda: A.get_scheduler("linear", _opt(), 1), ValueError, "'linear' requires num_training_steps"),
    (lambda: A.LinearLR(_opt(), start_factor=0.0), ValueError, "Starting multiplicative factor"),
    (lambda: A.SequentialLR(_opt(), [T.StepLR(_opt(), 2)], []), TypeError, r"schedulers\[0\] must be an ampfuse"),
    (lambda: A.LambdaLR(_opt(), [lambda t: t, lambda t: t]), ValueError, "Expected 1 lr_lambdas, but got 2"),
], ids=["step-epoch", "one-cycle-momentum", "sequential-one-cycle-momentum", "one-cycle-steps", "chained-cosine", "twin-lambda", "twin-plateau",
        "torch-scaler", "get-scheduler-name", "get-scheduler-steps", "linear-start", "sequential-torch", "lambda-count"])
def test_bad_input_is_refused_with_a_message(make, exc, message):
    with pytest.raises(exc, match=message):
        make()


def test_a_refused_construction_leaves_the_optimizers_lr_alone():
    opt = _opt()
    for bad in [dict(max_lr=[0.1, 0.2]), dict(max_lr=0.1, max_momentum=[0.9, 0.95])]:
        with pytest.raises(ValueError, match="expected 1 values for max_"):
            A.OneCycleLR(opt, total_steps=10, **bad)
        group = opt.param_groups[0]
        assert group["lr"] == 0.1 and group["momentum"] == 0 and "max_lr" not in group and "max_momentum" not in group


def _one_cycle_run(lib, kind, skips, steps=30):
    """OneCycleLR with torch's defaults over SGD with momentum / AdamW, two groups, the overflowed
    steps skipped (torch: neither the step nor the schedule's step runs): params, learning rates
    and momenta after each iteration."""
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(300, generator=g).requires_grad_() for _ in range(2)]
    groups = [{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.1}]
    optim, schedules = (ampfuse.optim, A) if lib == "ampfuse" else (torch.optim, T)
    opt = optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True) if kind == "sgd" else optim.AdamW(groups, lr=0.1)
    sched = schedules.OneCycleLR(opt, max_lr=[0.5, 0.1], total_steps=40)
    out = []
    for k in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        if lib == "ampfuse":
            opt.step(scaling=_scaling(k, skips))
            with HostReads() as mode:
                sched.step()
            assert mode.reads == [], mode.reads
        elif k not in skips:
            opt.step()
            sched.step()
        momenta = [float(gr["betas"][0] if kind == "adam" else gr["momentum"]) for gr in opt.param_groups]
        out.append(([p.detach().clone() for p in params], [float(gr["lr"]) for gr in opt.param_groups], momenta))
    return out, opt


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_one_cycle_with_torchs_defaults_cycles_the_momentum_on_the_device(kind):
    """torch's defaults (cycle_momentum=True): SGD's momentum / Adam's beta1 cycled between 0.85
    and 0.95 as torch's OneCycleLR stepped on taken steps, each a device tensor the fused step
    reads: the same params, learning rates and momenta (fp32 device values), and no host read."""
    ours, opt = _one_cycle_run("ampfuse", kind, SKIPS)
    ref, _ = _one_cycle_run("torch", kind, SKIPS)
    for k, ((p, lr, m), (p_ref, lr_ref, m_ref)) in enumerate(zip(ours, ref)):
        assert lr == pytest.approx(lr_ref, rel=1e-6), k
        assert m == pytest.approx(m_ref, rel=1e-7), k
        for a, b in zip(p, p_ref):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda s, k=k: f"iteration {k}: {s}")
    momentum = [g["betas"][0] if kind == "adam" else g["momentum"] for g in opt.param_groups]
    assert all(isinstance(m, torch.Tensor) and m.dtype == torch.float32 and m.dim() == 0 for m in momentum)
    assert len({m_ref[0] for _, _, m_ref in ref}) > 10  # the momentum did cycle


def test_one_cycle_momentum_changes_the_step():
    """The fused step reads the device momentum: the same run with the momentum held at 0.95
    (cycle_momentum=False) ends elsewhere."""
    ours, _ = _one_cycle_run("ampfuse", "sgd", set())
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(300, generator=g).requires_grad_() for _ in range(2)]
    opt = ampfuse.optim.SGD([{"params": [params[0]]}, {"params": [params[1]], "weight_decay": 0.1}], lr=0.1,
                            momentum=0.95, nesterov=True)
    sched = A.OneCycleLR(opt, max_lr=[0.5, 0.1], total_steps=40, cycle_momentum=False)
    for k in range(30):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        sched.step()
    assert not torch.equal(params[0].detach(), ours[-1][0][0])


@requires_cuda
@pytest.mark.parametrize(("name", "make_torch", "make_ours"), CASES, ids=IDS)
def test_cuda_schedules_step_without_a_sync(name, make_torch, make_ours):
    """On a GPU every schedule's step() runs with CUDA's sync debug mode set to error (after a
    first step, which makes the constant tables), and gives the CPU run's learning rates."""
    params = [[p.detach().cuda().requires_grad_()] for p in sum(_params(), [])]
    opt = ampfuse.optim.SGD(_groups(params), lr=0.1)
    sched = make_ours(opt)
    lrs = []
    for k in range(12):
        for g in opt.param_groups:
            g["params"][0].grad = torch.ones(5, device="cuda")
        opt.step(scaling=StepScaling(None, torch.full((1,), 1.0 if k in SKIPS else 0.0, device="cuda"), None))
        if k:
            torch.cuda.set_sync_debug_mode("error")
        try:
            sched.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        lrs.append(sched.get_last_lr())
    _close(lrs, _ampfuse_run(make_ours, steps=12)[0])


# ---- the scaler's scheduler_step and the accumulator --------------------------------------------------


def _overflowing_steps(opt, scaler, p, n=4, overflow=1):
    for k in range(n):
        loss = (p * p).sum() * (float("inf") if k == overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        yield k


def test_scaler_scheduler_step_steps_a_device_schedule_without_a_read():
    p = torch.randn(4, requires_grad=True)
    opt = ampfuse.optim.SGD([p], lr=1.0)
    scaler = ampfuse.GradScaler("cpu", init_scale=16.0)
    sched = A.ExponentialLR(opt, gamma=0.5)
    for _ in _overflowing_steps(opt, scaler, p):
        with HostReads(ignore=scaler_counters(scaler)) as mode:
            assert scaler.scheduler_step(sched)
        assert mode.reads == []
    assert sched.get_last_lr() == [0.5**3]


def test_a_schedule_that_cannot_see_skips_is_stepped_only_after_taken_steps():
    """torch's optimizer, schedule built without a scaler: it counts every call, so the scaler
    reads the flag and steps it only after taken steps (as for torch's schedules)."""
    p = torch.randn(4, requires_grad=True)
    opt = torch.optim.SGD([p], lr=torch.tensor(1.0))
    scaler = ampfuse.GradScaler("cpu", init_scale=16.0)
    sched = A.ExponentialLR(opt, gamma=0.5)
    assert not sched.sees_skips() and A.ExponentialLR(opt, gamma=0.5, scaler=scaler).sees_skips()
    stepped = [scaler.scheduler_step(sched) for _ in _overflowing_steps(opt, scaler, p)]
    assert stepped == [True, False, True, True] and sched.get_last_lr() == [0.5**3]


def test_the_accumulator_steps_a_device_schedule_without_a_read():
    """A window skipped for an overflow does not advance the schedule, and no flag is read."""
    model = torch.nn.Linear(3, 2)
    opt = ampfuse.optim.SGD(model.parameters(), lr=1.0)
    scaler = ampfuse.GradScaler("cpu", init_scale=16.0)
    sched = A.StepLR(opt, step_size=1, gamma=0.5)
    acc = ampfuse.GradAccumulator(model, opt, scaler, steps=2, lr_scheduler=sched)
    mode = HostReads(ignore=scaler_counters(scaler))
    for w in range(4):
        for k in range(2):
            x = torch.full((1, 3), float("inf") if (w, k) == (1, 0) else 1.0)
            with mode if w == 3 else contextlib.nullcontext():
                with acc.accumulate():
                    acc.backward(model(x).sum())
    assert mode.reads == []
    assert sched.get_last_lr() == [0.5**3] and acc.skipped_windows_host == 0
