"""16-bit master remainders: the fp32 master of a bf16 param kept as (param, int16 remainder).

The param holds the master's upper 16 bits rounded to nearest (ties away from zero) and the
remainder ``bits(master) - (bits(param) << 16)``, so the pair *is* the fp32 master bit for bit.
These are the host-side (torch) twins of ``join_master``/``split_master`` in ``csrc/ops/rules.h``,
used to build remainders from fp32 masters and to reconstruct masters for checkpoints.

Why ties away from zero: with round-half-even params an even param can hold 65537 masters (its
two ties included), one more than 16 bits can tell apart. So 1 master value in 65536 (an exact
tie) gives a param one bf16 ulp away from ``master.to(torch.bfloat16)``; it is still a nearest
value, and the master itself is exact.

DTensors (FSDP2, tensor parallel): both helpers work elementwise, so they run on the local
tensors and return DTensors with the arguments' mesh and placements (any ``Shard`` kind or
``Replicate``). torch's integer ops on DTensors cannot be trusted for this: in torch 2.14
``x << 16`` on a DTensor returns ``x`` unshifted (``torch.bitwise_left_shift`` shifts), hence the
explicit local path. ``Partial`` tensors are refused: a master cannot be split or joined before
it is summed.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

__all__ = ["join_master", "split_master"]

_U32 = 0xFFFFFFFF


def _as_uint32(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & _U32


def _from_uint32(u: torch.Tensor) -> torch.Tensor:
    signed = torch.where(u >= 2**31, u - 2**32, u)
    return signed.to(torch.int32).view(torch.float32)


def _is_dtensor(x: Any) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")  # not imported: nothing is a DTensor
    return mod is not None and isinstance(x, mod.DTensor)


def _on_local(fn: Callable[..., Any], name: str, *xs: torch.Tensor) -> Any:
    """``fn`` on the local tensors of DTensor arguments (one mesh and placements, no Partial),
    its tensor results wrapped back as DTensors of the same mesh, placements, shape and stride."""
    from torch.distributed.tensor import DTensor

    if not all(_is_dtensor(x) for x in xs):
        raise TypeError(f"{name}: pass all tensors as DTensors or none (got a mix).")
    first = xs[0]
    for x in xs[1:]:
        if x.placements != first.placements or x.device_mesh != first.device_mesh or x.shape != first.shape:
            raise ValueError(f"{name}: the DTensors must have one shape, mesh and placements, got "
                             f"{tuple(first.shape)} {first.placements} and {tuple(x.shape)} {x.placements}.")
    if any(pl.is_partial() for pl in first.placements):
        raise ValueError(f"{name}: a Partial DTensor ({first.placements}) must be reduced first.")
    out = fn(*(x._local_tensor for x in xs))

    def wrap(t: torch.Tensor) -> Any:
        return DTensor.from_local(t, first.device_mesh, first.placements, run_check=False,
                                  shape=first.shape, stride=first.stride())

    return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of bf16 ``param`` and int16 ``remainder`` (a new tensor).

    Where the pair cannot come from :func:`split_master` -- a param edited since (zero, inf or
    NaN with an incompatible remainder) -- the master is the param's value, as the kernels do.
    """
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(f"join_master needs a torch.bfloat16 param and a torch.int16 remainder, got {param.dtype} and {remainder.dtype}.")
    if _is_dtensor(param) or _is_dtensor(remainder):
        return _on_local(join_master, "join_master", param, remainder)
    p = param.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    r = remainder.contiguous().to(torch.int64)
    mag = p & 0x7FFF
    plain = (mag > 0x7F80) | ((mag == 0x7F80) & (r >= 0)) | ((mag == 0) & (r < 0))
    bits = torch.where(plain, p << 16, ((p << 16) + r) & _U32)
    return _from_uint32(bits).reshape(param.shape)


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(param, remainder)``: the bf16 param and int16 remainder whose :func:`join_master` is
    fp32 ``master`` bit for bit (NaN stays a quiet NaN with remainder 0)."""
    if master.dtype != torch.float32:
        raise TypeError(f"split_master needs a torch.float32 master, got {master.dtype}.")
    if _is_dtensor(master):
        return _on_local(split_master, "split_master", master)
    b = _as_uint32(master.contiguous())
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    hi = (b + 0x8000) >> 16
    rem = torch.where(nan, torch.zeros_like(b), b - (hi << 16))
    p = torch.where(nan, (b >> 16) | 0x40, hi) & 0xFFFF
    p16 = torch.where(p >= 0x8000, p - 0x10000, p).to(torch.int16).view(torch.bfloat16)
    return p16.reshape(master.shape), rem.to(torch.int16).reshape(master.shape)
