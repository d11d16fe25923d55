"""Fused optimizers with fp32 master weights: ``ampfuse.optim.SGD``, ``Adam``, ``AdamW``.

They are ``torch.optim.Optimizer`` subclasses with torch's argument names and defaults, plus
``master_weights``. One kernel pass per (param group, device, dtype) does the whole update:

* reads each gradient once, still scaled if a GradScaler says so: it is divided by the scale
  and multiplied by the clip coefficient of ``GradScaler.unscale_and_clip_`` in registers;
* if the scaler's ``found_inf`` is set, does **nothing at all** (params, masters, optimizer state
  and step counters bitwise unchanged; no host sync decides this, the kernel does);
* otherwise updates the fp32 master weight and fp32 state and writes the fp16/bf16 param
  (rounded to nearest) in the same pass.

What is *not* fused: the inf/NaN check and the norm (a separate read-only pass,
``GradScaler.unscale_and_clip_`` or the scaler's own check), sparse gradients (unsupported),
complex parameters (unsupported), and ``differentiable``/closure-based line searches.

Memory per parameter element (bytes), beyond the fp16/bf16 param and grad themselves:

========================  ============  ============  =====================
optimizer                 fp32 params   fp16/bf16 +   state kept
                                        masters
========================  ============  ============  =====================
SGD (momentum=0)          0             4             master
SGD (momentum>0)          4             8             master, momentum
Adam / AdamW              8             12            master, exp_avg, exp_avg_sq
Adam / AdamW (amsgrad)    12            16            + max_exp_avg_sq
========================  ============  ============  =====================

plus a 4-byte step counter per parameter tensor. The step allocates no other per-element memory
(no temporaries); only O(number of tensors) metadata.

They set ``_step_supports_amp_scaling = True``: ``ampfuse.GradScaler`` and ``torch.amp.GradScaler``
both drive them without a host sync. ``state_dict()`` uses torch's per-parameter layout (``step``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``) plus ``master_param``, so
checkpoints move between these and ``torch.optim`` optimizers in both directions.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from itertools import chain
from typing import Any, Callable, Literal, Union

import torch
from torch.optim.optimizer import ParamsT

from ampfuse import ops

__all__ = ["SGD", "Adam", "AdamW"]

MasterWeights = Union[bool, Literal["auto"]]
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


class _ParamMap:
    """A mapping keyed by tensor identity (tensors compare elementwise, so they cannot be dict or
    WeakKeyDictionary keys by value); entries die with their tensor."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[weakref.ref, Any]] = {}

    def __setitem__(self, key: torch.Tensor, value: Any) -> None:
        k = id(key)
        self._d[k] = (weakref.ref(key, lambda _, k=k: self._d.pop(k, None)), value)

    def get(self, key: torch.Tensor, default: Any = None) -> Any:
        entry = self._d.get(id(key))
        if entry is None or entry[0]() is not key:
            return default
        return entry[1]

    def pop(self, key: torch.Tensor, default: Any = None) -> Any:
        value = self.get(key, default)
        self._d.pop(id(key), None)
        return value

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


def _scalar_on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.reshape(())
    if t.device != device or t.dtype != torch.float32:
        t = t.to(device=device, dtype=torch.float32, non_blocking=True)
    return t


class _FusedOptimizer(torch.optim.Optimizer):
    """Shared machinery: parameter checks, lazy fp32 state, buckets, checkpoints."""

    _ampfuse_fused_step = True  # ampfuse.GradScaler hands this optimizer a clip coefficient
    _step_supports_amp_scaling = True
    _state_keys: tuple[str, ...] = ()

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        mw = defaults.get("master_weights")
        if mw not in (True, False, "auto"):
            raise ValueError(f"master_weights must be True, False or 'auto', got {mw!r}.")
        self._param_dtypes = _ParamMap()
        # Per param group, the bucket lists of the last step (state tensors are stable once
        # created): a step where every parameter has a gradient of the same dtypes as then only
        # gathers the gradients.
        self._plans: dict[int, dict[str, Any]] = {}
        #: fp32 gradient buffers that replace ``param.grad`` for the step (GradAccumulator).
        self._grad_buffers = _ParamMap()
        super().__init__(params, defaults)

    # ---- parameters --------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_plans"):
            self._plans.clear()
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        if group.get("master_weights") not in (True, False, "auto"):
            raise ValueError(f"param_groups[{gi}]['master_weights'] must be True, False or 'auto', got {group.get('master_weights')!r}.")
        devices = {p.device for p in group["params"]}
        for i, p in enumerate(group["params"]):
            if p.dtype not in _SUPPORTED:
                self.param_groups.pop()
                raise ValueError(
                    f"param_groups[{gi}]['params'][{i}] has dtype {p.dtype}; ampfuse optimizers support "
                    "torch.float16, torch.bfloat16 and torch.float32 parameters."
                )
            self._param_dtypes[p] = p.dtype
        if len(devices) > 1:
            self.param_groups.pop()
            raise ValueError(
                f"param_groups[{gi}] has parameters on several devices ({', '.join(sorted(map(str, devices)))}); "
                "ampfuse optimizers need the parameters of one group on one device."
            )

    def _wants_master(self, p: torch.Tensor, group: dict[str, Any]) -> bool:
        return group["master_weights"] in (True, "auto") and p.dtype in _LOW_PRECISION

    def _grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        buf = self._grad_buffers.get(p)
        return buf if buf is not None else p.grad

    def _validate(self) -> None:
        """All checks of a step, before anything is modified."""
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                g = self._grad_of(p)
                if g is None:
                    continue
                where = f"param_groups[{gi}]['params'][{i}]"
                if g.is_sparse:
                    raise RuntimeError(f"{where} has a sparse gradient; ampfuse optimizers do not support sparse gradients (use torch.optim.SparseAdam).")
                expected = self._param_dtypes.get(p)
                if expected is not None and p.dtype != expected:
                    raise RuntimeError(
                        f"{where} has dtype {p.dtype} but was {expected} when the optimizer was built; "
                        "build the optimizer after converting the model (e.g. after model.half())."
                    )
                if g.dtype not in _SUPPORTED:
                    raise RuntimeError(f"{where} has a gradient of dtype {g.dtype}; expected torch.float16, torch.bfloat16 or torch.float32.")
                if g.shape != p.shape:
                    raise RuntimeError(f"{where} has a gradient of shape {tuple(g.shape)} but the parameter has shape {tuple(p.shape)}.")
                if g.device != p.device:
                    raise RuntimeError(f"{where} is on {p.device} but its gradient is on {g.device}.")

    # ---- state -------------------------------------------------------------------------------
    def _new_state(self, p: torch.Tensor, group: dict[str, Any], key: str) -> torch.Tensor:
        raise NotImplementedError

    def _ensure_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        elif not (isinstance(state["step"], torch.Tensor) and state["step"].device == p.device and state["step"].dtype == torch.float32):
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device).reshape(())
        for key in self._state_keys_for(group):
            if state.get(key) is None:
                state[key] = self._new_state(p, group, key)
        if self._wants_master(p, group):
            if state.get("master_param") is None:
                state["master_param"] = p.detach().to(torch.float32, memory_format=torch.preserve_format, copy=True)
        return state

    def _state_keys_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        return self._state_keys

    @staticmethod
    def _zeros_like(p: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)

    # ---- step --------------------------------------------------------------------------------
    def _buckets(self, group: dict[str, Any]) -> dict[tuple, dict[str, list]]:
        buckets: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        for p in group["params"]:
            g = self._grad_of(p)
            if g is None:
                continue
            state = self._ensure_state(p, group)
            has_master = "master_param" in state and self._wants_master(p, group)
            b = buckets[(p.device, p.dtype, g.dtype, has_master)]
            b["params"].append(p)
            b["grads"].append(g)
            b["steps"].append(state["step"])
            if has_master:
                b["masters"].append(state["master_param"])
            for key in self._state_keys_for(group):
                b[key].append(state[key])
        return buckets

    def _run(self, group: dict[str, Any], b: dict[str, list], scaling: dict[str, torch.Tensor | None]) -> None:
        raise NotImplementedError

    def _fast_buckets(self, gi: int, group: dict[str, Any]) -> list[tuple[tuple, dict[str, list]]] | None:
        """The cached buckets of group gi with this step's gradients, or None if they don't apply."""
        plan = self._plans.get(gi)
        params = group["params"]
        if plan is None or plan["params"] is not params or plan["n"] != len(params):
            return None
        grads = [p.grad for p in params] if len(self._grad_buffers) == 0 else [self._grad_of(p) for p in params]
        if any(g is None or g.is_sparse for g in grads):
            return None
        if [p.dtype for p in params] != plan["dtypes"] or [g.dtype for g in grads] != plan["grad_dtypes"]:
            return None
        out = []
        for key, idx, lists in plan["buckets"]:
            b = dict(lists)
            b["grads"] = [grads[i] for i in idx]
            out.append((key, b))
        return out

    def _remember(self, gi: int, group: dict[str, Any], buckets: dict[tuple, dict[str, list]]) -> None:
        params = group["params"]
        grads = [self._grad_of(p) for p in params]
        if any(g is None for g in grads):
            self._plans.pop(gi, None)
            return
        position = {id(p): i for i, p in enumerate(params)}
        self._plans[gi] = {
            "params": params,
            "n": len(params),
            "dtypes": [p.dtype for p in params],
            "grad_dtypes": [g.dtype for g in grads],
            "buckets": [
                (key, [position[id(p)] for p in b["params"]], {k: v for k, v in b.items() if k != "grads"})
                for key, b in buckets.items()
            ],
        }

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step (see the module docstring for what is fused).

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
        for gi, group in enumerate(self.param_groups):
            fast = self._fast_buckets(gi, group)
            work.append((gi, group, fast))
        if any(fast is None for _, _, fast in work):
            self._validate()  # before anything (state creation included) is modified
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        clip_coef = getattr(self, "clip_coef", None)
        for gi, group, fast in work:
            if fast is None:
                buckets = self._buckets(group)
                self._remember(gi, group, buckets)
                fast = list(buckets.items())
            for (device, _, _, _), b in fast:
                scaling = {
                    "grad_scale": _scalar_on(grad_scale, device),
                    "found_inf": _scalar_on(found_inf, device),
                    "clip_coef": _scalar_on(clip_coef, device),
                }
                lr = group["lr"]
                if isinstance(lr, torch.Tensor):
                    lr = _scalar_on(lr, device)
                self._run(group, b, dict(scaling, lr=lr))
        return loss

    # ---- checkpoints -------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by this optimizer or by the matching ``torch.optim`` one.

        Checked before anything changes: the number of groups and parameters, and every state
        tensor's shape. fp32 state and masters keep fp32 (torch would cast them to the param's
        dtype); a torch checkpoint has no masters, so they are taken from the current params at
        the next step.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for k, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"loaded state dict contains a parameter group that doesn't match the size of optimizer's group (group {k})"
                )
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups), chain.from_iterable(g["params"] for g in self.param_groups)))
        for pid, st in state_dict["state"].items():
            p = id_map.get(pid)
            if p is None:
                continue
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and key != "step" and v.shape != p.shape:
                    raise ValueError(
                        f"state '{key}' of parameter {pid} has shape {tuple(v.shape)} but the parameter has shape {tuple(p.shape)}."
                    )
                if key == "step" and isinstance(v, torch.Tensor) and v.numel() != 1:
                    raise ValueError(f"state 'step' of parameter {pid} must have one element, got shape {tuple(v.shape)}.")
        originals = {id_map[pid]: dict(st) for pid, st in state_dict["state"].items() if pid in id_map}
        previous_groups = [dict(g) for g in self.param_groups]
        super().load_state_dict(state_dict)
        self._plans.clear()
        # A torch checkpoint lacks ampfuse's group options (master_weights): keep the current ones.
        for group, prev in zip(self.param_groups, previous_groups):
            for key, value in prev.items():
                group.setdefault(key, value)
        for p, st in originals.items():
            state = self.state[p]
            for key, v in st.items():
                if key == "step":
                    state[key] = torch.as_tensor(v, dtype=torch.float32).to(p.device).reshape(()).clone()
                elif isinstance(v, torch.Tensor):
                    state[key] = v.detach().to(device=p.device, dtype=torch.float32, copy=True)
            self._adopt_foreign_state(p, state)

    def _adopt_foreign_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """Hook for optimizer-specific fix-ups of a loaded (possibly torch) state."""


class SGD(_FusedOptimizer):
    """Fused SGD with optional fp32 master weights (``torch.optim.SGD`` semantics).

    Args:
        params: parameters or param groups (fp16, bf16 or fp32; one device per group).
        lr (float or Tensor, default 1e-3): learning rate; a tensor lr is read on device.
        momentum (float, default 0): momentum factor.
        dampening (float, default 0): dampening for momentum.
        weight_decay (float, default 0): L2 penalty.
        nesterov (bool, default False): Nesterov momentum.
        maximize (bool, default False): maximize the objective.
        master_weights (bool or "auto", default "auto"): keep fp32 masters for fp16/bf16 params
            (``True`` and ``"auto"`` alike; fp32 params never need one). ``False`` updates
            low-precision params directly (fp32 math, fp32 momentum).

    Unlike torch's fused SGD, a skipped first step leaves the momentum buffer uninitialised
    *and* marked so (the next step taken initialises it to that step's gradient).
    """

    _state_keys = ("momentum_buffer",)

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        master_weights: MasterWeights = "auto",
    ) -> None:
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
                        nesterov=nesterov, maximize=maximize, master_weights=master_weights)
        super().__init__(params, defaults)

    def _state_keys_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _new_state(self, p: torch.Tensor, group: dict[str, Any], key: str) -> torch.Tensor:
        return self._zeros_like(p)

    def _run(self, group, b, s) -> None:
        ops.sgd_step_(
            b["params"], b["grads"], b.get("masters", []), b.get("momentum_buffer", []), b["steps"],
            lr=s["lr"], momentum=group["momentum"], dampening=group["dampening"],
            weight_decay=group["weight_decay"], nesterov=group["nesterov"], maximize=group["maximize"],
            grad_scale=s["grad_scale"], found_inf=s["found_inf"], clip_coef=s["clip_coef"],
        )

    def state_dict(self) -> dict[str, Any]:
        """torch's layout: a momentum buffer that was never initialised is saved as ``None``."""
        sd = super().state_dict()
        for k, st in list(sd["state"].items()):
            if "momentum_buffer" in st and "step" in st and float(st["step"]) == 0.0:
                sd["state"][k] = dict(st, momentum_buffer=None)  # a copy: the live state stays
        return sd

    def _adopt_foreign_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        # torch's SGD has no step counter: a present buffer means momentum was initialised.
        if "step" not in state:
            initialised = state.get("momentum_buffer") is not None
            state["step"] = torch.full((), 1.0 if initialised else 0.0, dtype=torch.float32, device=p.device)


class Adam(_FusedOptimizer):
    """Fused Adam with optional fp32 master weights (``torch.optim.Adam`` semantics).

    Args:
        params: parameters or param groups (fp16, bf16 or fp32; one device per group).
        lr (float or Tensor, default 1e-3): learning rate; a tensor lr is read on device.
        betas (tuple, default (0.9, 0.999)): running-average coefficients.
        eps (float, default 1e-8): added to the denominator.
        weight_decay (float, default 0): L2 penalty (added to the gradient).
        amsgrad (bool, default False): keep the maximum of the second moment.
        maximize (bool, default False): maximize the objective.
        master_weights (bool or "auto", default "auto"): fp32 masters for fp16/bf16 params.

    Optimizer state is fp32 for every param dtype; bias corrections are computed in fp64 from
    each parameter's own step count, as in torch's for-loop implementation.
    """

    _decoupled = False

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        master_weights: MasterWeights = "auto",
    ) -> None:
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
                        maximize=maximize, master_weights=master_weights)
        super().__init__(params, defaults)

    def _state_keys_for(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")

    def _new_state(self, p: torch.Tensor, group: dict[str, Any], key: str) -> torch.Tensor:
        return self._zeros_like(p)

    def _run(self, group, b, s) -> None:
        beta1, beta2 = group["betas"]
        ops.adam_step_(
            b["params"], b["grads"], b.get("masters", []), b["exp_avg"], b["exp_avg_sq"],
            b.get("max_exp_avg_sq", []), b["steps"],
            lr=s["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            amsgrad=group["amsgrad"], maximize=group["maximize"], decoupled_weight_decay=self._decoupled,
            grad_scale=s["grad_scale"], found_inf=s["found_inf"], clip_coef=s["clip_coef"],
        )


class AdamW(Adam):
    """Fused AdamW (decoupled weight decay) with optional fp32 master weights
    (``torch.optim.AdamW`` semantics; ``weight_decay`` defaults to 1e-2). Arguments as :class:`Adam`."""

    _decoupled = True

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        master_weights: MasterWeights = "auto",
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, master_weights=master_weights)
