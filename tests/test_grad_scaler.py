"""ampfuse.GradScaler against torch.amp.GradScaler: the same training sequences must give the same
scale, growth tracker, grads, params and optimizer state after every step (bitwise), and every
misuse must raise torch's exception with torch's message. Beyond torch: ampfuse's own options
(scale bounds, hysteresis, stats), its checks of arguments and loaded state dicts (a failed load
changes nothing), and unscale_and_clip_."""

from __future__ import annotations

import copy
import io
import math
import pickle
import warnings
from functools import partial

import pytest
import torch
from torch import nn

import ampfuse
from conftest import DEVICES, HAS_CUDA, requires_cuda

TorchScaler = torch.amp.GradScaler
OurScaler = ampfuse.GradScaler

OPTIMIZERS = {
    "sgd": partial(torch.optim.SGD, lr=0.05, momentum=0.9, foreach=False),
    "sgd_foreach": partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, foreach=True),
    "sgd_fused": partial(torch.optim.SGD, lr=0.05, momentum=0.9, fused=True),
    "adam": partial(torch.optim.Adam, lr=1e-2, foreach=False),
    "adam_foreach": partial(torch.optim.Adam, lr=1e-2, amsgrad=True, foreach=True),
    "adam_fused": partial(torch.optim.Adam, lr=1e-2, fused=True),
    "adamw": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw_fused": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True),
}


def make_model(device, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)


def batch(step, device, n=16):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 8, generator=g).to(device), torch.randn(n, 4, generator=g).to(device)


def autocast_dtype(device):
    return torch.float16 if device == "cuda" else torch.bfloat16


def snapshot(scaler, models, optimizers):
    snap = {}
    if scaler.is_enabled() and scaler._scale is not None:
        snap["scale"] = scaler._scale.clone()
        snap["growth_tracker"] = scaler._growth_tracker.clone()
    for k, m in enumerate(models):
        for n, p in m.named_parameters():
            snap[f"m{k}.{n}"] = p.detach().clone()
            snap[f"m{k}.{n}.grad"] = None if p.grad is None else p.grad.clone()
    for k, o in enumerate(optimizers):
        for pi, st in enumerate(o.state.values()):
            for key, v in st.items():
                snap[f"o{k}.{pi}.{key}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return snap


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True, msg=k)
        else:
            assert a[k] == b[k], k


def train(scaler_cls, device, opt_name, steps=12, inject=(2, 3, 7), scenario="plain", scaler_kwargs=None):
    """One of torch's AMP recipes; returns a snapshot after every step."""
    models = [make_model(device, 0)]
    if scenario == "multi":
        models.append(make_model(device, 1))
    opts = [OPTIMIZERS[opt_name](m.parameters()) for m in models]
    kwargs = dict(init_scale=2.0**12, growth_interval=3)
    kwargs.update(scaler_kwargs or {})
    scaler = scaler_cls(device, **kwargs)
    snaps = []
    accum = 3 if scenario == "accumulate" else 1
    for step in range(steps):
        for o in opts:
            o.zero_grad(set_to_none=(step % 2 == 0))
        for micro in range(accum):
            x, y = batch(step * accum + micro, device)
            with torch.autocast(device, dtype=autocast_dtype(device)):
                outs = [m(x) for m in models]
                losses = [nn.functional.mse_loss(o.float(), y) / accum for o in outs]
            if step in inject and micro == accum - 1:
                losses[-1] = losses[-1] * math.inf
            if scenario == "penalty":
                params = list(models[0].parameters())
                scaled = torch.autograd.grad(scaler.scale(losses[0]), params, create_graph=True)
                inv = 1.0 / scaler.get_scale()
                norm = sum((g * inv).pow(2).sum() for g in scaled).sqrt()
                losses[0] = losses[0] + 0.01 * norm
            if scenario == "multi":
                scaler.scale(losses[0] * 0.3 + losses[1] * 0.7).backward(retain_graph=True)
                scaler.scale(losses[1]).backward()
            else:
                scaler.scale(losses[0]).backward()
        if scenario == "clip":
            scaler.unscale_(opts[0])
            torch.nn.utils.clip_grad_norm_(models[0].parameters(), max_norm=0.5)
        for o in opts:
            scaler.step(o)
        if scenario == "new_scale" and step % 4 == 3:
            scaler.update(2.0**9 if step % 8 == 3 else torch.full((), 2.0**11, device=device))
        else:
            scaler.update()
        snaps.append(snapshot(scaler, models, opts))
    return snaps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("scenario", ["plain", "clip", "accumulate", "multi", "penalty", "new_scale"])
def test_parity_with_torch(device, opt_name, scenario):
    if scenario == "penalty" and "fused" in opt_name:
        pytest.skip("double backward through a fused optimizer adds nothing over 'plain'")
    ours = train(OurScaler, device, opt_name, scenario=scenario)
    ref = train(TorchScaler, device, opt_name, scenario=scenario)
    assert len(ours) == len(ref)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert_same(a, b), step


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_steps_and_scale_trajectory(device):
    snaps = train(OurScaler, device, "adam", steps=8, inject=(1, 2))
    scales = [s["scale"].item() for s in snaps]
    assert scales[:3] == [2.0**12, 2.0**11, 2.0**10]


def test_isinstance_and_defaults():
    s = OurScaler("cpu")
    assert isinstance(s, torch.amp.GradScaler)
    t = TorchScaler("cpu")
    for name in ["get_growth_factor", "get_backoff_factor", "get_growth_interval", "is_enabled", "get_scale"]:
        assert getattr(s, name)() == getattr(t, name)()
    assert s._init_growth_tracker == t._init_growth_tracker == 0
    # the same fresh per-optimizer state (ampfuse's factory is its own: torch.compile does not
    # trace into torch.amp)
    assert s._per_optimizer_states.default_factory() == t._per_optimizer_states.default_factory()
    s.set_growth_factor(3.0)
    s.set_backoff_factor(0.25)
    s.set_growth_interval(7)
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (3.0, 0.25, 7)


def test_torch_cuda_amp_signature_drop_in():
    """ampfuse.GradScaler's first argument is the device (a number is refused clearly);
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


def test_deprecated_scaler_classes_warn():
    """As torch's deprecated torch.cpu.amp/torch.cuda.amp GradScaler classes do."""
    for cls, device in ((ampfuse.cpu.amp.GradScaler, "cpu"), (ampfuse.cuda.amp.GradScaler, "cuda")):
        with pytest.warns(FutureWarning, match=rf"torch.{device}.amp.GradScaler\(args...\)` is deprecated"):
            cls(enabled=False)


@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour without CUDA")
def test_default_device_without_cuda_warns_and_disables():
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling.") as rec:
        s = OurScaler()
    assert rec[0].filename == __file__  # the warning points at the caller, as torch's does
    assert not s.is_enabled()
    with pytest.warns(UserWarning):
        t = TorchScaler()
    assert s.state_dict() == t.state_dict() == {}


def test_disabled_is_pass_through():
    m = make_model("cpu")
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = OurScaler("cpu", enabled=False)
    loss = m(batch(0, "cpu")[0]).sum()
    assert s.scale(loss) is loss
    loss.backward()
    s.unscale_(o)
    assert s.step(o) is None
    s.update()
    assert s.get_scale() == 1.0 and s.state_dict() == {}


def test_scale_nested_outputs():
    s, t = OurScaler("cpu", init_scale=4.0), TorchScaler("cpu", init_scale=4.0)
    out = [torch.ones(2), (torch.ones(3), [torch.full((1,), 2.0)])]
    a, b = s.scale(out), t.scale(out)
    assert type(a) is list and type(a[1]) is tuple
    torch.testing.assert_close(a[1][1][0], b[1][1][0])
    assert a[1][1][0].item() == 8.0
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        OurScaler("cpu").scale([1.0])


def test_step_returns_optimizer_value_and_forwards_args():
    class Opt(torch.optim.SGD):
        def step(self, closure=None, extra=None):  # noqa: D401
            super().step()
            return ("ret", extra)

    m = make_model("cpu")
    o = Opt(m.parameters(), lr=0.1)
    s = OurScaler("cpu")
    s.scale(m(batch(0, "cpu")[0]).sum()).backward()
    assert s.step(o, extra=5) == ("ret", 5)


def _misuse_cases():
    def fresh():
        m = make_model("cpu")
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        return m, o

    def unscale_twice(S):
        m, o = fresh()
        s = S("cpu")
        s.scale(m(batch(0, "cpu")[0]).sum()).backward()
        s.unscale_(o)
        s.unscale_(o)

    def unscale_after_step(S):
        m, o = fresh()
        s = S("cpu")
        s.scale(m(batch(0, "cpu")[0]).sum()).backward()
        s.step(o)
        s.unscale_(o)

    def step_twice(S):
        m, o = fresh()
        s = S("cpu")
        s.scale(m(batch(0, "cpu")[0]).sum()).backward()
        s.step(o)
        s.step(o)

    def no_inf_checks(S):
        m, o = fresh()
        s = S("cpu")
        s.scale(torch.ones(1))  # initialises the scale; no grads anywhere
        s.step(o)

    def update_without_checks(S):
        s = S("cpu")
        s.scale(torch.ones(1))
        s.update()

    def fp16_grads(S):
        m, o = fresh()
        m.half()
        s = S("cpu")
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        s.scale(torch.ones(1))
        s.unscale_(o)

    def closure(S):
        m, o = fresh()
        s = S("cpu")
        s.scale(torch.ones(1))
        s.step(o, closure=lambda: 0.0)

    def step_before_scale(S):
        _, o = fresh()
        S("cpu").step(o)

    def update_before_scale(S):
        S("cpu").update()

    def unscale_before_scale(S):
        _, o = fresh()
        S("cpu").unscale_(o)

    def bad_new_scale(S):
        m, o = fresh()
        s = S("cpu")
        s.scale(torch.ones(1))
        s.update(torch.ones(2))

    def load_empty(S):
        S("cpu").load_state_dict({})

    def bad_growth(S):
        S("cpu", growth_factor=1.0)

    def bad_backoff(S):
        S("cpu", backoff_factor=1.0)

    def pickle_mid_iteration(S):
        m, o = fresh()
        s = S("cpu")
        s.scale(m(batch(0, "cpu")[0]).sum()).backward()
        s.unscale_(o)
        pickle.dumps(s)

    return [
        unscale_twice, unscale_after_step, step_twice, no_inf_checks, update_without_checks, fp16_grads,
        closure, step_before_scale, update_before_scale, unscale_before_scale, bad_new_scale, load_empty,
        bad_growth, bad_backoff, pickle_mid_iteration,
    ]


@pytest.mark.parametrize("case", _misuse_cases(), ids=lambda f: f.__name__)
def test_misuse_raises_like_torch(case):
    with pytest.raises(Exception) as ref:
        case(TorchScaler)
    with pytest.raises(Exception) as ours:
        case(OurScaler)
    assert type(ours.value) is type(ref.value)
    assert str(ours.value) == str(ref.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("direction", ["torch->ours", "ours->torch"])
def test_state_dict_round_trip_both_ways(device, direction):
    """Train 5 steps with one scaler, save, load into the other kind, continue 5 steps: identical to
    training 10 steps with the second kind throughout (and the saved dicts are torch-compatible)."""
    src_cls, dst_cls = (TorchScaler, OurScaler) if direction == "torch->ours" else (OurScaler, TorchScaler)

    def run(first_cls, second_cls, split):
        model = make_model(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler = first_cls(device, init_scale=2.0**12, growth_interval=2)
        snaps = []
        for step in range(10):
            if step == split:
                buf = io.BytesIO()
                torch.save({"scaler": scaler.state_dict()}, buf)
                buf.seek(0)
                sd = torch.load(buf)["scaler"]
                for key in ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]:
                    assert key in sd
                scaler = second_cls(device)
                scaler.load_state_dict(sd)
            opt.zero_grad()
            x, y = batch(step, device)
            loss = nn.functional.mse_loss(model(x), y)
            if step in (1, 6):
                loss = loss * math.inf
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            snaps.append(snapshot(scaler, [model], [opt]))
        return snaps

    mixed = run(src_cls, dst_cls, split=5)
    pure = run(dst_cls, dst_cls, split=10)
    for a, b in zip(mixed, pure):
        assert_same(a, b)


def test_pickling_like_torch():
    m = make_model("cpu")
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = OurScaler("cpu", init_scale=256.0, hysteresis=3)
    for step in range(3):
        o.zero_grad()
        s.scale(m(batch(step, "cpu")[0]).sum() * (math.inf if step == 1 else 1.0)).backward()
        s.step(o)
        s.update()
    s2 = pickle.loads(pickle.dumps(s))
    assert s2._scale is None and s2._growth_tracker is None  # re-created lazily, as torch does
    assert s2.get_scale() == s.get_scale() == 256.0
    assert s2._init_hysteresis_tracker == 2 and s2._init_stats == [3, 1, 0, 0]
    s2.scale(torch.ones(1))
    assert s2._hysteresis_tracker.item() == 2 and s2.stats()["skipped"].item() == 1
    t = pickle.loads(pickle.dumps(TorchScaler("cpu", init_scale=8.0)))
    assert t.get_scale() == 8.0


def test_failed_step_leaves_the_scaler_picklable():
    """A step() that raises (before scale(), or with closure=) leaves no per-optimizer entry
    behind: the scaler pickles and deep-copies as torch's does."""
    s = ampfuse.GradScaler("cpu")
    opt = ampfuse.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        s.step(opt, closure=lambda: 0.0)
    with pytest.raises(AssertionError, match="Attempted step but _scale is None"):
        s.step(opt)
    pickle.dumps(s)
    copy.deepcopy(s)


def test_optimizer_gets_grad_scale_and_found_inf_like_torch():
    seen = {}

    class Recorder(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            seen.setdefault(self.tag, []).append((self.grad_scale.clone(), self.found_inf.clone()))

    for S, tag in [(TorchScaler, "torch"), (OurScaler, "ours")]:
        m = make_model("cpu")
        o = Recorder(m.parameters(), lr=0.1)
        o.tag = tag
        o.grad_scale = torch.full((), 3.0)  # a user-preset grad_scale multiplies in
        s = S("cpu", init_scale=16.0)
        for step in range(3):
            s.scale(m(batch(step, "cpu")[0]).sum() * (math.inf if step == 1 else 1.0)).backward()
            s.step(o)
            s.update()
            o.grad_scale = torch.full((), 3.0)
            o.zero_grad()
    for (a_scale, a_inf), (b_scale, b_inf) in zip(seen["ours"], seen["torch"]):
        assert torch.equal(a_scale, b_scale) and torch.equal(a_inf, b_inf)


def test_check_pass_reads_grads_without_writing():
    """For amp-scaling optimizers torch multiplies every grad by 1.0 in its check; ours only reads
    (the grad tensors' version counters do not move)."""
    m = make_model("cpu")
    o = torch.optim.AdamW(m.parameters(), fused=True)
    s = OurScaler("cpu")
    s.scale(m(batch(0, "cpu")[0]).sum()).backward()
    versions = [p.grad._version for p in m.parameters()]
    s._check_inf_per_device(o)
    assert [p.grad._version for p in m.parameters()] == versions


def test_unscaled_grads_after_step_the_documented_way():
    """With an ampfuse optimizer, scaler.step leaves .grad scaled (it never writes the
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


def test_unscale_is_one_fused_call_per_device(monkeypatch):
    calls = []
    real = ampfuse.ops.unscale_check_
    monkeypatch.setattr(ampfuse.ops, "unscale_check_", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k)))
    m = make_model("cpu")
    m[2].double()  # mixed dtypes: torch would launch per dtype
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = OurScaler("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m[4](m[3](m[2](m[1](m[0](batch(0, "cpu")[0])).double()).float()))
    s.scale(out.sum()).backward()
    s.unscale_(o)
    assert calls == [6]


# ----------------------------------------------------------------------------------------------
# torch's "Automatic Mixed Precision examples" page, run with both scalers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("example", ["typical", "clipping", "accumulation", "penalty", "multiple"])
def test_amp_examples_page(example):
    scenario = {"typical": "plain", "clipping": "clip", "accumulation": "accumulate", "penalty": "penalty", "multiple": "multi"}[example]
    ours = train(OurScaler, "cpu", "adamw", steps=10, scenario=scenario)
    ref = train(TorchScaler, "cpu", "adamw", steps=10, scenario=scenario)
    for a, b in zip(ours, ref):
        assert_same(a, b)


# ----------------------------------------------------------------------------------------------
# beyond torch
# ----------------------------------------------------------------------------------------------


def test_defaults_stay_torch_even_at_the_floor():
    """With default options only the floor differs from torch (torch decays to 0)."""
    m = make_model("cpu")
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = OurScaler("cpu", init_scale=1e-36, on_min_scale="ignore")
    for _ in range(10):
        o.zero_grad()
        s.scale(m(batch(0, "cpu")[0]).sum() * math.inf).backward()
        s.step(o)
        s.update()
    assert s.get_scale() == torch.finfo(torch.float32).tiny
    assert s.stats()["floor_hits"].item() > 0


def _overflowing_loop(scaler, steps):
    m = make_model("cpu")
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(steps):
        o.zero_grad()
        scaler.scale(m(batch(0, "cpu")[0]).sum() * math.inf).backward()
        scaler.step(o)
        scaler.update()


def test_min_scale_warn_raise_ignore():
    with pytest.warns(RuntimeWarning, match=r"hit its floor \(4\)"):
        _overflowing_loop(OurScaler("cpu", init_scale=16.0, min_scale=4.0), 4)
    with pytest.raises(RuntimeError, match="hit its floor"):
        _overflowing_loop(OurScaler("cpu", init_scale=16.0, min_scale=4.0, on_min_scale="raise"), 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = OurScaler("cpu", init_scale=16.0, min_scale=4.0, on_min_scale="ignore")
        _overflowing_loop(s, 4)
    assert s.get_scale() == 4.0


def test_hysteresis_and_max_scale():
    s = OurScaler("cpu", init_scale=64.0, growth_interval=1, hysteresis=2, max_scale=128.0)
    _overflowing_loop(s, 1)
    assert s.get_scale() == 64.0  # first overflow tolerated
    _overflowing_loop(s, 1)
    assert s.get_scale() == 32.0
    m = make_model("cpu")
    o = torch.optim.SGD(m.parameters(), lr=0.0)
    for _ in range(4):
        o.zero_grad()
        s.scale(m(batch(0, "cpu")[0]).sum()).backward()
        s.step(o)
        s.update()
    assert s.get_scale() == 128.0  # grew 32 -> 64 -> 128, then capped


@pytest.mark.parametrize(("kw", "msg"), [
    (dict(growth_interval=0), r"growth_interval must be an integer in \[1, 2147483647\], got 0"),
    (dict(growth_interval=2**40), r"growth_interval must be an integer in \[1, 2147483647\]"),
    (dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\), got 0"),
    (dict(growth_factor=math.inf), "growth_factor must be a finite number > 1.0, got inf"),
    (dict(init_scale=1e39), "init_scale must be a positive finite number that float32 holds"),
], ids=["interval-0", "interval-2^40", "backoff-0", "growth-inf", "init-1e39"])
def test_options_update_would_refuse_are_refused_at_construction(kw, msg):
    """By the rule the update op applies: otherwise the first update() fails after the optimizer
    stepped, and every later iteration fails too."""
    with pytest.raises(RuntimeError, match=msg):
        ampfuse.GradScaler("cpu", **kw)
    ampfuse.GradScaler("cpu", enabled=False, **kw)  # a disabled scaler checks nothing, as torch's


def test_extension_arguments_are_validated():
    for kw, msg in [
        (dict(hysteresis=0), "hysteresis must be an integer >= 1"),
        (dict(min_scale=-1.0), r"min_scale must be a finite number in \[0, 3.40282e\+38\]"),
        (dict(min_scale=1e39), r"\(the float32 range\), got 1e\+39"),
        (dict(max_scale=0.0), "max_scale must be a number > 0"),
        (dict(min_scale=2.0, max_scale=1.0), r"min_scale \(2.0\) must not be greater than max_scale \(1.0\)"),
        (dict(on_min_scale="loud"), "on_min_scale must be"),
        (dict(on_min_scale=["warn"]), r"on_min_scale must be 'warn', 'raise' or 'ignore', got \['warn'\]\."),
        (dict(on_min_scale=b"warn"), r"got b'warn'\."),
    ]:
        with pytest.raises(ValueError, match=msg):
            OurScaler("cpu", **kw)


def test_scale_bounds_clamp_init_and_loaded_scale():
    """init_scale and a loaded scale outside [min_scale, max_scale] are clamped (with a
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
    """A bad state dict raises before any part of the object changed; it stays usable."""
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
    with pytest.raises(ValueError, match=r"state 'step' of param_groups\[0\]\['params'\]\[0\] must be a number"):
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


def test_stats_and_last_found_inf_are_device_tensors():
    s = OurScaler("cpu", init_scale=2.0**8)
    m = make_model("cpu")
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    flags = []
    for step in range(6):
        o.zero_grad()
        s.scale(m(batch(step, "cpu")[0]).sum() * (math.inf if step in (1, 4) else 1.0)).backward()
        s.step(o)
        s.update()
        flags.append(s.last_found_inf.item())
    assert flags == [0, 1, 0, 0, 1, 0]
    st = s.stats()
    assert all(isinstance(v, torch.Tensor) for v in st.values())
    assert (st["updates"].item(), st["skipped"].item(), st["backoffs"].item()) == (6, 2, 2)


def test_scheduler_advances_only_on_taken_steps():
    s = OurScaler("cpu")
    m = make_model("cpu")
    o = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    for step in range(5):
        o.zero_grad()
        s.scale(m(batch(step, "cpu")[0]).sum() * (math.inf if step in (0, 2) else 1.0)).backward()
        s.step(o)
        s.update()
        s.scheduler_step(sched)
    assert sched.last_epoch == 3 and o.param_groups[0]["lr"] == 0.125


def test_overflow_report_names_parameters():
    m = make_model("cpu")
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = OurScaler("cpu")
    s.scale(m(batch(0, "cpu")[0]).sum()).backward()
    m[2].weight.grad[3, 4] = math.nan
    m[4].bias.grad[1] = math.inf
    s.step(o)
    s.update()
    assert s.last_found_inf.item() == 1.0
    assert s.overflow_report(o, model=m) == [(0, 2, "2.weight"), (0, 5, "4.bias")]
    assert s.overflow_report(o) == [(0, 2, "param_groups[0][2]"), (0, 5, "param_groups[0][5]")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "adamw_fused"])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_unscale_and_clip_matches_unscale_then_clip_grad_norm(device, opt_name, norm_type):
    results = []
    for fused_clip in (True, False):
        model = make_model(device)
        opt = OPTIMIZERS[opt_name](model.parameters())
        s = OurScaler(device, init_scale=2.0**10)
        norms = []
        for step in range(6):
            opt.zero_grad()
            x, y = batch(step, device)
            loss = nn.functional.mse_loss(model(x), y) * (math.inf if step == 2 else 10.0)
            s.scale(loss).backward()
            if fused_clip:
                norms.append(s.unscale_and_clip_(opt, max_norm=0.5, norm_type=norm_type))
            else:
                s.unscale_(opt)
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type))
            s.step(opt)
            s.update()
        results.append((norms, snapshot(s, [model], [opt])))
    (n_ours, snap_ours), (n_ref, snap_ref) = results
    for a, b in zip(n_ours, n_ref):
        # fp32 norms summed in a different order: 1e-6 relative (inf-norms are exact).
        torch.testing.assert_close(a, b, rtol=1e-6 if norm_type == 2.0 else 0, atol=0, equal_nan=True)
    for k in snap_ours:
        torch.testing.assert_close(snap_ours[k], snap_ref[k], rtol=2e-6, atol=1e-7, equal_nan=True, msg=k)


def test_unscale_and_clip_accepts_a_tensor_max_norm():
    """As clip_grad_norm_ does, with its formula (a true division for a tensor max_norm)."""
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


def test_unscale_and_clip_state_machine():
    m = make_model("cpu")
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = OurScaler("cpu")
    s.scale(m(batch(0, "cpu")[0]).sum()).backward()
    s.unscale_and_clip_(o, 1.0)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        s.unscale_(o)
    with pytest.raises(ValueError, match="max_norm must be a positive finite number"):
        OurScaler("cpu").unscale_and_clip_(o, -1.0)


def test_step_without_inf_checks_is_refused():
    """After unscale_and_clip_, stepping an ampfuse optimizer whose params got no gradient
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


def test_scaler_step_without_gradients_returns_like_torch():
    """torch's scaler with an optimizer that supports amp scaling returns from step()
    and raises at update()."""
    for scaler_cls in (torch.amp.GradScaler, ampfuse.GradScaler):
        s = scaler_cls("cpu")
        opt = ampfuse.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=0.1)
        s.scale(torch.ones(()))
        assert s.step(opt) is None
        with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
            s.update()


# ----------------------------------------------------------------------------------------------
# CUDA only: no host sync, and CUDA-graph capture
# ----------------------------------------------------------------------------------------------


@requires_cuda
def test_no_host_sync_with_amp_scaling_optimizer():
    model = make_model("cuda")
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    s = OurScaler("cuda", on_min_scale="ignore")
    x, y = batch(0, "cuda")
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        torch.cuda.set_sync_debug_mode("error")
        try:
            s.scale(loss).backward()
            s.unscale_and_clip_(opt, 1.0)
            s.step(opt)
            s.update()
        finally:
            torch.cuda.set_sync_debug_mode(0)


@requires_cuda
def test_cuda_graph_capture_of_scale_backward_step_update():
    model = make_model("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    s = OurScaler("cuda", init_scale=2.0**10, on_min_scale="ignore")
    x, y = batch(0, "cuda")
    static_x, static_y = x.clone(), y.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up (lazy state creation) outside the graph
            opt.zero_grad(set_to_none=False)
            s.scale(nn.functional.mse_loss(model(static_x), static_y)).backward()
            s.step(opt)
            s.update()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(g):
        s.scale(nn.functional.mse_loss(model(static_x), static_y)).backward()
        s.step(opt)
        s.update()
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        g.replay()
    torch.cuda.synchronize()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
