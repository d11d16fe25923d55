"""ampfuse on torch.distributed: DTensor (FSDP2, tensor parallel) support for every op.

Importing this module (``import ampfuse`` does it once ``torch.distributed.tensor`` is loaded, and
every ampfuse op wrapper makes sure of it) registers a handler per ampfuse op with DTensor's op
dispatcher -- the mechanism torch uses for its own ``_amp_foreach_non_finite_check_and_unscale_``
(``found_inf_reduce_handler``) -- so the ops accept DTensor arguments:

* the elementwise work runs on each rank's local shards, in one fused call per
  (mesh, placements) group of tensors;
* what the ops reduce is combined across the mesh dimensions the tensors are sharded over, with
  one all-reduce per kind (no host sync): ``found_inf`` and per-tensor flags by MAX, the 2-norm by
  the SUM of squares, the inf-norm by MAX. Every rank of the mesh ends with the same found_inf,
  norm and clip coefficient (computed from the global norm by the fused ops' one rule,
  :func:`ampfuse.ops.clip_coef`), so scalers and optimizers stay identical on every rank;
* fused optimizer steps run on the local shards of params, grads, masters and state (the step
  counters and the scaler's scalars are plain tensors).

A list mixing DTensors and plain tensors, tensors of one call on different meshes, or a gradient
with a ``Partial`` placement (not yet reduced) is refused with a message naming the argument.
Ranks whose local shards are empty still take part in every collective, as FSDP2 requires.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["install"]

_installed = False


def install() -> None:
    """Register the DTensor handlers of the ampfuse ops (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.distributed.tensor import DTensor

    ops = torch.ops.ampfuse
    DTensor._op_dispatcher._custom_op_handlers.update({
        ops.unscale_check_.default: _check_handler,
        ops.unscale_check_norm_.default: _check_handler,
        ops.check_norm_.default: _check_handler,
        ops.accumulate_grads_.default: _accumulate_handler,
        ops.sgd_step_.default: _step_handler,
        ops.adam_step_.default: _step_handler,
        ops.clip_coef.default: _local_handler,
        ops.update_scale_.default: _local_handler,
    })
    _installed = True


# ---- helpers --------------------------------------------------------------------------------------


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def _local(x: Any, name: str) -> Any:
    """A scalar argument (found_inf, scale, lr, ...): a DTensor must be replicated; its local value."""
    DTensor = _dtensor_cls()
    if isinstance(x, DTensor):
        from torch.distributed.tensor import Replicate

        if not all(isinstance(pl, Replicate) for pl in x.placements):
            raise RuntimeError(f"ampfuse: {name} is a DTensor with placements {x.placements}; it must be replicated.")
        return x._local_tensor
    return x


def _local_list(xs: Sequence[torch.Tensor], name: str, want_dtensor: bool | None = None) -> tuple[list[torch.Tensor], bool]:
    """The local tensors of a list that is all DTensors or all plain tensors."""
    DTensor = _dtensor_cls()
    kinds = {isinstance(x, DTensor) for x in xs}
    if len(kinds) > 1:
        i = next(i for i, x in enumerate(xs) if isinstance(x, DTensor) != isinstance(xs[0], DTensor))
        raise RuntimeError(
            f"ampfuse: {name} mixes DTensors and plain tensors ({name}[0] is "
            f"{'a DTensor' if isinstance(xs[0], DTensor) else 'a torch.Tensor'}, {name}[{i}] is not); "
            "pass all of them as DTensors (e.g. FSDP2 parameters and their gradients) or all as local tensors."
        )
    is_dt = bool(kinds) and kinds.pop()
    if want_dtensor is not None and xs and is_dt != want_dtensor:
        raise RuntimeError(f"ampfuse: {name} must be {'DTensors' if want_dtensor else 'plain tensors'} like the params of the call.")
    return ([x._local_tensor for x in xs] if is_dt else list(xs)), is_dt


def _check_placements(xs: Sequence[Any], name: str) -> None:
    from torch.distributed.tensor import Partial

    for i, x in enumerate(xs):
        if any(isinstance(pl, Partial) for pl in x.placements):
            raise RuntimeError(
                f"ampfuse: {name}[{i}] has placements {x.placements}: a Partial (not yet reduced) tensor; "
                "reduce it first (e.g. .redistribute(placements=[Replicate()]) or let FSDP/DDP reduce the gradients)."
            )


def _groups(xs: Sequence[Any], name: str) -> dict[tuple, list[int]]:
    """Indices of `xs` (DTensors) grouped by (mesh, placements); one mesh per call."""
    _check_placements(xs, name)
    first = xs[0].device_mesh if xs else None
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(xs):
        mesh = x.device_mesh
        if mesh is not first and mesh != first:  # equal meshes may be distinct objects (FSDP2)
            raise RuntimeError(f"ampfuse: {name}[{i}] is on device mesh {mesh} but {name}[0] is on {first}; "
                               "call the op once per mesh.")
        groups.setdefault(tuple(x.placements), []).append(i)
    return groups


def _sharded_dims(x: Any) -> list[int]:
    """Mesh dimensions over which a DTensor's elements are split (a reduction must combine them)."""
    from torch.distributed.tensor import Shard

    return [d for d, pl in enumerate(x.placements) if isinstance(pl, Shard)]


def _all_reduce(t: torch.Tensor, mesh: Any, dims: list[int], op: Any) -> None:
    for d in dims:
        dist.all_reduce(t, op=op, group=mesh.get_group(d))


# ---- handlers -------------------------------------------------------------------------------------


def _normalize(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """All arguments by name (schema order, defaults filled)."""
    out = {}
    schema = op._schema
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            out[a.name] = None
    return out


def _check_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """unscale_check_ / unscale_check_norm_ / check_norm_ on DTensors: local fused passes per
    (mesh, placements) group, then found_inf, per-tensor flags and the norm combined across the
    mesh; the clip coefficient from the global norm."""
    a = _normalize(op, args, kwargs)
    tensors = a["tensors"]
    local, is_dt = _local_list(tensors, "tensors")
    found_inf = _local(a["found_inf"], "found_inf")
    inv_scale = _local(a.get("inv_scale"), "inv_scale")
    scale = _local(a.get("scale"), "scale")
    per_tensor = _local(a.get("per_tensor_found_inf"), "per_tensor_found_inf")
    with_norm = op is not torch.ops.ampfuse.unscale_check_.default
    norm_type = float(a.get("norm_type") or 2.0) if with_norm else 2.0
    max_norm = a.get("max_norm") if with_norm else None
    overwrite = bool(a.get("overwrite_found_inf", False))
    if not is_dt:  # reached through a DTensor scalar only: run on the local values
        return _local_handler(op, args, kwargs)
    groups = _groups(tensors, "tensors")
    device = found_inf.device
    inf = norm_type == float("inf")
    # per group: [found, flags...] (MAX) and the norm part (SUM of squares, or MAX)
    flag_parts: list[torch.Tensor] = []
    norm_parts: list[torch.Tensor] = []
    norm_dtype = torch.float64 if any(t.dtype == torch.float64 for t in local) else torch.float32
    group_list = list(groups.values())
    for idx in group_list:
        ts = [local[i] for i in idx]
        f = torch.empty((), dtype=torch.float32, device=device)
        flags = torch.zeros(len(idx), dtype=torch.float32, device=device) if per_tensor is not None else None
        kw: dict[str, Any] = {"scale": scale, "overwrite_found_inf": True}
        if with_norm:
            kw.update(norm_type=norm_type, per_tensor_found_inf=flags)
            norm, _ = op(ts, f, inv_scale, **kw)
            norm_parts.append(norm.to(norm_dtype) if inf else norm.to(norm_dtype).square())
        else:
            op(ts, f, inv_scale, **kw)
        flag_parts.append(f.reshape(1) if flags is None else torch.cat([f.reshape(1), flags]))
    # combine across the mesh: one all-reduce of the flags per mesh dim (MAX); one of the norms
    mesh = tensors[0].device_mesh
    sharded = sorted({d for idx in group_list for d in _sharded_dims(tensors[idx[0]])})
    reduce_groups = [_sharded_dims(tensors[idx[0]]) for idx in group_list]
    if len(set(map(tuple, reduce_groups))) == 1:
        flat_flags = torch.cat(flag_parts)
        _all_reduce(flat_flags, mesh, sharded, dist.ReduceOp.MAX)
        offsets, o = [], 0
        for part in flag_parts:
            offsets.append(o)
            o += part.numel()
        flag_parts = [flat_flags[off: off + p.numel()] for off, p in zip(offsets, flag_parts)]
        if norm_parts:
            flat_norm = torch.stack(norm_parts)
            _all_reduce(flat_norm, mesh, sharded, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
            norm_parts = list(flat_norm.unbind())
    else:  # groups sharded over different mesh dims: reduce each over its own
        for k, dims in enumerate(reduce_groups):
            _all_reduce(flag_parts[k], mesh, dims, dist.ReduceOp.MAX)
            if norm_parts:
                _all_reduce(norm_parts[k], mesh, dims, dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    found = torch.stack([p[0] for p in flag_parts]).amax()
    if overwrite:
        found_inf.copy_(found.reshape(found_inf.shape))
    else:
        torch.maximum(found_inf, found.reshape(found_inf.shape), out=found_inf)
    if per_tensor is not None:
        for idx, part in zip(group_list, flag_parts):
            sel = torch.tensor(idx, device=per_tensor.device)
            per_tensor.index_copy_(0, sel, torch.maximum(per_tensor.index_select(0, sel), part[1:]))
    if not with_norm:
        return None
    total = torch.stack(norm_parts)
    total = total.amax() if inf else total.sum().sqrt()
    if norm_dtype == torch.float32:
        total = total.to(torch.float32)
    if max_norm is not None:
        from ampfuse import ops as _ops

        coef = _ops.clip_coef(total, float(max_norm))
    else:
        coef = torch.ones((), dtype=torch.float32, device=device)
    return total, coef


def _accumulate_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    a = _normalize(op, args, kwargs)
    accs, acc_dt = _local_list(a["accumulators"], "accumulators")
    grads, grad_dt = _local_list(a["grads"], "grads")
    if acc_dt != grad_dt:
        raise RuntimeError(
            "ampfuse.accumulate_grads_: accumulators are " + ("DTensors" if acc_dt else "plain tensors")
            + " but grads are " + ("DTensors" if grad_dt else "plain tensors")
            + "; pass both as DTensors with the same placements, or both as local tensors (.to_local())."
        )
    found_inf = _local(a["found_inf"], "found_inf")
    if not grad_dt:
        return op(accs, grads, found_inf, zero_grads=a["zero_grads"])
    for i, (x, g) in enumerate(zip(a["accumulators"], a["grads"])):
        if x.placements != g.placements or (x.device_mesh is not g.device_mesh and x.device_mesh != g.device_mesh):
            raise RuntimeError(f"ampfuse.accumulate_grads_: accumulators[{i}] has placements {x.placements} but "
                               f"grads[{i}] has {g.placements}; they must match.")
    groups = _groups(a["grads"], "grads")
    f = torch.zeros((), dtype=torch.float32, device=found_inf.device)
    op(accs, grads, f, zero_grads=a["zero_grads"])
    dims = sorted({d for idx in groups.values() for d in _sharded_dims(a["grads"][idx[0]])})
    _all_reduce(f, a["grads"][0].device_mesh, dims, dist.ReduceOp.MAX)
    torch.maximum(found_inf, f.reshape(found_inf.shape), out=found_inf)
    return None


_STEP_LISTS = ("params", "grads", "master_params", "momentum_buffers", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")


def _step_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """sgd_step_ / adam_step_ on DTensors: the fused pass on every rank's local shards."""
    a = _normalize(op, args, kwargs)
    params = a["params"]
    local_params, is_dt = _local_list(params, "params")
    if is_dt:
        _groups(params, "params")  # one mesh, no Partial placements
    call: dict[str, Any] = {}
    for name, value in a.items():
        if name in _STEP_LISTS:
            xs = value or []
            loc, _ = _local_list(xs, name, want_dtensor=is_dt if (xs and name != "steps") else None)
            if is_dt and xs:
                for i, (x, p) in enumerate(zip(xs, params)):
                    if x.placements != p.placements:
                        raise RuntimeError(f"ampfuse.{op._schema.name.split('::')[1]}: {name}[{i}] has placements "
                                           f"{x.placements} but params[{i}] has {p.placements}; they must match.")
            call[name] = loc
        elif name == "steps":
            call[name] = [_local(s, f"steps[{i}]") for i, s in enumerate(value)]
        else:
            call[name] = _local(value, name)
    positional = [call.pop(arg.name) for arg in op._schema.arguments if not arg.kwarg_only]
    return op(*positional, **call)


def _local_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Ops on replicated scalars (clip_coef, update_scale_): run on the local values."""
    a = _normalize(op, args, kwargs)
    call = {name: _local(v, name) for name, v in a.items()}
    positional = [call.pop(arg.name) for arg in op._schema.arguments if not arg.kwarg_only]
    return op(*positional, **call)
