"""The persistent native step plan (csrc/engine/step_plan.h) behind ampfuse.optim and GradScaler.

After a step went the validated way, an ampfuse optimizer holds a native plan; later steps (and
the scaler's check before them) are one native call each. These tests check that the plan is
what runs in the steady state, that it gives bit for bit what the validated ops give, that the
Python work per step does not grow with the number of params, and that everything that can
change between steps sends the step back the validated way (same result, same messages).
"""

from __future__ import annotations

import copy
import pickle
import sys

import pytest
import torch

import ampfuse
from ampfuse import ops
from ampfuse.optim import SGD, Adam, AdamW


def _params(n=6, dtype=torch.bfloat16, seed=0, shapes=None):
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or [(3 + i, 5) if i % 2 else (7 + 3 * i,) for i in range(n)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _set_grads(params, step, scale=1.0, skip=()):
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        if i in skip:
            p.grad = None
            continue
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def _assign_grad(p, g):
    """``p.grad = g`` also where ``g``'s dtype is not ``p``'s (torch checks ``p.grad_dtype``)."""
    if g is not None and g.dtype != p.dtype:
        if not hasattr(p, "grad_dtype"):
            pytest.skip("this torch cannot give a parameter a gradient of another dtype")
        p.grad_dtype = None
    p.grad = g


def _pair(make, params):
    """(optimizer using the plan, reference that always goes the validated way)."""
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    a, b = make(params), make(ref_params)
    b._native_kind = ""  # the reference never builds a plan
    return a, b, ref_params


def _same(xs, ys):
    for x, y in zip(xs, ys):
        assert torch.equal(x, y), (x, y)


def _same_state(a, b):
    for pa, pb in zip([p for g in a.param_groups for p in g["params"]], [p for g in b.param_groups for p in g["params"]]):
        sa, sb = a.state.get(pa, {}), b.state.get(pb, {})
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k], sb[k]), k


MAKERS = {
    "sgd": lambda ps: SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd-nesterov-fp32": lambda ps: SGD(ps, lr=0.05, momentum=0.9, nesterov=True, master_weights=False),
    "adam": lambda ps: Adam(ps, lr=1e-2, weight_decay=1e-2),
    "adamw-amsgrad": lambda ps: AdamW(ps, lr=1e-2, amsgrad=True),
    "adamw-remainder-bf16state": lambda ps: AdamW(ps, lr=1e-2, master_weights="remainder", state_dtype=torch.bfloat16),
    "adamw-tensor-lr": lambda ps: AdamW(ps, lr=torch.tensor(1e-2)),
    "adamw-groups": lambda ps: AdamW([{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0}], lr=1e-2),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_plan_matches_the_validated_ops_bitwise(kind, dtype):
    params = _params(dtype=dtype)
    opt, ref, ref_params = _pair(MAKERS[kind], params)
    for step in range(5):
        _set_grads(params, step)
        _set_grads(ref_params, step)
        opt.step()
        ref.step()
        assert opt._native is not None  # built by the first step, used by the next ones
        _same(params, ref_params)
    _same_state(opt, ref)


@pytest.mark.parametrize("path", ["clip", "unscale", "plain"])
def test_plan_with_the_scaler_matches_and_skips_on_overflow(path):
    dtype = torch.bfloat16
    params = _params(dtype=dtype)
    opt, ref, ref_params = _pair(lambda ps: AdamW(ps, lr=1e-2), params)
    scalers = [ampfuse.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    for step in range(7):
        for ps, o, sc in ((params, opt, scalers[0]), (ref_params, ref, scalers[1])):
            sc.scale(torch.ones(()))
            _set_grads(ps, step, scale=1024.0)
            if step == 3:
                ps[2].grad.view(-1)[0] = float("inf")
            if path == "clip":
                norm = sc.unscale_and_clip_(o, 1.0)
            elif path == "unscale" and dtype != torch.float16:
                sc.unscale_(o)
            sc.step(o)
            sc.update()
        _same(params, ref_params)
        assert scalers[0].get_scale() == scalers[1].get_scale()
        if path == "clip":
            assert torch.isfinite(norm) or step == 3
    _same_state(opt, ref)


def test_steady_state_runs_no_op_and_no_per_param_python(monkeypatch):
    """Once built, neither the step nor the scaler's check calls an op from Python, and the Python
    work of a step (function calls, profiled) is the same for 10 and for 300 params."""

    def calls(n):
        params = _params(n=n, shapes=[(4,)] * n)
        opt = AdamW(params, lr=1e-3)
        sc = ampfuse.GradScaler("cpu", init_scale=8.0)
        loss = torch.ones(())

        def whole():
            sc.scale(loss)
            sc.unscale_and_clip_(opt, 1.0)
            sc.step(opt)
            sc.update()

        _set_grads(params, 0)
        whole()
        whole()
        events = []

        def prof(frame, event, arg):
            if event in ("call", "c_call"):
                events.append(event)

        sys.setprofile(prof)
        try:
            whole()
        finally:
            sys.setprofile(None)
        return len(events)

    with monkeypatch.context() as m:
        for name in ("adam_step_", "sgd_step_", "check_norm_", "unscale_check_"):
            m.setattr(ops, name, lambda *a, **k: pytest.fail("an op ran from Python in the steady state"))
        # the plans are built with the real ops first
    small, large = calls(10), calls(300)
    assert small == large, (small, large)
    params = _params(n=4)
    opt = AdamW(params, lr=1e-3)
    _set_grads(params, 0)
    opt.step()
    monkeypatch.setattr(ops, "adam_step_", lambda *a, **k: pytest.fail("an op ran from Python in the steady state"))
    _set_grads(params, 1)
    opt.step()  # the native plan, not the op


def _strided_grad(p):
    """A gradient that is not dense (every other element of a larger buffer)."""
    buf = torch.zeros((2 * p.numel(),), dtype=p.grad.dtype)
    view = buf[::2].view(p.shape) if p.dim() == 1 else buf[::2].unflatten(0, p.shape)
    view.copy_(p.grad)
    return view


SCALER_CHANGES = {
    # what changes before the scaler's pass of step 3, done alike on both sides; each meets one of
    # the plan's per-call shortcuts (a gradient range already found clear of what the step writes,
    # the last pass's disjoint gradients, dense gradients handed to the kernel without a copy)
    "grad-not-dense": lambda ps: setattr(ps[1], "grad", _strided_grad(ps[1])),
    "grad-moved": lambda ps: setattr(ps[2], "grad", ps[2].grad.clone()),
    "grad-transposed": lambda ps: setattr(ps[3], "grad", ps[3].grad.t().contiguous().t()),
    "grads-share-memory": lambda ps: setattr(ps[1], "grad", ps[0].grad.view(3, 4)),
    "grad-in-another-grad": lambda ps: setattr(ps[2], "grad", ps[0].grad[3:9]),
    # the scaler's pass does not look at the params themselves: the step after it must
    "param-moved": lambda ps: setattr(ps[2], "data", ps[2].data.clone()),
    "param-edited-and-moved": lambda ps: setattr(ps[3], "data", ps[3].data * 2),
    # a storage shared copy-on-write: written in place, it gets its own memory first
    "grad-lazily-cloned": lambda ps: setattr(ps[4], "grad", ps[4].grad._lazy_clone()),
}


@pytest.fixture
def two_threads():
    """Two intra-op threads, so that walks over many params run split (the plan's parallel walk)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("change", sorted(SCALER_CHANGES))
@pytest.mark.parametrize("path", ["clip", "unscale"])
@pytest.mark.parametrize("many", [False, True], ids=["5-params", "605-params"])
def test_scaler_pass_after_changes_matches_the_validated_way(change, path, many, two_threads):
    """The plan's scaler pass after a change of gradients between steps: the same values, norm and
    skips as the validated way, or the same error with nothing changed. With 605 params the plan
    walks them in two ranges on two threads, and the changed params lie in the second."""
    if change == "grad-lazily-cloned" and not hasattr(torch.Tensor, "_lazy_clone"):
        pytest.skip("this torch has no copy-on-write storages")
    shapes = [(12,), (3, 4), (6,), (4, 5), (8,)]
    filler = [(3,), (2, 2)] * 300 if many else []
    all_params = _params(shapes=filler + shapes)
    params = all_params[len(filler):]
    opt, ref, ref_all = _pair(lambda ps: AdamW(ps, lr=1e-2), all_params)
    ref_params = ref_all[len(filler):]
    scalers = [ampfuse.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) for _ in range(2)]
    for step in range(5):
        outs = []
        for ps, o, sc in ((params, opt, scalers[0]), (ref_params, ref, scalers[1])):
            sc.scale(torch.ones(()))
            _set_grads(ref_all if ps is ref_params else all_params, step, scale=1024.0)
            if step >= 3:
                SCALER_CHANGES[change](ps)
            try:
                out = sc.unscale_and_clip_(o, 1.0) if path == "clip" else sc.unscale_(o)
                sc.step(o)
                sc.update()
                outs.append((out, [p.grad.clone() for p in (ref_all if ps is ref_params else all_params)]))
            except RuntimeError as e:
                outs.append(e)
        if isinstance(outs[0], Exception) or isinstance(outs[1], Exception):
            # unscale_ writes the gradients in place (unscale_and_clip_ of a fused optimizer reads them)
            assert path == "unscale" and change in ("grads-share-memory", "grad-in-another-grad") and step == 3, outs
            assert type(outs[0]) is type(outs[1]) and str(outs[0]) == str(outs[1])
            assert "share memory" in str(outs[0])
            break
        (na, ga), (nb, gb) = outs
        if path == "clip":
            assert torch.equal(na, nb)
        _same(ga, gb)
        _same(params, ref_params)
        assert opt._native is not None
    else:
        assert path == "clip" or change not in ("grads-share-memory", "grad-in-another-grad")
    _same(all_params, ref_all)
    _same_state(opt, ref)


def _fresh(kind="adamw", dtype=torch.bfloat16, n=5):
    params = _params(n=n, dtype=dtype)
    make = MAKERS["adam" if kind == "adamw" else "sgd"]
    opt, ref, ref_params = _pair(make, params)
    for step in range(2):
        _set_grads(params, step)
        _set_grads(ref_params, step)
        opt.step()
        ref.step()
    assert opt._native is not None
    return params, opt, ref_params, ref


CHANGES = {
    # what changes between two steps, done to (params, optimizer) alike on both sides
    "grad-none": lambda ps, o: setattr(ps[1], "grad", None),
    "grad-comes-back": lambda ps, o: None,
    "fp32-grad": lambda ps, o: _assign_grad(ps[2], ps[2].grad.float()),
    "grad-transposed-view": lambda ps, o: setattr(ps[1], "grad", ps[1].grad.t().contiguous().t()),
    "data-swap": lambda ps, o: setattr(ps[0], "data", ps[0].data.clone()),
    "lr-edit": lambda ps, o: o.param_groups[0].__setitem__("lr", 0.5),
    "weight-decay-edit": lambda ps, o: o.param_groups[0].__setitem__("weight_decay", 0.3),
    "state-edit": lambda ps, o: o.state[ps[3]].__setitem__("exp_avg", torch.zeros_like(ps[3], dtype=torch.float32)),
    "amsgrad-on": lambda ps, o: o.param_groups[0].__setitem__("amsgrad", True),
    "master-off": lambda ps, o: o.param_groups[0].__setitem__("master_weights", False),
    "param-list-entry": lambda ps, o: o.param_groups[0]["params"].__setitem__(4, ps[4]),
    "in-place-edit": lambda ps, o: ps[0].data.mul_(0.5),
    "state-dict-roundtrip": lambda ps, o: o.load_state_dict(o.state_dict()),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_changes_between_steps_match_the_validated_way(change):
    params, opt, ref_params, ref = _fresh()
    for step in range(2, 5):
        _set_grads(params, step)
        _set_grads(ref_params, step)
        if step == 3:
            if change == "grad-comes-back":
                for ps in (params, ref_params):
                    ps[1].grad = None
            CHANGES[change](params, opt)
            CHANGES[change](ref_params, ref)
        opt.step()
        ref.step()
        _same(params, ref_params)
    _same_state(opt, ref)


@pytest.mark.parametrize("edit", ["betas-list-in-place", "lr-tensor-in-place", "lr-same-value", "new-group-key"])
def test_hyper_parameters_checked_once_still_follow_every_edit(edit):
    """The plan reuses a group's checked hyper-parameters while no value in the group dict was
    replaced; a value that can change in place (a list) is read at every step, and the lr tensor's
    value is read by the kernel."""
    make = MAKERS["adamw-tensor-lr" if edit == "lr-tensor-in-place" else "adam"]
    params = _params()
    opt, ref, ref_params = _pair(make, params)
    for step in range(6):
        for ps, o in ((params, opt), (ref_params, ref)):
            _set_grads(ps, step)
            g = o.param_groups[0]
            if edit == "betas-list-in-place":
                if step == 1:
                    g["betas"] = [0.9, 0.999]
                elif step >= 3:
                    g["betas"][1] = 0.9 - 0.1 * step  # the same list, a new value
            elif edit == "lr-tensor-in-place" and step >= 3:
                g["lr"].fill_(0.02 * step)
            elif edit == "lr-same-value" and step >= 3:
                g["lr"] = float(str(g["lr"]))  # an equal float, another object
            elif edit == "new-group-key" and step == 3:
                g["eps"] = 0.5
                g["note"] = "added"
            o.step()
        _same(params, ref_params)
        assert opt._native is not None or step == 0
    _same_state(opt, ref)


def _raises_same(fn_a, fn_b):
    with pytest.raises(Exception) as ea:
        fn_a()
    with pytest.raises(Exception) as eb:
        fn_b()
    assert type(ea.value) is type(eb.value) and str(ea.value) == str(eb.value)
    return str(ea.value)


@pytest.mark.parametrize("bad", ["grad-is-param", "sparse-grad", "model-half", "fp16-grad-for-bf16",
                                 "negative-lr", "grad-overlaps-state"])
def test_bad_input_after_the_plan_is_built_fails_as_before_and_changes_nothing(bad):
    params, opt, ref_params, ref = _fresh()

    def spoil(ps, o):
        _set_grads(ps, 7)
        if bad == "grad-is-param":
            ps[2].grad = ps[2].detach()  # the param's own memory
        elif bad == "sparse-grad":
            ps[0].grad = torch.zeros_like(ps[0]).to_sparse()
        elif bad == "model-half":
            ps[3].data = ps[3].data.half()
            _assign_grad(ps[3], torch.zeros_like(ps[3]))
        elif bad == "fp16-grad-for-bf16":
            _assign_grad(ps[1], ps[1].grad.half())
        elif bad == "negative-lr":
            o.param_groups[0]["lr"] = -1.0
        elif bad == "grad-overlaps-state":
            _assign_grad(ps[4], o.state[ps[4]]["exp_avg"])  # an fp32 gradient that is the param's state

    spoil(params, opt)
    spoil(ref_params, ref)
    before = [p.detach().clone() for p in params]
    state_before = [(p, {k: t.clone() for k, t in st.items() if isinstance(t, torch.Tensor)}) for p, st in opt.state.items()]
    if bad == "grad-overlaps-state":
        # the plan sees the overlap and goes the validated way, which names the state
        msg = _raises_same(opt.step, ref.step)
        assert "shares memory with its optimizer state 'exp_avg'" in msg
    else:
        _raises_same(opt.step, ref.step)
    for p, q in zip(params, before):
        assert torch.equal(p, q) or p.dtype != q.dtype
    for p, saved in state_before:
        for key, t in saved.items():
            assert torch.equal(opt.state[p][key], t), key


def test_scaler_check_falls_back_for_fp16_unscale_and_for_grads_mapping():
    params = _params(dtype=torch.float16)
    opt = AdamW(params, lr=1e-3)
    sc = ampfuse.GradScaler("cpu", init_scale=4.0)
    for step in range(2):
        sc.scale(torch.ones(()))
        _set_grads(params, step)
        sc.step(opt)
        sc.update()
    assert opt._native is not None
    sc.scale(torch.ones(()))
    _set_grads(params, 3)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        sc.unscale_(opt)


def test_pickle_and_deepcopy_after_the_plan_is_built():
    params, opt, _, _ = _fresh()
    clone = copy.deepcopy(opt)
    assert clone._native is None
    blob = pickle.dumps(opt.state_dict())
    assert pickle.loads(blob)["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]
    _set_grads([p for g in clone.param_groups for p in g["params"]], 9)
    clone.step()
    assert clone._native is not None


def test_plan_object_rejects_bad_construction():
    with pytest.raises(ValueError, match="unknown optimizer kind 'lamb'; the kinds are 'sgd', 'adam'"):
        torch.classes.ampfuse.StepPlan("lamb")
    plan = torch.classes.ampfuse.StepPlan("sgd")
    with pytest.raises(RuntimeError, match="params must not be empty"):
        plan.add_bucket(0, [], [], [], [], [], [], False)
    p = torch.zeros(3)
    with pytest.raises(RuntimeError, match="not finalized"):
        plan.step(None, None, None)
    # the same tensor written twice is refused when the plan is finalized, naming it
    plan.add_bucket(0, [p], [], [], [], [], [torch.zeros(())], False)
    plan.add_bucket(0, [p], [], [], [], [], [torch.zeros(())], False)
    with pytest.raises(RuntimeError, match="share memory"):
        plan.finalize()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_plan_hyper_parameters_are_taken_by_name_each_exactly_once(kind):
    """A plan takes each group's hyper-parameters by name (no positional layout): an unknown or a
    missing name, a flag that is not 0 or 1 and a group stepped without any are refused by name."""
    plan = torch.classes.ampfuse.StepPlan(kind)
    names = plan.hyper_names()
    assert names == (["lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"] if kind == "sgd" else
                     ["lr", "beta1", "beta2", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"]
                     ) + ["stochastic_rounding", "rounding_seed"]
    good = dict.fromkeys(names, 0.0)
    with pytest.raises(RuntimeError, match=r"unknown hyper-parameter 'betas'; a .* plan takes lr, "):
        plan.set_hyper(0, {**good, "betas": 0.9}, None, None)
    with pytest.raises(RuntimeError, match="hyper-parameter 'weight_decay' is missing"):
        plan.set_hyper(0, {k: v for k, v in good.items() if k != "weight_decay"}, None, None)
    with pytest.raises(RuntimeError, match="'maximize' is a flag \\(0 or 1\\), got 0.5"):
        plan.set_hyper(0, {**good, "maximize": 0.5}, None, None)
    with pytest.raises(RuntimeError, match=r"'rounding_seed' is an integer of at most 2\*\*53 in magnitude, got 0.5"):
        plan.set_hyper(0, {**good, "rounding_seed": 0.5}, None, None)
    with pytest.raises(RuntimeError, match="lr must be a 1-element tensor"):
        plan.set_hyper(0, good, torch.zeros(2), None)
    with pytest.raises(RuntimeError, match="momentum must be a 1-element tensor"):
        plan.set_hyper(0, good, None, torch.zeros(2))
    p = torch.zeros(3)
    p.grad = torch.ones(3)
    states = ([], []) if kind == "sgd" else ([torch.zeros(3)], [torch.zeros(3)])
    plan.add_bucket(1, [p], [], *states, [], [torch.zeros(())], False)
    plan.finalize()
    plan.set_hyper(0, good, None, None)
    with pytest.raises(RuntimeError, match="no hyper-parameters were set for group 1"):
        plan.step(None, None, None)
    assert torch.equal(p, torch.zeros(3))
    plan.set_hyper(1, {**good, "lr": 0.5} if kind == "sgd" else {**good, "lr": 0.5, "beta2": 0.5}, None, None)
    assert plan.step(None, None, None) == 0
    assert torch.all(p < 0)


@pytest.mark.parametrize("kind,name", [("sgd", "momentum_buffers"), ("adam", "exp_avgs")])
def test_plan_bucket_messages_name_the_state_lists_as_the_step_op_does(kind, name):
    plan = torch.classes.ampfuse.StepPlan(kind)
    p = torch.zeros(3)
    two = [torch.zeros(3), torch.zeros(3)]
    with pytest.raises(RuntimeError, match=rf"{name} must be empty or have one tensor per param \(1\), got 2"):
        plan.add_bucket(0, [p], [], two, [], [], [torch.zeros(())], False)


# ---- the accumulator's plan ------------------------------------------------------------------------


class _Tiny(torch.nn.Module):
    """Three params (a, b, c); with ``extra``, that many small bf16 params between b and c (then
    c lies in the second half of the param list, which the native walks take on another thread)."""

    def __init__(self, dtype, fp32_bias=False, extra=0):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.a = torch.nn.Parameter(torch.randn(16, 8, generator=g).to(dtype))
        self.b = torch.nn.Parameter(torch.randn(8, generator=g).to(torch.float32 if fp32_bias else dtype))
        self.extra = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(3, generator=g).to(dtype)) for _ in range(extra)])
        self.c = torch.nn.Parameter(torch.randn(8, 4, generator=g).to(dtype))

    def forward(self, x, use_c=True):
        h = (x @ self.a + self.b).to(self.a.dtype)
        out = (h @ self.c).square().mean() if use_c else h.square().mean()
        if len(self.extra):
            out = out + torch.stack(list(self.extra)).float().square().sum() * x.float().mean()
        return out


def _train_windows(plan: str, monkeypatch, *, unfreeze_at=None, skip_c_at=(), windows=4, steps=3,
                   scaler=True, max_grad_norm=1.0, inf_at=(), flush_after=None, fp32_bias=False, extra=0):
    monkeypatch.setenv("AMPFUSE_STEP_PLAN", plan)
    torch.manual_seed(0)
    model = _Tiny(torch.bfloat16, fp32_bias, extra)
    if unfreeze_at is not None:
        model.c.requires_grad_(False)
    opt = AdamW(model.parameters(), lr=1e-2)
    sc = ampfuse.GradScaler("cpu", init_scale=2.0**8) if scaler else None
    acc = ampfuse.GradAccumulator(model, opt, sc, steps=steps, max_grad_norm=max_grad_norm)
    g = torch.Generator().manual_seed(5)
    used_plan = []
    for mb in range(windows * steps):
        if unfreeze_at is not None and mb == unfreeze_at:
            model.c.requires_grad_(True)
        x = torch.randn(4, 16, generator=g).to(torch.bfloat16)
        if mb in inf_at:
            x[0, 0] = float("inf")
        with acc.accumulate():
            acc.backward(model(x, use_c=mb not in skip_c_at))
        used_plan.append(acc._acc_plan is not None)
        if flush_after is not None and mb == flush_after:
            acc.flush()
    return [p.detach().clone() for p in model.parameters()], used_plan, acc


@pytest.mark.parametrize("case", ["steady", "param-without-grad-in-a-micro-batch", "unfrozen-mid-window"])
@pytest.mark.parametrize("extra", [0, 600], ids=["3-params", "603-params"])
def test_accumulator_plan_matches_the_validated_way_bitwise(case, extra, monkeypatch, two_threads):
    kw = {"steady": {}, "param-without-grad-in-a-micro-batch": {"skip_c_at": (4, 7)},
          "unfrozen-mid-window": {"unfreeze_at": 4}}[case]
    kw["extra"] = extra
    with_plan, used, _ = _train_windows("1", monkeypatch, **kw)
    without, unused, _ = _train_windows("0", monkeypatch, **kw)
    _same(with_plan, without)
    assert any(used) and not any(unused)


def test_accumulator_plan_runs_no_op_from_python(monkeypatch):
    _, used, acc = _train_windows("1", monkeypatch, windows=1, steps=2)
    assert acc._acc_plan is not None
    monkeypatch.setattr(ops, "accumulate_grads_", lambda *a, **k: pytest.fail("the validated pass ran"))
    x = torch.randn(4, 16).to(torch.bfloat16)
    with acc.accumulate():
        acc.backward(acc.model(x))
    assert acc.model.a.grad is None and any(acc._has_grad)


def test_accumulator_plan_refuses_a_sparse_gradient_as_before(monkeypatch):
    _, _, acc = _train_windows("1", monkeypatch, windows=1, steps=2)
    assert acc._acc_plan is not None
    with pytest.raises(RuntimeError, match="GradAccumulator does not support sparse gradients"):
        with acc.accumulate():
            acc.backward(acc.model(torch.randn(4, 16).to(torch.bfloat16)))
            acc.model.a.grad = torch.zeros_like(acc.model.a).to_sparse()


_WINDOW_CASES = {
    "scaler-clip": {},
    "scaler": {"max_grad_norm": None},
    "clip": {"scaler": False},
    "plain": {"scaler": False, "max_grad_norm": None},
    "overflow-window": {"inf_at": (4,)},
    "flush": {"flush_after": 4},
    "fp32-param": {"fp32_bias": True},
    "fp32-param-no-clip": {"fp32_bias": True, "max_grad_norm": None},
    "param-idle-for-a-window": {"skip_c_at": (6, 7, 8)},
}


@pytest.mark.parametrize("case", list(_WINDOW_CASES))
def test_accumulator_window_step_reads_the_sums_natively_and_matches_the_validated_way(case, monkeypatch):
    """The window's step reads the fp32 sums through the accumulator's plan (no mapping of them is
    built) and gives bit for bit what the validated way gives: with and without the scaler and
    clipping, a skipped window, an incomplete one, an fp32 param summing in its own .grad, a
    param without a gradient for a whole window (not stepped)."""
    kw = _WINDOW_CASES[case]
    built = []
    real_build = ampfuse.accumulation.GradAccumulator._window_grads

    def counting(self):
        built.append(1)
        return real_build(self)

    monkeypatch.setattr(ampfuse.accumulation.GradAccumulator, "_window_grads", counting)
    with_plan, _, acc = _train_windows("1", monkeypatch, **kw)
    native = acc.optimizer._native
    assert native is not None and native.source is acc._acc_plan
    planned_windows = acc.windows - len(built)
    built.clear()
    without, _, _ = _train_windows("0", monkeypatch, **kw)
    _same(with_plan, without)
    assert len(built) == acc.windows  # the validated way built the mapping every window
    # the first window goes the validated way (the plans are built from it); an incomplete one
    # (flush), and a change of which params have a gradient (and the window after it) too
    assert planned_windows >= acc.windows - (2 if "flush_after" in kw else 3 if "skip_c_at" in kw else 1)


def test_accumulator_window_runs_no_per_param_python(monkeypatch):
    """A whole window (micro-batches and the step) in the steady state: no op called from Python,
    and the same Python work (calls and lines executed, traced) for 10 and for 300 params."""

    def trace_window(n):
        params = _params(n=n, shapes=[(4,)] * n)
        opt = AdamW(params, lr=1e-3)
        sc = ampfuse.GradScaler("cpu", init_scale=8.0)
        acc = ampfuse.GradAccumulator(torch.nn.ParameterList(params), opt, sc, steps=2, max_grad_norm=1.0)

        def loss():
            return torch.cat([p.reshape(-1) for p in params]).float().square().sum()

        def window(losses):
            for lo in losses:
                with acc.accumulate():
                    acc.backward(lo)

        for _ in range(2):
            window([loss(), loss()])
        assert acc.optimizer._native.source is acc._acc_plan
        losses = [loss(), loss()]  # built outside the trace: the model's forward is the user's
        events = []

        def tracer(frame, event, arg):
            events.append(event)
            return tracer

        with monkeypatch.context() as m:
            for name in ("adam_step_", "check_norm_", "unscale_check_", "accumulate_grads_"):
                m.setattr(ops, name, lambda *a, **k: pytest.fail("an op ran from Python in the steady state"))
            sys.settrace(tracer)
            try:
                window(losses)
            finally:
                sys.settrace(None)
        assert acc.windows == 3
        return len(events)

    small, large = trace_window(10), trace_window(300)
    assert small == large, (small, large)


def test_accumulator_plan_flags_follow_a_rebuilt_layout(monkeypatch):
    """The window's flags move between the native plan and Python when the plan is dropped or
    rebuilt (a layer unfrozen mid-window): a checkpoint taken mid-window lists them."""
    _, _, acc = _train_windows("1", monkeypatch, windows=1, steps=3, unfreeze_at=None)
    x = torch.randn(4, 16).to(torch.bfloat16)
    with acc.accumulate():
        acc.backward(acc.model(x, use_c=False))  # c has no gradient in this micro-batch
    assert acc._acc_plan is not None
    assert acc._has_grad == [True, True, False]
    acc._acc_plan = None
    assert acc._has_grad == [True, True, False]
    with acc.accumulate():
        acc.backward(acc.model(x))
    assert acc._has_grad == [True, True, True] and acc.state_dict()["has_grad"] == [True, True, True]
