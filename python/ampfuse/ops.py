"""Typed wrappers around the ``torch.ops.ampfuse`` custom ops, and their fake kernels.

The schemas and kernels live in the native library (``csrc/``); these wrappers only give the ops
Python signatures and docstrings. ``torch.compile`` and ``FakeTensorMode`` trace the ops through
their Meta kernels, registered in C++ with the very checks (and messages) of the real kernels.
"""

from __future__ import annotations

import enum

from collections.abc import Sequence
from typing import Any

import torch

from ampfuse._library import dtensor_support as _dtensor_support, load_library

load_library()


__all__ = [
    "unscale_check_",
    "unscale_check_norm_",
    "check_norm_",
    "clip_coef",
    "update_scale_",
    "accumulate_grads_",
    "sgd_step_",
    "adam_step_",
    "quantize_blocks",
    "dequantize_blocks",
    "QUANT_BLOCK",
    "join_master",
    "split_master",
    "NUM_SCALE_STATS",
    "ScaleStat",
]

# The members come from the native library's one list, so a type checker cannot know them.
_make_enum: Any = enum.IntEnum
ScaleStat: Any = _make_enum("ScaleStat", [(n, i) for i, n in enumerate(torch.ops.ampfuse.scale_stat_names())])
ScaleStat.__module__ = __name__
ScaleStat.__doc__ = """Indices into the ``stats`` tensor written by :func:`update_scale_` (the native library's list).

    ``UPDATES``: ``update_scale_`` calls; ``OVERFLOWS``: calls that saw found_inf != 0 (skipped steps);
    ``BACKOFFS``: overflows that reduced the scale; ``FLOOR_HITS``: backoffs clamped at the floor
    (min_scale or the smallest normal fp32).
    """

#: Number of int64 counters in the ``stats`` tensor of :func:`update_scale_`.
NUM_SCALE_STATS = len(ScaleStat)


def unscale_check_(
    tensors: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor | None = None,
    *,
    scale: torch.Tensor | None = None,
    overwrite_found_inf: bool = False,
) -> None:
    """Multiply every tensor in place by ``inv_scale`` and flag non-finite values.

    A drop-in for ``torch._amp_foreach_non_finite_check_and_unscale_`` (same positional
    arguments and semantics) that accepts fp16, bf16, fp32 and fp64 tensors mixed in one list,
    any layout, on CPU or CUDA (bf16 included), in one pass.

    Args:
        tensors: tensors on one device, unscaled in place (even when non-finite values are
            present; an ``inv_scale`` of exactly 1 leaves them untouched).
        found_inf: 1-element float32 tensor on the same device; set to 1.0 if any element of
            any tensor is inf or NaN, never reset (the caller zeroes it) unless
            ``overwrite_found_inf``.
        inv_scale: 1-element float32 tensor on the same device.
        scale: instead of ``inv_scale``, the loss scale (see :func:`unscale_check_norm_`).
        overwrite_found_inf: set ``found_inf`` to 0 or 1 (it needs no zeroing beforehand).
    """
    _dtensor_support()
    torch.ops.ampfuse.unscale_check_(tensors, found_inf, inv_scale, scale=scale, overwrite_found_inf=overwrite_found_inf)


def unscale_check_norm_(
    tensors: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor | None = None,
    *,
    norm_type: float = 2.0,
    max_norm: float | None = None,
    per_tensor_found_inf: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    overwrite_found_inf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`unscale_check_` plus the global norm and the clip coefficient, in the same pass.

    Args:
        tensors, found_inf, inv_scale: as for :func:`unscale_check_`.
        norm_type: 2.0 or ``inf``; the norm of all unscaled values, accumulated in fp32 (in
            fp64 when ``tensors`` holds an fp64 tensor, whose norm may exceed the fp32 range).
        max_norm: if given, ``clip_coef = min(1, max_norm / (total_norm + 1e-6))`` as
            ``torch.nn.utils.clip_grad_norm_`` computes it; otherwise ``clip_coef`` is 1.
        per_tensor_found_inf: optional float32 tensor of shape ``[len(tensors)]``; entry ``i``
            is set to 1.0 if ``tensors[i]`` holds a non-finite value (never reset).
        scale: instead of ``inv_scale``, the loss scale itself (a 1-element float32 tensor):
            the kernel multiplies by ``float(1 / double(scale))`` as ``torch.amp.GradScaler``
            computes its ``inv_scale``, with no reciprocal launch of its own. Pass exactly one.
        overwrite_found_inf: set ``found_inf`` to 0 or 1 instead of only setting it to 1 on a
            non-finite value, so it needs no zeroing (``torch.empty`` will do).

    Returns:
        ``(total_norm, clip_coef)``: 0-dim tensors on the tensors' device (float32; total_norm
        float64 with an fp64 tensor in the list). The tensors are not multiplied by
        ``clip_coef``.
    """
    _dtensor_support()
    return torch.ops.ampfuse.unscale_check_norm_(
        tensors,
        found_inf,
        inv_scale,
        norm_type=norm_type,
        max_norm=max_norm,
        per_tensor_found_inf=per_tensor_found_inf,
        scale=scale,
        overwrite_found_inf=overwrite_found_inf,
    )


def check_norm_(
    tensors: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor | None = None,
    *,
    norm_type: float = 2.0,
    max_norm: float | None = None,
    per_tensor_found_inf: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    overwrite_found_inf: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read-only :func:`unscale_check_norm_`: the tensors are read once and never written.

    This is the check pass of the fused optimizer step: it sets ``found_inf`` and returns the
    norm and clip coefficient of ``tensors * inv_scale`` (or ``tensors / scale``) without
    materialising them.
    """
    _dtensor_support()
    return torch.ops.ampfuse.check_norm_(
        tensors,
        found_inf,
        inv_scale,
        norm_type=norm_type,
        max_norm=max_norm,
        per_tensor_found_inf=per_tensor_found_inf,
        scale=scale,
        overwrite_found_inf=overwrite_found_inf,
    )


def clip_coef(
    total_norm: torch.Tensor, max_norm: float | torch.Tensor
) -> torch.Tensor:
    """The clip coefficient of ``total_norm`` by the rule of the fused check ops (and of
    ``torch.nn.utils.clip_grad_norm_``): ``min(1, max_norm / (total_norm + 1e-6))`` -- for a float
    ``max_norm`` computed as reciprocal-then-multiply, for a tensor one as a true division, in the
    norm's precision. For norms combined outside one check pass (several devices, several ranks).

    Args:
        total_norm: 1-element float32 or float64 tensor.
        max_norm: a positive finite number, or a 1-element floating-point tensor (cast to
            float32, moved to ``total_norm``'s device).

    Returns:
        A 0-dim float32 tensor on ``total_norm``'s device (no host sync).
    """
    if isinstance(max_norm, torch.Tensor):
        t = max_norm.reshape(())
        if t.dtype != torch.float32 or t.device != total_norm.device:
            t = t.to(device=total_norm.device, dtype=torch.float32, non_blocking=True)
        _dtensor_support()
        return torch.ops.ampfuse.clip_coef(total_norm, max_norm_tensor=t)
    _dtensor_support()
    return torch.ops.ampfuse.clip_coef(total_norm, max_norm=float(max_norm))


#: Values per block of the 8-bit block-scaled state form (:func:`quantize_blocks`).
QUANT_BLOCK = 256


def quantize_blocks(
    values: torch.Tensor, dtype: torch.dtype, *, nonnegative: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit block-scaled form of fp32 ``values``, as the optimizers keep 8-bit state.

    ``values`` is cut, in its flat order, into blocks of :data:`QUANT_BLOCK` values (the last one
    may be shorter). Each block keeps its absmax (largest finite magnitude) and one byte per value,
    the entry of a table of magnitudes in ``[0, 1]`` nearest to ``|value| / absmax`` (ties: the
    even entry):

    * ``torch.uint8``: the dynamic map of Dettmers et al. (2022), a sign bit and 128 magnitudes
      over seven decades, or with ``nonnegative`` 256 magnitudes and no sign;
    * ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``: the fp8 number nearest to
      ``value / absmax * 448`` (``57344``), so the codes are fp8 values scaled per block.

    A block's largest finite value decodes to exactly its absmax, and requantizing the decoded
    values gives the same codes and absmax. An inf or a NaN decodes as itself: its block is marked
    (absmax stored negated) and two of its codes stand for inf (with the sign) and NaN; the other
    values keep their precision (the manual's Ops page, "8-bit block-scaled state").

    Args:
        values: float32 tensor, any shape.
        dtype: ``torch.uint8``, ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        nonnegative: the values are a second moment: negative values encode as 0 and a positive
            value never as 0 (the smallest positive entry instead).

    Returns:
        ``(codes, absmax)``: codes of ``values``' shape and ``dtype``, and a 1-D float32 tensor of
        ``ceil(numel / QUANT_BLOCK)`` absmax values, on ``values``' device.
    """
    return torch.ops.ampfuse.quantize_blocks(values, dtype, nonnegative=nonnegative)


def dequantize_blocks(codes: torch.Tensor, absmax: torch.Tensor, *, nonnegative: bool = False) -> torch.Tensor:
    """The float32 values of :func:`quantize_blocks`' ``(codes, absmax)``: each code's table entry
    times its block's absmax. ``nonnegative`` must be what the codes were made with (it selects the
    ``torch.uint8`` table)."""
    return torch.ops.ampfuse.dequantize_blocks(codes, absmax, nonnegative=nonnegative)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    hysteresis: int = 1,
    hysteresis_tracker: torch.Tensor | None = None,
    consecutive_hysteresis: bool = False,
    min_scale: float | None = None,
    max_scale: float | None = None,
    stats: torch.Tensor | None = None,
) -> None:
    """Update the loss scale in place on its device (no host sync).

    The first six arguments are those of ``torch._amp_update_scale_``. With the defaults the
    rule is torch's bit for bit (backoff on overflow, growth after ``growth_interval`` clean
    steps, no growth past finite fp32), except that the scale never falls below the smallest
    normal float32 (torch lets it decay to denormals and 0, which silently stops training).

    Args:
        scale: 1-element float32 tensor, updated in place.
        growth_tracker: 1-element int32 tensor (consecutive clean steps), updated in place.
        found_inf: 1-element float32 tensor; non-zero means this step overflowed.
        growth_factor: > 1. backoff_factor: in (0, 1). growth_interval: >= 1.
        hysteresis: back off only on the ``hysteresis``-th overflow since the budget was last
            refilled (1 = every overflow, torch's rule).
        hysteresis_tracker: 1-element int32 tensor holding the remaining budget (initialise it to
            ``hysteresis``); required when ``hysteresis > 1`` or ``consecutive_hysteresis``.
        consecutive_hysteresis: refill the budget after every clean step (default: only when the
            scale grows).
        min_scale, max_scale: bounds for the scale.
        stats: optional int64 tensor of :data:`NUM_SCALE_STATS` counters (see :class:`ScaleStat`),
            incremented in place.
    """
    _dtensor_support()
    torch.ops.ampfuse.update_scale_(
        scale,
        growth_tracker,
        found_inf,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis=hysteresis,
        hysteresis_tracker=hysteresis_tracker,
        consecutive_hysteresis=consecutive_hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
        stats=stats,
    )


def accumulate_grads_(
    accumulators: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    *,
    zero_grads: bool = True,
) -> None:
    """``accumulators[i] += grads[i]`` in fp32, in one pass over all tensors.

    Args:
        accumulators: fp32 tensors (any layout), updated in place.
        grads: fp16, bf16 or fp32 tensors of the same shapes on the same device; set to zero in
            the same pass when ``zero_grads`` (ready for the next micro-batch's backward).
        found_inf: 1-element float32 tensor; set to 1.0 if any sum is inf or NaN -- an inf/NaN
            grad element, or finite grads whose fp32 sum overflowed (never reset: zero it once per
            accumulation window).
    """
    _dtensor_support()
    torch.ops.ampfuse.accumulate_grads_(accumulators, grads, found_inf, zero_grads=zero_grads)


def sgd_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    momentum: float | torch.Tensor = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    clip_coef: torch.Tensor | None = None,
    momentum_absmax: Sequence[torch.Tensor] = (),
    rounding_seed: int | None = None,
) -> None:
    """One fused ``torch.optim.SGD`` step over a list of tensors, in one pass.

    Args:
        params: fp16, bf16 or fp32 tensors (one dtype), updated in place; with masters they
            receive the updated masters rounded to nearest.
        grads: fp16, bf16 or fp32 (one dtype), same shapes; read only, possibly still scaled.
        master_params: fp32 master copies of ``params`` (updated in place), or ``[]``.
        momentum_buffers: fp32 buffers, one per param when ``momentum != 0``, else ``[]``. A
            buffer is initialised to the gradient on the first step actually taken (``steps[i] == 0``).
        steps: 1-element fp32 counters, incremented by one.
        lr: float, or a 1-element fp32 tensor on the params' device (capturable schedules).
        momentum: float, or a 1-element fp32 tensor on the params' device, read at the step (a
            schedule that cycles it on the device); a tensor means momentum buffers, whatever
            its value.
        grad_scale: grads are divided by it. clip_coef: and multiplied by it.
        found_inf: if non-zero, nothing at all is modified (params, masters, buffers, steps).
        momentum_absmax: with 8-bit buffers (``torch.uint8``, ``torch.float8_e4m3fn`` or
            ``torch.float8_e5m2`` codes of :func:`quantize_blocks`), each buffer's block absmax
            (updated in place); else ``()``. A block is dequantized, updated in fp32 and
            requantized with its new absmax in the same pass.
        rounding_seed: given, bf16 params without masters are written rounded stochastically:
            up in magnitude with probability (the fp32 update's dropped 16 bits) / 65536, so the
            rounding is unbiased. The draws are a hash of the seed, the param's step count, the
            element's index in the param and the param's bits before the update: the same on
            every backend, and again after a checkpoint. None: rounded to nearest.
    """
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    momentum_tensor = momentum if isinstance(momentum, torch.Tensor) else None
    _dtensor_support()
    torch.ops.ampfuse.sgd_step_(
        params, grads, master_params, momentum_buffers, steps,
        lr=0.0 if lr_tensor is not None else float(lr), lr_tensor=lr_tensor,
        momentum=0.0 if momentum_tensor is not None else float(momentum), momentum_tensor=momentum_tensor,
        dampening=dampening, weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
        grad_scale=grad_scale, found_inf=found_inf, clip_coef=clip_coef,
        momentum_absmax=list(momentum_absmax), rounding_seed=rounding_seed,
    )


def adam_step_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    master_params: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float | torch.Tensor = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    clip_coef: torch.Tensor | None = None,
    exp_avg_absmax: Sequence[torch.Tensor] = (),
    exp_avg_sq_absmax: Sequence[torch.Tensor] = (),
    max_exp_avg_sq_absmax: Sequence[torch.Tensor] = (),
    rounding_seed: int | None = None,
) -> None:
    """One fused ``torch.optim.Adam`` (``decoupled_weight_decay=True``: ``AdamW``) step.

    Same conventions as :func:`sgd_step_`; ``exp_avgs``/``exp_avg_sqs`` (and ``max_exp_avg_sqs``
    with ``amsgrad``, else ``[]``) are fp32 or bf16, or all 8-bit codes, each list with its
    ``*_absmax`` list (the second moments in the ``nonnegative`` form of :func:`quantize_blocks`).
    Bias corrections use each tensor's own step (and the step's beta1: ``beta1`` may be a
    1-element fp32 tensor on the params' device, read at the step, as ``lr``).
    """
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    beta1_tensor = beta1 if isinstance(beta1, torch.Tensor) else None
    _dtensor_support()
    torch.ops.ampfuse.adam_step_(
        params, grads, master_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
        lr=0.0 if lr_tensor is not None else float(lr), lr_tensor=lr_tensor,
        beta1=0.0 if beta1_tensor is not None else float(beta1), beta1_tensor=beta1_tensor,
        beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
        decoupled_weight_decay=decoupled_weight_decay, grad_scale=grad_scale,
        found_inf=found_inf, clip_coef=clip_coef, exp_avg_absmax=list(exp_avg_absmax),
        exp_avg_sq_absmax=list(exp_avg_sq_absmax), max_exp_avg_sq_absmax=list(max_exp_avg_sq_absmax),
        rounding_seed=rounding_seed,
    )


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of bf16 ``param`` and int16 ``remainder`` (a new tensor): bits
    ``(bits(param) << 16) + remainder``.

    The param holds the master's upper 16 bits rounded to nearest (ties away from zero) and the
    remainder the rest, so the pair *is* the fp32 master bit for bit (see :func:`split_master`).
    Where the pair cannot come from :func:`split_master` -- a param edited since (zero, inf or NaN
    with an incompatible remainder) -- the master is the param's value, as the kernels do.
    DTensors (one mesh and placements, not ``Partial``) work on their local tensors.
    """
    _dtensor_support()
    return torch.ops.ampfuse.join_master(param, remainder)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(param, remainder)``: the bf16 param and int16 remainder whose :func:`join_master` is
    fp32 ``master`` bit for bit (NaN stays a quiet NaN with remainder 0).

    The param is the master rounded to nearest, ties away from zero: with round-half-even an even
    param could stand for 65537 masters (its two ties included), one more than 16 bits tell apart.
    So for 1 master value in 65536 (an exact tie) the param is one bf16 ulp away from
    ``master.to(torch.bfloat16)``; it is still a nearest value, and the master is exact.
    """
    _dtensor_support()
    return torch.ops.ampfuse.split_master(master)
