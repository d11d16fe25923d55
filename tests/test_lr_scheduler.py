"""Device learning-rate schedules (``ampfuse.lr_scheduler``): torch's own classes stepped ahead
on the host, read on the device at the count of taken steps.

Every value is compared bit for bit with torch's class stepped only after the steps taken: each
group's lr tensor is torch's fp64 value rounded once to fp32, ``get_last_lr()`` is torch's value,
``state_dict()`` is torch's state. A generated suite draws compositions of every class (SequentialLR,
ChainedScheduler, two schedules stepped back to back, LambdaLR of functions and callable objects,
several groups, edge arguments), drives them with a real scaler and planted overflows, and
checkpoints in the middle (torch <-> ampfuse states, through ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import random
import traceback
from collections import Counter

import pytest
import torch
from torch.optim import lr_scheduler as T

import ampfuse
from ampfuse import lr_scheduler as A
from ampfuse.optim import StepScaling
from conftest import HostReads, requires_cuda, requires_cuemu, scaler_counters

STEPS = 40
SKIPS = {0, 3, 4, 11, 12, 13, 25, 39}  # overflowed iterations: the first one included


def _params(n_groups=2):
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(5, generator=g).requires_grad_()] for _ in range(n_groups)]


def _groups(params, lrs=(0.1, 0.02, 0.3)):
    return [{"params": ps, "lr": lr} for ps, lr in zip(params, lrs)]


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _values(opt):
    """Each group's (lr, momentum / beta1) as floats."""
    key = "betas" if "betas" in opt.defaults else "momentum"
    return [(float(g["lr"]), float(g[key][0] if key == "betas" else g[key])) for g in opt.param_groups]


def _rounded(values):
    return [(_f32(lr), _f32(m)) for lr, m in values]


class _Torch:
    """torch's optimizer and schedules, stepped only after the steps taken."""

    lib = T

    def __init__(self, build, n_groups=2, device="cpu"):
        self.opt = torch.optim.SGD(_groups(_params(n_groups)), lr=0.1, momentum=0.9)
        self.scheds = build(T, self.opt)

    def step(self, k, skips):
        if k not in skips:
            self.opt.step()
            for s in self.scheds:
                s.step()
        return _values(self.opt), [list(s.get_last_lr()) for s in self.scheds]


class _Ampfuse:
    """ampfuse's SGD under ampfuse's scaler, overflows planted through the loss, and the device
    schedules stepped at every iteration."""

    def __init__(self, build, n_groups=2, device="cpu"):
        self.params = [[p.detach().to(device).requires_grad_() for p in ps] for ps in _params(n_groups)]
        self.opt = ampfuse.optim.SGD(_groups(self.params), lr=0.1, momentum=0.9)
        self.scaler = ampfuse.GradScaler(device, init_scale=16.0)
        self.scheds = build(A, self.opt)

    def step(self, k, skips, read=True):
        """One iteration; with ``read``, the values after it (host reads)."""
        loss = sum(p.sum() for ps in self.params for p in ps) * (float("inf") if k in skips else 1.0)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()
        for s in self.scheds:
            s.step()
        return (_values(self.opt), [s.get_last_lr() for s in self.scheds]) if read else None


def _run(stack, start, stop, skips):
    """Each iteration's values, up to an exception (its type and message, last)."""
    out = []
    for k in range(start, stop):
        try:
            out.append(stack.step(k, skips))
        except Exception as e:
            out.append(("raised", type(e), str(e)))
            break
    return out


def _assert_same(ours, theirs):
    """ours: an ampfuse run's values; theirs: torch's. The group tensors are torch's values in fp32,
    get_last_lr() is torch's value."""
    assert len(ours) == len(theirs)
    for k, (mine, ref) in enumerate(zip(ours, theirs)):
        if "raised" in (mine[0], ref[0]):
            assert mine == ref, f"iteration {k}"
            continue
        (values, last), (ref_values, ref_last) = mine, ref
        assert _rounded(values) == _rounded(ref_values), f"iteration {k}: {values} != {ref_values}"
        assert last == ref_last, f"iteration {k}: get_last_lr() {last} != {ref_last}"


def _one(make):
    return lambda lib, o: [make(lib, o)]


# (name, builder): a builder takes the module (torch's or ampfuse's) and the optimizer
CASES = [
    ("ConstantLR", _one(lambda L, o: L.ConstantLR(o, factor=0.25, total_iters=7))),
    ("LinearLR", _one(lambda L, o: L.LinearLR(o, start_factor=0.1, end_factor=0.9, total_iters=13))),
    ("StepLR", _one(lambda L, o: L.StepLR(o, step_size=6, gamma=0.5))),
    ("MultiStepLR", _one(lambda L, o: L.MultiStepLR(o, [3, 9, 9, 20], gamma=0.3))),
    ("ExponentialLR", _one(lambda L, o: L.ExponentialLR(o, gamma=0.93))),
    ("PolynomialLR", _one(lambda L, o: L.PolynomialLR(o, total_iters=20, power=2.0))),
    ("CosineAnnealingLR", _one(lambda L, o: L.CosineAnnealingLR(o, T_max=17, eta_min=1e-3))),
    ("CosineAnnealingWarmRestarts", _one(lambda L, o: L.CosineAnnealingWarmRestarts(o, T_0=5, T_mult=2, eta_min=1e-4))),
    ("CyclicLR", _one(lambda L, o: L.CyclicLR(o, base_lr=0.01, max_lr=0.2, step_size_up=4, mode="triangular2"))),
    ("OneCycleLR", _one(lambda L, o: L.OneCycleLR(o, max_lr=[0.5, 0.1], total_steps=40))),
    ("OneCycleLR-three-phase-linear", _one(lambda L, o: L.OneCycleLR(
        o, max_lr=0.4, total_steps=35, pct_start=0.25, three_phase=True, anneal_strategy="linear"))),
    ("LambdaLR", _one(lambda L, o: L.LambdaLR(o, [lambda e: 0.97**e, lambda e: 1.0 / (1 + e) if e < 9 else 0.05]))),
    ("MultiplicativeLR", _one(lambda L, o: L.MultiplicativeLR(o, lambda e: 0.9 if e % 3 else 1.0))),
    ("SequentialLR", _one(lambda L, o: L.SequentialLR(o, [L.ConstantLR(o, factor=0.1, total_iters=4), L.ExponentialLR(
        o, gamma=0.9), L.CosineAnnealingLR(o, T_max=10)], milestones=[5, 15]))),
    ("ChainedScheduler", _one(lambda L, o: L.ChainedScheduler([L.ConstantLR(o, factor=0.1, total_iters=2),
                                                               L.ExponentialLR(o, gamma=0.9),
                                                               L.CosineAnnealingLR(o, T_max=50, eta_min=0.01)]))),
    ("back-to-back", lambda L, o: [L.ExponentialLR(o, gamma=0.9), L.MultiStepLR(o, [2, 5], gamma=0.1)]),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize(("name", "build"), CASES, ids=IDS)
def test_values_equal_torchs_class_stepped_only_on_taken_steps(name, build):
    _assert_same(_run(_Ampfuse(build), 0, STEPS, SKIPS), _run(_Torch(build), 0, STEPS, SKIPS))


@pytest.mark.parametrize(("name", "build"), CASES, ids=IDS)
def test_state_dict_is_torchs_state_after_the_taken_steps(name, build):
    ours, ref = _Ampfuse(build), _Torch(build)
    _run(ours, 0, 17, SKIPS)
    _run(ref, 0, 17, SKIPS)
    assert [s.state_dict() for s in ours.scheds] == [s.state_dict() for s in ref.scheds]
    # last_epoch means what torch means: the steps taken
    for s, r in zip(ours.scheds, ref.scheds):
        assert getattr(s, "last_epoch", None) == getattr(r, "last_epoch", None)


def _through_file(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(("name", "build"), CASES, ids=IDS)
def test_a_resumed_run_continues_bit_for_bit_from_either_sides_checkpoint(name, build):
    """Checkpoints taken after 17 iterations, read back with weights_only: ampfuse's resumed by
    ampfuse and by torch, torch's resumed by ampfuse; each continues torch's uninterrupted run."""
    straight = _run(_Torch(build), 0, STEPS, SKIPS)
    ours, ref = _Ampfuse(build), _Torch(build)
    _run(ours, 0, 17, SKIPS)
    _run(ref, 0, 17, SKIPS)
    ours_ck = _through_file({"opt": ours.opt.state_dict(), "scaler": ours.scaler.state_dict(),
                             "scheds": [s.state_dict() for s in ours.scheds]})
    ref_ck = _through_file({"opt": ref.opt.state_dict(), "scheds": [s.state_dict() for s in ref.scheds]})
    for opt_ck, scheds_ck in ((ours_ck["opt"], ours_ck["scheds"]), (ref_ck["opt"], ref_ck["scheds"])):
        resumed = _Ampfuse(build)
        resumed.opt.load_state_dict(opt_ck)
        resumed.scaler.load_state_dict(ours_ck["scaler"])
        for s, sd in zip(resumed.scheds, scheds_ck):
            s.load_state_dict(sd)
        _assert_same(_run(resumed, 17, STEPS, SKIPS), straight[17:])
    by_torch = _Torch(build)
    by_torch.opt.load_state_dict(ref_ck["opt"])
    for s, sd in zip(by_torch.scheds, ours_ck["scheds"]):
        s.load_state_dict(sd)
    assert _run(by_torch, 17, STEPS, SKIPS) == straight[17:]


@pytest.mark.parametrize(("name", "build"), CASES, ids=IDS)
def test_step_reads_nothing_on_the_host(name, build):
    ours = _Ampfuse(build)
    _run(ours, 0, 2, SKIPS)
    for k in range(2, 12):
        with HostReads(ignore=scaler_counters(ours.scaler)) as mode:
            ours.step(k, SKIPS, read=False)
        assert mode.reads == [], mode.reads


@pytest.mark.parametrize(("name", "build"), [c for c in CASES if c[0] != "back-to-back"],
                         ids=[c[0] for c in CASES if c[0] != "back-to-back"])
def test_device_twin_of_each_torch_schedule(name, build):
    """torch's schedule built on the optimizer, then taken over by device_twin (a composite's
    schedules with it)."""
    ours = _Ampfuse(lambda L, o: [A.device_twin(s) for s in build(T, o)])
    _assert_same(_run(ours, 0, STEPS, SKIPS), _run(_Torch(build), 0, STEPS, SKIPS))


# ---- the generated conformance suite -------------------------------------------------------------


class _Warmup:
    """A callable-object lambda with state (torch saves and restores its __dict__)."""

    def __init__(self, width):
        self.width = width
        self.calls = 0

    def __call__(self, epoch):
        self.calls += 1
        return min(1.0, (epoch + 1) / self.width)


def _leaf_spec(rng, steps, chainable_only=False):
    names = ["LambdaLR", "LambdaLR-object", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR",
             "ExponentialLR", "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts"]
    if not chainable_only:
        names += ["CyclicLR", "OneCycleLR"]
    name = rng.choice(names)
    kw: dict = {}
    if name == "LambdaLR":
        kw = {"power": rng.choice([0.9, 0.99, 1.0])}
    elif name == "LambdaLR-object":
        kw = {"width": rng.randint(1, 8)}
    elif name == "MultiplicativeLR":
        kw = {"factor": rng.choice([0.5, 0.95, 1.0])}
    elif name == "StepLR":
        kw = {"step_size": rng.randint(1, 6), "gamma": rng.choice([0.0, 0.1, 0.5, 1.0])}
    elif name == "MultiStepLR":
        kw = {"milestones": sorted(rng.randint(0, steps) for _ in range(rng.randint(0, 4))), "gamma": rng.choice([0.1, 0.5])}
    elif name == "ConstantLR":
        kw = {"factor": rng.choice([0.0, 0.25, 1.0]), "total_iters": rng.randint(0, 8)}
    elif name == "LinearLR":
        kw = {"start_factor": rng.choice([0.01, 0.5, 1.0]), "end_factor": rng.choice([0.0, 0.3, 1.0]),
              "total_iters": rng.randint(1, 12)}
    elif name == "ExponentialLR":
        kw = {"gamma": rng.choice([0.5, 0.93, 1.0])}
    elif name == "PolynomialLR":
        kw = {"total_iters": rng.randint(1, 15), "power": rng.choice([0.5, 1.0, 3.0])}
    elif name == "CosineAnnealingLR":
        kw = {"T_max": rng.randint(1, 20), "eta_min": rng.choice([0.0, 1e-3])}
    elif name == "CosineAnnealingWarmRestarts":
        kw = {"T_0": rng.randint(1, 6), "T_mult": rng.randint(1, 3), "eta_min": rng.choice([0.0, 1e-4])}
    elif name == "CyclicLR":
        kw = {"base_lr": 0.01, "max_lr": rng.choice([0.05, 0.3]), "step_size_up": rng.randint(1, 5),
              "mode": rng.choice(["triangular", "triangular2", "exp_range"]), "gamma": 0.97,
              "cycle_momentum": rng.random() < 0.5}
    elif name == "OneCycleLR":
        kw = {"max_lr": rng.choice([0.2, 1.0]), "total_steps": steps + rng.randint(1, 10),
              "pct_start": rng.choice([0.1, 0.3, 0.5]), "anneal_strategy": rng.choice(["cos", "linear"]),
              "three_phase": rng.random() < 0.5, "cycle_momentum": rng.random() < 0.5}
    return ("leaf", name, kw)


def _spec(seed, steps):
    rng = random.Random(seed)
    shape = rng.choice(["leaf", "leaf", "sequential", "chained", "back-to-back"])
    if shape == "leaf":
        tops = [_leaf_spec(rng, steps)]
    elif shape == "sequential":
        n = rng.randint(2, 3)
        milestones = sorted(rng.sample(range(1, steps), n - 1))
        tops = [("sequential", [_leaf_spec(rng, steps) for _ in range(n)], milestones)]
    elif shape == "chained":
        tops = [("chained", [_leaf_spec(rng, steps, chainable_only=True) for _ in range(rng.randint(2, 3))])]
    else:
        tops = [_leaf_spec(rng, steps, chainable_only=True) for _ in range(2)]
    n_groups = rng.randint(1, 3)
    skips = {k for k in range(steps) if rng.random() < 0.25}
    return tops, n_groups, skips


def _build_spec(spec, L, opt):
    kind = spec[0]
    if kind == "sequential":
        return L.SequentialLR(opt, [_build_spec(s, L, opt) for s in spec[1]], milestones=spec[2])
    if kind == "chained":
        return L.ChainedScheduler([_build_spec(s, L, opt) for s in spec[1]])
    _, name, kw = spec
    if name == "LambdaLR":
        return L.LambdaLR(opt, lambda e, p=kw["power"]: p**e)
    if name == "LambdaLR-object":
        return L.LambdaLR(opt, _Warmup(kw["width"]))
    if name == "MultiplicativeLR":
        return L.MultiplicativeLR(opt, lambda e, f=kw["factor"]: f)
    return getattr(L, name)(opt, **kw)


GENERATED = 48


@pytest.mark.parametrize("seed", range(GENERATED))
def test_generated_compositions_equal_torch_through_a_checkpoint(seed):
    steps = 30
    tops, n_groups, skips = _spec(seed, steps)

    def build(L, opt):
        return [_build_spec(t, L, opt) for t in tops]

    straight = _run(_Torch(build, n_groups), 0, steps, skips)
    ours = _Ampfuse(build, n_groups)
    first = _run(ours, 0, 13, skips)
    _assert_same(first, straight[:13])
    if len(straight) <= 13:  # torch's class refused a step (an edge argument): so did ours, at the same one
        assert len(first) == len(straight)
        return
    ck = _through_file({"opt": ours.opt.state_dict(), "scaler": ours.scaler.state_dict(),
                        "scheds": [s.state_dict() for s in ours.scheds]})
    ref = _Torch(build, n_groups)
    _run(ref, 0, 13, skips)
    assert ck["scheds"] == [s.state_dict() for s in ref.scheds]
    resumed = _Ampfuse(build, n_groups)
    resumed.opt.load_state_dict(ck["opt"])
    resumed.scaler.load_state_dict(ck["scaler"])
    for s, sd in zip(resumed.scheds, ck["scheds"]):
        s.load_state_dict(sd)
    _assert_same(_run(resumed, 13, steps, skips), straight[13:])
    _assert_same(_run(ours, 13, steps, skips), straight[13:])


# ---- bad arguments: torch's exception, at construction or at the first step ----------------------

BAD = [
    ("CosineAnnealingLR-T_max-0", lambda L, o: L.CosineAnnealingLR(o, T_max=0)),
    ("StepLR-step_size-0", lambda L, o: L.StepLR(o, step_size=0)),
    ("LinearLR-total_iters-0", lambda L, o: L.LinearLR(o, total_iters=0)),
    ("PolynomialLR-total_iters-0", lambda L, o: L.PolynomialLR(o, total_iters=0)),
    ("OneCycleLR-empty-phase", lambda L, o: L.OneCycleLR(o, max_lr=0.1, total_steps=100, pct_start=0.01)),
    ("OneCycleLR-no-length", lambda L, o: L.OneCycleLR(o, max_lr=0.1)),
    ("LinearLR-start-0", lambda L, o: L.LinearLR(o, start_factor=0.0)),
    ("LambdaLR-count", lambda L, o: L.LambdaLR(o, [lambda e: 1.0] * 3)),
    ("LambdaLR-raises", lambda L, o: L.LambdaLR(o, lambda e: 1 / (e - 1))),
    ("SequentialLR-milestones", lambda L, o: L.SequentialLR(o, [L.StepLR(o, 2)], milestones=[3])),
    ("ChainedScheduler-empty", lambda L, o: L.ChainedScheduler([])),
]


def _outcome(make, opt, lib):
    """(phase, exception type, message) of building the schedule and stepping it twice."""
    try:
        sched = make(lib, opt)
    except Exception as e:
        return "construction", type(e), str(e)
    for k in range(2):
        try:
            if lib is T:
                opt.step()
            sched.step()
        except Exception as e:
            return f"step {k}", type(e), str(e)
    return None


@pytest.mark.parametrize(("name", "make"), BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise_torchs_exception_where_torch_does_or_stay_finite(name, make):
    ref = _outcome(make, torch.optim.SGD(_groups(_params()), lr=0.1, momentum=0.9), T)
    opt = ampfuse.optim.SGD(_groups(_params()), lr=0.1, momentum=0.9)
    before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    assert _outcome(make, opt, A) == ref
    if ref is None:  # torch takes it: the same values, finite
        values = _run(_Ampfuse(_one(make)), 0, 12, SKIPS)
        _assert_same(values, _run(_Torch(_one(make)), 0, 12, SKIPS))
        assert all(lr == lr and abs(lr) < float("inf") for v, _ in values for lr, _ in v)
    elif ref[0] == "construction" and name not in ("SequentialLR-milestones",):  # nothing changed
        assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before


def test_one_cycle_past_its_end_raises_torchs_error_where_torch_does():
    """Past ``total_steps`` torch's class raises; so does the device schedule, at the step whose
    taken count passes it (no earlier, however many steps were skipped), with nothing changed."""
    for strategy in ("cos", "linear"):
        skips = {2, 5, 6}
        build = _one(lambda L, o, s=strategy: L.OneCycleLR(o, max_lr=1.0, total_steps=10, anneal_strategy=s))
        ref = _run(_Torch(build), 0, 20, skips)
        ours = _Ampfuse(build)
        values = _run(ours, 0, 20, skips)
        _assert_same(values, ref)
        assert len(values) == 14 and values[-1] == ("raised", ValueError,
                                                    "Tried to step 11 times. The specified number of total steps is 10")
        assert _values(ours.opt) == [(v, m) for v, m in _rounded(ref[-2][0])]
        assert ours.scheds[0].state_dict()["last_epoch"] == 10


def test_accelerates_guard_against_over_stepping_a_one_cycle_schedule_holds():
    """Accelerate steps a schedule with ``total_steps`` only while ``_step_count <= total_steps``."""
    opt = ampfuse.optim.SGD(_groups(_params(1)), lr=0.1, momentum=0.9)
    sched = A.OneCycleLR(opt, max_lr=1.0, total_steps=5)
    for _ in range(12):
        if sched._step_count <= sched.total_steps:
            sched.step()
    assert sched._step_count == 6 and sched.state_dict()["last_epoch"] == 5


# ---- torch's semantics the device keeps --------------------------------------------------------------


def _torch_and_ours(run):
    """``run(L, opt, stepped)`` for torch's classes stepped only on taken steps and for ampfuse's
    stepped at every iteration, each over its own SGD with SKIPS planted."""
    out = {}
    for L, cls in ((T, torch.optim.SGD), (A, ampfuse.optim.SGD)):
        opt = cls(_groups(_params()), lr=0.1)

        def stepped(k, opt=opt, L=L):
            _take(opt, skipped=k in SKIPS)
            return L is A or k not in SKIPS

        out[L] = run(L, opt, stepped)
    return out


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_changing_an_attribute_mid_run_takes_effect_as_in_torch():
    """``sched.milestones`` replaced after some steps (torch honours it from the next step on)."""
    def run(L, opt, stepped, skips_matter=True):
        sched = L.MultiStepLR(opt, [3, 6], gamma=0.5)
        out = []
        for k in range(12):
            if k == 4:
                sched.milestones = Counter([5, 8, 9])
            if stepped(k) or not skips_matter:
                sched.step()
            out.append(sched.get_last_lr())
        return out

    out = _torch_and_ours(run)
    assert out[A] == out[T]
    every = _torch_and_ours(lambda L, opt, stepped: run(L, opt, stepped, skips_matter=False))
    assert every[T] != out[T]  # the skips mattered


def test_a_write_to_a_groups_lr_is_chained_on_as_torch_does():
    """A user's own ``group["lr"] = x`` between steps: chainable schedules continue from it (one
    host read of the count, at the next step)."""
    def run(L, opt, stepped):
        sched = L.ExponentialLR(opt, gamma=0.5)
        out = []
        for k in range(10):
            taken = stepped(k)
            if k == 5:
                opt.param_groups[0]["lr"] = 0.7
            if taken:
                sched.step()
            out.append([_f32(float(g["lr"])) for g in opt.param_groups])
        return out

    out = _torch_and_ours(run)
    assert out[A] == out[T]


def test_lambda_state_of_callable_objects_is_saved_and_restored():
    opt = ampfuse.optim.SGD(_groups(_params(1)), lr=1.0)
    sched = A.LambdaLR(opt, _Warmup(4))
    for _ in range(3):
        sched.step()
    sd = _through_file(sched.state_dict())
    assert sd["lr_lambdas"] == [{"width": 4, "calls": 4}]  # construction + 3 taken steps, as torch's
    opt2 = ampfuse.optim.SGD(_groups(_params(1)), lr=1.0)
    lam = _Warmup(1)
    sched2 = A.LambdaLR(opt2, lam)
    sched2.load_state_dict(sd)
    sched2.step()
    assert sched2.get_last_lr() == [0.1] and lam.width == 4  # (4 + 1) / 4 capped at 1, times the group's 0.1


def test_load_state_dict_into_a_schedule_built_with_other_arguments_takes_the_saved_ones():
    opt = ampfuse.optim.SGD(_groups(_params(1)), lr=1.0)
    sched = A.MultiStepLR(opt, [2, 3], gamma=0.5)
    for _ in range(1):
        sched.step()
    opt2 = ampfuse.optim.SGD(_groups(_params(1)), lr=1.0)
    other = A.MultiStepLR(opt2, [100], gamma=0.9)
    opt2.load_state_dict(opt.state_dict())
    other.load_state_dict(sched.state_dict())
    lrs = []
    for _ in range(3):
        other.step()
        lrs.append(other.get_last_lr()[0])
    assert lrs == [0.05, 0.025, 0.025]  # the group's 0.1 halved at the saved milestones 2 and 3


def test_torchs_chained_scheduler_state_loads():
    t_opt = torch.optim.SGD(_groups(_params(1)), lr=1.0)
    chain = T.ChainedScheduler([T.ExponentialLR(t_opt, 0.5), T.StepLR(t_opt, 2, 0.1)])
    for _ in range(3):
        t_opt.step()
        chain.step()
    opt = ampfuse.optim.SGD(_groups(_params(1)), lr=1.0)
    ours = A.ChainedScheduler([A.ExponentialLR(opt, 0.5), A.StepLR(opt, 2, 0.1)])
    opt.load_state_dict(t_opt.state_dict())
    ours.load_state_dict(chain.state_dict())
    t_opt.step()
    chain.step()
    ours.step()
    assert ours.get_last_lr() == chain.get_last_lr()


def test_sequential_resets_the_groups_to_the_next_schedules_initial_lr_as_torch():
    build = _one(lambda L, o: L.SequentialLR(o, [L.LinearLR(o, start_factor=0.1, total_iters=3),
                                                 L.OneCycleLR(o, max_lr=0.3, total_steps=30, cycle_momentum=False)],
                                             milestones=[4]))
    _assert_same(_run(_Ampfuse(build), 0, 20, SKIPS), _run(_Torch(build), 0, 20, SKIPS))


def test_an_absorbed_schedule_is_stepped_through_its_composite():
    opt = ampfuse.optim.SGD(_groups(_params(1)), lr=1.0)
    inner = A.ExponentialLR(opt, 0.5)
    A.SequentialLR(opt, [inner], milestones=[])
    with pytest.raises(RuntimeError, match="ExponentialLR is part of SequentialLR: step that one"):
        inner.step()
    with pytest.raises(ValueError, match="already part of SequentialLR"):
        A.ChainedScheduler([inner])


def test_a_schedule_class_of_the_users_own_runs_on_the_device():
    class Halving(T.LRScheduler):
        def get_lr(self):
            return [g["lr"] * 0.5 if self.last_epoch % 2 else g["lr"] for g in self.optimizer.param_groups]

    build = _one(lambda L, o: Halving(o) if L is T else A.device_twin(Halving(o)))
    _assert_same(_run(_Ampfuse(build), 0, 20, SKIPS), _run(_Torch(build), 0, 20, SKIPS))


def test_transformers_schedules_by_name_and_as_twins():
    transformers = pytest.importorskip("transformers")
    for name, extra in [("linear", None), ("cosine", None), ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
                        ("constant_with_warmup", None), ("warmup_stable_decay", {"num_decay_steps": 8})]:
        def make(L, o, name=name, extra=extra):
            if L is T:
                return transformers.get_scheduler(name, o, num_warmup_steps=6, num_training_steps=30,
                                                  scheduler_specific_kwargs=extra)
            return A.get_scheduler(name, o, num_warmup_steps=6, num_training_steps=30, scheduler_specific_kwargs=extra)
        _assert_same(_run(_Ampfuse(_one(make)), 0, 36, SKIPS), _run(_Torch(_one(make)), 0, 36, SKIPS))
    # the twin ends where transformers' cosine_with_min_lr ends: at min_lr_rate * lr, not 0
    opt = ampfuse.optim.SGD(_groups(_params(1)), lr=0.01)
    twin = A.device_twin(transformers.get_scheduler("cosine_with_min_lr", opt, num_warmup_steps=0, num_training_steps=5,
                                                    scheduler_specific_kwargs={"min_lr_rate": 0.1}))
    for _ in range(5):
        twin.step()
    assert twin.get_last_lr() == pytest.approx([0.01], rel=1e-12)  # 0.1 of the group's 0.1


def test_reduce_lr_on_plateau_stays_on_the_host():
    with pytest.raises(TypeError, match="ReduceLROnPlateau has no device twin: it steps on a metric"):
        A.device_twin(T.ReduceLROnPlateau(torch.optim.SGD(_groups(_params(1)), lr=0.1)))


@pytest.mark.parametrize(("make", "exc", "message"), [
    (lambda o: A.StepLR(o, 3).step(5), ValueError, r"StepLR.step\(epoch\) is not supported"),
    (lambda o: A.OneCycleLR(torch.optim.Adagrad([torch.zeros(2, requires_grad=True)]), max_lr=0.1, total_steps=10),
     ValueError, "optimizer must support momentum or beta1"),
    (lambda o: A.StepLR(o, 3, scaler=torch.amp.GradScaler("cpu")), TypeError, "scaler must be an ampfuse.GradScaler"),
    (lambda o: A.StepLR(o, 3, horizon=-1), ValueError, "horizon must be an integer >= 0, got -1"),
    (lambda o: A.LRScheduler(o), TypeError, "LRScheduler is the base class"),
    (lambda o: A.device_twin(3), TypeError, "int is not a torch.optim.lr_scheduler.LRScheduler"),
], ids=["step-epoch", "one-cycle-momentum", "torch-scaler", "horizon", "base-class", "twin-of-a-number"])
def test_bad_input_is_refused_with_a_message(make, exc, message):
    with pytest.raises(exc, match=message):
        make(ampfuse.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1))


def test_the_table_covers_the_horizon_past_every_call():
    """What a captured step replays from: at every step() the device table holds the values of
    ``horizon`` taken steps past the most the count can be."""
    opt = ampfuse.optim.SGD(_groups(_params(1)), lr=1.0)
    sched = A.ExponentialLR(opt, 0.99, horizon=40)
    one_cycle = A.OneCycleLR(ampfuse.optim.SGD(_groups(_params(1)), lr=1.0, momentum=0.9), max_lr=1.0, total_steps=1000)
    assert one_cycle._timeline.n_rows >= 1001  # its own length is its default horizon
    for k in range(100):
        sched.step()
        assert sched._timeline.table.shape[0] >= sched._timeline.n_rows >= k + 2 + 40


def test_group_lr_is_one_tensor_written_in_place():
    opt = ampfuse.optim.AdamW([torch.zeros(4, requires_grad=True)], lr=1e-3)
    sched = A.LinearLR(opt, start_factor=0.5, total_iters=4)
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and lr.dim() == 0
    for _ in range(3):
        opt.param_groups[0]["params"][0].grad = torch.ones(4)
        opt.step()
        sched.step()
        assert opt.param_groups[0]["lr"] is lr
    assert float(lr) == _f32(1e-3 * (0.5 + 0.5 * 3 / 4))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt.param_groups[0]["lr"] is not lr
    sched.load_state_dict(sched.state_dict())
    lr2 = opt.param_groups[0]["lr"]
    sched.step()
    assert opt.param_groups[0]["lr"] is lr2 and float(lr2) == _f32(1e-3)


def test_a_torch_optimizer_with_a_tensor_lr_through_an_ampfuse_scaler():
    p = torch.randn(8, requires_grad=True)
    opt = torch.optim.Adam([p], lr=torch.tensor(0.05), foreach=False)
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**10)
    sched = A.ExponentialLR(opt, gamma=0.8, scaler=scaler)
    ours = []
    for k in range(8):
        loss = (p * p).sum() * (float("inf") if k in {1, 2, 5} else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()
        ours.append(sched.get_last_lr()[0])
    expected = [_f32(0.05)]
    for _ in range(5):
        expected.append(expected[-1] * 0.8)
    assert ours == [expected[n] for n in [1, 1, 1, 2, 3, 3, 4, 5]]


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


@requires_cuda
@pytest.mark.parametrize(("name", "build"), CASES, ids=IDS)
def test_cuda_schedules_step_without_a_sync(name, build):
    ours = _Ampfuse(build, device="cuda")
    _run(ours, 0, 1, SKIPS)
    for k in range(1, 12):
        torch.cuda.set_sync_debug_mode("error")
        try:
            ours.step(k, SKIPS, read=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    cpu = _Ampfuse(build)
    _run(cpu, 0, 12, SKIPS)
    assert [s.get_last_lr() for s in ours.scheds] == [s.get_last_lr() for s in cpu.scheds]


@requires_cuemu
@pytest.mark.parametrize(("name", "build"), CASES, ids=IDS)
def test_emulated_cuda_schedules_make_no_synchronizing_call_after_the_first_step(name, build):
    import ampfuse.testing.cuemu as cuemu

    ours = _Ampfuse(build, device="cuemu")
    _run(ours, 0, 1, SKIPS)
    for k in range(1, 12):
        with cuemu.counting_syncs() as syncs:
            ours.step(k, SKIPS, read=False)
        assert syncs == [], "\n".join(str(s) for s in syncs)
    cpu = _Ampfuse(build)
    _run(cpu, 0, 12, SKIPS)
    assert [s.get_last_lr() for s in ours.scheds] == [s.get_last_lr() for s in cpu.scheds]


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
    p = torch.randn(4, requires_grad=True)
    opt = torch.optim.SGD([p], lr=torch.tensor(1.0))
    scaler = ampfuse.GradScaler("cpu", init_scale=16.0)
    sched = A.ExponentialLR(opt, gamma=0.5)
    assert not sched.sees_skips()
    assert A.ExponentialLR(torch.optim.SGD([p], lr=1.0), gamma=0.5, scaler=scaler).sees_skips()
    stepped = [scaler.scheduler_step(sched) for _ in _overflowing_steps(opt, scaler, p)]
    assert stepped == [True, False, True, True] and sched.get_last_lr() == [0.5**3]


def test_the_accumulator_steps_a_device_schedule_without_a_read():
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


# ---- one optimizer's schedules, their attributes, copies ----------------------------------------------


def _sgd(lib_opt, lr=0.1, n=1):
    return lib_opt([{"params": [torch.zeros(2, requires_grad=True)], "lr": lr * (i + 1)} for i in range(n)], lr=lr)


def _take(opt, skipped=False):
    for g in opt.param_groups:
        g["params"][0].grad = torch.ones_like(g["params"][0])
    if isinstance(opt, ampfuse.optim.SGD):
        opt.step(scaling=StepScaling(None, torch.tensor([1.0 if skipped else 0.0]), None))
    elif not skipped:
        opt.step()


def test_a_schedule_dropped_or_left_in_a_failed_composite_does_not_step():
    for make in (lambda L, o: L.ExponentialLR(o, 0.5),
                 lambda L, o: pytest.raises(ValueError, L.SequentialLR, o, [L.ExponentialLR(o, 0.5)], milestones=[3])):
        out = {}
        for L, cls in ((T, torch.optim.SGD), (A, ampfuse.optim.SGD)):
            opt = _sgd(cls)
            make(L, opt)
            sched = L.ExponentialLR(opt, 0.9)
            for _ in range(2):
                _take(opt)
                sched.step()
            out[L] = [_f32(float(g["lr"])) for g in opt.param_groups]
        assert out[A] == out[T]


def test_schedules_of_one_optimizer_stepped_at_different_paces_are_refused():
    opt = _sgd(ampfuse.optim.SGD)
    warmup, epochs = A.LinearLR(opt, 0.1, total_iters=6), A.StepLR(opt, 1, 0.5)
    _take(opt)
    warmup.step()
    before = [float(g["lr"]) for g in opt.param_groups]
    _take(opt)
    with pytest.raises(RuntimeError, match="StepLR of this optimizer was not stepped in the last iteration"):
        warmup.step()
    assert [float(g["lr"]) for g in opt.param_groups] == before


def test_an_epoch_schedule_kept_as_torchs_composes_with_a_device_schedule():
    """A per-iteration device warm-up and torch's StepLR stepped once per 'epoch' of 4: torch's
    writes into the lr tensor are taken as written by hand, as torch's chaining takes them."""
    out = {}
    for L, cls in ((T, torch.optim.SGD), (A, ampfuse.optim.SGD)):
        opt = _sgd(cls)
        warmup, epochs = L.LinearLR(opt, 0.1, total_iters=6), T.StepLR(opt, 1, 0.5)
        lrs = []
        for i in range(12):
            _take(opt)
            warmup.step()
            if i % 4 == 3:
                epochs.step()
            lrs.append(_f32(float(opt.param_groups[0]["lr"])))
        out[L] = lrs
    assert out[A] == out[T]


def test_copying_or_pickling_a_device_schedule_is_refused_with_a_message():
    import pickle

    opt = _sgd(ampfuse.optim.SGD)
    sched = A.StepLR(opt, 2)
    for copier in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match=r"a device schedule \(StepLR\) is not copied or pickled.*state_dict"):
            copier(sched)
    for _ in range(2):  # the schedule is untouched: it goes on
        _take(opt)
        sched.step()
    assert sched.get_last_lr() == [0.1 * 0.1]


def test_a_param_group_added_after_the_schedule_joins_it_as_in_torch():
    out = {}
    for L, cls in ((T, torch.optim.SGD), (A, ampfuse.optim.SGD)):
        opt = _sgd(cls)
        sched = L.ExponentialLR(opt, 0.9)
        _take(opt)
        sched.step()
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "lr": 0.5})
        lrs = []
        for _ in range(3):
            _take(opt)
            sched.step()
            lrs.append(sched.get_last_lr())
        out[L] = lrs
    assert out[A] == out[T]


def test_attributes_read_and_written_as_they_stand_after_the_steps_taken():
    """torch's attributes (T_cur, a composite's schedules, _step_count) read at the present, not
    at the rows computed ahead; a write is seen at once, in reads and in state_dict()."""
    skips = {1, 4}
    for make, names in ((lambda L, o: L.CosineAnnealingWarmRestarts(o, T_0=5), ("T_cur", "T_i", "_last_lr", "_step_count")),
                        (lambda L, o: L.SequentialLR(o, [L.ConstantLR(o, 0.5, 2), L.ExponentialLR(o, 0.9)], [3]),
                         ("_last_lr", "last_epoch"))):
        got = {}
        for L, cls in ((T, torch.optim.SGD), (A, ampfuse.optim.SGD)):
            opt = _sgd(cls)
            sched = make(L, opt)
            for k in range(9):
                _take(opt, skipped=k in skips)
                if L is A or k not in skips:
                    sched.step()
            got[L] = [getattr(sched, n) for n in names]
            if names[1] == "last_epoch":
                got[L].append(sched._schedulers[1].last_epoch)
        assert got[A] == got[T]
    opt = _sgd(ampfuse.optim.SGD)
    sched = A.ExponentialLR(opt, 0.5)
    sched.gamma = 0.1
    assert sched.gamma == 0.1 and sched.state_dict()["gamma"] == 0.1


def test_get_last_lr_after_a_write_by_hand_or_a_loaded_state_is_torchs():
    state = {"step_size": 3, "gamma": 0.5, "base_lrs": [0.1], "last_epoch": 4, "_step_count": 5,
             "_is_initial": False, "_get_lr_called_within_step": False, "_last_lr": [0.05]}
    out = {}
    for L, cls in ((T, torch.optim.SGD), (A, ampfuse.optim.SGD)):
        opt = _sgd(cls)
        sched = L.ExponentialLR(opt, 0.9)
        _take(opt)
        sched.step()
        opt.param_groups[0]["lr"] = 0.07
        _take(opt, skipped=True)
        if L is A:
            sched.step()
        loaded = L.StepLR(_sgd(cls), 3, 0.5)
        loaded.load_state_dict(dict(state))
        out[L] = (sched.get_last_lr(), sched.state_dict()["_last_lr"], loaded.get_last_lr())
    assert out[A] == out[T]


@pytest.mark.parametrize("order", ["schedule-first", "optimizer-first"])
def test_either_load_order_continues_with_torchs_fp64_values(order):
    out = {}
    for L, cls in ((T, torch.optim.SGD), (A, ampfuse.optim.SGD)):
        opt = _sgd(cls)
        sched = L.ExponentialLR(opt, 0.9)
        for _ in range(3):
            _take(opt)
            sched.step()
        ck = _through_file({"opt": opt.state_dict(), "sched": sched.state_dict()})
        opt = _sgd(cls)
        sched = L.ExponentialLR(opt, 0.9)
        loads = [lambda: sched.load_state_dict(ck["sched"]), lambda: opt.load_state_dict(ck["opt"])]
        for load in (loads if order == "schedule-first" else loads[::-1]):
            load()
        _take(opt)
        sched.step()
        out[L] = sched.get_last_lr()
    assert out[A] == out[T]


def test_a_written_lr_is_taken_exactly_even_where_it_rounds_like_the_current_one():
    out = {}
    for L, cls in ((T, torch.optim.SGD), (A, ampfuse.optim.SGD)):
        opt = _sgd(cls)
        sched = L.ExponentialLR(opt, 0.9)
        _take(opt)
        sched.step()  # 0.09000000000000001
        opt.param_groups[0]["lr"] = 0.09
        _take(opt)
        sched.step()
        out[L] = sched.get_last_lr()
    assert out[A] == out[T] == [0.081]


def test_a_refused_step_raises_a_fresh_exception_each_time():
    opt = _sgd(ampfuse.optim.SGD, n=1)
    opt.param_groups[0]["momentum"] = 0.9
    sched = A.OneCycleLR(opt, max_lr=0.5, total_steps=3)
    for _ in range(3):
        sched.step()
    raised = []
    for _ in range(3):
        with pytest.raises(ValueError, match="Tried to step 4 times") as info:
            sched.step()
        raised.append(info.value)
    assert raised[0] is not raised[1]
    assert len(list(traceback.walk_tb(raised[2].__traceback__))) == len(list(traceback.walk_tb(raised[0].__traceback__)))


def test_torchs_messages_name_the_users_optimizer():
    a, b = _sgd(ampfuse.optim.SGD), _sgd(ampfuse.optim.SGD)
    with pytest.raises(ValueError, match=r"which is different from SGD") as info:
        A.SequentialLR(a, [A.StepLR(a, 2), A.StepLR(b, 2)], milestones=[3])
    assert "_ShadowOptimizer" not in str(info.value) and "SGD (" in str(info.value)


def test_a_schedule_that_replaces_a_dropped_one_counts_from_its_first_step():
    out = {}
    for L, cls in ((T, torch.optim.SGD), (A, ampfuse.optim.SGD)):
        opt = _sgd(cls)
        sched = L.ExponentialLR(opt, 0.9)
        _take(opt)
        sched.step()
        sched = L.StepLR(opt, 1, 0.5)  # a new schedule for the next phase; the first is dropped
        values = []
        for _ in range(3):
            _take(opt)
            sched.step()
            values.append((_f32(float(opt.param_groups[0]["lr"])), sched.get_last_lr(), sched.last_epoch))
        out[L] = values
    assert out[A] == out[T]
