"""Fused optimizers with fp32 master weights: ``ampfuse.optim.SGD``, ``Adam``, ``AdamW``.

``torch.optim.Optimizer`` subclasses with torch's argument names, defaults and numerics, plus
``master_weights`` (fp32 masters, or for bf16 params exact int16 remainders) and ``state_dtype``
(fp32 or bf16 state). One kernel pass per (group, device, dtype) reads each still-scaled gradient
once, divides by the scale and applies the clip coefficient in registers, and either changes
nothing at all (the scaler's ``found_inf`` is set: decided on the device, no host sync) or updates
the master and the state and writes the 16-bit param. ``state_dict()`` is torch's layout plus
``master_param``, so checkpoints move between these and ``torch.optim`` in both directions. The
whole contract (memory per parameter, edits between steps, the step plan, checkpoints):
the manual's Optimizers page (``docs/optimizers.md``).
"""

from __future__ import annotations

import collections
import math
import numbers
import operator
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from copy import deepcopy
from typing import Any, Callable, Literal, NamedTuple, Union

import torch
import torch.utils.weak
from torch.optim.optimizer import ParamsT

from ampfuse import ops
from ampfuse._checks import check_grads_keys
from ampfuse._library import dtensor_support
from ampfuse.ops import join_master, split_master

__all__ = ["SGD", "Adam", "AdamW", "FusedOptimizer", "SourcedGrads", "StepScaling", "join_master", "split_master"]

MasterWeights = Union[bool, Literal["auto", "remainder", "stochastic"]]
_MASTER_WEIGHTS = (True, False, "auto", "remainder", "stochastic")
_MASTER_WEIGHTS_CHOICES = "True, False, 'auto', 'remainder' or 'stochastic'"
_PRECISION_OPTIONS = ("master_weights", "state_dtype", "exp_avg_sq_dtype")
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


class StepScaling(NamedTuple):
    """What a loss scaler hands to a fused step: optional 1-element fp32 tensors (any device;
    moved to the params' device without a sync).

    Attributes:
        grad_scale: the gradients are divided by it (they are still scaled by the loss scale).
        found_inf: non-zero means this step changes nothing at all.
        clip_coef: the gradients are multiplied by it (``GradScaler.unscale_and_clip_``).
    """

    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    clip_coef: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------
# optimizer state that tells the optimizer when it changes
# ------------------------------------------------------------------------------------------------


class _ParamState(dict):
    """A param's state dict; every change bumps its optimizer's state generation, so that the
    cached step plan (which holds the state tensors) is rebuilt."""

    __slots__ = ("_owner",)

    def __init__(self, owner: _State, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner = owner

    def _changed(self) -> None:
        self._owner.generation += 1

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self._changed()

    def clear(self) -> None:
        super().clear()
        self._changed()

    def pop(self, *args: Any) -> Any:
        value = super().pop(*args)
        self._changed()
        return value

    def popitem(self) -> Any:
        item = super().popitem()
        self._changed()
        return item

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self._changed()

    def __reduce__(self) -> Any:  # pickles (and deep-copies) as a plain dict
        return (dict, (dict(self),))


class _State(collections.defaultdict):
    """``optimizer.state``: torch's ``defaultdict(dict)`` keyed by param, whose changes (and those
    of its per-param dicts, which it keeps as :class:`_ParamState`) are counted in ``generation``.
    ``state[p] = d`` stores a tracked copy of ``d``."""

    def __init__(self, data: Mapping | None = None) -> None:
        super().__init__(None)
        self.generation = 0
        for key, value in (data or {}).items():
            super().__setitem__(key, _ParamState(self, value) if isinstance(value, Mapping) else value)

    def __missing__(self, key: Any) -> _ParamState:
        value = _ParamState(self)
        super().__setitem__(key, value)
        self.generation += 1
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        # Per-param dicts are tracked; anything else (torch allows e.g. ``state["flag"] = True``
        # under a key that is not a param, from a hook) is kept as it is.
        if isinstance(value, Mapping) and not (isinstance(value, _ParamState) and value._owner is self):
            value = _ParamState(self, value)
        super().__setitem__(key, value)
        self.generation += 1

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self.generation += 1

    def clear(self) -> None:
        super().clear()
        self.generation += 1

    def pop(self, *args: Any) -> Any:
        value = super().pop(*args)
        self.generation += 1
        return value

    def popitem(self) -> Any:
        item = super().popitem()
        self.generation += 1
        return item

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = {} if default is None else default
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __reduce__(self) -> Any:  # pickles as torch's defaultdict(dict) of plain dicts
        return (_plain_state, ({k: dict(v) if isinstance(v, Mapping) else v for k, v in self.items()},))


def _plain_state(data: dict) -> collections.defaultdict:
    out: collections.defaultdict = collections.defaultdict(dict)
    out.update(data)
    return out


def _scalar_on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.reshape(())
    if t.device != device or t.dtype != torch.float32:
        t = t.to(device=device, dtype=torch.float32, non_blocking=True)
    return t


class _Plan:
    """The bucket lists of one param group, valid while the group's params, the optimizer state,
    the group's structural options and which params have a gradient of which dtype stay the same
    (checked at every step: O(1) for the state, one pass over the params for the rest)."""

    __slots__ = ("params", "ids", "generation", "signature", "grad_dtypes", "param_dtypes", "buckets")

    def __init__(self, params, ids, generation, signature, grad_dtypes, param_dtypes, buckets) -> None:
        self.params = params
        self.ids = ids
        self.generation = generation
        self.signature = signature
        self.grad_dtypes = grad_dtypes  # per param: its gradient's dtype, None without one
        self.param_dtypes = param_dtypes  # per param: its dtype (a converted model makes the plan stale)
        self.buckets = buckets  # [(device, [index in group], {list name: [tensors]})]


class _NativePlan:
    """The optimizer's persistent native step plan (``torch.classes.ampfuse.StepPlan``, see
    csrc/engine/step_plan.h) and what it was built for: the state object and its generation, and per
    param group its params list, their ids and the group's structural options. Those are the
    owner's to check (O(groups) plus one C-level pass over the ids); the plan checks the rest
    (gradients, param data) natively at every call."""

    __slots__ = ("plan", "state", "generation", "groups", "devices", "fp16_grads", "hyper", "source")

    def __init__(self, plan, state, generation, groups, devices, fp16_grads, source=None) -> None:
        self.plan = plan
        self.source = source  # the AccumulatePlan whose sums it reads (SourcedGrads), or None
        self.state = state
        self.generation = generation
        self.groups = groups  # [(params list, a copy of its entries, signature)]
        self.devices = devices  # how many devices its buckets are on
        self.fp16_grads = fp16_grads  # whether it reads fp16 gradients
        # Per group the _hyper_snapshot of the hyper-parameters the plan holds, when every group's
        # values are immutable (else None: they are set again at every step)
        self.hyper: list[tuple[tuple, tuple]] | None = None


class SourcedGrads(Mapping):
    """A ``grads=`` mapping ``{param: gradient or None}`` whose gradients a native
    ``torch.classes.ampfuse.AccumulatePlan`` holds (``GradAccumulator``'s fp32 sums; the
    accumulator's hand-off to the optimizer): the step's plan (and :meth:`FusedOptimizer.scaler_check`)
    read them from ``source`` natively, and the mapping itself is built (by ``build``) only when
    something goes the validated way."""

    __slots__ = ("source", "_build", "_dict")

    def __init__(self, source: Any, build: Callable[[], dict]) -> None:
        self.source = source
        self._build = build
        self._dict: dict | None = None

    def _mapping(self) -> dict:
        if self._dict is None:
            self._dict = self._build()
        return self._dict

    def __getitem__(self, key: Any) -> Any:
        return self._mapping()[key]

    def __iter__(self) -> Iterator:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())

    def __contains__(self, key: Any) -> bool:
        return key in self._mapping()


def _grads_source(grads: Any) -> Any:
    """The native source of ``grads`` (a :class:`SourcedGrads`), else None."""
    return grads.source if type(grads) is SourcedGrads else None


# Values that cannot change without being replaced in the group dict (identity tells a change).
_IMMUTABLE_HYPER = (float, int, bool, str, type(None), torch.dtype)


def _hyper_snapshot(group: dict[str, Any]) -> tuple[tuple, tuple]:
    """A group's keys and values, for an identity comparison with the next step's (C-level)."""
    return tuple(group), tuple(group.values())


def _immutable_hyper(group: dict[str, Any]) -> bool:
    """Whether no value of the group (params and the device values aside: the owner checks the
    params list, and the plan reads the lr and momentum / beta1 tensors' values at every step)
    can change in place."""
    for k, v in group.items():
        t = type(v)
        if t in _IMMUTABLE_HYPER or k == "params" or (k in ("lr", "momentum") and isinstance(v, torch.Tensor)):
            continue
        if t is not tuple or not all(type(x) in _IMMUTABLE_HYPER or (k == "betas" and i == 0 and isinstance(x, torch.Tensor))
                                     for i, x in enumerate(v)):
            return False
    return True


def _same_snapshots(a: list[tuple[tuple, tuple]], b: list[tuple[tuple, tuple]]) -> bool:
    return len(a) == len(b) and all(
        len(ka) == len(kb) and len(va) == len(vb) and all(map(operator.is_, ka, kb)) and all(map(operator.is_, va, vb))
        for (ka, va), (kb, vb) in zip(a, b)
    )


class FusedOptimizer(torch.optim.Optimizer):
    """The base of ampfuse's optimizers: torch's optimizer interface, fused steps with the
    master, state and precision options, and the hand-off with a loss scaler. A scaler gives a
    step its scale and found_inf (``step(scaling=StepScaling(...))``, or torch's ``grad_scale`` /
    ``found_inf`` attributes) and may make its gradient check through :meth:`scaler_check`; it
    reads nothing else of the optimizer."""

    _step_supports_amp_scaling = True
    state: _State  # torch's per-param state, with its change counter

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        mw = defaults.get("master_weights")
        if not any(mw is v or (isinstance(v, str) and mw == v) for v in _MASTER_WEIGHTS):
            raise ValueError(f"master_weights must be {_MASTER_WEIGHTS_CHOICES}, got {mw!r}.")
        self._param_dtypes: dict[int, torch.dtype] = {}
        self._plans: dict[int, _Plan] = {}
        self._native: _NativePlan | None = None
        if not self._kind_name:
            raise TypeError(f"{type(self).__name__}: ampfuse's optimizers are SGD, Adam and AdamW (subclass one of "
                            "them); FusedOptimizer is their base, stepped by an engine kind they name.")
        self._kind = _kind(self._kind_name)
        # every step the validated way when AMPFUSE_STEP_PLAN=0 (debugging, A/B)
        self._native_kind = self._kind_name if os.environ.get("AMPFUSE_STEP_PLAN", "1") != "0" else ""
        # params whose loaded fp32 master the next step reconciles with the param (ties)
        self._reconcile: set[int] = set()
        self._last_found_inf: torch.Tensor | None = None
        # who keeps each param's master, and the restart of a replaced param's (csrc/engine/master_keeper.h)
        self._keeper = torch.classes.ampfuse.MasterKeeper(type(self).__name__)
        super().__init__(params, defaults)
        self.state = _State(self.state)

    @staticmethod
    def _check_torch_kwargs(foreach: bool | None, fused: bool | None, capturable: bool, differentiable: bool) -> None:
        """torch's implementation switches. The step is always one fused pass with no host sync
        (so it is capturable whatever ``capturable`` says) and its numerics follow torch's
        for-loop implementation, so ``foreach``/``fused``/``capturable`` are accepted and change
        nothing; ``differentiable=True`` cannot be honoured."""
        for name, value in (("foreach", foreach), ("fused", fused)):
            if value not in (None, True, False):
                raise ValueError(f"{name} must be None, True or False, got {value!r}.")
        if capturable not in (True, False):
            raise ValueError(f"capturable must be True or False, got {capturable!r}.")
        if differentiable:
            raise ValueError(
                "differentiable=True is not supported: ampfuse's fused step runs outside autograd. "
                "Use the torch.optim optimizer for differentiable steps."
            )

    def __getstate__(self) -> dict[str, Any]:
        # The dtypes the params had when the optimizer was built, by position: a copy (deepcopy,
        # pickle) has new params, and keeps the check against converting the model afterwards.
        state = super().__getstate__()
        state = dict(state)
        state.pop("_native", None)  # native objects: rebuilt by the first step
        state.pop("_keeper", None)
        state["_param_dtypes_by_position"] = [
            [self._param_dtypes.get(id(p)) for p in g["params"]] for g in self.param_groups
        ]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        by_position = state.pop("_param_dtypes_by_position", None)
        super().__setstate__(state)
        self._param_dtypes = {}
        if by_position is not None:
            for g, dtypes in zip(self.param_groups, by_position):
                for p, dtype in zip(g["params"], dtypes):
                    if dtype is not None:
                        self._param_dtypes[id(p)] = dtype
        self._plans = {}
        self._native = None
        self._kind = _kind(self._kind_name)
        self._native_kind = self._kind_name if os.environ.get("AMPFUSE_STEP_PLAN", "1") != "0" else ""
        self._reconcile = set()
        self._last_found_inf = None
        self._keeper = torch.classes.ampfuse.MasterKeeper(type(self).__name__)
        self.state = _State(self.state)

    # ---- parameters --------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_plans"):
            self._plans.clear()
            self._native = None
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        try:
            self._check_group_options(gi, group, hyper=False)
        except ValueError:
            self.param_groups.pop()
            raise
        devices = {p.device for p in group["params"]}
        for i, p in enumerate(group["params"]):
            if p.dtype not in _SUPPORTED:
                self.param_groups.pop()
                raise ValueError(
                    f"param_groups[{gi}]['params'][{i}] has dtype {p.dtype}; ampfuse optimizers support "
                    "torch.float16, torch.bfloat16 and torch.float32 parameters."
                )
        if len(devices) > 1:
            self.param_groups.pop()
            raise ValueError(
                f"param_groups[{gi}] has parameters on several devices ({', '.join(sorted(map(str, devices)))}); "
                "ampfuse optimizers need the parameters of one group on one device."
            )
        for p in group["params"]:
            self._param_dtypes[id(p)] = p.dtype

    def _check_group_options(self, gi: int, group: dict[str, Any], hyper: bool = True) -> None:
        """The options of group ``gi`` as the user may have edited them since construction: every
        value the kernel would refuse is refused here, before any group steps (``hyper=False``:
        only the master form and the state dtype, as a new group is checked). The master form's
        values are this surface's own; the rest is the engine's ``group_hyper_check``."""
        mw = group.get("master_weights")
        if not any(mw is v or (isinstance(v, str) and mw == v) for v in _MASTER_WEIGHTS):
            raise ValueError(f"param_groups[{gi}]['master_weights'] must be {_MASTER_WEIGHTS_CHOICES}, got {mw!r}.")
        values = self._hyper_values(group) if hyper else {}
        values["state_dtype"] = repr(group.get("state_dtype", torch.float32))
        values["rounding_seed"] = group.get("rounding_seed", 0)
        if "exp_avg_sq_dtype" in group:
            sq = group["exp_avg_sq_dtype"]
            values["exp_avg_sq_dtype"] = None if sq is None else repr(sq)
        _group_hyper_check(self._engine_name, values, f"param_groups[{gi}]")

    @staticmethod
    def _master_kind(p: torch.Tensor, group: dict[str, Any]) -> str | None:
        """How ``p``'s fp32 master is kept: None (``p`` is updated directly), ``"float"`` (an fp32
        tensor, ``state["master_param"]``) or ``"remainder"`` (bf16 params: an int16 tensor,
        ``state["master_remainder"]``, that with ``p`` is the fp32 master bit for bit). bf16
        params under ``"stochastic"`` keep none: the step rounds into them stochastically."""
        mw = group["master_weights"]
        if mw is False or p.dtype not in _LOW_PRECISION or (mw == "stochastic" and p.dtype == torch.bfloat16):
            return None
        if mw == "remainder" and p.dtype == torch.bfloat16:
            return "remainder"
        return "float"  # True, "auto"; "remainder"/"stochastic" for fp16 params (see the module docstring)

    @staticmethod
    def _grad(p: torch.Tensor, grads: Mapping | None) -> torch.Tensor | None:
        if grads is not None and p in grads:
            return grads[p]
        return p.grad

    def _validate(self, grads: Mapping | None) -> None:
        """Every check of a step, before anything (state creation included) is modified: what
        the kernels would refuse is refused here, for every group, before the first one steps
        (the gradients' rules: ``step_grads_check``, the engine's)."""
        params: list[torch.Tensor] = []
        gs: list[torch.Tensor | None] = []
        groups: list[int] = []
        indices: list[int] = []
        state, owner, keys = [], [], []
        _check_groups_eagerly(self)
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                g = self._grad(p, grads)
                if g is None:
                    continue
                if not isinstance(g, torch.Tensor):
                    raise TypeError(f"the gradient of param_groups[{gi}]['params'][{i}] must be a tensor or None, got {type(g).__name__}.")
                expected = self._param_dtypes.get(id(p))
                if expected is not None and p.dtype != expected:
                    raise RuntimeError(
                        f"param_groups[{gi}]['params'][{i}] has dtype {p.dtype} but was {expected} when the optimizer was built; "
                        "build the optimizer after converting the model (e.g. after model.half())."
                    )
                st = self.state.get(p)
                for key, t in (st.items() if isinstance(st, Mapping) else ()):
                    if isinstance(t, torch.Tensor):
                        state.append(_local(t))
                        owner.append(len(params))
                        keys.append(str(key))
                params.append(_local(p))
                gs.append(_local(g))
                groups.append(gi)
                indices.append(i)
        if params:
            torch.ops.ampfuse.step_grads_check(params, gs, state, owner, keys, groups, indices,
                                               "param_groups[{g}]['params'][{i}]")

    def _claim_masters(self, grads: Mapping | None) -> None:
        """This optimizer keeps the masters of the params it steps with one (the engine's master
        keeper, csrc/engine/master_keeper.h): a param another ampfuse optimizer took over with
        its own master since this one last stepped it is refused, before anything is modified
        (``sync_masters_from_params`` takes the params back)."""
        stepping, groups, indices, kept = [], [], [], []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if self._master_kind(p, group) is None:
                    continue
                if self._grad(p, grads) is not None:
                    stepping.append(p)
                    groups.append(gi)
                    indices.append(i)
                    continue
                st = self.state.get(p)
                if isinstance(st, Mapping) and (st.get("master_param") is not None or st.get("master_remainder") is not None):
                    kept.append(p)
        self._keeper.claim(stepping, groups, indices, "param_groups[{g}]['params'][{i}]", kept)

    _engine_name = ""  # the optimizer's name for the engine's checks: "SGD", "Adam", "AdamW"
    _kind_name = ""  # its kind descriptor's name (csrc/engine/optimizer_kind.h): "sgd", "adam"

    def _hyper_values(self, group: dict[str, Any]) -> dict[str, Any]:
        """The group's hyper-parameter options as the engine's check takes them, by option name."""
        values: dict[str, Any] = {}
        for h in self._kind.hyper:
            if h.option and h.option not in values:
                v = _option_value(group, h)
                values[h.option] = bool(v) if h.type == "flag" else _hyper_value(v)
        return values

    def check_grads(self, grads: Any) -> None:
        """A ``grads=`` argument (of :meth:`step`, or a scaler's methods for this optimizer): None,
        or a mapping whose keys are this optimizer's params themselves. Raises TypeError or
        ValueError naming what is wrong."""
        if grads is None:
            return
        if not isinstance(grads, Mapping):
            raise TypeError(f"grads must be a mapping from parameters to gradients (or None), got {type(grads).__name__}.")
        check_grads_keys(self.param_groups, grads)

    # ---- state -------------------------------------------------------------------------------
    _restart_on_create = False  # a state tensor created for a param resets its step counter

    def _bring_state(self, group: dict[str, Any], params: list[torch.Tensor], create: list[bool]) -> None:
        """The state of ``params`` brought to the group's precision options by the native
        ``optimizer_state_`` (the state model both surfaces use): created where ``create`` (one
        kind of tensor at a time over the params, so each kind lies in one run of memory in the
        step's order), else only the tensors a param has converted; masters converted exactly
        (ties included), ``master_weights=False`` drops them."""
        todo = [(p, c) for p, c in zip(params, create) if c or (isinstance(self.state.get(p), Mapping) and self.state[p])]
        if not todo:
            return
        keys = self._state_keys_for(group)
        names = _slot_names(keys)
        slots: list[torch.Tensor | None] = []
        for p, _ in todo:
            st = self.state[p]
            step = st.get("step")
            slots.append(step if step is None or isinstance(step, torch.Tensor) else torch.as_tensor(step, dtype=torch.float32))
            slots += [st.get(key) for key in names[1:]]
        reconcile = [id(p) in self._reconcile for p, _ in todo]
        self._reconcile.difference_update(id(p) for p, _ in todo)
        mw = group["master_weights"]
        dtensor_support()
        out = torch.ops.ampfuse.optimizer_state_(
            [p.detach() for p, _ in todo], slots, list(keys), list(self._state_dtypes_for(group, keys)),
            "true" if mw is True else "false" if mw is False else mw, [c for _, c in todo], reconcile,
            self._restart_on_create)
        for j, (p, _) in enumerate(todo):
            _put_slots(self.state[p], names, out[j * len(names):(j + 1) * len(names)])

    def _state_keys_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The group's state keys: the kind's, each whose option (its gate) is on."""
        kind = self._kind
        return tuple(key for key, gate in zip(kind.states, kind.gates) if not gate or _is_on(group[gate]))

    def _state_dtypes_for(self, group: dict[str, Any], keys: Sequence[str]) -> tuple[torch.dtype, ...]:
        """The dtype the group asks for each of its state tensors ``keys`` (the engine keeps
        small params' 8-bit state in fp32): its dtype option's, or ``state_dtype`` when None."""
        kind = self._kind
        first = group.get("state_dtype", torch.float32)
        options = (kind.dtype_options[kind.states.index(key)] for key in keys)
        return tuple(first if group.get(o) is None else group[o] for o in options)

    def sync_masters_from_params(self) -> None:
        """Restart every fp32 master from its param now.

        The step does this by itself for a param edited since the last step (it sees that the
        param no longer holds its master rounded); call this to have the masters (and a
        ``state_dict()`` taken now) follow such edits before the next step. It also takes back
        params another ampfuse optimizer took over with its own master (see the README,
        "A master belongs to one optimizer").
        """
        params, masters = [], []  # each param with a master, and its fp32 master or remainder
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                for key in ("master_param", "master_remainder"):
                    master = st.get(key) if isinstance(st, Mapping) else None
                    if isinstance(master, torch.Tensor):
                        params.append(_local(p))
                        masters.append(_local(master))
        with torch.no_grad():
            self._keeper.sync_from_params(params, masters)

    # ---- step --------------------------------------------------------------------------------
    def _signature(self, group: dict[str, Any]) -> tuple:
        return (self._state_keys_for(group), group["master_weights"], group.get("state_dtype", torch.float32),
                group.get("exp_avg_sq_dtype"))

    def _build_plan(self, group: dict[str, Any], ids: tuple, grad_dtypes: tuple) -> _Plan:
        buckets: dict[tuple, tuple[list[int], dict[str, list]]] = {}
        keys = self._state_keys_for(group)
        self._bring_state(group, group["params"], [g is not None for g in grad_dtypes])
        for i, p in enumerate(group["params"]):
            if grad_dtypes[i] is None:
                continue
            state = self.state[p]
            kind = "float" if "master_param" in state else "remainder" if "master_remainder" in state else None
            form = tuple(state[key].dtype for key in keys)  # a small param's 8-bit state is fp32
            idx, lists = buckets.setdefault((p.device, p.dtype, grad_dtypes[i], kind, form),
                                            ([], collections.defaultdict(list)))
            idx.append(i)
            lists["params"].append(p)
            lists["steps"].append(state["step"])
            if kind is not None:
                lists["masters"].append(state["master_param" if kind == "float" else "master_remainder"])
            for key in keys:
                lists[key].append(state[key])
                if key + "_absmax" in state:
                    lists[key + "_absmax"].append(state[key + "_absmax"])
        plan_buckets = [(key[0], idx, dict(lists)) for key, (idx, lists) in buckets.items()]
        return _Plan(group["params"], ids, self.state.generation, self._signature(group), grad_dtypes,
                     tuple(p.dtype for p in group["params"]), plan_buckets)

    def _run(self, group: dict[str, Any], lists: dict[str, list], grads: list, s: dict[str, Any]) -> None:
        """One bucket's step op (``ops.<kind>_step_``), its arguments named by the kind."""
        kind = self._kind
        params = lists["params"]
        hyper: dict[str, Any] = {}
        for h in kind.hyper:
            if h.option and h.name != "lr":
                v = _option_of(group, h)
                hyper[h.name] = _device_value(v, params) if h.device else bool(v) if h.type == "flag" else v
        for key, arg in zip(kind.states, kind.absmax):
            hyper[arg] = lists.get(key + "_absmax", ())
        states = [lists.get(key, []) for key in kind.states]
        getattr(ops, kind.name + "_step_")(
            params, grads, lists.get("masters", []), *states, lists["steps"],
            lr=s["lr"], grad_scale=s["grad_scale"], found_inf=s["found_inf"], clip_coef=s["clip_coef"],
            rounding_seed=_rounding_seed(group), **hyper,
        )

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], float] | None = None,
        *,
        scaling: StepScaling | None = None,
        grads: Mapping[torch.Tensor, torch.Tensor | None] | None = None,
    ) -> float | None:
        """One optimization step (see the module docstring for what is fused).

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).
            scaling: the loss scaler's hand-off (:class:`StepScaling`). Without it, the
                ``grad_scale``/``found_inf`` attributes ``torch.amp.GradScaler`` sets are used.
            grads: gradients to read instead of ``param.grad`` for the params it holds (``None``
                values: those params are not stepped), e.g. ``GradAccumulator``'s fp32 sums.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if scaling is None:
            scaling = StepScaling(_attribute_scalar(getattr(self, "grad_scale", None)),
                                  _attribute_scalar(getattr(self, "found_inf", None)), None)
        _check_scaling(scaling)
        source = _grads_source(grads)
        if source is None:
            self.check_grads(grads)
        if not isinstance(self.state, _State):  # replaced from outside (e.g. opt.state = ...)
            self.state = _State(self.state)
            self._plans.clear()
            self._native = None
        native = self._live_native(source) if grads is None or source is not None else None
        if native is not None:
            self._set_native_hyper(native)
            if native.plan.step(scaling.grad_scale, scaling.found_inf, scaling.clip_coef) == 0:
                self._last_found_inf = scaling.found_inf
                return loss
            # stale (a gradient or param changed in a way the plan was not built for): nothing
            # was changed; the validated way below names what is wrong, and rebuilds the plan.
            self._native = None
        if source is not None:
            self.check_grads(grads)
        work: list[Any] = []  # (gi, group, grads, grad dtypes, ids, plan); every plan built before use
        stale = False
        compiling = torch.compiler.is_compiling()  # a traced step: the ops check aliasing (no data_ptr)
        strided = torch.strided
        for gi, group in enumerate(self.param_groups):
            params = group["params"]
            grad_list = [self._grad(p, grads) for p in params] if grads is not None else [p.grad for p in params]
            try:
                # dtype per gradient; a sparse one (or a non-tensor) makes the plan stale, and
                # _validate names it
                grad_dtypes = tuple(None if g is None else g.dtype if g.layout is strided else "sparse" for g in grad_list)
            except AttributeError:  # not a tensor: _validate names it
                self._validate(grads)
                raise
            ids = tuple(map(id, params))
            plan = self._plans.get(gi)
            if (plan is None or plan.params is not params or plan.ids != ids or plan.generation != self.state.generation
                    or plan.grad_dtypes != grad_dtypes or plan.signature != self._signature(group)
                    or plan.param_dtypes != tuple(p.dtype for p in params)):
                plan = None
                stale = True
            elif any(g is not None and (g.shape != p.shape or (not compiling and g.data_ptr() == p.data_ptr()
                                                                and p.numel() != 0))
                     for p, g in zip(params, grad_list)):
                stale = True  # _validate names the gradient the kernel would refuse
            work.append((gi, group, grad_list, grad_dtypes, ids, plan))
        if stale:
            self._validate(grads)  # before anything (state creation included) is modified
            if not compiling:
                self._claim_masters(grads)
            for k, (gi, group, grad_list, grad_dtypes, ids, plan) in enumerate(work):
                if plan is None:
                    self._plans[gi] = plan = self._build_plan(group, ids, grad_dtypes)
                    work[k] = (gi, group, grad_list, grad_dtypes, ids, plan)
            generation = self.state.generation  # state creation is part of the plans
            for *_, plan in work:
                plan.generation = generation
        elif not compiling:
            # (a compiled step's values are the ones its graph was traced for, which the eager
            # step checked; a changed value retraces it, and the step op refuses a bad one)
            _check_groups_eagerly(self)
            if self._keeper.needs_claim():
                self._claim_masters(grads)
        if not compiling:  # a param replaced since its master was last seen restarts the master
            for *_, plan in work:
                for _, _, lists in plan.buckets:
                    if lists.get("masters"):
                        self._keeper.restart_replaced(lists["params"], lists["masters"])
        for gi, group, grad_list, _, _, plan in work:
            for device, idx, lists in plan.buckets:
                s: dict[str, torch.Tensor | float | None] = {
                    "grad_scale": _scalar_on(scaling.grad_scale, device),
                    "found_inf": _scalar_on(scaling.found_inf, device),
                    "clip_coef": _scalar_on(scaling.clip_coef, device),
                }
                lr = group["lr"]
                s["lr"] = _scalar_on(lr, device) if isinstance(lr, torch.Tensor) else float(lr)
                self._run(group, lists, [grad_list[i] for i in idx], s)
        self._last_found_inf = scaling.found_inf
        if ((grads is None or source is not None) and not torch.compiler.is_compiling()
                and (stale or self._native is None or self._native.source is not source)):
            self._native = self._build_native(source)
        return loss

    def scaler_check(
        self,
        scale: torch.Tensor,
        *,
        write: bool = False,
        norm_type: float | None = None,
        max_norm: float | None = None,
        grads: Mapping[torch.Tensor, torch.Tensor | None] | None = None,
        allow_fp16: bool = True,
    ) -> list[torch.Tensor] | None:
        """A loss scaler's pass over the gradients the next :meth:`step` reads, made by the step's
        plan in one native call per device: each gradient divided by ``scale`` (in place when
        ``write``, else read only) and checked for inf/NaN, and with ``norm_type`` (2 or inf)
        their total norm and, given ``max_norm`` and one device, the clip coefficient.

        Returns per device ``[found_inf]``, or ``[found_inf, total_norm, clip_coef]`` with a norm
        (``clip_coef`` only on one device), the tensors on that device. Returns None, having
        done nothing, when the plan cannot make the pass: before the first step, after a change
        the next step must validate, under ``torch.compile`` or a dispatch mode, for a ``grads``
        mapping other than a ``GradAccumulator``'s sums, or with fp16 gradients when not
        ``allow_fp16``. The caller then makes the same pass with the ops.
        """
        source = _grads_source(grads)
        if grads is not None and source is None:
            return None
        native = self._live_native(source)
        if native is None or (native.fp16_grads and not allow_fp16):
            return None
        with_norm = norm_type is not None
        out = native.plan.check(scale, write, with_norm, 2.0 if norm_type is None else float(norm_type),
                                max_norm if native.devices <= 1 else None)
        return list(out) or None

    @property
    def last_step_skipped(self) -> torch.Tensor | None:
        """The ``found_inf`` flag the last :meth:`step` was given: a 1-element device tensor,
        non-zero when that step changed nothing (inf/NaN gradients); reading it is the caller's
        host sync, if any. ``None`` before the first step and after a step given no flag. With
        several optimizers under one scaler, each reports its own step."""
        return self._last_found_inf

    # ---- the native step plan ------------------------------------------------------------------
    _native_kind = ""  # the StepPlan kind (empty: no native plan)

    def _build_native(self, source: Any = None) -> _NativePlan | None:
        """The native plan of the current Python plans (all valid: a step just ran through them),
        reading the gradients ``source`` holds from it (see :class:`SourcedGrads`)."""
        if not self._native_kind or torch._C._len_torch_dispatch_stack():
            return None
        python_key = torch._C.DispatchKey.Python
        for group in self.param_groups:
            for p in group["params"]:
                # tensor subclasses (DTensor, FSDP2's sharded params) go through the ops, which
                # their __torch_dispatch__ routes
                if torch._C._dispatch_keys(p).has(python_key) or p.is_meta:
                    return None
        plan = torch.classes.ampfuse.StepPlan(self._native_kind)
        devices: set[torch.device] = set()
        fp16_grads = False
        groups = []
        for gi, group in enumerate(self.param_groups):
            py = self._plans.get(gi)
            if py is None or py.params is not group["params"]:
                return None
            for device, idx, lists in py.buckets:
                states = [lists.get(k, []) for k in self._kind.states]
                states += [[]] * (3 - len(states))
                absmax = [lists.get(k + "_absmax", []) for k in self._kind.states]
                absmax += [[]] * (3 - len(absmax))
                grad_dtype = py.grad_dtypes[idx[0]]
                plan.add_bucket(gi, lists["params"], lists.get("masters", []), *states, lists["steps"],
                                grad_dtype == torch.float32 and py.param_dtypes[idx[0]] != torch.float32,
                                *absmax)
                devices.add(device)
                fp16_grads |= grad_dtype == torch.float16
            idle = [p for p, dt in zip(group["params"], py.grad_dtypes) if dt is None]
            if idle:
                plan.add_idle(idle)
            groups.append((group["params"], list(group["params"]), py.signature))
        if source is not None:
            plan.bind_source(source)
        plan.finalize()
        self._keeper.hold_plan(plan)
        return _NativePlan(plan, self.state, self.state.generation, groups, len(devices), fp16_grads, source)

    def _live_native(self, source: Any = None) -> _NativePlan | None:
        """The native plan when nothing the optimizer owns changed since it was built (param
        groups, state, structural options) and it reads its gradients from ``source`` (None:
        ``.grad``), else None; eager steps only (a compiled or traced step goes through the ops)."""
        if torch.compiler.is_compiling():
            return None
        native = self._native
        if native is None or native.source is not source or torch._C._len_torch_dispatch_stack():
            return None  # a dispatch mode (FakeTensorMode, an op logger) sees the ops
        state = self.state
        if native.state is not state or native.generation != state.generation:
            return None
        groups = self.param_groups
        if len(groups) != len(native.groups):
            return None
        for (params, snapshot, signature), group in zip(native.groups, groups):
            p = group["params"]
            # the list itself, and each of its entries (no allocation per param)
            if (p is not params or signature != self._signature(group) or len(p) != len(snapshot)
                    or not all(map(operator.is_, p, snapshot))):
                return None
        return native

    def _set_native_hyper(self, native: _NativePlan) -> None:
        """Every group's hyper-parameters, checked (as the validated way checks them), into the
        plan by option name (the engine reads the kind's values from them); kept there while no value of any group was replaced (and none can change
        in place: the lr tensor's value the plan reads at every step)."""
        snapshots = [_hyper_snapshot(g) for g in self.param_groups]
        if native.hyper is not None and _same_snapshots(snapshots, native.hyper):
            return
        for gi, group in enumerate(self.param_groups):
            self._check_group_options(gi, group)  # all of them before the plan holds any
        for gi, group in enumerate(self.param_groups):
            lr = group["lr"]
            tensor_lr = isinstance(lr, torch.Tensor)
            native.plan.set_options(gi, self._hyper_values(group), _rounding_seed(group), lr if tensor_lr else None,
                                    self._momentum_tensor(group))
        native.hyper = snapshots if all(map(_immutable_hyper, self.param_groups)) else None

    def _momentum_tensor(self, group: dict[str, Any]) -> torch.Tensor | None:
        """The kind's device value besides lr (SGD's momentum, Adam's beta1) when the group holds
        it as a 1-element tensor (a schedule cycles it on the device), else None."""
        v = _option_of(group, self._kind.device_value)
        return v if isinstance(v, torch.Tensor) else None

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state`` keyed by param index, ``param_groups``), state values as
        plain dicts: loadable by the matching ``torch.optim`` optimizer. bf16 state is saved as
        fp32 (exactly: bf16 widens losslessly) and a remainder as the fp32 ``master_param`` it
        stands for, so the checkpoint does not depend on the precision options. The groups' dtype
        options are saved as their names (``"torch.uint8"``); a load keeps the live groups' precision
        options."""
        sd = super().state_dict()
        # A dtype option as torch spells it ("torch.uint8"): the value kinds torch's distributed
        # state-dict helpers walk (tensors, numbers, strings) have no dtype, and a load takes the
        # precision options from the live groups anyway.
        sd["param_groups"] = [{k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in g.items()}
                              for g in sd["param_groups"]]
        params = [p for g in self.param_groups for p in g["params"]]
        names = _slot_names(self._kind.states)
        keys = [k for k, v in sd["state"].items()  # torch allows other values under non-param keys
                if isinstance(v, Mapping) and isinstance(k, int) and 0 <= k < len(params)]
        out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in sd["state"].items()}
        if keys:
            slots = [v if isinstance(v := out[k].get(name), torch.Tensor) else None for k in keys for name in names]
            dtensor_support()
            saved = torch.ops.ampfuse.optimizer_state_saved([params[k].detach() for k in keys], slots,
                                                            list(self._kind.states))
            for j, k in enumerate(keys):
                _put_slots(out[k], names, saved[j * len(names):(j + 1) * len(names)])
        sd["state"] = out
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this optimizer or by the matching ``torch.optim`` one.

        Everything is checked before anything changes: the groups and their sizes, every state
        tensor's shape and dtype kind, every ``step``. fp32 state and masters stay fp32 (torch
        would cast them to the param's dtype); a torch checkpoint has no masters, so they are
        taken from the current params at the next step.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError("state_dict must be a mapping with 'state' and 'param_groups' entries.")
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for k, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"loaded state dict contains a parameter group that doesn't match the size of optimizer's group (group {k})"
                )
        where = {pid: (gi, i, p) for gi, (g, sg) in enumerate(zip(groups, saved_groups))
                 for i, (pid, p) in enumerate(zip(sg["params"], g["params"]))}
        names = _slot_names(self._kind.states)
        new_state: dict[Any, dict[str, Any]] = {}
        loaded = []  # (pid, gi, i, p): the states the engine checks and converts
        for pid, st in state_dict["state"].items():
            if pid not in where:
                new_state[pid] = deepcopy(st)
                continue
            if not isinstance(st, Mapping):
                gi, i, _ = where[pid]
                raise ValueError(f"the state of param_groups[{gi}]['params'][{i}] must be a dict, got {type(st).__name__}.")
            loaded.append((pid, *where[pid]))
        slots: list[torch.Tensor | None] = []
        for pid, gi, i, p in loaded:
            st = state_dict["state"][pid]
            step = st.get("step")
            if step is not None and not isinstance(step, torch.Tensor):
                try:
                    step = torch.as_tensor(step, dtype=torch.float32)
                except (TypeError, ValueError, RuntimeError) as e:
                    raise ValueError(f"state 'step' of param_groups[{gi}]['params'][{i}] must be a number or a "
                                     f"1-element tensor, got {step!r}.") from e
            for name in names[1:]:
                if not isinstance(_saved_slot(st, name), (torch.Tensor, type(None))):
                    raise ValueError(f"state '{name}' of param_groups[{gi}]['params'][{i}] must be a tensor, "
                                     f"got {type(st[name]).__name__}.")
            slots += [step, *(_saved_slot(st, name) for name in names[1:])]
        dtensor_support()
        out = torch.ops.ampfuse.optimizer_state_loaded(
            [p.detach() for *_, p in loaded], slots, list(self._kind.states), [gi for _, gi, _, _ in loaded],
            [i for *_, i, _ in loaded], "param_groups[{g}]['params'][{i}]", self._restart_on_create) if loaded else []
        for j, (pid, _, _, p) in enumerate(loaded):
            converted = {key: deepcopy(v) for key, v in state_dict["state"][pid].items() if key not in names}
            _put_slots(converted, names, out[j * len(names):(j + 1) * len(names)])
            new_state[p] = converted
        # apply
        new_groups = []
        for group, saved in zip(groups, saved_groups):
            new_group = dict(saved)
            new_group["params"] = group["params"]
            if "param_names" in group and "param_names" not in new_group:
                new_group["param_names"] = group["param_names"]
            for key, value in group.items():  # a torch checkpoint lacks ampfuse's options
                new_group.setdefault(key, value)
            for key in _PRECISION_OPTIONS:  # the optimizer's own precision options win: state is converted
                if key in group:
                    new_group[key] = group[key]
            new_groups.append(new_group)
        self.param_groups[:] = new_groups
        self.state = _State(new_state)
        self._plans.clear()
        self._native = None
        # A loaded fp32 master may be a remainder form's (its param rounded ties away from zero).
        self._reconcile = {id(p) for p, st in new_state.items() if isinstance(p, torch.Tensor) and "master_param" in st}
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)



class _Hyper(NamedTuple):
    """A hyper-parameter of a kind (``csrc/engine/optimizer_kind.h``: ``HyperSpec``)."""

    name: str  # the step op's and the step plan's name
    option: str  # the group option it is read from ("": from master_weights)
    element: int  # its element of a pair option, else -1
    type: str  # "real", "flag" or "seed"
    device: bool  # may be a 1-element device tensor
    fallback: float  # its value when the group lacks the option (NaN: every group holds it)


class _Kind(NamedTuple):
    """An optimizer kind's descriptor, as the engine holds it (the optimizer_kind op)."""

    name: str
    hyper: tuple[_Hyper, ...]
    states: tuple[str, ...]  # state keys
    gates: tuple[str, ...]  # the option each state exists with ("": always)
    dtype_options: tuple[str, ...]  # the option each state's dtype is read from (None: state_dtype)
    absmax: tuple[str, ...]  # the step op's block-absmax argument of each state
    device_value: _Hyper  # the device value besides lr


_KINDS: dict[str, _Kind] = {}


def _kind(name: str) -> _Kind:
    """The engine's kind descriptor ``name``, read once per process."""
    kind = _KINDS.get(name)
    if kind is None:
        names, options, elements, types, device, fallbacks, states, gates, dtypes, absmax = (
            torch.ops.ampfuse.optimizer_kind(name))
        hyper = tuple(map(_Hyper, names, options, elements, types, device, fallbacks))
        kind = _KINDS[name] = _Kind(name, hyper, tuple(states), tuple(gates), tuple(dtypes), tuple(absmax),
                                    next(h for h in hyper if h.device and h.name != "lr"))
    return kind


def _option_value(group: dict[str, Any], h: _Hyper) -> Any:
    """The group's option hyper-parameter ``h`` is read from: KeyError when the group lacks it,
    unless the kind gives it a value for groups that lack it (saved by an older torch)."""
    return group[h.option] if math.isnan(h.fallback) else group.get(h.option, h.fallback)


def _option_of(group: dict[str, Any], h: _Hyper) -> Any:
    """The value of hyper-parameter ``h`` in ``group`` (an element of a pair option)."""
    v = _option_value(group, h)
    return v[h.element] if h.element >= 0 else v


def _is_on(value: Any) -> bool:
    """A state's gate option is on: a tensor (a device value), a nonzero number, True."""
    return isinstance(value, torch.Tensor) or bool(value)


def _saved_slot(state: Mapping, name: str) -> Any:
    """State entry ``name`` of a loaded param state; an empty dict is an entry that was never
    saved: torch's distributed ``set_optimizer_state_dict`` with ``flatten_optimizer_state_dict``
    rebuilds each param's state from the keys of the live state and gives ``{}`` for those it does
    not find (a live remainder or block absmax, which a checkpoint holds as fp32 values)."""
    value = state.get(name)
    return None if isinstance(value, Mapping) and not value else value


@torch._dynamo.disable
def _check_groups_eagerly(optimizer: FusedOptimizer) -> None:
    """Every group's options checked (``_check_group_options``), in one call a compiled step runs
    eagerly (one graph break, outside the step's loops)."""
    for gi, group in enumerate(optimizer.param_groups):
        optimizer._check_group_options(gi, group)


@torch._dynamo.disable
def _group_hyper_check(optimizer: str, values: dict[str, Any], group: str) -> None:
    """The engine's check of a group's options. Run eagerly, outside a compiled step: its values
    are the group's Python numbers, which torch.compile turns into symbols once a second
    optimizer (or a changed group) has other values, and the op takes concrete values."""
    torch.ops.ampfuse.group_hyper_check(optimizer, values, group, True)


def _rounding_seed(group: dict[str, Any]) -> int | None:
    """The step ops' ``rounding_seed``: the group's under ``master_weights="stochastic"``, else None."""
    return int(group.get("rounding_seed", 0)) if group["master_weights"] == "stochastic" else None


def _slot_names(keys: Sequence[str]) -> tuple[str, ...]:
    """The state keys of the engine's slots of a param (``csrc/engine/optimizer_state.h``) for
    the optimizer's state ``keys``: step, the masters, the states, each state's block absmax."""
    return ("step", "master_param", "master_remainder", *keys, *(k + "_absmax" for k in keys))


def _put_slots(state: dict[str, Any], names: Sequence[str], values: Sequence[torch.Tensor | None]) -> None:
    """The engine's slots of a param's state (``names``; None: no tensor) written into its dict."""
    for name, v in zip(names, values):
        if v is None:
            if isinstance(state.get(name), torch.Tensor):
                del state[name]
        elif state.get(name) is not v:
            state[name] = v


def _is_real(value: Any) -> bool:
    """A real number as torch takes one for a hyper-parameter: Python and numpy numbers, not bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _hyper_value(value: Any) -> Any:
    """A group's option as the engine's check takes it: numbers as Python numbers, tensors, bools
    and None as they are, a pair element by element, anything else as its repr (refused, named)."""
    if _is_real(value):
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    if value is None or isinstance(value, (bool, torch.Tensor)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_hyper_value(v) for v in value)
    return repr(value)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the engine's checks look at what the kernels will see)."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _check_scaling(scaling: Any) -> StepScaling:
    """``step(scaling=...)``: each field None or a 1-element tensor, checked before anything changes."""
    if not isinstance(scaling, StepScaling):
        raise TypeError(f"scaling must be an ampfuse.optim.StepScaling or None, got {type(scaling).__name__}.")
    for name, t in zip(StepScaling._fields, scaling):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"scaling.{name} must be a 1-element tensor or None, got {type(t).__name__} {t!r}.")
        if t.numel() != 1:
            raise ValueError(f"scaling.{name} must be a 1-element tensor or None, got a tensor of shape {tuple(t.shape)}.")
        if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
            raise ValueError(f"scaling.{name} must be a floating-point tensor, got {t.dtype}.")
    return scaling


def _attribute_scalar(value: Any) -> torch.Tensor | None:
    """torch's scaler sets ``found_inf`` to the Python number 0 when no gradient was checked."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    return torch.tensor(float(value), dtype=torch.float32)


def _device_value(value: Any, params: list[torch.Tensor]) -> Any:
    """A group's momentum / beta1 as the step op takes it: a tensor as a 0-dim fp32 tensor on the
    params' device (moved without a sync), a number as it is."""
    return _scalar_on(value, params[0].device) if isinstance(value, torch.Tensor) and params else value


def _float_hyper(name: str, value: Any) -> float:
    """betas / weight_decay given as CPU tensors (torch accepts them) become numbers; the fused
    kernels take them as arguments, not device tensors."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.device.type != "cpu":
            raise ValueError(f"{name} must be a number (or a 1-element CPU tensor), got a tensor of shape "
                             f"{tuple(value.shape)} on {value.device}.")
        return float(value)
    return value


class SGD(FusedOptimizer):
    """Fused SGD with optional fp32 master weights (``torch.optim.SGD`` semantics).

    Args:
        params: parameters or param groups (fp16, bf16 or fp32; one device per group).
        lr (float or Tensor, default 1e-3): learning rate; a tensor lr is read on device.
        momentum (float, default 0): momentum factor.
        dampening (float, default 0): dampening for momentum.
        weight_decay (float, default 0): L2 penalty.
        nesterov (bool, default False): Nesterov momentum.
        maximize (bool, default False): maximize the objective.
        foreach, fused, capturable: torch's implementation switches; accepted, nothing changes
            (the step is always one fused, capturable pass with the for-loop numerics).
        differentiable (bool, default False): ``True`` is refused.
        master_weights (bool, "auto", "remainder" or "stochastic", default "auto"): keep fp32
            masters for fp16/bf16 params (``True`` and ``"auto"`` alike; fp32 params never need
            one). ``"remainder"``: bf16 params keep an int16 remainder instead (2 bytes, not 4; the
            same fp32 master bit for bit; see the module docstring). ``"stochastic"``: bf16 params
            keep no master; each step's fp32 update is rounded into the param stochastically
            (unbiased, so updates smaller than half a bf16 ulp survive on average), with draws
            that depend only on ``rounding_seed``, the param's step count, the element's index
            and the param's value: a run is reproducible, on every backend and across a
            checkpoint (fp16 params keep an fp32 master, as with ``"remainder"``). ``False``
            updates low-precision params directly, rounded to nearest (fp32 math).
        rounding_seed (int, default 0): the seed of ``master_weights="stochastic"``'s draws, an
            integer in [0, 2**53).
        state_dtype (torch.dtype, default float32): storage of the momentum buffer (the math is
            fp32): ``torch.float32``, ``torch.bfloat16`` (rounded to nearest even) or 8-bit as
            :class:`Adam`'s.

    ``state["step"]`` counts the steps taken with the current momentum buffer: the next step taken
    with ``step == 0`` initialises the buffer to that step's gradient, as torch does when its
    buffer is ``None``. Unlike torch's fused SGD, a skipped first step leaves the buffer so marked.
    """

    _kind_name = "sgd"
    _engine_name = "SGD"

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float | torch.Tensor = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: MasterWeights = "auto",
        state_dtype: torch.dtype = torch.float32,
        rounding_seed: int = 0,
    ) -> None:
        self._check_torch_kwargs(foreach, fused, False, differentiable)
        weight_decay = _float_hyper("weight_decay", weight_decay)
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused, master_weights=master_weights, state_dtype=state_dtype,
                        rounding_seed=rounding_seed)
        super().__init__(params, defaults)

    # momentum switched on mid-run (torch: the buffer is None): the next step taken starts it from
    # the gradient, which the kernel does when the step counter is 0
    _restart_on_create = True

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: a momentum buffer that was never initialised is saved as ``None``."""
        sd = super().state_dict()
        for k, st in list(sd["state"].items()):
            if isinstance(st, Mapping) and "momentum_buffer" in st and "step" in st and float(st["step"]) == 0.0:
                sd["state"][k] = dict(st, momentum_buffer=None)  # a copy: the live state stays
        return sd


class Adam(FusedOptimizer):
    """Fused Adam with optional fp32 master weights (``torch.optim.Adam`` semantics).

    Args:
        params: parameters or param groups (fp16, bf16 or fp32; one device per group).
        lr (float or Tensor, default 1e-3): learning rate; a tensor lr is read on device.
        betas (tuple, default (0.9, 0.999)): running-average coefficients.
        eps (float, default 1e-8): added to the denominator.
        weight_decay (float, default 0): L2 penalty (added to the gradient), or decoupled.
        amsgrad (bool, default False): keep the maximum of the second moment.
        foreach, fused, capturable: torch's implementation switches; accepted, nothing changes.
        maximize (bool, default False): maximize the objective.
        differentiable (bool, default False): ``True`` is refused.
        decoupled_weight_decay (bool, default False): AdamW's decoupled weight decay.
        master_weights (bool, "auto", "remainder" or "stochastic", default "auto"): fp32 masters
            for fp16/bf16 params; ``"remainder"``: int16 remainders for bf16 params;
            ``"stochastic"``: no master for bf16 params (see :class:`SGD`).
        rounding_seed (int, default 0): the seed of ``master_weights="stochastic"``'s draws.
        state_dtype (torch.dtype, default float32): storage of ``exp_avg``, ``exp_avg_sq`` (and
            ``max_exp_avg_sq``); the math is fp32 in registers either way. ``torch.float32``,
            ``torch.bfloat16`` (rounded to nearest even), or 8-bit, block-scaled:
            ``torch.uint8`` (a dynamic map), ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``
            (each state tensor of 4,096 elements or more; smaller ones stay fp32). An 8-bit state
            is its codes under its key and its blocks' fp32 scales under ``<key>_absmax``.
        exp_avg_sq_dtype (torch.dtype or None, default None): storage of ``exp_avg_sq`` and
            ``max_exp_avg_sq`` when it differs from ``state_dtype`` (None: ``state_dtype``).

    Bias corrections are computed in fp64 from each parameter's own step count, as in torch's
    for-loop implementation.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        master_weights: MasterWeights = "auto",
        state_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype | None = None,
        rounding_seed: int = 0,
    ) -> None:
        self._check_torch_kwargs(foreach, fused, capturable, differentiable)
        # torch's argument rules for tensor hyper-parameters, as strict as torch.optim.Adam (the
        # fused step would handle each case, but code written for ampfuse must run on torch too)
        if isinstance(lr, torch.Tensor) and foreach and not capturable:
            raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
        if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
            raise ValueError("betas must be either both floats or both Tensors")
        for k in (0, 1):
            if isinstance(betas[k], torch.Tensor) and foreach and not capturable:
                raise ValueError(f"betas[{k}] as a Tensor is not supported for capturable=False and foreach=True")
        betas = (_float_hyper("betas[0]", betas[0]), _float_hyper("betas[1]", betas[1]))
        weight_decay = _float_hyper("weight_decay", weight_decay)
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                        fused=fused, decoupled_weight_decay=decoupled_weight_decay, master_weights=master_weights,
                        state_dtype=state_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype, rounding_seed=rounding_seed)
        super().__init__(params, defaults)

    _kind_name = "adam"
    _engine_name = "Adam"


class AdamW(Adam):
    """Fused AdamW (decoupled weight decay) with optional fp32 master weights
    (``torch.optim.AdamW`` semantics; ``weight_decay`` defaults to 1e-2). Arguments as :class:`Adam`."""

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float | torch.Tensor, float | torch.Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: MasterWeights = "auto",
        state_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype | None = None,
        rounding_seed: int = 0,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, master_weights=master_weights, state_dtype=state_dtype,
                         exp_avg_sq_dtype=exp_avg_sq_dtype, rounding_seed=rounding_seed)
