"""Rules the Python modules share: which keys a ``grads=`` mapping may hold, and how a value
reaches the engine's checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["check_grads_keys", "engine_value"]


def check_grads_keys(param_groups: list[dict[str, Any]], grads: Mapping) -> None:
    """Every key of ``grads`` must be one of the optimizer's params (the tensor itself: a tensor
    key is found by identity, so ``p.detach()`` or a copy would silently be ignored)."""
    if not grads:
        return
    ids = {id(p) for g in param_groups for p in g["params"]}
    for key in grads:
        if id(key) not in ids:
            what = (f"a tensor of shape {tuple(key.shape)} and dtype {key.dtype}" if isinstance(key, torch.Tensor)
                    else f"{type(key).__name__} {key!r}")
            raise ValueError(
                f"grads has a key that is not a parameter of this optimizer ({what}); its keys must be the "
                "parameters themselves (not p.detach(), p.data or a copy)."
            )


def engine_value(v: Any) -> Any:
    """``v`` as the engine's checks take it: the values a checkpoint entry can hold pass as they
    are; anything else as its repr (refused, and named, by the check)."""
    if v is None or isinstance(v, (bool, int, float, str, torch.Tensor)):
        return v
    if isinstance(v, (list, tuple)) and (all(type(x) is int for x in v) or all(type(x) is bool for x in v)):
        return v
    return repr(v)
