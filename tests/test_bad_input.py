"""Bad input at every public entry point: the error type, a message naming the argument and what
was wrong, and nothing changed (tensors, scaler, optimizer and accumulator state all as before).

Each case builds fresh objects and returns (call, [things whose state must not change]). The
C++ API's counterparts are in tests/cpp (``*BadInput*``)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import ampfuse
from ampfuse import ops
from conftest import DEVICES

CASES = []


def case(name: str, exc: type, pattern: str):
    def deco(make):
        CASES.append(pytest.param(make, exc, pattern, id=name))
        return make

    return deco


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def scalar(v=0.0):
    return torch.full((1,), v)


# ---- snapshots ----------------------------------------------------------------------------------


def snapshot(obj):
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            return ("meta", obj.shape)
        if obj.is_sparse:
            return ("sparse", obj.to_dense().clone())
        return ("tensor", obj.detach().clone())
    if isinstance(obj, ampfuse.GradAccumulator):
        return ("acc", obj.micro_step, obj.windows, [b.clone() for b in obj._flat.values()], list(obj._has_grad))
    if isinstance(obj, torch.amp.GradScaler):
        return ("scaler", copy.deepcopy(obj.state_dict()), {k: v["stage"] for k, v in obj._per_optimizer_states.items()})
    if isinstance(obj, torch.optim.Optimizer):
        return ("opt", copy.deepcopy(obj.state_dict()), [p.detach().clone() for g in obj.param_groups for p in g["params"]])
    raise TypeError(type(obj))


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.nan_to_num(), b.nan_to_num()))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


# ---- ops: unscale_check_ / unscale_check_norm_ / check_norm_ ------------------------------------

_UNSCALE_FNS = [ops.unscale_check_, lambda *a, **k: ops.unscale_check_norm_(*a, **k), ops.check_norm_]


def _unscale_case(name, pattern, make_args, fn_index=0):
    @case(f"unscale/{name}", RuntimeError, pattern)
    def make():
        tensors, fi, inv, kw = make_args()
        return (lambda: _UNSCALE_FNS[fn_index](tensors, fi, inv, **kw)), [*tensors, fi, inv]


_unscale_case("other-device", r"tensors\[1\] is on meta but found_inf is on (cpu|cuemu:0|cuda:0)", lambda: ([t(3), torch.empty(2, device="meta")], scalar(), scalar(0.5), {}))
_unscale_case("int64", r"tensors\[0\] has dtype torch.int64", lambda: ([torch.ones(2, dtype=torch.int64)], scalar(), scalar(0.5), {}))
_unscale_case("bool", r"tensors\[0\] has dtype torch.bool", lambda: ([torch.ones(2, dtype=torch.bool)], scalar(), scalar(0.5), {}))
_unscale_case("complex", r"tensors\[0\] has dtype torch.complex64", lambda: ([torch.ones(2, dtype=torch.complex64)], scalar(), scalar(0.5), {}))
_unscale_case("sparse", r"tensors\[1\] has layout Sparse", lambda: ([t(3), t(3, 3).to_sparse()], scalar(), scalar(0.5), {}))
_unscale_case("found_inf-fp64", "found_inf must be a torch.float32 tensor", lambda: ([t(3)], torch.zeros(1, dtype=torch.float64), scalar(0.5), {}))
_unscale_case("found_inf-2", "found_inf must be a 1-element tensor, got 2", lambda: ([t(3)], torch.zeros(2), scalar(0.5), {}))
_unscale_case("inv_scale-fp16", "inv_scale must be a torch.float32 tensor", lambda: ([t(3)], scalar(), torch.ones(1).half(), {}))
_unscale_case("inv_scale-3", "inv_scale must be a 1-element tensor", lambda: ([t(3)], scalar(), torch.ones(3), {}))
_unscale_case("same-tensor-twice", r"tensors\[0\] and tensors\[1\] share memory", lambda: (lambda x: ([x, x], scalar(), scalar(0.5), {}))(t(4)))
_unscale_case("overlapping-views", r"share memory", lambda: (lambda b: ([b[:5], b[3:]], scalar(), scalar(0.5), {}))(t(8)))
# named in the order passed, not by address
_unscale_case("overlapping-views-lower-second", r"tensors\[0\] and tensors\[1\] share memory", lambda: (lambda b: ([b[3:], b[:5]], scalar(), scalar(0.5), {}))(t(8)))
_unscale_case("expanded", r"tensors\[0\] has internally overlapping memory", lambda: ([t(1).expand(4)], scalar(), scalar(0.5), {}))
_unscale_case("found_inf-is-inv_scale", r"found_inf and inv_scale share memory", lambda: (lambda s: ([t(3)], s, s, {}))(scalar(0.5)))
_unscale_case("norm_type-1", "norm_type must be 2.0 or inf, got 1", lambda: ([t(3)], scalar(), scalar(0.5), {"norm_type": 1.0}), 1)
_unscale_case("max_norm-negative", "max_norm must be a positive finite number, got -1", lambda: ([t(3)], scalar(), scalar(0.5), {"max_norm": -1.0}), 1)
_unscale_case("max_norm-inf", "max_norm must be a positive finite number, got inf", lambda: ([t(3)], scalar(), scalar(0.5), {"max_norm": math.inf}), 2)
_unscale_case("per_tensor-length", r"per_tensor_found_inf must be a contiguous 1-D tensor with one element per tensor \(1\)",
              lambda: ([t(3)], scalar(), scalar(0.5), {"per_tensor_found_inf": torch.zeros(2)}), 2)
_unscale_case("per_tensor-int32", "per_tensor_found_inf must be a torch.float32 tensor",
              lambda: ([t(3)], scalar(), scalar(0.5), {"per_tensor_found_inf": torch.zeros(1, dtype=torch.int32)}), 1)


# ---- ops: update_scale_ ---------------------------------------------------------------------------


def _clip_case(name, pattern, make_args):
    @case(f"clip_coef/{name}", RuntimeError, pattern)
    def make():
        args, kwargs = make_args()
        return (lambda: torch.ops.ampfuse.clip_coef(*args, **kwargs)), []


_clip_case("neither", "pass exactly one of max_norm and max_norm_tensor, got neither", lambda: ((scalar(2.0),), {}))
_clip_case("both", "pass exactly one of max_norm and max_norm_tensor, got both",
           lambda: ((scalar(2.0),), dict(max_norm=1.0, max_norm_tensor=scalar(1.0))))
_clip_case("norm-fp16", r"total_norm must be a 1-element torch.float32 or torch.float64 tensor, got shape \[1\] and dtype torch.float16",
           lambda: ((torch.ones(1, dtype=torch.float16),), dict(max_norm=1.0)))
_clip_case("max_norm-0", "max_norm must be a positive finite number, got 0", lambda: ((scalar(2.0),), dict(max_norm=0.0)))
_clip_case("max_norm_tensor-2", "max_norm_tensor must be a 1-element tensor", lambda: ((scalar(2.0),), dict(max_norm_tensor=torch.ones(2))))


def _update_case(name, pattern, change):
    @case(f"update_scale/{name}", RuntimeError, pattern)
    def make():
        a = dict(scale=scalar(1024.0), growth_tracker=torch.zeros(1, dtype=torch.int32), found_inf=scalar(),
                 growth_factor=2.0, backoff_factor=0.5, growth_interval=10)
        kw = {}
        change(a, kw)
        call = lambda: ops.update_scale_(a["scale"], a["growth_tracker"], a["found_inf"], a["growth_factor"],  # noqa: E731
                                         a["backoff_factor"], a["growth_interval"], **kw)
        return call, [a["scale"], a["growth_tracker"]] + [v for v in kw.values() if isinstance(v, torch.Tensor)]


_update_case("scale-fp64", "scale must be a torch.float32 tensor", lambda a, k: a.update(scale=torch.ones(1, dtype=torch.float64)))
_update_case("scale-2", "scale must be a 1-element tensor", lambda a, k: a.update(scale=torch.ones(2)))
_update_case("tracker-int64", "growth_tracker must be a torch.int32 tensor", lambda a, k: a.update(growth_tracker=torch.zeros(1, dtype=torch.int64)))
_update_case("found_inf-fp16", "found_inf must be a torch.float32 tensor", lambda a, k: a.update(found_inf=torch.zeros(1).half()))
_update_case("growth-1", r"growth_factor must be a finite number > 1.0, got 1", lambda a, k: a.update(growth_factor=1.0))
_update_case("growth-inf", r"growth_factor must be a finite number > 1.0, got inf", lambda a, k: a.update(growth_factor=math.inf))
_update_case("backoff-1", r"backoff_factor must be in \(0, 1\), got 1", lambda a, k: a.update(backoff_factor=1.0))
_update_case("backoff-0", r"backoff_factor must be in \(0, 1\), got 0", lambda a, k: a.update(backoff_factor=0.0))
_update_case("interval-0", "growth_interval must be an integer in \\[1, 2147483647\\], got 0", lambda a, k: a.update(growth_interval=0))
_update_case("hysteresis-0", "hysteresis must be an integer in \\[1, 2147483647\\], got 0", lambda a, k: k.update(hysteresis=0))
_update_case("hysteresis-no-tracker", r"hysteresis_tracker \(a 1-element torch.int32 tensor", lambda a, k: k.update(hysteresis=2))
_update_case("min-above-max", r"min_scale \(10\) must not be greater than max_scale \(1\)", lambda a, k: k.update(min_scale=10.0, max_scale=1.0))
_update_case("min-negative", "min_scale must be a finite number >= 0, got -1", lambda a, k: k.update(min_scale=-1.0))
_update_case("stats-3", "stats must be a contiguous 1-D tensor of 4 elements", lambda a, k: k.update(stats=torch.zeros(3, dtype=torch.int64)))
_update_case("stats-int32", "stats must be a torch.int64 tensor", lambda a, k: k.update(stats=torch.zeros(4, dtype=torch.int32)))
_update_case("scale-is-tracker-memory", "scale and growth_tracker share memory",
             lambda a, k: a.update(growth_tracker=a["scale"].view(torch.int32)))


# ---- ops: accumulate_grads_ ------------------------------------------------------------------------


def _acc_case(name, pattern, make_lists):
    @case(f"accumulate/{name}", RuntimeError, pattern)
    def make():
        accs, grads = make_lists()
        fi = scalar()
        return (lambda: ops.accumulate_grads_(accs, grads, fi)), [*accs, *grads, fi]


_acc_case("acc-fp16", r"accumulators\[0\] has dtype torch.float16; accumulators must be torch.float32", lambda: ([t(4).half()], [t(4).half()]))
_acc_case("shape", r"accumulators\[0\] has shape \[4, 3\] but grads\[0\] has shape \[3, 4\]", lambda: ([t(4, 3)], [t(3, 4)]))
_acc_case("length", "accumulators and grads must have the same length, got 2 and 1", lambda: ([t(4), t(4)], [t(4)]))
_acc_case("grad-fp64", r"grads\[0\] has dtype torch.float64", lambda: ([t(4)], [t(4, dtype=torch.float64)]))
_acc_case("acc-sparse", r"accumulators\[0\] must be a strided tensor", lambda: ([t(3, 3).to_sparse()], [t(3, 3)]))
_acc_case("acc-twice", r"accumulators\[0\] and accumulators\[1\] share memory", lambda: (lambda a: ([a, a], [t(4), t(4)]))(t(4)))
_acc_case("acc-expanded", r"accumulators\[0\] has internally overlapping memory", lambda: ([t(1).expand(4)], [t(4)]))
_acc_case("grad-is-acc", r"share memory", lambda: (lambda a: ([a], [a]))(t(4)))


# ---- ops: sgd_step_ / adam_step_ -------------------------------------------------------------------


def _optim_op_case(name, pattern, call_factory):
    @case(f"optim-op/{name}", RuntimeError, pattern)
    def make():
        p, g, s = [t(4), t(4)], [t(4), t(4)], [torch.zeros(()), torch.zeros(())]
        m = [torch.zeros(4), torch.zeros(4)]
        v = [torch.zeros(4), torch.zeros(4)]
        call, extra = call_factory(p, g, s, m, v)
        return call, [*p, *g, *s, *m, *v, *extra]


_optim_op_case("grad-shape", r"grads\[1\] has shape \[5\] but params\[1\] has shape \[4\]",
               lambda p, g, s, m, v: (lambda: ops.sgd_step_(p, [g[0], t(5)], [], [], s, lr=0.1), []))
_optim_op_case("momentum-without-buffers", "momentum_buffers must have one tensor per param when momentum != 0",
               lambda p, g, s, m, v: (lambda: ops.sgd_step_(p, g, [], [], s, lr=0.1, momentum=0.9), []))
_optim_op_case("master-for-fp32-params", r"master_params were given for torch.float32 params, which are their own masters",
               lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [x.clone() for x in m], m, v, [], s, lr=0.1), []))


def _low_precision_case(name, pattern, call_factory, pdtype=torch.bfloat16):
    """Cases with fp16/bf16 params (masters, remainders, state dtypes)."""
    @case(f"optim-op/{name}", RuntimeError, pattern)
    def make():
        p = [t(4).to(pdtype), t(4).to(pdtype)]
        g = [t(4).to(pdtype), t(4).to(pdtype)]
        s = [torch.zeros(()), torch.zeros(())]
        m = [torch.zeros(4), torch.zeros(4)]
        v = [torch.zeros(4), torch.zeros(4)]
        call, extra = call_factory(p, g, s, m, v)
        return call, [*p, *g, *s, *m, *v, *extra]


_low_precision_case("master-fp16", r"master_params\[0\] has dtype torch.float16; expected torch.float32 masters or torch.int16 remainders",
                    lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [x.half() for x in m], m, v, [], s, lr=0.1), []))
_low_precision_case("remainder-for-fp16-params", r"master_params\[0\] has dtype torch.int16; expected torch.float32 masters\.",
                    lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [torch.zeros(4, dtype=torch.int16)] * 2, m, v, [], s, lr=0.1), []),
                    pdtype=torch.float16)
_low_precision_case("mixed-master-kinds", r"master_params\[1\] has dtype torch.float32; expected torch.int16",
                    lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [torch.zeros(4, dtype=torch.int16), torch.zeros(4)], m, v, [], s, lr=0.1), []))
_low_precision_case("state-fp16", r"exp_avgs\[0\] has dtype torch.float16; optimizer state must be torch.float32, torch.bfloat16 or 8-bit \(torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2\)",
                    lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [], [x.half() for x in m], [x.half() for x in v], [], s, lr=0.1), []))
_low_precision_case("mixed-state-dtypes", r"exp_avg_sqs\[0\] has dtype torch.float32; expected torch.bfloat16",
                    lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [], [x.bfloat16() for x in m], v, [], s, lr=0.1), []))
_low_precision_case("state-is-master", r"master_params\[0\] and exp_avgs\[0\] share memory",
                    lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [m[0], t(4)], m, v, [], s, lr=0.1), []))
_low_precision_case("grad-dtype-other-half", r"grads\[0\] has dtype torch.float16 but params\[0\] has dtype torch.bfloat16",
                    lambda p, g, s, m, v: (lambda: ops.sgd_step_(p, [x.half() for x in g], [], [], s, lr=0.1), []))
_optim_op_case("momentum-tensor-without-buffers",
               "momentum_buffers must have one tensor per param when momentum != 0 or momentum_tensor is given",
               lambda p, g, s, m, v: (lambda: ops.sgd_step_(p, g, [], [], s, lr=0.1, momentum=torch.tensor(0.9)), []))
_optim_op_case("momentum-tensor-fp64", "momentum_tensor must be a torch.float32 tensor, got torch.float64",
               lambda p, g, s, m, v: (lambda: ops.sgd_step_(p, g, [], m, s, lr=0.1,
                                                            momentum=torch.tensor(0.9, dtype=torch.float64)), []))
_optim_op_case("beta1-tensor-2", "beta1_tensor must be a 1-element",
               lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [], m, v, [], s, lr=0.1, beta1=torch.zeros(2)), []))
_optim_op_case("beta1-tensor-is-state", r"exp_avgs\[0\] and beta1_tensor share memory",
               lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [], m, v, [], s, lr=0.1, beta1=m[0][:1]), []))
_optim_op_case("amsgrad-without-max", "max_exp_avg_sqs must have one tensor per param when amsgrad is set",
               lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [], m, v, [], s, lr=0.1, amsgrad=True), []))
_optim_op_case("beta2-1", r"beta2 must be in \[0, 1\), got 1",
               lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [], m, v, [], s, lr=0.1, beta2=1.0), []))
_optim_op_case("found_inf-2", "found_inf must be a 1-element tensor",
               lambda p, g, s, m, v: (lambda: ops.sgd_step_(p, g, [], [], s, lr=0.1, found_inf=torch.zeros(2)), []))
_optim_op_case("lr-negative", "lr must be >= 0, got -1",
               lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [], m, v, [], s, lr=-1.0), []))
_optim_op_case("mixed-param-dtypes", r"params\[1\] has dtype torch.float16; expected torch.float32 \(one dtype per list in a call\)",
               lambda p, g, s, m, v: (lambda: ops.sgd_step_([p[0], p[1].half()], g, [], [], s, lr=0.1), []))
_optim_op_case("steps-length", r"steps must have one tensor per param \(2\), got 1",
               lambda p, g, s, m, v: (lambda: ops.sgd_step_(p, g, [], [], s[:1], lr=0.1), []))
_optim_op_case("eps-negative", "eps must be >= 0, got -1",
               lambda p, g, s, m, v: (lambda: ops.adam_step_(p, g, [], m, v, [], s, lr=0.1, eps=-1.0), []))
_optim_op_case("nesterov-dampening", "nesterov momentum requires a momentum > 0 and zero dampening",
               lambda p, g, s, m, v: (lambda: ops.sgd_step_(p, g, [], m, s, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), []))
_optim_op_case("param-is-grad", r"params\[0\] and grads\[0\] share memory",
               lambda p, g, s, m, v: (lambda: ops.sgd_step_(p, [p[0], g[1]], [], [], s, lr=0.1), []))
_optim_op_case("expanded-param", r"params\[1\] has internally overlapping memory",
               lambda p, g, s, m, v: (lambda: ops.adam_step_([p[0], t(1).expand(4)], g, [], m, v, [], s, lr=0.1), []))


# ---- GradScaler ---------------------------------------------------------------------------------------


def _scaler_ctor_case(name, exc, pattern, args, kwargs):
    @case(f"scaler-init/{name}", exc, pattern)
    def make():
        return (lambda: ampfuse.GradScaler(*args, **kwargs)), []


_scaler_ctor_case("init_scale-first", TypeError, "first argument is the device type", (1024.0,), {})
_scaler_ctor_case("hysteresis-0", ValueError, "hysteresis must be an integer >= 1, got 0", ("cpu",), dict(hysteresis=0))
_scaler_ctor_case("min_scale-negative", ValueError, r"min_scale must be a finite number in \[0", ("cpu",), dict(min_scale=-1.0))
_scaler_ctor_case("min_scale-huge", ValueError, r"\(the float32 range\), got 1e\+39", ("cpu",), dict(min_scale=1e39))
_scaler_ctor_case("max_scale-0", ValueError, "max_scale must be a number > 0", ("cpu",), dict(max_scale=0.0))
_scaler_ctor_case("min-above-max", ValueError, r"min_scale \(2.0\) must not be greater than max_scale \(1.0\)", ("cpu",), dict(min_scale=2.0, max_scale=1.0))
_scaler_ctor_case("on_min_scale", ValueError, "on_min_scale must be 'warn', 'raise' or 'ignore', got 'loud'", ("cpu",), dict(on_min_scale="loud"))
_scaler_ctor_case("growth_factor-1", AssertionError, r"The growth factor must be > 1.0.", ("cpu",), dict(growth_factor=1.0))


def _scaler_with_grads():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = ampfuse.optim.SGD(model.parameters(), lr=0.1)
    s = ampfuse.GradScaler("cpu", init_scale=8.0)
    s.scale(model(torch.randn(3, 4)).sum()).backward()
    return model, opt, s


def _scaler_case(name, exc, pattern, prepare, call):
    @case(f"scaler/{name}", exc, pattern)
    def make():
        model, opt, s = _scaler_with_grads()
        prepare(s, opt)
        return (lambda: call(s, opt)), [s, opt, *[p.grad for p in model.parameters()]]


_scaler_case("unscale-twice", RuntimeError, r"unscale_\(\) has already been called on this optimizer since the last update\(\)",
             lambda s, o: s.unscale_(o), lambda s, o: s.unscale_(o))
_scaler_case("step-twice", RuntimeError, r"step\(\) has already been called since the last update\(\)",
             lambda s, o: s.step(o), lambda s, o: s.step(o))
_scaler_case("clip-max_norm-negative", ValueError, "max_norm must be a positive finite number, got -1",
             lambda s, o: None, lambda s, o: s.unscale_and_clip_(o, -1.0))
_scaler_case("clip-max_norm-tensor-2", ValueError, r"max_norm must be a number or a 1-element floating-point tensor, got shape \(2,\)",
             lambda s, o: None, lambda s, o: s.unscale_and_clip_(o, torch.ones(2)))
_scaler_case("clip-after-unscale", RuntimeError, r"unscale_\(\) has already been called",
             lambda s, o: s.unscale_(o), lambda s, o: s.unscale_and_clip_(o, 1.0))
_scaler_case("load-bad-stats", ValueError, "the state dict's stats must be 4 non-negative integers",
             lambda s, o: None, lambda s, o: s.load_state_dict(dict(s.state_dict(), stats=[1])))
_scaler_case("load-empty", RuntimeError, "The source state dict is empty", lambda s, o: None, lambda s, o: s.load_state_dict({}))
_scaler_case("load-missing-key", KeyError, "no 'scale' entry",
             lambda s, o: None, lambda s, o: s.load_state_dict({k: v for k, v in s.state_dict().items() if k != "scale"}))
_scaler_case("record-torch-optimizer", TypeError, r"record_inf_check\(\) needs an ampfuse optimizer",
             lambda s, o: None, lambda s, o: s.record_inf_check(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), torch.zeros(())))
_scaler_case("record-bad-flag", ValueError, "must be a 1-element float32 tensor",
             lambda s, o: None, lambda s, o: s.record_inf_check(o, torch.zeros(2)))
_scaler_case("update-new_scale-2", AssertionError, "new_scale should be a float or a 1-element",
             lambda s, o: None, lambda s, o: s.update(torch.ones(2)))


# ---- optimizers -----------------------------------------------------------------------------------------


def _opt_ctor_case(name, exc, pattern, cls, kwargs, params=None):
    @case(f"optim-init/{name}", exc, pattern)
    def make():
        ps = params() if params else [torch.zeros(3, requires_grad=True)]
        return (lambda: getattr(ampfuse.optim, cls)(ps, **kwargs)), [p for p in ps if p.device.type != "meta"]


_opt_ctor_case("sgd-lr", ValueError, "Invalid learning rate: -1", "SGD", dict(lr=-1.0))
_opt_ctor_case("sgd-nesterov", ValueError, "Nesterov momentum requires a momentum and zero dampening", "SGD", dict(lr=0.1, nesterov=True))
_opt_ctor_case("adam-beta1", ValueError, "Invalid beta parameter at index 0: 1.0", "Adam", dict(betas=(1.0, 0.999)))
_opt_ctor_case("adam-eps", ValueError, "Invalid epsilon value: -1", "Adam", dict(eps=-1.0))
_opt_ctor_case("adamw-wd", ValueError, "Invalid weight_decay value: -1", "AdamW", dict(weight_decay=-1.0))
_opt_ctor_case("state_dtype", ValueError, r"\['state_dtype'\] must be torch.float32, torch.bfloat16, torch.uint8, torch.float8_e4m3fn or "
               "torch.float8_e5m2, got torch.float16", "AdamW",
               dict(state_dtype=torch.float16))
_opt_ctor_case("master_weights", ValueError, "master_weights must be True, False, 'auto', 'remainder' or 'stochastic', got 'yes'", "AdamW", dict(master_weights="yes"))
_opt_ctor_case("rounding_seed-negative", ValueError, r"param_groups\[0\]\['rounding_seed'\] must be an integer in \[0, 2\*\*53\), got -1",
               "AdamW", dict(master_weights="stochastic", rounding_seed=-1))
_opt_ctor_case("rounding_seed-float", ValueError, r"param_groups\[0\]\['rounding_seed'\] must be an integer in \[0, 2\*\*53\), got 1.5",
               "SGD", dict(lr=0.1, master_weights="stochastic", rounding_seed=1.5))
_opt_ctor_case("int64-param", ValueError, r"param_groups\[0\]\['params'\]\[0\] has dtype torch.int64", "SGD", dict(lr=0.1),
               lambda: [torch.zeros(2, dtype=torch.int64)])
_opt_ctor_case("two-devices", ValueError, r"param_groups\[0\] has parameters on several devices", "AdamW", {},
               lambda: [torch.zeros(2, requires_grad=True), torch.zeros(2, device="meta", requires_grad=True)])
_opt_ctor_case("differentiable", ValueError, "differentiable=True is not supported", "AdamW", dict(differentiable=True))
_opt_ctor_case("foreach-str", ValueError, "foreach must be None, True or False, got 'yes'", "SGD", dict(lr=0.1, foreach="yes"))
_opt_ctor_case("betas-device-tensor", ValueError, r"betas\[0\] must be a number", "Adam", dict(betas=(torch.ones(2), torch.tensor(0.9))))


def _stepped_optimizer(dtype=torch.bfloat16):
    torch.manual_seed(0)
    params = [torch.randn(5).to(dtype).requires_grad_(), torch.randn(3, 2).to(dtype).requires_grad_()]
    opt = ampfuse.optim.AdamW(params, lr=0.01)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return params, opt


def _opt_case(name, exc, pattern, call, prepare=None):
    @case(f"optim/{name}", exc, pattern)
    def make():
        params, opt = _stepped_optimizer()
        if prepare is not None:  # the bad input itself, made before the snapshot
            prepare(params, opt)
        return (lambda: call(params, opt)), [opt, *[p.grad for p in params]]


def _sparse_grad(params, opt):
    params[0].grad = torch.zeros(5, dtype=torch.bfloat16).to_sparse()


def _changed_dtype(params, opt):
    params[0].data = params[0].data.float()
    params[0].grad = torch.zeros(5)


_opt_case("sparse-grad", RuntimeError, r"param_groups\[0\]\['params'\]\[0\] has a sparse gradient", lambda ps, o: o.step(), _sparse_grad)
_opt_case("grads-shape", RuntimeError, r"param_groups\[0\]\['params'\]\[1\] has a gradient of shape \(2, 3\)",
          lambda ps, o: o.step(grads={ps[1]: torch.zeros(2, 3)}))
_opt_case("grads-not-tensor", TypeError, r"the gradient of param_groups\[0\]\['params'\]\[0\] must be a tensor or None",
          lambda ps, o: o.step(grads={ps[0]: 1.0}))
_opt_case("dtype-changed", RuntimeError, r"has dtype torch.float32 but was torch.bfloat16 when the optimizer was built",
          lambda ps, o: o.step(), _changed_dtype)
_opt_case("group-lr-negative", ValueError, r"param_groups\[0\]\['lr'\] must be >= 0, got -1",
          lambda ps, o: o.step(), lambda ps, o: o.param_groups[0].__setitem__("lr", -1.0))
_opt_case("load-state-shape", ValueError, r"state 'exp_avg' of param_groups\[0\]\['params'\]\[0\] has shape \(3, 3\) but the parameter has shape \(5,\)",
          lambda ps, o: o.load_state_dict((lambda sd: (sd["state"][0].__setitem__("exp_avg", torch.zeros(3, 3)), sd)[1])(copy.deepcopy(o.state_dict()))))
_opt_case("load-groups", ValueError, "loaded state dict has a different number of parameter groups",
          lambda ps, o: o.load_state_dict(dict(o.state_dict(), param_groups=[])))
_opt_case("load-step-abc", ValueError, r"state 'step' of param_groups\[0\]\['params'\]\[1\] must be a number or a 1-element tensor, got 'abc'",
          lambda ps, o: o.load_state_dict((lambda sd: (sd["state"][1].__setitem__("step", "abc"), sd)[1])(copy.deepcopy(o.state_dict()))))
_opt_case("load-int-state", ValueError, r"state 'exp_avg_sq' of param_groups\[0\]\['params'\]\[0\] must be a floating-point tensor",
          lambda ps, o: o.load_state_dict((lambda sd: (sd["state"][0].__setitem__("exp_avg_sq", torch.zeros(5, dtype=torch.int64)), sd)[1])(copy.deepcopy(o.state_dict()))))


# ---- GradAccumulator ---------------------------------------------------------------------------------------


def _acc_ctor_case(name, exc, pattern, **kwargs):
    @case(f"accumulator-init/{name}", exc, pattern)
    def make():
        model = nn.Linear(3, 2)
        opt = ampfuse.optim.SGD(model.parameters(), lr=0.1)
        args = dict(model=model, optimizer=opt, scaler=None, steps=2)
        args.update(kwargs)
        return (lambda: ampfuse.GradAccumulator(**args)), [opt]


_acc_ctor_case("steps-0", ValueError, "steps must be an integer >= 1, got 0", steps=0)
_acc_ctor_case("max_grad_norm", ValueError, "max_grad_norm must be a positive finite number or None, got -1", max_grad_norm=-1.0)
_acc_ctor_case("norm_type", ValueError, "norm_type must be a positive number or inf, got 0", norm_type=0.0)
_acc_ctor_case("model", TypeError, "model must be a torch.nn.Module, got str", model="model")
_acc_ctor_case("scaler", TypeError, "scaler must be a torch.amp.GradScaler", scaler=object())
_acc_ctor_case("scheduler", TypeError, "lr_scheduler must have a step", lr_scheduler=3)


def _accumulator_mid_window():
    torch.manual_seed(0)
    model = nn.Linear(4, 2).bfloat16()
    opt = ampfuse.optim.SGD(model.parameters(), lr=0.1)
    acc = ampfuse.GradAccumulator(model, opt, ampfuse.GradScaler("cpu"), steps=3)
    with acc.accumulate():
        acc.backward(model(torch.randn(2, 4).bfloat16()).float().sum())
    return model, acc


def _accumulator_case(name, exc, pattern, call):
    @case(f"accumulator/{name}", exc, pattern)
    def make():
        model, acc = _accumulator_mid_window()
        return (lambda: call(model, acc)), [acc, acc.optimizer, acc.scaler]


def _nested(model, acc):
    with acc.accumulate():
        with acc.accumulate():
            pass


def _no_backward(model, acc):
    with acc.accumulate():
        pass


def _sparse_in_window(model, acc):
    with acc.accumulate():
        acc.backward(model(torch.randn(2, 4).bfloat16()).float().sum() * 0)
        model.weight.grad = torch.zeros(2, 4, dtype=torch.bfloat16).to_sparse()


_accumulator_case("backward-outside", RuntimeError, r"must be called inside acc.accumulate\(\)",
                  lambda m, a: a.backward(m(torch.randn(2, 4).bfloat16()).float().sum()))
_accumulator_case("nested", RuntimeError, r"contexts cannot be nested", _nested)
_accumulator_case("no-backward", RuntimeError, r"call acc.backward\(loss\) inside the context", _no_backward)
def _loss_not_tensor(model, acc):
    with acc.accumulate():
        acc.backward(1.0)


_accumulator_case("loss-not-tensor", TypeError, "loss must be a tensor, got float", _loss_not_tensor)
_accumulator_case("sparse-grad", RuntimeError, "GradAccumulator does not support sparse gradients", _sparse_in_window)
_accumulator_case("load-steps", ValueError, "state_dict was saved with steps=5, this accumulator has steps=3",
                  lambda m, a: a.load_state_dict(dict(a.state_dict(), steps=5)))
_accumulator_case("load-buffer", ValueError, r"buffers\['(cpu|cuemu:0|cuda:0)'\] entry must be a float32 tensor of shape \[10\]",
                  lambda m, a: a.load_state_dict(dict(a.state_dict(), buffers={str(m.weight.device): torch.zeros(3)})))
_accumulator_case("load-micro_step", ValueError, r"micro_step must be an integer in \[0, 3\), got 7",
                  lambda m, a: a.load_state_dict(dict(a.state_dict(), micro_step=7)))
_accumulator_case("load-scaler", ValueError, "the state dict's hysteresis must be an integer in \\[1, 2147483647\\], got 0",
                  lambda m, a: a.load_state_dict(dict(a.state_dict(), scaler=dict(a.scaler.state_dict(), hysteresis=0))))


# ------------------------------------------------------------------------------------------------------------------


def test_at_least_sixty_cases():
    assert len(CASES) >= 60, len(CASES)


def check_refused(make, exc, pattern, device: str = "cpu") -> None:
    """Build the case's objects on `device` (torch's default device while it runs), call, and check
    the error and that nothing changed."""
    with torch.device(device):
        call, watched = make()
        before = [snapshot(x) for x in watched]
        with pytest.raises(exc, match=pattern):
            call()
        after = [snapshot(x) for x in watched]
    for i, (a, b) in enumerate(zip(before, after)):
        assert same(a, b), f"argument {i} ({type(watched[i]).__name__}) changed"


def unsupported(case_id: str, device: str) -> str | None:
    """Why a case cannot be built on `device`, or None."""
    if device == "cuemu" and "sparse" in case_id:
        return "sparse tensors on the emulated device would need torch's sparse kernels for its key"
    return None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make, exc, pattern", CASES)
def test_bad_input(make, exc, pattern, device, request):
    why = unsupported(request.node.callspec.id, device)
    if why:
        pytest.skip(why)
    check_refused(make, exc, pattern, device)
