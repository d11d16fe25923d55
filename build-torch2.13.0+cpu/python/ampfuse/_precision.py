"""16-bit master remainders: the fp32 master of a bf16 param kept as (param, int16 remainder).

The param holds the master's upper 16 bits rounded to nearest (ties away from zero) and the
remainder ``bits(master) - (bits(param) << 16)``, so the pair *is* the fp32 master bit for bit.
These are the host-side (torch) twins of ``join_master``/``split_master`` in ``csrc/ops/rules.h``,
used to build remainders from fp32 masters and to reconstruct masters for checkpoints.

Why ties away from zero: with round-half-even params an even param can hold 65537 masters (its
two ties included), one more than 16 bits can tell apart. So 1 master value in 65536 (an exact
tie) gives a param one bf16 ulp away from ``master.to(torch.bfloat16)``; it is still a nearest
value, and the master itself is exact.
"""

from __future__ import annotations

import torch

__all__ = ["join_master", "split_master"]

_U32 = 0xFFFFFFFF


def _as_uint32(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & _U32


def _from_uint32(u: torch.Tensor) -> torch.Tensor:
    signed = torch.where(u >= 2**31, u - 2**32, u)
    return signed.to(torch.int32).view(torch.float32)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of bf16 ``param`` and int16 ``remainder`` (a new tensor).

    Where the pair cannot come from :func:`split_master` -- a param edited since (zero, inf or
    NaN with an incompatible remainder) -- the master is the param's value, as the kernels do.
    """
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise TypeError(f"join_master needs a torch.bfloat16 param and a torch.int16 remainder, got {param.dtype} and {remainder.dtype}.")
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
    b = _as_uint32(master.contiguous())
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    hi = (b + 0x8000) >> 16
    rem = torch.where(nan, torch.zeros_like(b), b - (hi << 16))
    p = torch.where(nan, (b >> 16) | 0x40, hi) & 0xFFFF
    p16 = torch.where(p >= 0x8000, p - 0x10000, p).to(torch.int16).view(torch.bfloat16)
    return p16.reshape(master.shape), rem.to(torch.int16).reshape(master.shape)
