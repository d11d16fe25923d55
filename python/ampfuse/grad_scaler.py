"""``ampfuse.GradScaler``: a drop-in replacement for ``torch.amp.GradScaler``.

A subclass of torch's scaler (its constructor, per-optimizer state machine, messages,
``state_dict`` keys and pickling rules) whose unscale and inf/NaN check are one fused pass per
device, whose ``update`` runs on the device (with optional hysteresis, bounds and counters),
which adds ``unscale_and_clip_`` (unscale + check + global norm + clip in one read) and which
hands ampfuse's optimizers the scale explicitly (``step(scaling=StepScaling(...))``), so a step
has no host sync. The whole contract: the manual's GradScaler page (``docs/grad_scaler.md``).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any, Literal, cast

import torch
from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator

from ampfuse import ops
from ampfuse._transfer import capturing, host_to_device
from ampfuse._checks import check_grads_keys, engine_value
from ampfuse.optim import FusedOptimizer, StepScaling

__all__ = ["GradScaler", "OverflowReport", "ScalerHandOff"]

OnMinScale = Literal["warn", "raise", "ignore"]
_FLT_MIN = float(torch.finfo(torch.float32).tiny)
_FLT_MAX = float(torch.finfo(torch.float32).max)
Grads = Mapping[torch.Tensor, "torch.Tensor | None"]



class _Replicas:
    """A tensor on the devices that ask for it: the tensor itself on its own device (torch's
    ``_MultiDeviceReplicator`` copies it there too, one launch per step), a copy elsewhere."""

    __slots__ = ("master", "copies")

    def __init__(self, master: torch.Tensor) -> None:
        self.master = master
        self.copies: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device == self.master.device:
            return self.master
        t = self.copies.get(device)
        if t is None:
            t = self.copies[device] = self.master.to(device=device, non_blocking=True, copy=True)
        return t

class _GradOf:
    """What ``torch.nn.utils.clip_grad_norm_`` reads of a param: its ``.grad``."""

    __slots__ = ("grad",)

    def __init__(self, grad: torch.Tensor | None) -> None:
        self.grad = grad


def _clip_grad_norm_of_step(optimizer: torch.optim.Optimizer, grads: Grads | None, max_norm: float,
                            norm_type: float) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over the gradients the optimizer's step reads: ``grads[p]``
    where given (a ``GradAccumulator``'s fp32 sums), else ``p.grad``."""
    params = _all_params(optimizer)
    if grads is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    check_grads_keys(optimizer.param_groups, grads)
    held = [_GradOf(grads[p] if p in grads else p.grad) for p in params]
    return torch.nn.utils.clip_grad_norm_(cast(Any, held), max_norm, norm_type)


def _all_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _dense_grads_per_group_device(optimizer: torch.optim.Optimizer, allow_fp16: bool) -> dict[torch.device, list[torch.Tensor]] | None:
    """The fast path of ``_grads_per_device`` for ampfuse optimizers (one device per param group):
    one pass over ``.grad`` per group, the device taken from the group. None when a gradient is
    sparse or, without ``allow_fp16``, fp16 (the general path handles and names those). A
    gradient on another device than its group is rejected by the check op, naming it."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    strided = torch.strided
    for group in optimizer.param_groups:
        params = group["params"]
        if not params:
            continue
        gs = [g for g in [p.grad for p in params] if g is not None]
        if not gs:
            continue
        for g in gs:
            if g.layout is not strided or (not allow_fp16 and g.dtype is torch.float16):
                return None
        device = params[0].device
        if device in per_device:
            per_device[device].extend(gs)
        else:
            per_device[device] = gs
    return per_device


class OverflowReport(list):
    """A list of ``(group_index, param_index, name)`` for parameters whose gradient is non-finite."""


def _fresh_optimizer_state() -> dict[str, Any]:
    # torch's _refresh_per_optimizer_state, defined here: torch.compile does not trace into
    # torch.amp, so update() must not call into it.
    return {"stage": OptState.READY, "found_inf_per_device": {}}


def _check_bounds(min_scale: Any, max_scale: Any) -> None:
    torch.ops.ampfuse.scale_bounds_check(engine_value(min_scale), engine_value(max_scale))


class ScalerHandOff:
    """What a gradient accumulator or a training framework's integration reads and changes of a
    loss scaler's iteration, for ``torch.amp.GradScaler`` and ``ampfuse.GradScaler`` alike (both
    keep torch's per-optimizer record of an iteration): the one place that knows that record.

    Args:
        scaler: the scaler (``torch.amp.GradScaler`` or a subclass).
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def _record(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return cast(Any, self.scaler)._per_optimizer_states[id(optimizer)]

    def unscale_open(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this iteration has not yet unscaled (or checked) ``optimizer``'s gradients."""
        return self._record(optimizer)["stage"] is OptState.READY

    def grads_still_scaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this iteration checked ``optimizer``'s gradients without dividing them (the
        fused step divides them, as after ``unscale_and_clip_``)."""
        return bool(self._record(optimizer).get("grads_still_scaled", False))

    def found_inf(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """This iteration's inf/NaN flag of ``optimizer``'s gradients, summed over its devices on
        the scale's device (a new tensor; non-zero: the step is skipped), or None before a check."""
        found = list(self._record(optimizer)["found_inf_per_device"].values())
        if not found:
            return None
        scale = cast(Any, self.scaler)._scale
        device = scale.device if scale is not None else found[0].device
        return sum(f.to(device, non_blocking=True) for f in found).clone()

    def add_found_inf(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
        """Add ``flag`` (a 1-element tensor, non-zero to skip) to this iteration's check of
        ``optimizer`` on each of its devices: the step (and the scale's update) count it."""
        record = self._record(optimizer)
        record["found_inf_per_device"] = {d: f + flag.to(d, non_blocking=True)
                                          for d, f in record["found_inf_per_device"].items()}

    def forget_iteration(self) -> None:
        """Drop this iteration's records of every optimizer (after a step that failed), as the
        scale's update does."""
        cast(Any, self.scaler)._per_optimizer_states = defaultdict(_fresh_optimizer_state)

    @contextlib.contextmanager
    def scale_multiplied(self, factor: torch.Tensor | None) -> Iterator[None]:
        """Within: the scale the scaler's check and the step divide gradients by is ``scale *
        factor`` (a 1-element tensor; None: unchanged); restored on leaving."""
        scaler: Any = self.scaler
        if factor is None:
            yield
            return
        scale = scaler._scale
        scaler._scale = scale * factor.to(scale.device, non_blocking=True)
        try:
            yield
        finally:
            scaler._scale = scale


class GradScaler(torch.amp.GradScaler):
    """Dynamic loss scaling, sync-free, as a drop-in for :class:`torch.amp.GradScaler`.

    The positional arguments are torch's, with the same defaults and validation; the keyword-only
    extensions' defaults reproduce torch exactly. The manual's GradScaler page has the whole
    contract.

    Args:
        device: device type of the scaled losses, ``"cuda"`` (default) or ``"cpu"``. Without CUDA,
            ``"cuda"`` warns and disables the scaler, as torch's does. (The deprecated
            ``torch.cuda.amp.GradScaler(init_scale, ...)`` signature: ``ampfuse.cuda.amp.GradScaler``.)
        init_scale: initial scale (2**16).
        growth_factor: scale multiplier after ``growth_interval`` clean steps (2.0).
        backoff_factor: scale multiplier on overflow (0.5).
        growth_interval: clean steps before growing (2000).
        enabled: ``False`` makes every method a pass-through.

    Keyword Args:
        hysteresis: back off only on the ``hysteresis``-th overflow since the budget was refilled
            (1 = every overflow). The budget refills when the scale grows, or after every clean
            step with ``consecutive_hysteresis=True``.
        min_scale, max_scale: bounds for the scale (an ``init_scale`` or loaded scale outside them
            is clamped, with a warning). The scale never falls below the smallest normal float32
            in any case (torch's can decay to 0, which silently stops training).
        on_min_scale: what to do when an overflow would take the scale below its floor:
            ``"warn"`` (default), ``"raise"`` (``RuntimeError``) or ``"ignore"``. Detected from a
            device counter copied without blocking and checked at later ``update()`` calls (at
            most a few steps late; never inside torch.compile or CUDA-graph capture) or on demand
            with :meth:`check_min_scale`.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        max_scale: float | None = None,
        on_min_scale: OnMinScale = "warn",
    ) -> None:
        if isinstance(device, torch.device):
            device = device.type
        if not isinstance(device, str):
            raise TypeError(
                f"GradScaler's first argument is the device type ('cuda', 'cpu', ...), got {device!r}. "
                "For the signature of the deprecated torch.cuda.amp.GradScaler (init_scale first), use "
                "ampfuse.cuda.amp.GradScaler."
            )
        if not isinstance(hysteresis, int) or isinstance(hysteresis, bool) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an integer >= 1, got {hysteresis!r}.")
        _check_bounds(min_scale, max_scale)
        text = isinstance(on_min_scale, str)  # anything else is refused, shown as Python prints it
        torch.ops.ampfuse.on_min_scale_check(on_min_scale if text else None, None if text else repr(on_min_scale))

        # torch's constructor, reproduced so that its warning points at the caller's line.
        self._device = device
        self._enabled = enabled
        if self._device == "cuda":
            if enabled and torch.cuda.amp.common.amp_definitely_not_available():
                warnings.warn(
                    "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling.",
                    stacklevel=2,
                )
                self._enabled = False
        if self._enabled:
            if growth_factor <= 1.0:
                raise AssertionError("The growth factor must be > 1.0.")
            if backoff_factor >= 1.0:
                raise AssertionError("The backoff factor must be < 1.0.")
            # what update() would refuse after a step, refused now (the engine's rule)
            torch.ops.ampfuse.scaler_options_check(init_scale, growth_factor, backoff_factor, growth_interval,
                                                   hysteresis)
            self._init_scale = init_scale
            self._scale: torch.Tensor | None = None
            self._growth_factor = growth_factor
            self._backoff_factor = backoff_factor
            self._growth_interval = growth_interval
            self._init_growth_tracker = 0
            self._growth_tracker: torch.Tensor | None = None
            self._per_optimizer_states: dict[int, dict[str, Any]] = defaultdict(_fresh_optimizer_state)

        self._hysteresis = hysteresis
        self._consecutive_hysteresis = consecutive_hysteresis
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._on_min_scale: OnMinScale = on_min_scale
        self._init_hysteresis_tracker = hysteresis
        self._init_stats = [0] * ops.NUM_SCALE_STATS
        self._hysteresis_tracker: torch.Tensor | None = None
        self._stats: torch.Tensor | None = None
        self._last_found_inf: torch.Tensor | None = None
        # Non-blocking floor detection: (host copy of stats, event) pairs in flight.
        self._pending_stats: list[tuple[torch.Tensor, Any]] = []
        self._floor_hits_seen = 0
        if self._enabled:
            self._init_scale = self._clamped(init_scale, "init_scale")

    # ------------------------------------------------------------------------------------------
    # bounds and lazily created device state
    # ------------------------------------------------------------------------------------------
    def _clamped(self, value: float, what: str) -> float:
        """A scale within [min_scale, max_scale] (with a warning when it was not)."""
        lo = self._min_scale if self._min_scale is not None else -math.inf
        hi = self._max_scale if self._max_scale is not None else math.inf
        if not (lo <= value <= hi):
            clamped = min(max(value, lo), hi)
            warnings.warn(f"GradScaler: {what} {value:g} is outside [min_scale, max_scale] = [{lo:g}, {hi:g}]; "
                          f"using {clamped:g}.", UserWarning, stacklevel=3)
            return clamped
        return value

    def _clamp_tensor_(self, t: torch.Tensor) -> None:
        if self._min_scale is not None or self._max_scale is not None:
            t.clamp_(min=self._min_scale, max=self._max_scale)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        # torch's check, defined here so that torch.compile traces update() without a break.
        fix = "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
        if self._scale is None:
            raise AssertionError(f"Attempted {funcname} but _scale is None.  " + fix)
        if self._growth_tracker is None:
            raise AssertionError(f"Attempted {funcname} but _growth_tracker is None.  " + fix)
        return (self._scale, self._growth_tracker)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)
        self._stats = host_to_device(torch.tensor(self._init_stats, dtype=torch.int64, device="cpu"), dev)

    # ------------------------------------------------------------------------------------------
    # unscale / check
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _grads_per_device(optimizer: torch.optim.Optimizer, allow_fp16: bool, grads: Grads | None = None) -> dict[torch.device, list[torch.Tensor]]:
        """The gradients the optimizer's step will read (``grads`` overrides ``.grad``), per device;
        sparse gradients as their coalesced values (torch's rule)."""
        if grads is not None:  # a key that is not a param would silently leave its .grad checked
            check_grads_keys(optimizer.param_groups, grads)
        if grads is None and isinstance(optimizer, FusedOptimizer):
            fast = _dense_grads_per_group_device(optimizer, allow_fp16)
            if fast is not None:
                return fast
        per_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if not isinstance(param, torch.Tensor):
                        raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
                    if grads is not None and param in grads:
                        grad = grads[param]
                        if grad is not None:
                            per_device[grad.device].append(grad)
                        continue
                    grad = param.grad
                    if grad is None:
                        continue
                    if (not allow_fp16) and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:
                        # As torch: check the coalesced values of fp16 sparse grads (coalescing
                        # sums duplicates, which may overflow).
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    per_device[grad.device].append(grad)
        return per_device

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
        grads: Grads | None = None,
    ) -> dict[torch.device, torch.Tensor]:
        """torch's contract: unscale every grad of ``optimizer`` by ``inv_scale`` (an ``inv_scale``
        of exactly 1 only checks, writing nothing) and return the per-device found_inf tensors.
        One fused launch sequence per device, for all dtypes together."""
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        per_device = self._grads_per_device(optimizer, allow_fp16, grads)
        with torch.no_grad():
            for device, gs in per_device.items():
                ops.unscale_check_(gs, per_device_found_inf.get(device), per_device_inv_scale.get(device))
        return per_device_found_inf._per_device_tensors

    def _unscale_from_scale_(
        self, optimizer: torch.optim.Optimizer, allow_fp16: bool, write: bool, grads: Grads | None = None
    ) -> dict[torch.device, torch.Tensor]:
        """The scaler's own check (and unscale, when ``write``): one launch per device that takes
        ``1/scale`` itself and writes a fresh found_inf (no reciprocal, no zero-fill launches)."""
        assert self._scale is not None
        out = optimizer.scaler_check(self._scale, write=write, grads=grads, allow_fp16=allow_fp16) if isinstance(
            optimizer, FusedOptimizer) else None
        if out is not None:
            return {f.device: f for f in out}
        per_device = self._grads_per_device(optimizer, allow_fp16, grads)
        per_device_scale = _Replicas(self._scale)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for device, gs in per_device.items():
                found[device] = f = torch.empty((), dtype=torch.float32, device=device)
                if write:
                    ops.unscale_check_(gs, f, scale=per_device_scale.get(device), overwrite_found_inf=True)
                else:
                    ops.check_norm_(gs, f, scale=per_device_scale.get(device), norm_type=math.inf, overwrite_found_inf=True)
        return found

    def check_for_step(self, optimizer: FusedOptimizer, *, grads: Grads | None = None) -> None:
        """This iteration's ``unscale_`` for an ampfuse optimizer without writing: the gradients
        its next step reads (``grads`` as for :meth:`unscale_`) are checked for inf/NaN and stay
        scaled (the fused step divides them)."""
        optimizer_state = self._check_unscale_stage(optimizer, "step")
        optimizer_state["found_inf_per_device"] = self._unscale_from_scale_(optimizer, True, False, grads)
        optimizer_state["grads_still_scaled"] = True
        optimizer_state["clip_coef"] = None
        optimizer_state["stage"] = OptState.UNSCALED

    def _inv_scale(self) -> torch.Tensor:
        assert self._scale is not None
        # As torch: the reciprocal in fp64, rounded to fp32.
        return self._scale.double().reciprocal().float()

    def _check_unscale_stage(self, optimizer: torch.optim.Optimizer, funcname: str) -> dict[str, Any]:
        self._check_scale_growth_tracker(funcname)
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        elif optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        return optimizer_state

    def unscale_(self, optimizer: torch.optim.Optimizer, *, grads: Grads | None = None) -> None:
        """As ``torch.amp.GradScaler.unscale_``: divide the optimizer's gradients by the scale in
        place and check them for inf/NaN (one fused pass per device, all dtypes together).

        ``grads`` (keyword-only): gradients the optimizer's step will read instead of ``.grad``
        (pass the same mapping to :meth:`step`).
        """
        if not self._enabled:
            return
        optimizer_state = self._check_unscale_stage(optimizer, "unscale_")
        optimizer_state["found_inf_per_device"] = self._unscale_from_scale_(optimizer, False, True, grads)
        optimizer_state["stage"] = OptState.UNSCALED

    def unscale_and_clip_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float | torch.Tensor,
        norm_type: float = 2.0,
        *,
        grads: Grads | None = None,
    ) -> torch.Tensor:
        """Unscale, check for inf/NaN, compute the global norm and clip, in one pass.

        The drop-in for ``scaler.unscale_(optimizer)`` followed by
        ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)``, returning the same total
        norm (a device tensor; no host sync). With an ampfuse fused optimizer the gradients are
        only read: the optimizer applies ``1/scale`` and the clip coefficient in its own pass.
        With any other optimizer they are unscaled and clipped in place (a read pass and a
        read-write pass; torch's sequence makes four passes).

        ``max_norm`` may be a float or a 1-element tensor (as for ``clip_grad_norm_``, whose
        coefficient formula each follows). ``norm_type`` 2 and ``inf`` are fused; other norms fall
        back to ``unscale_`` + ``clip_grad_norm_``. ``grads`` as for :meth:`unscale_`. Counts as
        this iteration's ``unscale_`` for ``optimizer``.
        """
        if isinstance(max_norm, torch.Tensor):
            if max_norm.numel() != 1 or not max_norm.is_floating_point():
                raise ValueError(f"max_norm must be a number or a 1-element floating-point tensor, got shape {tuple(max_norm.shape)}, {max_norm.dtype}.")
        elif not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm must be a positive finite number, got {max_norm!r}.")
        fused = isinstance(optimizer, FusedOptimizer)
        if grads is not None and not fused:
            raise ValueError("grads= can only be given for an ampfuse optimizer (whose step reads them).")
        # torch's clip_grad_norm_ takes a tensor max_norm too (its hint says float)
        torch_max_norm = cast(float, max_norm)
        if not self._enabled:
            return _clip_grad_norm_of_step(optimizer, grads, torch_max_norm, norm_type)
        norm_type = float(norm_type)
        if not (norm_type == 2.0 or norm_type == math.inf):
            self.unscale_(optimizer, grads=grads)
            return _clip_grad_norm_of_step(optimizer, grads, torch_max_norm, norm_type)

        optimizer_state = self._check_unscale_stage(optimizer, "unscale_and_clip_")
        assert self._scale is not None
        float_max = None if isinstance(max_norm, torch.Tensor) else float(max_norm)
        out = cast(FusedOptimizer, optimizer).scaler_check(
            self._scale, norm_type=norm_type, max_norm=float_max, grads=grads) if fused else None
        if out is not None:
            single = len(out) == 3
            total_norm = out[1] if single else torch.linalg.vector_norm(
                torch.stack([n.to(self._scale.device) for n in out[1::3]]), norm_type)
            optimizer_state["clip_coef"] = out[2] if single and float_max is not None else ops.clip_coef(total_norm, max_norm)
            optimizer_state["grads_still_scaled"] = True
            optimizer_state["found_inf_per_device"] = {f.device: f for f in out[0::3]}
            optimizer_state["stage"] = OptState.UNSCALED
            return total_norm
        per_device = self._grads_per_device(optimizer, allow_fp16=fused, grads=grads)
        if any(g.layout is not torch.strided for gs in per_device.values() for g in gs) or any(
            p.grad is not None and p.grad.is_sparse for p in _all_params(optimizer) if grads is not None and p not in grads
        ):
            raise RuntimeError("unscale_and_clip_ does not support sparse gradients; use unscale_() and clip_grad_norm_().")
        per_device_scale = _Replicas(self._scale)
        found_infs: dict[torch.device, torch.Tensor] = {}
        single = len(per_device) <= 1
        norms: list[torch.Tensor] = []
        coef: torch.Tensor | None = None
        with torch.no_grad():
            for device, gs in per_device.items():
                # One launch: 1/scale taken in the kernel, found_inf written (not only set).
                found_infs[device] = f = torch.empty((), dtype=torch.float32, device=device)
                norm, c = ops.check_norm_(
                    gs, f, scale=per_device_scale.get(device), norm_type=norm_type,
                    max_norm=float_max if single else None, overwrite_found_inf=True,
                )
                norms.append(norm)
                coef = c
            if not per_device:
                total_norm = torch.zeros((), device=self._scale.device)
                coef = torch.ones((), device=self._scale.device)
            elif single:
                total_norm = norms[0]
            else:
                total_norm = torch.linalg.vector_norm(torch.stack([n.to(self._scale.device) for n in norms]), norm_type)
            if per_device and (not single or float_max is None):
                # the coefficient of the combined norm, by the fused ops' rule (ops/rules.h)
                coef = ops.clip_coef(total_norm, max_norm)
            assert coef is not None
            if fused:
                optimizer_state["clip_coef"] = coef
                optimizer_state["grads_still_scaled"] = True
            else:
                inv_scale = self._inv_scale()
                factor = _MultiDeviceReplicator((inv_scale * coef.to(inv_scale.device)).reshape(1))
                for device, gs in per_device.items():
                    # found_inf is already final: re-setting it is idempotent.
                    ops.unscale_check_(gs, found_infs[device], factor.get(device))
        optimizer_state["found_inf_per_device"] = found_infs
        optimizer_state["stage"] = OptState.UNSCALED
        return total_norm

    def record_inf_check(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | Mapping[torch.device, torch.Tensor]) -> None:
        """Record that the gradients ``optimizer``'s next step reads were already checked for
        inf/NaN elsewhere, e.g. by ``ampfuse.ops.accumulate_grads_`` while they were summed, and
        are still scaled: :meth:`step` then runs no check pass of its own. Counts as this
        iteration's ``unscale_``. Only for ampfuse optimizers (whose step reads scaled gradients).

        Args:
            found_inf: a 1-element float32 tensor (non-zero: inf/NaN seen), or one per device.
        """
        if not isinstance(optimizer, FusedOptimizer):
            raise TypeError("record_inf_check() needs an ampfuse optimizer (ampfuse.optim.*), whose step reads scaled gradients.")
        flags = dict(found_inf) if isinstance(found_inf, Mapping) else {found_inf.device: found_inf}
        for device, t in flags.items():
            if not (isinstance(t, torch.Tensor) and t.numel() == 1 and t.dtype == torch.float32):
                raise ValueError(f"found_inf for {device} must be a 1-element float32 tensor, got {t!r}.")
        if not self._enabled:
            return
        optimizer_state = self._check_unscale_stage(optimizer, "record_inf_check")
        # Copies: the caller reuses (and resets) its flags, which the step reads later on the device.
        optimizer_state["found_inf_per_device"] = {d: t.reshape(()).clone() for d, t in flags.items()}
        optimizer_state["grads_still_scaled"] = True
        optimizer_state["clip_coef"] = None
        optimizer_state["stage"] = OptState.UNSCALED

    # ------------------------------------------------------------------------------------------
    # step
    # ------------------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """As ``torch.amp.GradScaler.step``: unscale (unless done), then step unless inf/NaN.

        ampfuse optimizers get ``optimizer.step(*args, scaling=StepScaling(...), **kwargs)``: the
        scale (unless :meth:`unscale_` already divided the gradients), the device inf flag and the
        clip coefficient of :meth:`unscale_and_clip_`; they run with no host sync and leave
        ``.grad`` as they found it. Other optimizers with ``_step_supports_amp_scaling`` get
        torch's ``grad_scale``/``found_inf`` attributes; the rest are stepped after the one host
        read of the inf flag that torch also needs.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        if not isinstance(optimizer, FusedOptimizer):
            return super().step(optimizer, *args, **kwargs)
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if optimizer_state["stage"] is OptState.READY:
            self.check_for_step(optimizer, grads=kwargs.get("grads"))
        if len(optimizer_state["found_inf_per_device"]) == 0:
            # No gradient to step (as torch's scaler does for an optimizer with
            # _step_supports_amp_scaling): the step changes nothing, and update() raises
            # "No inf checks were recorded prior to update."
            retval = optimizer.step(*args, **kwargs)
            optimizer_state["stage"] = OptState.STEPPED
            return retval
        scale = self._scale  # set by the unscale that recorded found_inf_per_device
        assert scale is not None
        found_infs = [t.to(scale.device, non_blocking=True) for t in optimizer_state["found_inf_per_device"].values()]
        found_inf = found_infs[0] if len(found_infs) == 1 else sum(found_infs)
        scaling = StepScaling(
            grad_scale=scale if optimizer_state.get("grads_still_scaled", False) else None,
            found_inf=found_inf,
            clip_coef=optimizer_state.get("clip_coef"),
        )
        retval = optimizer.step(*args, scaling=scaling, **kwargs)
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    # ------------------------------------------------------------------------------------------
    # update
    # ------------------------------------------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As ``torch.amp.GradScaler.update``, with ampfuse's scale rule (see the class doc).
        A ``new_scale`` outside [min_scale, max_scale] is clamped into them."""
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            super().update(new_scale)
            self._clamp_tensor_(_scale)
            return
        found_infs = [
            found_inf.to(device=_scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        # Out of place (torch adds into the first flag): each optimizer's step keeps its own flag
        # (its last_step_skipped).
        found_inf_combined = found_infs[0]
        for i in range(1, len(found_infs)):
            found_inf_combined = found_inf_combined + found_infs[i]
        if self._hysteresis_tracker is None or self._stats is None:  # e.g. after load into a live scaler
            self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=_scale.device)
            self._stats = torch.tensor(self._init_stats, dtype=torch.int64, device=_scale.device)
        ops.update_scale_(
            _scale,
            _growth_tracker,
            found_inf_combined,
            self._growth_factor,
            self._backoff_factor,
            self._growth_interval,
            hysteresis=self._hysteresis,
            hysteresis_tracker=self._hysteresis_tracker,
            consecutive_hysteresis=self._consecutive_hysteresis,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
            stats=self._stats,
        )
        self._last_found_inf = found_inf_combined
        self._per_optimizer_states = defaultdict(_fresh_optimizer_state)
        if self._on_min_scale != "ignore" and self._may_poll():
            self._poll_min_scale(blocking=False)
            if not self._pending_stats:  # at most one copy in flight
                self._post_stats_copy()

    # ------------------------------------------------------------------------------------------
    # floor detection and counters
    # ------------------------------------------------------------------------------------------
    def _may_poll(self) -> bool:
        """Whether update() may look at the device counters now: not while torch.compile traces
        (a host read would break the graph) and not during CUDA-graph capture (no event queries
        or device-to-host copies there). check_min_scale() polls later."""
        if torch.compiler.is_compiling():
            return False
        return self._stats is not None and not capturing(self._stats.device)

    def _post_stats_copy(self) -> None:
        assert self._stats is not None
        if self._stats.device.type == "cpu":  # nothing to copy or wait for: read the counters
            self._pending_stats.append((self._stats, None))
            self._poll_min_scale(blocking=False)
            return
        host = torch.empty(ops.NUM_SCALE_STATS, dtype=torch.int64, device="cpu", pin_memory=True)
        host.copy_(self._stats, non_blocking=True)
        event = torch.Event(self._stats.device)  # the copy is done when this is
        event.record()
        self._pending_stats.append((host, event))

    def _poll_min_scale(self, blocking: bool) -> None:
        while self._pending_stats:
            host, event = self._pending_stats[0]
            if event is not None and not blocking and not event.query():
                break
            if event is not None and blocking:
                event.synchronize()
            self._pending_stats.pop(0)
            hits = int(host[ops.ScaleStat.FLOOR_HITS])
            if hits > self._floor_hits_seen:
                new = hits - self._floor_hits_seen
                self._floor_hits_seen = hits
                msg = torch.ops.ampfuse.floor_hit_message(new, self._min_scale if self._min_scale else _FLT_MIN)
                if self._on_min_scale == "raise":
                    raise RuntimeError(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def check_min_scale(self) -> None:
        """Report floor hits now (reads the device counters: a host sync)."""
        if not self._enabled or self._stats is None or self._on_min_scale == "ignore":
            return
        if not self._pending_stats:
            self._post_stats_copy()
        self._poll_min_scale(blocking=True)

    @property
    def last_found_inf(self) -> torch.Tensor | None:
        """Device tensor from the last :meth:`update`: > 0 if that iteration's steps were skipped."""
        return self._last_found_inf

    def stats(self) -> dict[str, torch.Tensor]:
        """Device counters (no host sync): ``updates``, ``skipped`` (overflowed iterations),
        ``backoffs``, ``floor_hits``, the current ``scale`` and ``last_skipped``."""
        if not self._enabled or self._stats is None or self._scale is None:
            zero = torch.zeros((), dtype=torch.int64)
            return {"updates": zero, "skipped": zero, "backoffs": zero, "floor_hits": zero,
                    "scale": torch.tensor(self._init_scale if self._enabled else 1.0), "last_skipped": torch.zeros(())}
        s = self._stats
        return {
            "updates": s[ops.ScaleStat.UPDATES],
            "skipped": s[ops.ScaleStat.OVERFLOWS],
            "backoffs": s[ops.ScaleStat.BACKOFFS],
            "floor_hits": s[ops.ScaleStat.FLOOR_HITS],
            "scale": self._scale,
            "last_skipped": self._last_found_inf if self._last_found_inf is not None else torch.zeros((), device=s.device),
        }

    def scheduler_step(self, scheduler: Any, *args: Any, **kwargs: Any) -> bool:
        """Advance an LR scheduler only if the last iteration's optimizer steps were taken.

        Call it after :meth:`update` where you would call ``scheduler.step()``. Reads the skip flag
        on the host: free when the optimizer was stepped through torch's synchronising path, one
        wait for the end of the iteration otherwise. Returns whether the scheduler stepped. A
        device schedule (:mod:`ampfuse.lr_scheduler`) that sees the skips itself (its
        ``sees_skips()``) counts only the steps taken: it is stepped with no read, and True is
        returned.
        """
        from ampfuse.lr_scheduler import counts_taken_steps

        if counts_taken_steps(scheduler):
            scheduler.step(*args, **kwargs)
            return True
        if self._enabled and self._last_found_inf is not None and self._last_found_inf.item() != 0.0:
            return False
        scheduler.step(*args, **kwargs)
        return True

    def overflow_report(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None,
                        *, grads: Grads | None = None) -> OverflowReport:
        """Which parameters of ``optimizer`` hold non-finite gradients now (a host sync).

        Call it after a skipped step and before ``zero_grad``. Names come from ``model``
        (``named_parameters``) if given, else from the optimizer's ``param_names``, else
        ``"param_groups[g][i]"``. ``grads`` as for :meth:`unscale_`.
        """
        names: dict[int, str] = {}
        if model is not None:
            names = {id(p): n for n, p in model.named_parameters()}
        entries: list[tuple[int, int, torch.Tensor, str]] = []
        for g, group in enumerate(optimizer.param_groups):
            group_names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                grad = grads[p] if grads is not None and p in grads else p.grad
                if grad is None:
                    continue
                name = names.get(id(p)) or (group_names[i] if group_names else f"param_groups[{g}][{i}]")
                grad = grad._values() if grad.is_sparse else grad
                entries.append((g, i, grad, name))
        report = OverflowReport()
        by_device: dict[torch.device, list[int]] = defaultdict(list)
        for k, e in enumerate(entries):
            by_device[e[2].device].append(k)
        with torch.no_grad():
            for device, idx in by_device.items():
                flags = torch.zeros(len(idx), device=device)
                ops.check_norm_(
                    [entries[k][2] for k in idx],
                    torch.zeros(1, device=device),
                    torch.ones(1, device=device),
                    per_tensor_found_inf=flags,
                )
                for k, f in zip(idx, flags.tolist()):
                    if f:
                        report.append((entries[k][0], entries[k][1], entries[k][3]))
        report.sort()
        return report

    # ------------------------------------------------------------------------------------------
    # checkpointing
    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus ampfuse's options and counters; torch's
        scaler loads it (ignoring the extra keys) and ours loads torch's."""
        sd = super().state_dict()
        if self._enabled:
            sd.update(
                {
                    "hysteresis": self._hysteresis,
                    "consecutive_hysteresis": self._consecutive_hysteresis,
                    "min_scale": self._min_scale,
                    "max_scale": self._max_scale,
                    "_hysteresis_tracker": (
                        int(self._hysteresis_tracker.item()) if self._hysteresis_tracker is not None else self._init_hysteresis_tracker
                    ),
                    "stats": self._stats.tolist() if self._stats is not None else list(self._init_stats),
                }
            )
        return sd

    def _validate_state_dict(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Every entry of a state dict checked; returns the values to apply (raises before
        anything changes)."""
        for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
            if state_dict and key not in state_dict:  # torch's error type for a missing entry
                raise KeyError(f"GradScaler state dict has no '{key}' entry.")
        entries = {k: engine_value(v) for k, v in state_dict.items() if isinstance(k, str)}
        return torch.ops.ampfuse.scaler_checkpoint_check(
            entries, self._hysteresis, self._consecutive_hysteresis, self._min_scale, self._max_scale,
            list(self._init_stats), "the state dict")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this scaler or of ``torch.amp.GradScaler``. Every entry is checked
        before anything changes; a scale outside [min_scale, max_scale] is clamped into them."""
        if not self._enabled:
            return
        v = self._validate_state_dict(state_dict)
        super().load_state_dict(state_dict)
        self._hysteresis = v["hysteresis"]
        self._consecutive_hysteresis = v["consecutive_hysteresis"]
        self._min_scale = v["min_scale"]
        self._max_scale = v["max_scale"]
        self._init_scale = self._clamped(v["scale"], "the loaded scale")
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
        self._init_hysteresis_tracker = v["hysteresis_tracker"]
        self._init_stats = v["stats"]
        self._floor_hits_seen = v["stats"][ops.ScaleStat.FLOOR_HITS]
        self._pending_stats = []
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(v["hysteresis_tracker"])
        if self._stats is not None:
            self._stats.copy_(torch.tensor(v["stats"], dtype=torch.int64))

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_hysteresis_tracker"] = (
                int(self._hysteresis_tracker.item()) if self._hysteresis_tracker is not None else self._init_hysteresis_tracker
            )
            state["_init_stats"] = self._stats.tolist() if self._stats is not None else list(self._init_stats)
            state["_hysteresis_tracker"] = None
            state["_stats"] = None
            state["_last_found_inf"] = None
        state["_pending_stats"] = []
        return state


def init_scale_first(device: str, torch_class: type, module: str) -> type:
    """The drop-in for a deprecated ``torch.<device>.amp.GradScaler``, whose first positional
    argument is ``init_scale``: ``ampfuse.GradScaler(device, ...)`` with that signature (and
    ``isinstance`` of the torch class)."""

    class GradScaler(_AmpfuseGradScaler, torch_class):
        def __init__(
            self,
            init_scale: float = 2.0**16,
            growth_factor: float = 2.0,
            backoff_factor: float = 0.5,
            growth_interval: int = 2000,
            enabled: bool = True,
            *,
            hysteresis: int = 1,
            consecutive_hysteresis: bool = False,
            min_scale: float | None = None,
            max_scale: float | None = None,
            on_min_scale: OnMinScale = "warn",
        ) -> None:
            # torch's deprecated classes warn so (torch's test_grad_scaler_deprecated_warning
            # matches the first sentence); the replacement named is ampfuse's.
            warnings.warn(
                f"`torch.{device}.amp.GradScaler(args...)` is deprecated (`{module}.GradScaler` mirrors it). "
                f"Please use `ampfuse.GradScaler('{device}', args...)` instead.",
                FutureWarning,
                stacklevel=2,
            )
            _AmpfuseGradScaler.__init__(
                self, device, init_scale, growth_factor, backoff_factor, growth_interval, enabled,
                hysteresis=hysteresis, consecutive_hysteresis=consecutive_hysteresis, min_scale=min_scale,
                max_scale=max_scale, on_min_scale=on_min_scale)

    GradScaler.__module__ = module
    GradScaler.__qualname__ = "GradScaler"
    GradScaler.__doc__ = (
        f"``ampfuse.GradScaler({device!r}, ...)`` with the signature of the deprecated "
        f"``torch.{device}.amp.GradScaler`` (``init_scale`` first) and ``isinstance`` of it; the "
        "keyword-only extensions of :class:`ampfuse.GradScaler` as well."
    )
    return GradScaler


_AmpfuseGradScaler = GradScaler
