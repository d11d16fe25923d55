"""ampfuse on torch.distributed: DTensor support (FSDP2, tensor parallelism, HSDP, any mesh) for every op.

Importing this module (``import ampfuse`` does it once ``torch.distributed.tensor`` is loaded)
registers a handler per ampfuse op with DTensor's op dispatcher, the mechanism torch uses for its
own unscale op. The elementwise work runs on local tensors; found_inf and the per-tensor flags are
agreed over the whole mesh of the call, the 2-norm adds local sums of squares over exactly the
dimensions each tensor is sharded on (a replicated tensor counts once), ``Partial`` tensors are
reduced first, and a list mixing DTensors with plain tensors or tensors on different meshes is
refused. The whole contract: the manual's Distributed training page (``docs/distributed.md``).
"""

from __future__ import annotations

import functools
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
    handlers: dict[Any, Any] = DTensor._op_dispatcher._custom_op_handlers
    handlers.update({
        ops.unscale_check_.default: _check_handler,
        ops.unscale_check_norm_.default: _check_handler,
        ops.check_norm_.default: _check_handler,
        ops.accumulate_grads_.default: _accumulate_handler,
        ops.sgd_step_.default: _step_handler,
        ops.adam_step_.default: _step_handler,
        ops.clip_coef.default: _local_handler,
        ops.update_scale_.default: _local_handler,
        ops.join_master.default: _elementwise_handler,
        ops.split_master.default: _elementwise_handler,
        ops.remainder_of_.default: _elementwise_handler,
        ops.round_ties_even_.default: _elementwise_handler,
        ops.quantize_blocks.default: _quantize_handler,
        ops.dequantize_blocks.default: _dequantize_handler,
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
            "pass all of them as DTensors (e.g. FSDP2 parameters and their gradients) or all as local tensors. "
            "A plain tensor has no device mesh, so whether it is the same on every rank (to be counted once in "
            "a norm) or a per-rank value cannot be told; make it a DTensor (e.g. DTensor.from_local(t, mesh, "
            "[Replicate()] * mesh.ndim)) or step it with its own optimizer."
        )
    is_dt = bool(kinds) and kinds.pop()
    if want_dtensor is not None and xs and is_dt != want_dtensor:
        raise RuntimeError(f"ampfuse: {name} must be {'DTensors' if want_dtensor else 'plain tensors'} like the params of the call.")
    return ([x._local_tensor for x in xs] if is_dt else list(xs)), is_dt  # type: ignore[attr-defined]


@functools.cache
def _kind_bases() -> tuple[tuple[str, tuple[type, ...]], ...]:
    """The placement base types of each kind, the C++ bases included where torch has them
    (``_StridedShard`` is not a ``Shard`` subclass, and its ``is_shard()`` is False)."""
    from torch.distributed.tensor import placement_types as pt

    c = getattr(torch._C, "_distributed", None)

    def types(*names_py: str, c_names: tuple[str, ...]) -> tuple[type, ...]:
        found = [getattr(pt, n, None) for n in names_py] + [getattr(c, n, None) for n in c_names]
        return tuple(t for t in found if isinstance(t, type))

    return (
        ("partial", types("Partial", c_names=("Partial",))),
        ("shard", types("Shard", "_StridedShard", c_names=("Shard", "StridedShard"))),
        ("replicate", types("Replicate", c_names=("Replicate",))),
    )


def placement_kind(placement_type: type) -> str | None:
    """``"shard"``, ``"replicate"`` or ``"partial"`` for a placement type (every ``Shard`` kind,
    ``_StridedShard`` included, is ``"shard"``); None for a type this module does not know."""
    for kind, bases in _kind_bases():
        if issubclass(placement_type, bases):
            return kind
    return None


def _kind(pl: Any, name: str) -> str:
    kind = placement_kind(type(pl))
    if kind is None:  # a placement type newer than this module: its own predicates, if they answer
        kind = next((k for k, f in (("partial", "is_partial"), ("shard", "is_shard"), ("replicate", "is_replicate"))
                     if callable(getattr(pl, f, None)) and getattr(pl, f)()), None)
    if kind is None:
        raise RuntimeError(f"ampfuse: {name} has placement {pl!r} of a kind ampfuse does not know (not a Shard, "
                           "Replicate or Partial); redistribute it to one of those first.")
    return kind


def _one_mesh(xs: Sequence[Any], name: str) -> Any:
    """The device mesh of all of `xs` (DTensors); tensors on different meshes are refused."""
    first = xs[0].device_mesh
    for i, x in enumerate(xs):
        mesh = x.device_mesh
        if mesh is not first and mesh != first:  # equal meshes may be distinct objects (FSDP2)
            raise RuntimeError(f"ampfuse: {name}[{i}] is on device mesh {mesh} but {name}[0] is on {first}; "
                               "call the op once per mesh.")
    return first


def _reduce_partials_(xs: Sequence[Any], name: str) -> None:
    """Every ``Partial`` DTensor of `xs` reduced in place: its local tensor becomes the reduced
    value and its placements ``Replicate`` on those mesh dims; its logical value is unchanged."""
    from torch.distributed.tensor import Replicate

    for i, x in enumerate(xs):
        kinds = [_kind(pl, f"{name}[{i}]") for pl in x.placements]
        if "partial" not in kinds:
            continue
        target = [Replicate() if k == "partial" else pl for k, pl in zip(kinds, x.placements)]
        with torch.no_grad():
            reduced = x.redistribute(x.device_mesh, target)
            x._local_tensor.copy_(reduced._local_tensor)
        x._spec = reduced._spec


def _replicated_dims(x: Any, name: str) -> tuple[int, ...]:
    """Mesh dimensions over which a (Partial-free) DTensor is replicated (its norm counts once there)."""
    return tuple(d for d, pl in enumerate(x.placements) if _kind(pl, name) == "replicate")


def _mesh_all_reduce(t: torch.Tensor, mesh: Any, op: Any) -> None:
    """All-reduce over every rank of `mesh`: one collective when the mesh is 1-D or spans the
    world, else one per mesh dimension (the same result)."""
    if mesh.ndim == 1:
        dist.all_reduce(t, op=op, group=mesh.get_group(0))
    elif mesh.size() == dist.get_world_size():
        dist.all_reduce(t, op=op)
    else:
        for d in range(mesh.ndim):
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
    """unscale_check_ / unscale_check_norm_ / check_norm_ on DTensors: Partial tensors reduced in
    place, one local fused pass per set of replicated mesh dims, then one all-reduce over the
    whole mesh of [found_inf, per-tensor flags, norm parts]; the clip coefficient from the
    global norm."""
    a = _normalize(op, args, kwargs)
    tensors = a["tensors"]
    _, is_dt = _local_list(tensors, "tensors")
    if not is_dt:  # reached through a DTensor scalar only: run on the local values
        return _local_handler(op, args, kwargs)
    found_inf = _local(a["found_inf"], "found_inf")
    inv_scale = _local(a.get("inv_scale"), "inv_scale")
    scale = _local(a.get("scale"), "scale")
    per_tensor = _local(a.get("per_tensor_found_inf"), "per_tensor_found_inf")
    with_norm = op is not torch.ops.ampfuse.unscale_check_.default
    norm_type = float(a.get("norm_type") or 2.0) if with_norm else 2.0
    max_norm = a.get("max_norm") if with_norm else None
    overwrite = bool(a.get("overwrite_found_inf", False))
    mesh = _one_mesh(tensors, "tensors")
    _reduce_partials_(tensors, "tensors")
    local = [x._local_tensor for x in tensors]
    device = found_inf.device
    inf = norm_type == float("inf")
    # the norm counts a tensor on the ranks at coordinate 0 of the mesh dims it is replicated on
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, x in enumerate(tensors):
        groups.setdefault(() if inf else _replicated_dims(x, f"tensors[{i}]"), []).append(i)
    coord = mesh.get_coordinate() or ()
    norm_dtype = torch.float64 if any(t.dtype == torch.float64 for t in local) else torch.float32
    founds: list[torch.Tensor] = []
    flags = torch.zeros(len(tensors), dtype=torch.float32, device=device) if per_tensor is not None else None
    norm_parts: list[torch.Tensor] = []
    for rep, idx in groups.items():
        f = torch.empty((), dtype=torch.float32, device=device)
        part_flags = torch.zeros(len(idx), dtype=torch.float32, device=device) if flags is not None else None
        kw: dict[str, Any] = {"scale": scale, "overwrite_found_inf": True}
        ts = [local[i] for i in idx]
        if with_norm:
            kw.update(norm_type=norm_type, per_tensor_found_inf=part_flags)
            norm, _ = op(ts, f, inv_scale, **kw)
            part = norm.to(norm_dtype) if inf else norm.to(norm_dtype).square()
            if not all(coord[d] == 0 for d in rep):
                part = torch.zeros_like(part)
            norm_parts.append(part.reshape(1))
        else:
            op(ts, f, inv_scale, **kw)
        founds.append(f.reshape(1))
        if flags is not None and part_flags is not None:
            flags.index_copy_(0, torch.tensor(idx, device=device), part_flags)
    # one all-reduce over the whole mesh: SUM with a 2-norm (0/1 flags summed, then > 0), else MAX
    summed = with_norm and not inf
    buf = torch.cat([torch.cat(founds).amax().reshape(1)] + ([flags] if flags is not None else []) + norm_parts)
    buf = buf.to(norm_dtype)
    _mesh_all_reduce(buf, mesh, dist.ReduceOp.SUM if summed else dist.ReduceOp.MAX)
    n_flags = 1 + (len(tensors) if flags is not None else 0)
    agreed = (buf[:n_flags] > 0).to(torch.float32)
    found = agreed[0]
    if overwrite:
        found_inf.copy_(found.reshape(found_inf.shape))
    else:
        torch.maximum(found_inf, found.reshape(found_inf.shape), out=found_inf)
    if per_tensor is not None:
        torch.maximum(per_tensor, agreed[1:].to(per_tensor.dtype).reshape(per_tensor.shape), out=per_tensor)
    if not with_norm:
        return None
    norms = buf[n_flags:]
    total = norms.amax() if inf else norms.sum().sqrt()
    # a non-finite gradient anywhere in the mesh: the norm says so on every rank (a replica's inf
    # may be outside the parts counted), as the norm of that gradient list would
    total = torch.where((found > 0) & total.isfinite(), torch.full_like(total, float("inf")), total)
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
    mesh = _one_mesh(a["grads"], "grads")
    _reduce_partials_(a["grads"], "grads")
    grads = [g._local_tensor for g in a["grads"]]
    for i, (x, g) in enumerate(zip(a["accumulators"], a["grads"])):
        if x.placements != g.placements or (x.device_mesh is not g.device_mesh and x.device_mesh != g.device_mesh):
            raise RuntimeError(f"ampfuse.accumulate_grads_: accumulators[{i}] has placements {x.placements} but "
                               f"grads[{i}] has {g.placements}; they must match.")
    f = torch.zeros((), dtype=torch.float32, device=found_inf.device)
    op(accs, grads, f, zero_grads=a["zero_grads"])
    _mesh_all_reduce(f, mesh, dist.ReduceOp.MAX)
    torch.maximum(found_inf, f.reshape(found_inf.shape), out=found_inf)
    return None


_STEP_LISTS = ("params", "grads", "master_params", "momentum_buffers", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")


def _step_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """sgd_step_ / adam_step_ on DTensors: the fused pass on every rank's local shards (Partial
    gradients reduced in place first)."""
    a = _normalize(op, args, kwargs)
    params = a["params"]
    _, is_dt = _local_list(params, "params")
    if is_dt:
        _one_mesh(params, "params")
        for i, p in enumerate(params):
            if "partial" in (_kind(pl, f"params[{i}]") for pl in p.placements):
                raise RuntimeError(f"ampfuse.{op._schema.name.split('::')[1]}: params[{i}] has placements "
                                   f"{p.placements}; a parameter cannot be Partial.")
        grads = a.get("grads") or []
        if grads and _local_list(grads, "grads")[1]:
            _reduce_partials_(grads, "grads")
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


def _elementwise_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """The master-form ops (join_master, split_master, remainder_of_, round_ties_even_), which work
    element by element: run on the local tensors of DTensors of one shape, mesh and placements
    (any ``Shard`` kind or ``Replicate``, not ``Partial``: a master cannot be split or joined
    before it is summed); tensor results are DTensors of the arguments' mesh and placements."""
    DTensor = _dtensor_cls()
    name = f"ampfuse.{op._schema.name.split('::')[1]}"
    xs = [*args, *kwargs.values()]
    if not all(isinstance(x, DTensor) for x in xs):
        raise TypeError(f"{name}: pass all tensors as DTensors or none (got a mix).")
    first = xs[0]
    for x in xs[1:]:
        if x.placements != first.placements or x.device_mesh != first.device_mesh or x.shape != first.shape:
            raise ValueError(f"{name}: the DTensors must have one shape, mesh and placements, got "
                             f"{tuple(first.shape)} {first.placements} and {tuple(x.shape)} {x.placements}.")
    if any(pl.is_partial() for pl in first.placements):
        raise ValueError(f"{name}: a Partial DTensor ({first.placements}) must be reduced first.")
    out = op(*(x._local_tensor for x in args), **{k: v._local_tensor for k, v in kwargs.items()})

    def wrap(t: torch.Tensor) -> Any:
        return DTensor.from_local(t, first.device_mesh, first.placements, run_check=False,
                                  shape=first.shape, stride=first.stride())

    if out is None:
        return None
    return tuple(wrap(t) for t in out) if isinstance(out, tuple) else wrap(out)


def _blocks_of(x: Any, name: str, op: torch._ops.OpOverload) -> Any:
    """A DTensor whose local tensor the 8-bit ops cut into blocks: any ``Shard`` kind or
    ``Replicate``, not ``Partial`` (its values are not known before the sum)."""
    if any(pl.is_partial() for pl in x.placements):
        raise ValueError(f"ampfuse.{op._schema.name.split('::')[1]}: {name} is a Partial DTensor ({x.placements}); "
                         "reduce it first.")
    return x


def _quantize_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """quantize_blocks of a DTensor: blocks inside each rank's local shard. The codes are a DTensor
    of the values' mesh, placements and shape; the absmax is each rank's own plain tensor (one
    value per block of its shard: shards of different sizes have different counts, so it has no
    global shape). Checkpoints hold the dequantized values, never the absmax."""
    DTensor = _dtensor_cls()
    a = _normalize(op, args, kwargs)
    values = _blocks_of(a["values"], "values", op)
    codes, absmax = op(values._local_tensor, a["dtype"], nonnegative=a["nonnegative"])
    return (DTensor.from_local(codes, values.device_mesh, values.placements, run_check=False,
                               shape=values.shape, stride=values.stride()), absmax)


def _dequantize_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """dequantize_blocks of DTensor codes and the rank's own absmax (see ``_quantize_handler``):
    a float32 DTensor of the codes' mesh, placements and shape."""
    DTensor = _dtensor_cls()
    a = _normalize(op, args, kwargs)
    codes = _blocks_of(a["codes"], "codes", op)
    absmax = a["absmax"]
    if isinstance(absmax, DTensor):
        raise TypeError("ampfuse.dequantize_blocks: absmax must be the rank's own plain tensor (as quantize_blocks "
                        "of a DTensor returns it), got a DTensor.")
    values = op(codes._local_tensor, absmax, nonnegative=a["nonnegative"])
    return DTensor.from_local(values, codes.device_mesh, codes.placements, run_check=False,
                              shape=codes.shape, stride=codes.stride())
