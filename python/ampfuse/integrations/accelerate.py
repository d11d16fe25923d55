"""ampfuse in Hugging Face Accelerate: ``enable(accelerator)``, right after the ``Accelerator`` is built.

On that accelerator only: the scaler becomes an :class:`ampfuse.GradScaler`, prepared ampfuse
optimizers report their skipped steps (``step_was_skipped``, read lazily, when something asks), a
prepared schedule of an ampfuse optimizer becomes its device twin
(:func:`ampfuse.lr_scheduler.device_twin`: it advances only on the steps taken, and its wrapper
never asks whether a step was skipped), other schedules do not advance on skipped steps,
``clip_grad_norm_`` runs the fused read-only check + norm pass (fp16 params included), and on a
CPU ``mixed_precision="fp16"`` becomes real. DeepSpeed, Megatron-LM, XLA and FSDP are refused. The
whole contract: the manual's Integrations page (``docs/integrations.md``).
"""

from __future__ import annotations

import types
from typing import Any, Iterable

import torch

import ampfuse
from ampfuse.integrations._common import (
    device_schedule,
    is_fused,
    norm_and_coef,
    params_with_grad,
    require,
    scaled_clip_norm_,
    scaled_clip_value_,
    scaler_enabled,
    unscale_stage_open,
)
from ampfuse.optim import StepScaling

require("accelerate", "accelerate", "accelerate", "accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.scheduler import AcceleratedScheduler  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["enable", "is_enabled"]

# Distributed types whose gradients are plain tensors, complete on every rank before the step.
_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class _AcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper, with the skip of an ampfuse optimizer's step read from the
    device flag (lazily) and a pending clip coefficient for scaler-less steps."""

    _ampfuse_skip_flag: torch.Tensor | None = None
    _ampfuse_clip_coef: torch.Tensor | None = None

    @property
    def last_step_skipped(self) -> torch.Tensor | None:
        """The wrapped ampfuse optimizer's device skip flag (see ampfuse.optim), for device schedules."""
        return self.optimizer.last_step_skipped if is_fused(self.optimizer) else None

    def step(self, closure: Any = None) -> None:
        if not (is_fused(self.optimizer) and self.gradient_state.sync_gradients):
            return super().step(closure)
        coef, self._ampfuse_clip_coef = self._ampfuse_clip_coef, None
        if scaler_enabled(self.scaler):
            super().step(closure)  # scaler.step + update; the fused step is queued, no host sync
            # this optimizer's own flag: the scaler's last check may be another optimizer's
            self._ampfuse_skip_flag = self.optimizer.last_step_skipped
        else:
            self._ampfuse_skip_flag = None
            if coef is not None:
                self.optimizer.step(closure, scaling=StepScaling(clip_coef=coef))
            else:
                self.optimizer.step(closure)
        self._is_overflow = False

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step was skipped (inf/NaN gradients); for ampfuse optimizers read from
        the optimizer's device flag on first access after the step (one 4-byte read), and never
        when nothing asks."""
        flag = self._ampfuse_skip_flag
        if flag is not None:
            self._ampfuse_skip_flag = None
            self._is_overflow = bool(flag.item() != 0)
        return self._is_overflow


class _AcceleratedDeviceScheduler(AcceleratedScheduler):
    """Accelerate's scheduler wrapper over a device schedule: stepped at every optimizer step
    (num_processes times without split_batches, as Accelerate does), never asking whether the step
    was skipped: the schedule counts only the steps taken, on the device."""

    total_steps: int | None = None  # a OneCycleLR's: Accelerate's guard steps it only while below
    calls = 0

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.gradient_state.sync_gradients:
            return
        for _ in range(1 if self.split_batches else AcceleratorState().num_processes):
            total = self.total_steps
            # Accelerate's guard, on the steps taken: read only once the calls could have reached it
            if total is not None and self.calls >= total and self.scheduler.last_epoch >= total:
                continue
            self.calls += 1
            self.scheduler.step(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.calls = int(state_dict.get("_step_count", 1)) - 1  # the steps the loaded state counted


def _prepare_scheduler(self: Any, scheduler: Any) -> Any:
    owner = next((o for o in self._optimizers if isinstance(o, _AcceleratedOptimizer) and is_fused(o.optimizer)
                  and getattr(scheduler, "optimizer", None) in (o, o.optimizer)), None)
    if owner is None or getattr(scheduler, "_is_accelerate_prepared", False) or not self.step_scheduler_with_optimizer:
        # a schedule stepped by the loop itself (once per epoch, say) counts those steps: torch's, as it is
        return type(self).prepare_scheduler(self, scheduler)
    twin = device_schedule(scheduler)
    if twin is None:  # its wrapper asks the optimizer whether each step was skipped (one read each)
        return type(self).prepare_scheduler(self, scheduler)
    total = getattr(scheduler, "total_steps", None)
    out = _AcceleratedDeviceScheduler(twin, owner, step_with_optimizer=self.step_scheduler_with_optimizer,
                                      split_batches=self.split_batches)
    out.total_steps = total if isinstance(total, int) else None
    self._schedulers.append(out)
    return out


def _fused_owner(accelerator: Any, params: list[torch.Tensor]) -> _AcceleratedOptimizer | None:
    """The prepared ampfuse optimizer whose parameters with gradients are exactly those of
    ``params`` with gradients (None when there is no such single optimizer)."""
    wanted = {id(p) for p in params if p.grad is not None}
    if not wanted:
        return None
    for opt in accelerator._optimizers:
        if isinstance(opt, _AcceleratedOptimizer) and is_fused(opt.optimizer):
            if {id(p) for p in params_with_grad(opt.optimizer)} == wanted:
                return opt
    return None


def _clip_grad_norm_(self: Any, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> torch.Tensor:
    params = list(parameters)
    owner = _fused_owner(self, params) if self.distributed_type in _SUPPORTED else None
    if owner is None:
        return type(self).clip_grad_norm_(self, params, max_norm, norm_type)
    inner = owner.optimizer
    if scaler_enabled(self.scaler):
        if unscale_stage_open(self.scaler, inner):
            return scaled_clip_norm_(self.scaler, inner, float(max_norm), norm_type)
        # already unscaled in place (accelerator.unscale_gradients): torch's clipping applies
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    norm, coef = norm_and_coef(inner, float(max_norm), norm_type)
    owner._ampfuse_clip_coef = coef if owner._ampfuse_clip_coef is None else owner._ampfuse_clip_coef * coef
    return norm


def _clip_grad_value_(self: Any, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    params = list(parameters)
    owner = _fused_owner(self, params) if self.distributed_type in _SUPPORTED else None
    if owner is None or not scaler_enabled(self.scaler) or not unscale_stage_open(self.scaler, owner.optimizer):
        return type(self).clip_grad_value_(self, params, clip_value)
    scaled_clip_value_(self.scaler, owner.optimizer, clip_value)


def _prepare_optimizer(self: Any, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
    out = type(self).prepare_optimizer(self, optimizer, device_placement=device_placement)
    if type(out) is AcceleratedOptimizer:
        out.__class__ = _AcceleratedOptimizer
    return out


def is_enabled(accelerator: Accelerator) -> bool:
    """Whether :func:`enable` was called on ``accelerator``."""
    return getattr(accelerator, "_ampfuse_enabled", False)


def enable(accelerator: Accelerator, **grad_scaler_kwargs: Any) -> Accelerator:
    """Make ``accelerator`` train with ampfuse (see the module docstring). Returns it.

    Args:
        accelerator: a freshly built ``accelerate.Accelerator`` (before ``prepare``).
        **grad_scaler_kwargs: arguments of :class:`ampfuse.GradScaler` (``init_scale``,
            ``growth_interval``, ``hysteresis``, ``min_scale``, ...). Without them, the values of
            the accelerator's ``GradScalerKwargs`` handler, else the scaler's defaults.

    Raises:
        RuntimeError: when an optimizer was already prepared, or for a distributed type ampfuse
            does not support here (DeepSpeed, Megatron-LM, XLA, FSDP).
    """
    if is_enabled(accelerator):
        return accelerator
    if accelerator._optimizers:
        raise RuntimeError("ampfuse.integrations.accelerate.enable() must be called before accelerator.prepare(...) "
                           "prepares an optimizer.")
    if accelerator.distributed_type not in _SUPPORTED:
        raise RuntimeError(f"ampfuse.integrations.accelerate supports single-process, DDP (CPU or GPU) training; "
                           f"this accelerator uses {accelerator.distributed_type}.")
    if accelerator.mixed_precision == "fp16":
        kwargs = dict(accelerator.scaler_handler.to_kwargs()) if accelerator.scaler_handler is not None else {}
        kwargs.update(grad_scaler_kwargs)
        accelerator.scaler = ampfuse.GradScaler(accelerator.device.type, **kwargs)
        accelerator.native_amp = True  # on a CPU too: fp16 autocast in prepare_model
    elif grad_scaler_kwargs:
        raise ValueError(f"grad_scaler_kwargs were given but mixed_precision is {accelerator.mixed_precision!r}: "
                         "only fp16 uses a loss scaler.")
    accelerator.prepare_optimizer = types.MethodType(_prepare_optimizer, accelerator)
    accelerator.prepare_scheduler = types.MethodType(_prepare_scheduler, accelerator)
    accelerator.clip_grad_norm_ = types.MethodType(_clip_grad_norm_, accelerator)
    accelerator.clip_grad_value_ = types.MethodType(_clip_grad_value_, accelerator)
    accelerator._ampfuse_enabled = True
    return accelerator
