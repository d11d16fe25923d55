"""ampfuse on device meshes beyond 1-D FSDP2: tensor parallelism (TP), FSDP2 over TP (2-D,
torchtitan-style), HSDP, sequence parallelism with ``Partial`` gradients, DCP checkpoints of fp32
and remainder masters under FSDP2 and TP x FSDP2 (saved on 4 ranks, loaded on 2), and the
precision helpers on DTensors.

The rule under test (``ampfuse.distributed``): found_inf is agreed over every mesh dimension of
the call, the 2-norm adds local sums of squares over exactly the dimensions a tensor is sharded
on (``_StridedShard`` included) and counts replicated dimensions once, ``Partial`` gradients are
reduced first.

To keep the suite's run time small, every 4-process scenario runs in ONE spawned 4-rank job
(gloo, CPU, under a deadline) and the checkpoint load in one 2-rank job; each test asserts on its
part of the results. References: the same setup driven by torch (``torch.optim.AdamW`` +
``torch.amp.GradScaler`` + ``clip_grad_norm_``) and the single-process gradient norm of the
gathered model on the whole batch.
"""

from __future__ import annotations

import math
import os
import tempfile
import traceback

import pytest
import torch

from dist_utils import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

BATCH = 8
MAX_NORM = 0.5
LR = 1e-2


def _batch(step: int, seq: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if seq:
        return torch.randn(2, seq, 8, generator=g), torch.randn(2, seq, 4, generator=g)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


class _MLP(torch.nn.Module):
    """w1 column-wise, w2 row-wise under TP (w2's bias is replicated over the TP dimension)."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(8) if norm else None
        self.w1 = torch.nn.Linear(8, 16)
        self.w2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        if self.norm is not None:
            x = self.norm(x)
        return self.w2(torch.tanh(self.w1(x)))


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A device mesh over ranks 0 .. prod(shape)-1 (every rank of the world must call this; the
    ranks outside it get no coordinate)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape), mesh_dim_names=names)


def _build(setup: str, dtype: torch.dtype = torch.float32, n: int | None = None):
    """(model, mesh, data-parallel index, data-parallel size) for one of the tested layouts on
    ranks 0 .. n-1 (default: the world); the model is None on the other ranks."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    n = n or torch.distributed.get_world_size()
    shapes = {"tp": ((n,), ("tp",)), "sp": ((n,), ("tp",)), "fsdp": ((n,), ("dp",)),
              "tpfsdp": ((n // 2, 2), ("dp", "tp")), "tpfsdp-sp": ((n // 2, 2), ("dp", "tp")),
              "hsdp": ((2, n // 2), ("replicate", "shard"))}
    mesh = _mesh(*shapes[setup])
    if mesh.get_coordinate() is None:
        return None, mesh, 0, 1
    model = _MLP(norm=setup.endswith("sp")).to(dtype)
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    if setup.endswith("sp"):  # sequence parallel: the LayerNorm runs on sequence shards
        plan = {"norm": SequenceParallel(), "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Replicate())}
    if setup in ("tp", "sp"):
        parallelize_module(model, mesh, plan)
        return model, mesh, 0, 1
    if setup.startswith("tpfsdp"):  # torchtitan's 2-D layout: TP inside, FSDP2 over the dp dimension
        parallelize_module(model, mesh["tp"], plan)
        dp_mesh = mesh["dp"]
        dp, ndp = mesh.get_local_rank(0), n // 2
    else:  # FSDP2 (1-D) or HSDP (2 replicas x n/2 shards)
        dp_mesh = mesh
        dp, ndp = torch.distributed.get_rank(), n
    fully_shard(model.w1, mesh=dp_mesh)
    fully_shard(model.w2, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, mesh, dp, ndp


def _full(t) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()


def _reference_model(model) -> torch.nn.Module:
    """A plain single-process copy of `model` (its gradient norm on the whole batch is the
    reference)."""
    ref = _MLP(norm=model.norm is not None)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(_full(q))
    return ref


def _train(setup: str, impl: str, steps: int, inf: tuple[int, int, str] | None = None):
    """`steps` steps of `setup`, driven by ampfuse (``impl="ampfuse"``) or torch; ``inf`` =
    (step, rank, param name): an inf put into that rank's local gradient after backward.
    Returns per step: the clip norm, the single-process norm, skipped, scale, the gradients'
    placements, the overflow report of the inf step and the all-reduces of the check (ampfuse);
    and the final full params."""
    import ampfuse

    rank = torch.distributed.get_rank()
    model, mesh, dp, ndp = _build(setup)
    if impl == "ampfuse":
        opt = ampfuse.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        scaler = ampfuse.GradScaler("cpu", init_scale=2.0**12)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    ref = _reference_model(model)
    log = []
    for step in range(steps):
        seq = 8 if setup.endswith("sp") else 0
        x, y = _batch(step, seq)
        # the single-process norm of the current params on the whole batch
        with torch.no_grad():
            for p, q in zip(ref.parameters(), model.parameters()):
                p.copy_(_full(q))
        ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ref.parameters()])))
        per = x.shape[0] // ndp
        x, y = x[dp * per:(dp + 1) * per], y[dp * per:(dp + 1) * per]
        if seq:  # each TP rank holds its part of the sequence
            tp = mesh.get_local_rank("tp")
            chunk = seq // mesh["tp"].size()
            x = x[:, tp * chunk:(tp + 1) * chunk]
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        placements = {n: tuple(p.grad.placements) for n, p in model.named_parameters()}
        if inf is not None and inf[0] == step and rank == inf[1]:
            g = dict(model.named_parameters())[inf[2]].grad
            g._local_tensor.view(-1)[0] = math.inf
        report = None
        if impl == "ampfuse":
            if inf is not None and inf[0] == step:  # the per-tensor flags, agreed over the mesh
                report = [name for _, _, name in scaler.overflow_report(opt, model)]
            calls = []
            real = torch.distributed.all_reduce

            def counting(t, *args, **kwargs):
                calls.append(t.numel())
                return real(t, *args, **kwargs)

            torch.distributed.all_reduce = counting  # what the check + norm costs in collectives
            try:
                norm = scaler.unscale_and_clip_(opt, MAX_NORM)
            finally:
                torch.distributed.all_reduce = real
        else:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        norm = float(_full(norm))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        log.append({"norm": norm, "ref_norm": ref_norm, "scale": float(scaler.get_scale()),
                    "skipped": _scale_backed_off(log, scaler), "placements": placements, "overflows": report,
                    "all_reduces": calls if impl == "ampfuse" else None})
    return {"log": log, "params": [_full(p) for p in model.parameters()],
            "placements": [tuple(p.placements) for p in model.parameters()]}


def _scale_backed_off(log: list, scaler) -> bool:
    before = log[-1]["scale"] if log else 2.0**12
    return float(scaler.get_scale()) < before


def _accumulate(setup: str, dtype: torch.dtype = torch.float32) -> dict:
    """GradAccumulator (2 micro-batches a window, clipping) for 2 windows; an inf put into rank 1's
    w2.bias gradient on the second window's last micro-batch."""
    import ampfuse

    rank = torch.distributed.get_rank()
    model, mesh, dp, ndp = _build(setup, dtype)
    opt = ampfuse.optim.AdamW(model.parameters(), lr=LR)
    acc = ampfuse.GradAccumulator(model, opt, ampfuse.GradScaler("cpu", init_scale=2.0**12), steps=2, max_grad_norm=MAX_NORM)
    scales = []
    for step in range(4):
        seq = 8 if setup.endswith("sp") else 0
        x, y = _batch(step, seq)
        per = x.shape[0] // ndp
        x, y = x[dp * per:(dp + 1) * per], y[dp * per:(dp + 1) * per]
        if seq:
            tp = mesh.get_local_rank("tp")
            x = x[:, tp * 2:(tp + 1) * 2]
        with acc.accumulate():
            acc.backward(torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y))
            if step == 3 and rank == 1:
                model.w2.bias.grad._local_tensor.view(-1)[0] = math.inf
        if step % 2:
            scales.append(float(acc.scaler.get_scale()))
    return {"scales": scales, "windows": acc.windows, "params": [_full(p) for p in model.parameters()]}


# ---- DCP: save on 4 ranks, load on 2 ------------------------------------------------------------

# one optimizer per layout with both master forms: w1 keeps fp32 masters, w2 int16 remainders
DCP_SETUPS = ["fsdp", "tpfsdp"]
MASTERS = {"w1": True, "w2": "remainder"}


def _dcp_objects(setup: str, n: int | None = None):
    import ampfuse

    model, mesh, dp, ndp = _build(setup, torch.bfloat16, n)
    if model is None:
        return None, None, dp, ndp
    groups = [{"params": list(getattr(model, name).parameters()), "master_weights": m} for name, m in MASTERS.items()]
    return model, ampfuse.optim.AdamW(groups, lr=LR, weight_decay=0.1), dp, ndp


def _opt_state(opt, model) -> dict:
    """Full (gathered) params and the optimizer's state_dict tensors, in param order."""
    sd = opt.state_dict()
    out = {"params": [_full(p) for p in model.parameters()], "state": []}
    for k in range(len(list(model.parameters()))):
        st = sd["state"][k]
        out["state"].append({key: _full(v) for key, v in sorted(st.items()) if isinstance(v, torch.Tensor) and key != "step"})
        out["state"][-1]["step"] = float(st["step"])
    return out


def _local_master(p: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a local bf16 param and int16 remainder, spelled out here (independent
    of the library's helper): the upper half from the param plus the signed remainder."""
    bits = (p.view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    bits = (bits + rem.to(torch.int64)) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def _dcp_save(ckpt: str, setup: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ampfuse

    model, opt, dp, ndp = _dcp_objects(setup)
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**12)
    for step in range(2):
        x, y = _batch(step)
        per = BATCH // ndp
        out = model(x[dp * per:(dp + 1) * per].to(torch.bfloat16))
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y[dp * per:(dp + 1) * per])).backward()
        scaler.unscale_and_clip_(opt, MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(ckpt, setup))
    state = _opt_state(opt, model)
    # the fp32 master each rank holds (its fp32 master, or its local param and remainder) and the
    # local part of the state_dict's master
    sd = opt.state_dict()
    state["local"] = []
    for k, p in enumerate(model.parameters()):
        st = opt.state[p]
        held = (_local_master(p._local_tensor.detach(), st["master_remainder"]._local_tensor) if "master_remainder" in st
                else st["master_param"]._local_tensor.clone())
        state["local"].append((sorted(st), held, sd["state"][k]["master_param"]._local_tensor.clone()))
    return state


def _dcp_load(ckpt: str, n: int) -> dict:
    """Load each layout's checkpoint on ranks 0 .. n-1 (the others only take part in creating the
    meshes and the process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    group = torch.distributed.new_group(list(range(n)))
    out = {}
    for setup in DCP_SETUPS:
        model, opt, _, _ = _dcp_objects(setup, n)
        if model is None:
            continue
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(ckpt, setup), process_group=group)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        loaded = _opt_state(opt, model)
        # a zero-gradient, lr-0 step brings the loaded state to the optimizer's options (the
        # remainders are made from the loaded masters) and changes no param and no master
        for g in opt.param_groups:
            g["lr"] = 0.0
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        after = _opt_state(opt, model)
        out[setup] = {"loaded": loaded, "after_step": after,
                      "state_keys": [sorted(opt.state[p]) for p in model.parameters()],
                      "placements": [tuple(p.placements) for p in model.parameters()]}
    return out


# ---- the precision helpers on DTensors -----------------------------------------------------------


def _precision_helpers() -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from ampfuse.optim import join_master, split_master

    world = torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(7)
    master = torch.randn(8, 6, generator=g) * 3
    bits = master.view(torch.int32)
    bits[0, :3] = bits[0, :3] & ~0xFFFF | 0x8000  # exact ties
    master[1, 0], master[1, 1], master[1, 2] = math.inf, -0.0, float("nan")
    want_p, want_r = split_master(master)
    want_join = join_master(want_p, want_r)
    layouts = {
        "Shard(0)": ((world,), (Shard(0),)),
        "Shard(1)": ((world,), (Shard(1),)),
        "Replicate": ((world,), (Replicate(),)),
        "Replicate,Shard(0)": ((2, world // 2), (Replicate(), Shard(0))),
        "_StridedShard,Shard(0)": ((2, world // 2), (_StridedShard(0, split_factor=2), Shard(0))),
    }
    out = {}
    for name, (shape, placements) in layouts.items():
        mesh = _mesh(shape, tuple(f"d{i}" for i in range(len(shape))))
        dm = distribute_tensor(master, mesh, placements)
        p, r = split_master(dm)
        j = join_master(p, r)
        out[name] = {
            "types": (type(p).__name__, type(r).__name__, type(j).__name__),
            "placements": (tuple(p.placements), tuple(r.placements), tuple(j.placements)),
            # gathered as fp32 (exact for bf16 and int16; gloo gathers no int16), compared as bits
            "split": _same_bits(p.float().full_tensor(), want_p.float()) and _same_bits(r.float().full_tensor(), want_r.float()),
            "join": _same_bits(j.full_tensor(), want_join),
        }
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _refusals() -> dict:
    """Mixed DTensor and plain tensors in one call: refused with the reason."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    import ampfuse

    mesh = _mesh((torch.distributed.get_world_size(),), ("tp",))
    dt = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    out = {}
    try:
        ampfuse.ops.check_norm_([dt, torch.ones(4)], torch.zeros(1), torch.ones(1))
        out["mixed"] = None
    except RuntimeError as e:
        out["mixed"] = str(e)
    return out


def _tp_8bit() -> dict:
    """TP on 4 ranks with 8-bit moments: a column-wise layer (its weight sharded on dim 0) and a
    row-wise one (dim 1) of 16,384 elements each, 3 AdamW steps; the same with fp32 moments."""
    import ampfuse
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh((4,), ("tp",))
    out: dict = {}
    for form in ("uint8", "fp32"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = ampfuse.optim.AdamW(model.parameters(), lr=LR,
                                  state_dtype=torch.uint8 if form == "uint8" else torch.float32)
        for step in range(3):
            g = torch.Generator().manual_seed(3000 + step)
            x, y = torch.randn(BATCH, 64, generator=g), torch.randn(BATCH, 64, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        res = {"params": [_full(p) for p in model.parameters()], "blocks": []}
        if form == "uint8":
            saved = opt.state_dict()["state"]
            for i, (name, p) in enumerate(model.named_parameters()):
                st = opt.state[p]
                if "exp_avg_absmax" not in st:
                    continue
                local = saved[i]["exp_avg"]._local_tensor.contiguous()
                codes, absmax = ampfuse.ops.quantize_blocks(local, torch.uint8)
                res["blocks"].append({"name": name, "placements": str(p.placements), "local_numel": local.numel(),
                                      "absmax": st["exp_avg_absmax"].clone(), "want_absmax": absmax,
                                      "codes": st["exp_avg"]._local_tensor.clone(), "want_codes": codes})
        out[form] = res
    return out


# ---- the one 4-rank job ---------------------------------------------------------------------------


def _scenarios(rank: int, world: int, ckpt: str) -> dict:
    torch.manual_seed(0)
    out: dict = {}
    runs = {
        # (setup, impl, steps, inf)
        "tpfsdp": ("tpfsdp", "ampfuse", 3, None),
        "tpfsdp-torch": ("tpfsdp", "torch", 3, None),
        "tpfsdp-inf": ("tpfsdp", "ampfuse", 3, (1, 3, "w1.weight")),
        "tp-inf-bias": ("tp", "ampfuse", 3, (1, 1, "w2.bias")),
        "hsdp-inf": ("hsdp", "ampfuse", 3, (1, 2, "w1.weight")),
        "sp": ("sp", "ampfuse", 3, None),
        "sp-torch": ("sp", "torch", 3, None),
        "sp-inf": ("sp", "ampfuse", 3, (1, 2, "norm.weight")),
        "tpfsdp-sp": ("tpfsdp-sp", "ampfuse", 2, None),
        "tpfsdp-sp-torch": ("tpfsdp-sp", "torch", 2, None),
    }
    for name, (setup, impl, steps, inf) in runs.items():
        try:
            out[name] = _train(setup, impl, steps, inf)
        except Exception:  # noqa: BLE001 - reported per scenario; the other ranks fail the same way
            out[name] = {"error": traceback.format_exc()}
    for setup in ("tpfsdp", "hsdp", "sp"):
        try:
            out[f"acc-{setup}"] = _accumulate(setup)
        except Exception:  # noqa: BLE001
            out[f"acc-{setup}"] = {"error": traceback.format_exc()}
    try:  # tensor parallel alone (no FSDP2 module), bf16 params: fp32 buffers shaped as DTensors
        out["acc-tp-bf16"] = _accumulate("tp", torch.bfloat16)
    except Exception:  # noqa: BLE001
        out["acc-tp-bf16"] = {"error": traceback.format_exc()}
    for setup in DCP_SETUPS:
        try:
            out[f"dcp-{setup}"] = _dcp_save(ckpt, setup)
        except Exception:  # noqa: BLE001
            out[f"dcp-{setup}"] = {"error": traceback.format_exc()}
    try:
        out["dcp-load-on-2"] = _dcp_load(ckpt, 2)
    except Exception:  # noqa: BLE001
        out["dcp-load-on-2"] = {"error": traceback.format_exc()}
    try:
        out["tp-8bit"] = _tp_8bit()
    except Exception:  # noqa: BLE001
        out["tp-8bit"] = {"error": traceback.format_exc()}
    out["precision"] = _precision_helpers()
    out["refusals"] = _refusals()
    return out


@pytest.fixture(scope="module")
def mesh_runs():
    with tempfile.TemporaryDirectory() as d:
        yield run_ranks(_scenarios, 4, d, timeout=300)


def _ok(res: dict, name: str) -> dict:
    r = res[name]
    assert "error" not in r, r.get("error")
    return r


def _skips(log) -> list:
    return [r["skipped"] for r in log]


@pytest.mark.parametrize("case", ["tpfsdp-inf", "tp-inf-bias", "hsdp-inf", "sp-inf"])
def test_overflow_report_names_the_parameter_on_every_rank(mesh_runs, case):
    """The per-tensor flags are agreed over the whole mesh too: every rank names the one
    parameter whose gradient got the inf on one rank."""
    want = {"tpfsdp-inf": "w1.weight", "tp-inf-bias": "w2.bias", "hsdp-inf": "w1.weight", "sp-inf": "norm.weight"}[case]
    for rank in range(4):
        assert _ok(mesh_runs[rank], case)["log"][1]["overflows"] == [want]


# ---- the tests ------------------------------------------------------------------------------------


def test_placement_kinds_cover_every_placement_type_torch_has():
    """Every Placement subclass torch defines is classified, every Shard kind as sharded."""
    from torch.distributed.tensor import placement_types as pt
    import torch.distributed.tensor._ops  # noqa: F401 - defines _NormPartial

    from ampfuse.distributed import placement_kind

    def subclasses(c):
        out = set()
        for s in c.__subclasses__():
            out |= {s} | subclasses(s)
        return out

    types = subclasses(pt.Placement)
    assert types, "torch defines no Placement subclasses?"
    kinds = {t: placement_kind(t) for t in types}
    assert None not in kinds.values(), kinds
    for t, k in kinds.items():
        name = t.__name__.lower()
        assert k == ("partial" if "partial" in name else "shard" if "shard" in name else "replicate"), (t, k)
    assert placement_kind(pt._StridedShard) == "shard"  # FSDP2 over TP places params with it


def test_tp_fsdp2_norm_and_params_equal_torch(mesh_runs):
    four = mesh_runs
    for rank in range(4):
        a, t = _ok(four[rank], "tpfsdp"), _ok(four[rank], "tpfsdp-torch")
        assert "_StridedShard" in repr(a["placements"][0])  # the 2-D layout under test
        for ra, rt in zip(a["log"], t["log"]):
            assert ra["norm"] == pytest.approx(ra["ref_norm"], rel=1e-5)  # the single-process norm
            assert ra["norm"] == pytest.approx(rt["norm"], rel=1e-5)  # torch's clip_grad_norm_
            assert ra["norm"] > MAX_NORM  # clipping is active
        assert _skips(a["log"]) == _skips(t["log"]) == [False] * 3
        # found_inf and the norm agreed by one small all-reduce: [found_inf, 2 norm parts]
        assert [r["all_reduces"] for r in a["log"]] == [[3]] * 3
        for x, y in zip(a["params"], t["params"]):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
        for x, y in zip(a["params"], _ok(four[0], "tpfsdp")["params"]):
            assert torch.equal(x, y)


def test_tp_8bit_state_blocks_lie_inside_each_local_shard(mesh_runs):
    """Column- and row-wise sharded weights keep 8-bit moments whose blocks cut each rank's local
    shard (not the global tensor), and train close to fp32 moments."""
    for rank in range(4):
        res = _ok(mesh_runs[rank], "tp-8bit")
        blocks = res["uint8"]["blocks"]
        assert [b["placements"] for b in blocks] == ["(Shard(dim=0),)", "(Shard(dim=1),)"]
        for b in blocks:
            assert b["local_numel"] == 4096 and b["absmax"].shape == (16,)
            assert torch.equal(b["absmax"], b["want_absmax"]) and torch.equal(b["codes"], b["want_codes"])
        for x, y in zip(res["uint8"]["params"], res["fp32"]["params"]):
            torch.testing.assert_close(x, y, rtol=0, atol=2e-3)
        for x, y in zip(res["uint8"]["params"], _ok(mesh_runs[0], "tp-8bit")["uint8"]["params"]):
            assert torch.equal(x, y)  # the ranks agree


def test_tp_fsdp2_inf_in_one_shard_skips_every_rank(mesh_runs):
    four = mesh_runs
    logs = [_ok(four[r], "tpfsdp-inf")["log"] for r in range(4)]
    for log in logs:
        assert _skips(log) == [False, True, False]
        assert [r["norm"] for r in log] == [r["norm"] for r in logs[0]]
    for r in range(4):
        for x, y in zip(_ok(four[r], "tpfsdp-inf")["params"], _ok(four[0], "tpfsdp-inf")["params"]):
            assert torch.equal(x, y)


def test_tp_inf_in_replicated_bias_on_one_rank_skips_every_rank(mesh_runs):
    four = mesh_runs
    res = [_ok(four[r], "tp-inf-bias") for r in range(4)]
    assert "Replicate" in repr(res[0]["log"][0]["placements"]["w2.bias"])
    for r in res:
        assert _skips(r["log"]) == [False, True, False]
        assert [x["scale"] for x in r["log"]] == [x["scale"] for x in res[0]["log"]]
        for x, y in zip(r["params"], res[0]["params"]):
            assert torch.equal(x, y)
        assert repr([x["norm"] for x in r["log"]]) == repr([x["norm"] for x in res[0]["log"]])
        assert r["log"][0]["norm"] == pytest.approx(r["log"][0]["ref_norm"], rel=1e-5)
        assert r["log"][1]["norm"] == math.inf  # rank 1's bias is not the copy counted, still not finite


def test_hsdp_inf_in_one_replicas_shard_skips_every_rank(mesh_runs):
    four = mesh_runs
    res = [_ok(four[r], "hsdp-inf") for r in range(4)]
    assert repr(res[0]["placements"][0]) == "(Replicate(), Shard(dim=0))"
    for r in res:
        assert _skips(r["log"]) == [False, True, False]
        for x, y in zip(r["params"], res[0]["params"]):
            assert torch.equal(x, y)  # the replicas stay identical
        for k in (0, 2):  # the replicated dimension counted once
            assert r["log"][k]["norm"] == pytest.approx(r["log"][k]["ref_norm"], rel=1e-5)
        assert r["log"][1]["norm"] == math.inf  # the skipped step's norm is not finite on any rank


def test_sequence_parallel_partial_gradients(mesh_runs):
    four = mesh_runs
    for rank in range(4):
        a, t, i = _ok(four[rank], "sp"), _ok(four[rank], "sp-torch"), _ok(four[rank], "sp-inf")
        assert "Partial" in repr(a["log"][0]["placements"]["norm.weight"])  # the case under test
        for ra, rt in zip(a["log"], t["log"]):
            assert ra["norm"] == pytest.approx(ra["ref_norm"], rel=1e-5)
            assert ra["norm"] == pytest.approx(rt["norm"], rel=1e-5)
        for x, y in zip(a["params"], t["params"]):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
        assert _skips(i["log"]) == [False, True, False]
        for x, y in zip(i["params"], _ok(four[0], "sp-inf")["params"]):
            assert torch.equal(x, y)


def test_tp_fsdp2_with_sequence_parallel(mesh_runs):
    """Under FSDP2 x TP, FSDP2 reduces the TP-partial norm gradients itself: they reach ampfuse
    replicated over tp; the norm and params are torch's."""
    four = mesh_runs
    for rank in range(4):
        a, t = _ok(four[rank], "tpfsdp-sp"), _ok(four[rank], "tpfsdp-sp-torch")
        assert repr(a["log"][0]["placements"]["norm.weight"]) == "(Shard(dim=0), Replicate())"
        for ra, rt in zip(a["log"], t["log"]):
            assert ra["norm"] == pytest.approx(ra["ref_norm"], rel=1e-5)
            assert ra["norm"] == pytest.approx(rt["norm"], rel=1e-5)
        for x, y in zip(a["params"], t["params"]):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


@pytest.mark.parametrize("setup", ["tpfsdp", "hsdp", "sp", "tp-bf16"])
def test_grad_accumulator_on_meshes(mesh_runs, setup):
    """The accumulator's ops follow the same rule: an inf on one rank skips the window on all
    ranks (FSDP2 x TP, HSDP, sequence parallelism, whose Partial gradients it reduces, and tensor
    parallelism alone with bf16 params, whose fp32 sums are DTensors like their gradients: it once
    made plain buffers and failed at the first micro-batch)."""
    res = [_ok(mesh_runs[r], f"acc-{setup}") for r in range(4)]
    for r in res:
        assert r["windows"] == 2 and r["scales"] == [2.0**12, 2.0**11]
        for x, y in zip(r["params"], res[0]["params"]):
            assert torch.equal(x, y)


def test_precision_helpers_on_dtensors(mesh_runs):
    four = mesh_runs
    for rank in range(4):
        for name, r in four[rank]["precision"].items():
            assert r["types"] == ("DTensor",) * 3, name
            assert r["split"] and r["join"], (name, r)
            assert len({repr(p) for p in r["placements"]}) == 1, name  # the argument's placements kept


def test_mixed_dtensor_and_plain_tensors_refused_with_the_reason(mesh_runs):
    four = mesh_runs
    msg = four[0]["refusals"]["mixed"]
    assert msg is not None and "mixes DTensors and plain tensors" in msg and "no device mesh" in msg


@pytest.mark.parametrize("setup", DCP_SETUPS)
def test_dcp_save_on_4_load_on_2(mesh_runs, setup):
    """fp32 masters (w1) and remainder masters (w2) in one optimizer, saved with DCP on 4 ranks
    and loaded on 2: params, moments and masters bit for bit."""
    four = mesh_runs
    saved = [_ok(four[r], f"dcp-{setup}") for r in range(4)]
    for s in saved:  # the state_dict's master is the master each rank holds, bit for bit
        for keys, held, in_sd in s["local"]:
            assert torch.equal(held.view(torch.int32), in_sd.view(torch.int32)), keys
        assert ["master_remainder" in keys for keys, _, _ in s["local"]] == [False, False, True, True]
    for rank in range(2):
        got = _ok(four[rank], "dcp-load-on-2")[setup]
        assert ["master_remainder" in k for k in got["state_keys"]] == [False, False, True, True]
        assert ["master_param" in k for k in got["state_keys"]] == [True, True, False, False]
        for when in ("loaded", "after_step"):
            for x, y in zip(saved[0]["params"], got[when]["params"]):
                assert torch.equal(x, y), when
            for x, y in zip(saved[0]["state"], got[when]["state"]):
                assert x.keys() == y.keys()
                for key in x:
                    if key == "step":
                        assert y[key] == x[key] + (when == "after_step")
                    elif when == "loaded" or key == "master_param":  # the lr-0 step decays the moments
                        assert torch.equal(x[key].view(torch.int32), y[key].view(torch.int32)), (when, key)
