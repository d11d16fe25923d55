"""ampfuse on torch.distributed (gloo, CPU, 2 processes; every run under a deadline, so a hang
fails): FSDP2 (DTensor) with the ampfuse scaler and optimizers, agreed found_inf and global clip
norm, ranks with empty shards, distributed checkpoints (DCP, under FSDP2 and DDP) including a
resharded load.

References are the same training in one process (world size 1, the whole batch), so
"equal within tolerance" compares the sharded run with a single-process one: bf16 gradients are
averaged across ranks in bf16 by FSDP2's reduce-scatter, so the runs agree to a bf16 rounding of
the gradients (parameters within 2e-2 after 6 AdamW steps of lr 1e-2, masters likewise).
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch

from dist_utils import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

STEPS = 6
BATCH = 8


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 1, generator=g)


def _model(kind: str):
    """A small MLP; its last layer has one output row, so with 2 ranks one rank's shard of it is
    empty."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 1))
    if kind == "bf16":
        m = m.to(torch.bfloat16)
    return m


def _shard(model, kind: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if kind == "fp32-mp" else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _train(rank: int, world: int, kind: str, steps: int, inf_at: int | None = None, model=None, opt=None, scaler=None,
           start: int = 0):
    import ampfuse

    if model is None:
        model = _shard(_model(kind), kind)
        opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        scaler = ampfuse.GradScaler("cpu", init_scale=2.0**12)
    log = []
    per = BATCH // world
    for step in range(start, start + steps):
        x, y = _batches(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        out = model(x.to(torch.bfloat16) if kind == "bf16" else x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        scaler.scale(loss).backward()
        if inf_at == step and rank == 0:  # an inf in rank 0's shard only
            p = next(p for p in model.parameters() if p.grad is not None and p.grad._local_tensor.numel())
            p.grad._local_tensor.view(-1)[0] = math.inf
        norm = scaler.unscale_and_clip_(opt, 0.5)
        scale_before = scaler.get_scale()
        grads_norm = _global_norm([p.grad for p in model.parameters() if p.grad is not None]) / scale_before
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        log.append({"norm": float(norm), "global_norm": float(grads_norm), "scale": scaler.get_scale(),
                    "skipped": float(scaler.last_found_inf)})
    return model, opt, scaler, log


def _global_norm(grads) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    full = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
    return torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in full]))


def _gathered(model, opt) -> dict:
    from torch.distributed.tensor import DTensor

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().clone()

    out = {"params": [full(p) for p in model.parameters()], "masters": []}
    for p in model.parameters():
        st = opt.state.get(p, {})
        if "master_param" in st:
            out["masters"].append(full(st["master_param"]))
    return out


def _fsdp_worker(rank: int, world: int, kind: str, inf_at: int | None):
    model, opt, scaler, log = _train(rank, world, kind, STEPS, inf_at)
    return {"log": log, **_gathered(model, opt)}


def _assert_close_runs(a: dict, b: dict, atol: float) -> None:
    for x, y in zip(a["params"], b["params"]):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)
    assert len(a["masters"]) == len(b["masters"])
    for x, y in zip(a["masters"], b["masters"]):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


@pytest.mark.parametrize("kind", ["bf16", "fp32-mp"], ids=["bf16-params-masters", "fp32-params-bf16-policy"])
def test_fsdp2_matches_single_process(kind):
    two = run_ranks(_fsdp_worker, 2, kind, None)
    one = run_ranks(_fsdp_worker, 1, kind, None)[0]
    # the ranks agree bit for bit; the sharded run equals the single-process one within tolerance
    for x, y in zip(two[0]["params"] + two[0]["masters"], two[1]["params"] + two[1]["masters"]):
        assert torch.equal(x, y)
    assert [r["scale"] for r in two[0]["log"]] == [r["scale"] for r in two[1]["log"]]
    _assert_close_runs(two[0], one, atol=2e-2)
    if kind == "bf16":
        assert len(one["masters"]) == len(one["params"])  # fp32 masters kept for the bf16 params
    # the clip norm is the global norm (of the unscaled gradients), the same on both ranks
    for r0, r1 in zip(two[0]["log"], two[1]["log"]):
        assert r0["norm"] == r1["norm"]
        assert r0["norm"] == pytest.approx(r0["global_norm"], rel=1e-4)


def test_fsdp2_inf_in_one_shard_skips_every_rank():
    inf_at = 3
    two = run_ranks(_fsdp_worker, 2, "bf16", inf_at)
    for rank in (0, 1):
        log = two[rank]["log"]
        assert log[inf_at]["skipped"] == 1.0 and all(r["skipped"] == 0.0 for k, r in enumerate(log) if k != inf_at)
        assert log[inf_at]["scale"] == log[inf_at - 1]["scale"] / 2  # backed off on every rank
    assert [r["scale"] for r in two[0]["log"]] == [r["scale"] for r in two[1]["log"]]
    for x, y in zip(two[0]["params"] + two[0]["masters"], two[1]["params"] + two[1]["masters"]):
        assert torch.equal(x, y)


def _empty_shard_worker(rank: int, world: int):
    model = _shard(_model("bf16"), "bf16")
    last = model[4].weight  # shape (1, 16): rank 1's shard is empty
    sizes = [p._local_tensor.numel() for p in (model[4].weight, model[4].bias)]
    model, opt, scaler, log = _train(rank, world, "bf16", 3, None, model,
                                     __import__("ampfuse").optim.AdamW(model.parameters(), lr=1e-2),
                                     __import__("ampfuse").GradScaler("cpu", init_scale=2.0**12))
    return {"sizes": sizes, "log": log, "last": last.full_tensor().float()}


def test_rank_with_empty_shards_takes_part():
    res = run_ranks(_empty_shard_worker, 2)
    assert res[1]["sizes"] == [0, 0] and res[0]["sizes"] == [16, 1]
    assert res[0]["log"] == res[1]["log"]
    assert torch.equal(res[0]["last"], res[1]["last"])


# ---- distributed checkpoints --------------------------------------------------------------------


def _dcp_save(ckpt: str, rank: int, module, opt, scaler) -> None:
    """A DCP checkpoint of `module` and `opt` (torch's state-dict helpers), the scaler beside it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(module, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    if rank == 0:
        torch.save(scaler.state_dict(), os.path.join(ckpt, "scaler.pt"))


def _dcp_load(ckpt: str, module, opt, scaler) -> None:
    """The checkpoint of `_dcp_save` into `module`, `opt` and `scaler`, on any number of ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(module, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    set_state_dict(module, opt, model_state_dict=msd, optim_state_dict=osd)
    scaler.load_state_dict(torch.load(os.path.join(ckpt, "scaler.pt")))


def _dcp_worker(rank: int, world: int, ckpt: str, mode: str):
    """mode "save": train 3 steps, save, train 3 more; "load": load, check the state, train 3 more
    from the same point (a resharded load when world differs from the saving run's)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import ampfuse

    model = _shard(_model("bf16"), "bf16")
    opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**12)
    if mode == "save":
        model, opt, scaler, _ = _train(rank, world, "bf16", 3, None, model, opt, scaler)
        _dcp_save(ckpt, rank, model, opt, scaler)
        at_save = _gathered(model, opt)
        at_save["steps"] = [float(opt.state[p]["step"]) for p in model.parameters()]
        model, opt, scaler, log = _train(rank, world, "bf16", 3, None, model, opt, scaler, start=3)
        return {"at_save": at_save, "final": _gathered(model, opt), "log": log}
    # load: DCP's get_state_dict initialises the optimizer state with a zero-grad, lr-0 step first
    before = _gathered(model, opt)
    msd, osd = get_state_dict(model, opt)
    after_init = _gathered(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    scaler.load_state_dict(torch.load(os.path.join(ckpt, "scaler.pt")))
    loaded = _gathered(model, opt)
    loaded["steps"] = [float(opt.state[p]["step"]) for p in model.parameters()]
    model, opt, scaler, log = _train(rank, world, "bf16", 3, None, model, opt, scaler, start=3)
    return {"before": before, "after_init": after_init, "loaded": loaded, "final": _gathered(model, opt), "log": log}


@pytest.mark.parametrize("load_world", [2, 1], ids=["same-ranks", "resharded-2-to-1"])
def test_fsdp2_dcp_save_load_continue(load_world):
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        saved = run_ranks(_dcp_worker, 2, ckpt, "save")[0]
        loaded = run_ranks(_dcp_worker, load_world, ckpt, "load")[0]
    # the zero-grad, lr-0 step of DCP's state initialisation changes no param and no master
    for x, y in zip(loaded["before"]["params"] + loaded["before"]["masters"],
                    loaded["after_init"]["params"] + loaded["after_init"]["masters"]):
        assert torch.equal(x, y)
    # the loaded state is the saved one, bit for bit (masters included), whatever the world size
    for x, y in zip(saved["at_save"]["params"] + saved["at_save"]["masters"],
                    loaded["loaded"]["params"] + loaded["loaded"]["masters"]):
        assert torch.equal(x, y)
    assert saved["at_save"]["steps"] == loaded["loaded"]["steps"]
    # continuing: identical to uninterrupted training with the same ranks, within the sharded /
    # single-process tolerance after a resharded load
    if load_world == 2:
        for x, y in zip(saved["final"]["params"] + saved["final"]["masters"], loaded["final"]["params"] + loaded["final"]["masters"]):
            assert torch.equal(x, y)
        assert saved["log"] == loaded["log"]
    else:
        _assert_close_runs(saved["final"], loaded["final"], atol=2e-2)


def _ddp_train(rank: int, world: int, ddp, opt, scaler, start: int, steps: int, batches=_batches,
               max_norm: float = 0.5) -> list:
    """`steps` steps of bf16 `ddp` (any module: DDP or FSDP2) on this rank's share of `batches`."""
    per = BATCH // world
    log = []
    for step in range(start, start + steps):
        x, y = batches(step)
        out = ddp(x[rank * per:(rank + 1) * per].to(torch.bfloat16))
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y[rank * per:(rank + 1) * per])).backward()
        scaler.unscale_and_clip_(opt, max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        log.append({"scale": scaler.get_scale(), "skipped": float(scaler.last_found_inf)})
    return log


def _ddp_dcp_worker(rank: int, world: int, ckpt: str, mode: str):
    """DDP (replicated bf16 params, fp32 masters): "save" trains 3 steps, saves with DCP, trains 3
    more; "load" starts from fresh objects, loads and trains the same 3 more."""
    import ampfuse

    model = _model("bf16")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = ampfuse.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**12)
    if mode == "save":
        _ddp_train(rank, world, ddp, opt, scaler, 0, 3)
        _dcp_save(ckpt, rank, ddp, opt, scaler)
        at_save = _gathered(model, opt)
    else:
        _dcp_load(ckpt, ddp, opt, scaler)
        at_save = _gathered(model, opt)
    at_save["steps"] = [float(opt.state[p]["step"]) for p in model.parameters()]
    log = _ddp_train(rank, world, ddp, opt, scaler, 3, 3)
    return {"at_save": at_save, "final": _gathered(model, opt), "log": log}


def test_ddp_dcp_save_load_continue():
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        saved = run_ranks(_ddp_dcp_worker, 2, ckpt, "save")
        loaded = run_ranks(_ddp_dcp_worker, 2, ckpt, "load")
    for rank in (0, 1):
        s, l = saved[rank], loaded[rank]
        assert s["at_save"]["steps"] == l["at_save"]["steps"] == [3.0] * len(s["at_save"]["steps"])
        assert len(s["at_save"]["masters"]) == len(s["at_save"]["params"])
        for x, y in zip(s["at_save"]["params"] + s["at_save"]["masters"], l["at_save"]["params"] + l["at_save"]["masters"]):
            assert torch.equal(x, y)
        # continuing from the checkpoint is bit for bit the uninterrupted run
        for x, y in zip(s["final"]["params"] + s["final"]["masters"], l["final"]["params"] + l["final"]["masters"]):
            assert torch.equal(x, y)
        assert s["log"] == l["log"]
    for x, y in zip(saved[0]["final"]["params"], saved[1]["final"]["params"]):
        assert torch.equal(x, y)


def test_zero_grad_lr0_step_changes_nothing():
    """What DCP's _init_optim_state does: zero gradients, lr 0, one step (no process group)."""
    import ampfuse

    for opt_cls, kw in [(ampfuse.optim.AdamW, {"weight_decay": 0.1}), (ampfuse.optim.SGD, {"momentum": 0.9, "weight_decay": 0.1}),
                        (ampfuse.optim.AdamW, {"master_weights": "remainder", "state_dtype": torch.bfloat16})]:
        model = _model("bf16")
        opt = opt_cls(model.parameters(), lr=0.0, **kw)
        before = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p, b)
            st = opt.state[p]
            if "master_param" in st:
                assert torch.equal(st["master_param"], b.float())


# ---- GradAccumulator on DDP and FSDP2 -----------------------------------------------------------


class _Branchy(torch.nn.Module):
    """bf16 layers, one fp32 layer (a parameter the accumulator does not buffer) and a branch that
    only some ranks use (a parameter that gets a gradient on rank 0 only)."""

    def __init__(self, use_branch: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16).to(torch.bfloat16)
        self.branch = torch.nn.Linear(8, 16).to(torch.bfloat16)
        self.head = torch.nn.Linear(16, 1)  # fp32
        self.use_branch = use_branch

    def forward(self, x):
        h = self.a(x.to(torch.bfloat16))
        if self.use_branch:
            h = h + self.branch(x.to(torch.bfloat16))
        return self.head(torch.tanh(h).float())


def _ddp_acc_worker(rank: int, world: int):
    import torch.distributed as dist

    import ampfuse

    model = _Branchy(use_branch=rank == 0)
    init_branch = model.branch.weight.detach().clone()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = ampfuse.optim.AdamW(ddp.parameters(), lr=1e-2)
    acc = ampfuse.GradAccumulator(ddp, opt, ampfuse.GradScaler("cpu", init_scale=2.0**10), steps=2, max_grad_norm=1.0)
    calls: list[str] = []
    real = dist.all_reduce

    def counting(t, *a, **k):
        op = k.get("op", a[0] if a else dist.ReduceOp.SUM)
        calls.append(f"{'MAX' if op == dist.ReduceOp.MAX else 'SUM'}:{t.dtype}:{t.numel()}")
        return real(t, *a, **k)

    dist.all_reduce = counting
    per_window = []
    try:
        for w in range(3):
            before = len(calls)
            for k in range(2):
                x, y = _batches(10 * w + k)
                with acc.accumulate():
                    acc.backward(torch.nn.functional.mse_loss(ddp(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]))
            per_window.append(calls[before:])
        x, y = _batches(99)  # an incomplete window, flushed
        with acc.accumulate():
            acc.backward(torch.nn.functional.mse_loss(ddp(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]))
        acc.flush()
    finally:
        dist.all_reduce = real
    return {"params": [p.detach().float().clone() for p in model.parameters()], "per_window": per_window,
            "branch_moved": not torch.equal(model.branch.weight.detach(), init_branch), "calls": calls}


def test_ddp_accumulator_ranks_agree_with_a_rank_only_branch_and_fp32_params():
    res = run_ranks(_ddp_acc_worker, 2)
    for x, y in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(x, y)
    assert res[0]["branch_moved"] and res[1]["branch_moved"]  # stepped on the rank that never used it too
    assert res[0]["calls"] == res[1]["calls"]  # the same collectives, in the same order, on every rank
    for window in res[0]["per_window"]:
        # one flag/mask exchange, one all-reduce of the bf16 params' fp32 sums, one bucket of fp32 grads
        assert [c.split(":")[0] for c in window] == ["MAX", "SUM", "SUM"], window


def _ddp_unfreeze_worker(rank: int, world: int):
    import ampfuse

    model = _Branchy(use_branch=rank == 0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    for p in model.branch.parameters():
        p.requires_grad_(False)  # frozen for the first windows
    opt = ampfuse.optim.AdamW(ddp.parameters(), lr=1e-2)
    acc = ampfuse.GradAccumulator(ddp, opt, ampfuse.GradScaler("cpu", init_scale=2.0**10), steps=2)
    init_branch = model.branch.weight.detach().clone()
    for w in range(4):
        for k in range(2):
            if (w, k) == (1, 1):  # unfrozen on every rank in the middle of a window
                for p in model.branch.parameters():
                    p.requires_grad_(True)
            x, y = _batches(10 * w + k)
            with acc.accumulate():
                acc.backward(torch.nn.functional.mse_loss(ddp(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]))
    return {"params": [p.detach().float().clone() for p in model.parameters()],
            "branch_moved": not torch.equal(model.branch.weight.detach(), init_branch)}


def test_ddp_accumulator_layer_unfrozen_mid_window_keeps_the_ranks_collectives_equal():
    """A bf16 layer that only rank 0's micro-batches use, unfrozen on every rank in the middle of a
    window: every rank sums it in fp32 from that micro-batch on (it requires a gradient, whether or
    not its micro-batch gave one), so the window-end collectives have the same size on every rank
    and the ranks stay equal."""
    res = run_ranks(_ddp_unfreeze_worker, 2, timeout=120.0)
    for x, y in zip(res[0]["params"], res[1]["params"]):
        assert torch.equal(x, y)
    assert res[0]["branch_moved"] and res[1]["branch_moved"]


def _fsdp_acc_worker(rank: int, world: int, sync: str, flush: bool):
    import torch.distributed as dist

    import ampfuse
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model("bf16")
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampfuse.GradAccumulator(model, opt, ampfuse.GradScaler("cpu", init_scale=2.0**10), steps=3, max_grad_norm=1.0,
                                  fsdp_sync=sync)
    counts = {"rs": 0}
    real = dist.reduce_scatter_single

    def counting(*a, **k):
        counts["rs"] += 1
        return real(*a, **k)

    dist.reduce_scatter_single = counting
    per_window = []
    error = None
    try:
        for w in range(2):
            before = counts["rs"]
            for k in range(3):
                x, y = _batches(10 * w + k)
                with acc.accumulate():
                    acc.backward(torch.nn.functional.mse_loss(model(x[rank * 4:(rank + 1) * 4].to(torch.bfloat16)).float(),
                                                              y[rank * 4:(rank + 1) * 4]))
            per_window.append(counts["rs"] - before)
        if flush:
            x, y = _batches(77)
            with acc.accumulate():
                acc.backward(torch.nn.functional.mse_loss(model(x[rank * 4:(rank + 1) * 4].to(torch.bfloat16)).float(),
                                                          y[rank * 4:(rank + 1) * 4]))
            try:
                acc.flush()
            except RuntimeError as e:
                error = str(e)
    finally:
        dist.reduce_scatter_single = real
    return {**_gathered(model, opt), "per_window": per_window, "error": error, "windows": acc.windows}


@pytest.mark.parametrize("sync", ["window", "micro_batch"])
def test_fsdp2_accumulator(sync):
    res = run_ranks(_fsdp_acc_worker, 2, sync, True)
    for x, y in zip(res[0]["params"] + res[0]["masters"], res[1]["params"] + res[1]["masters"]):
        assert torch.equal(x, y)
    groups = 3  # the three Linear layers' FSDP groups
    assert res[0]["per_window"] == [groups if sync == "window" else 3 * groups] * 2
    if sync == "window":  # an incomplete window cannot be flushed: FSDP2 reduces only in a backward
        assert "fsdp_sync='micro_batch'" in res[0]["error"] and res[0]["windows"] == 2
    else:
        assert res[0]["error"] is None and res[0]["windows"] == 3


def _token_lm_and_batch():
    """A tiny language model and a padded batch of 6 sequences (1 to 7 real tokens each)."""
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    tokens, labels = torch.randint(0, 11, (6, 7), generator=g), torch.randint(0, 11, (6, 7), generator=g)
    for i, keep in enumerate([7, 1, 3, 7, 2, 5]):
        labels[i, keep:] = -100
    return model, tokens, labels


def _token_loss(model, tokens, labels):
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)


def _fsdp_token_worker(rank: int, world: int, root: bool = True):
    import ampfuse
    from torch.distributed.fsdp import fully_shard

    model, tokens, labels = _token_lm_and_batch()
    for layer in model:
        fully_shard(layer)
    if root:
        fully_shard(model)
    acc = ampfuse.GradAccumulator(model, ampfuse.optim.SGD(model.parameters(), lr=0.5), steps=3)
    for k in range(3):  # rank 0: sequences 0-2 (14, 1, 3 tokens); rank 1: 3-5 (7, 2, 5)
        i = 3 * rank + k
        with acc.accumulate():
            acc.backward(_token_loss(model, tokens[i:i + 1], labels[i:i + 1]), count=(labels[i] != -100).sum())
    return [p.full_tensor().detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("root", [True, False], ids=["sharded-root", "sharded-layers-only"])
def test_fsdp2_token_weighted_window_equals_the_full_batch_token_mean(root):
    """Two FSDP2 ranks with different token counts: the window's step is the mean over every token
    of both ranks' micro-batches (the ranks' totals summed over the mesh), also with fully_shard on
    the layers only (each rank once divided its shard by its own total)."""
    got = run_ranks(_fsdp_token_worker, 2, root)[0]
    model, tokens, labels = _token_lm_and_batch()
    _token_loss(model, tokens, labels).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    for p, q in zip(model.parameters(), got):
        torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6)


def _mid_window_state_worker(rank: int, world: int):
    import ampfuse

    model = _Branchy(use_branch=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    acc = ampfuse.GradAccumulator(ddp, ampfuse.optim.AdamW(ddp.parameters(), lr=1e-2), steps=2)
    x, y = _batches(0)
    with acc.accumulate():
        acc.backward(torch.nn.functional.mse_loss(ddp(x[:4]), y[:4]))
    try:
        acc.state_dict()
        refused = None
    except RuntimeError as e:
        refused = str(e)
    per_rank = acc.state_dict(per_rank=True)
    return {"refused": refused, "has_buffers": "buffers" in per_rank}


def test_mid_window_accumulator_state_is_per_rank_or_refused():
    res = run_ranks(_mid_window_state_worker, 2)[0]
    assert "partial sums differ per rank" in res["refused"] and res["has_buffers"]


# ---- 8-bit optimizer state under FSDP2 ----------------------------------------------------------


def _model_8bit():
    """bf16, with one layer past the 8-bit threshold (256 x 32 = 8,192 elements: 8-bit moments
    whatever the shard) and small ones (fp32 moments)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).to(torch.bfloat16)


def _batches_8bit(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 1, generator=g)


def _train_8bit(rank: int, world: int, model, opt, scaler, start: int, steps: int) -> list:
    return _ddp_train(rank, world, model, opt, scaler, start, steps, batches=_batches_8bit, max_norm=1.0)


def _state_8bit(model, opt) -> dict:
    """Per param: the full fp32 values of each moment (the checkpoint's), and this rank's own 8-bit
    codes and absmax where the moment is 8-bit."""
    from torch.distributed.tensor import DTensor

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    sd = opt.state_dict()["state"]
    out = {"params": [full(p).float() for p in model.parameters()], "values": [], "codes": [], "forms": []}
    for i, p in enumerate(model.parameters()):
        st = opt.state[p]
        out["values"].append({k: full(sd[i][k]) for k in ("exp_avg", "exp_avg_sq", "master_param")})
        out["forms"].append({k: str(st[k].dtype) for k in ("exp_avg", "exp_avg_sq")})
        out["codes"].append({k: (st[k]._local_tensor.view(torch.uint8).clone(), st[k + "_absmax"].clone())
                             for k in ("exp_avg", "exp_avg_sq") if k + "_absmax" in st})
    return out


def _dcp_8bit_worker(rank: int, world: int, ckpt: str, mode: str):
    import ampfuse

    model = _shard(_model_8bit(), "bf16")
    opt = ampfuse.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights="remainder",
                              state_dtype=torch.uint8, exp_avg_sq_dtype=torch.float8_e5m2)
    scaler = ampfuse.GradScaler("cpu", init_scale=2.0**12)
    if mode == "save":
        _train_8bit(rank, world, model, opt, scaler, 0, 3)
        _dcp_save(ckpt, rank, model, opt, scaler)
        at_save = _state_8bit(model, opt)
        log = _train_8bit(rank, world, model, opt, scaler, 3, 3)
        return {"at_save": at_save, "final": _state_8bit(model, opt), "log": log}
    _dcp_load(ckpt, model, opt, scaler)
    # a skipped step (found_inf set) brings the loaded fp32 values to the 8-bit form, changing nothing else
    opt.step(scaling=ampfuse.optim.StepScaling(None, torch.ones(1), None))
    loaded = _state_8bit(model, opt)
    # what each rank's codes must be: its shard of the loaded values, requantized in its own blocks
    expect = []
    for p in model.parameters():
        st = opt.state[p]
        expect.append({k: ampfuse.ops.quantize_blocks(
            opt.state_dict()["state"][len(expect)][k]._local_tensor.contiguous(), st[k].dtype,
            nonnegative=k == "exp_avg_sq") for k in ("exp_avg", "exp_avg_sq") if k + "_absmax" in st})
    expect = [{k: (c.view(torch.uint8), a) for k, (c, a) in e.items()} for e in expect]
    log = _train_8bit(rank, world, model, opt, scaler, 3, 3)
    return {"loaded": loaded, "expect": expect, "final": _state_8bit(model, opt), "log": log}


@pytest.mark.parametrize("worlds", [(2, 2), (4, 2)], ids=["same-ranks", "resharded-4-to-2"])
def test_fsdp2_8bit_state_dcp_save_load_continue(worlds):
    """8-bit moments under FSDP2 keep their blocks inside each rank's shard. A DCP checkpoint holds
    the moments' fp32 values: loaded on the same ranks the codes come back bit for bit and training
    continues as if uninterrupted; resharded (4 ranks to 2), the values load bit for bit and each
    rank's codes are its new shard's values requantized."""
    save_world, load_world = worlds
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        saved = run_ranks(_dcp_8bit_worker, save_world, ckpt, "save", timeout=300.0)
        loaded = run_ranks(_dcp_8bit_worker, load_world, ckpt, "load", timeout=300.0)
    s0, l0 = saved[0], loaded[0]
    assert s0["at_save"]["forms"][0] == {"exp_avg": "torch.uint8", "exp_avg_sq": "torch.float8_e5m2"}
    assert s0["at_save"]["forms"][1] == {"exp_avg": "torch.float32", "exp_avg_sq": "torch.float32"}
    for a, b in zip(s0["at_save"]["params"], l0["loaded"]["params"]):
        assert torch.equal(a, b)
    for a, b in zip(s0["at_save"]["values"], l0["loaded"]["values"]):  # the fp32 values, whatever the ranks
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for rank, res in enumerate(loaded):
        for i, (got, want) in enumerate(zip(res["loaded"]["codes"], res["expect"])):
            assert got.keys() == want.keys() and bool(got) == (i == 0)  # the one big param is 8-bit
            for k in got:
                assert torch.equal(got[k][0], want[k][0]) and torch.equal(got[k][1], want[k][1]), (rank, k)
    if save_world == load_world:
        for rank in range(save_world):
            for a, b in zip(saved[rank]["at_save"]["codes"], loaded[rank]["loaded"]["codes"]):
                for k in a:
                    assert torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]), (rank, k)
            assert saved[rank]["log"] == loaded[rank]["log"]
            for a, b in zip(saved[rank]["final"]["params"], loaded[rank]["final"]["params"]):
                assert torch.equal(a, b)
    else:
        # other blocks: requantization changes the state by a block's rounding, training goes on close
        for a, b in zip(s0["final"]["params"], l0["final"]["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-2)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _state_dict_helpers_worker(rank: int, world: int, layout: str):
    """For every StateDictOptions combination, master form and state dtype: torch's
    get_optimizer_state_dict, then set_optimizer_state_dict into a fresh model and optimizer.
    Returns the failures, ampfuse's and torch AdamW's on the same model, and the state entries a
    round trip changed."""
    import itertools

    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ampfuse

    def build(make_opt):
        model = _model("bf16")
        model = _shard(model, "bf16") if layout == "fsdp2" else DDP(model)
        opt = make_opt(model.parameters())
        x, y = _batches(0)
        torch.nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    failures: dict[str, list] = {"ampfuse": [], "torch": []}
    changed = []
    for full, offload, flat in itertools.product([False, True], repeat=3):
        options = StateDictOptions(full_state_dict=full, cpu_offload=offload, flatten_optimizer_state_dict=flat)
        # a rank-0 full checkpoint (only rank 0 holds it) loads by broadcast, as torch documents
        load_options = StateDictOptions(full_state_dict=full, cpu_offload=offload, flatten_optimizer_state_dict=flat,
                                        broadcast_from_rank0=full and offload)
        case = (full, offload, flat)
        try:
            model, opt = build(lambda ps: torch.optim.AdamW(ps, lr=1e-2))
            sd = get_optimizer_state_dict(model, opt, options=options)
            model2, opt2 = build(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
            set_optimizer_state_dict(model2, opt2, sd, options=load_options)
        except Exception as e:  # noqa: BLE001 - torch's own limits, compared below
            failures["torch"].append((case, type(e).__name__))
        for master, state_dtype in itertools.product([True, "remainder", "stochastic", False],
                                                     [torch.float32, torch.bfloat16, torch.uint8]):
            def make(ps, lr):
                return ampfuse.optim.AdamW(ps, lr=lr, master_weights=master, state_dtype=state_dtype)

            try:
                model, opt = build(lambda ps: make(ps, 1e-2))
                sd = get_optimizer_state_dict(model, opt, options=options)
                model2, opt2 = build(lambda ps: make(ps, 1e-3))
                set_optimizer_state_dict(model2, opt2, sd, options=load_options)
            except Exception as e:  # noqa: BLE001 - reported to the test
                failures["ampfuse"].append((case, type(e).__name__, str(e)[:200]))
                continue
            a, b = opt.state_dict(), opt2.state_dict()
            assert [g["lr"] for g in b["param_groups"]] == [1e-2] * len(b["param_groups"])
            for k, st in a["state"].items():
                for name, v in st.items():
                    w = b["state"][k].get(name)
                    if not (isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor)
                            and torch.equal(_local(v), _local(w))):
                        changed.append((case, master, str(state_dtype), name))
    return failures, sorted(set(changed))


@pytest.mark.parametrize("layout", ["ddp", "fsdp2"])
def test_torchs_distributed_state_dict_helpers_round_trip_every_optimizer_form(layout):
    """torch's get/set_optimizer_state_dict with every StateDictOptions combination (the rank-0
    full checkpoint with cpu_offload that Lightning and Accelerate take, DCP's flattened form that
    torchtitan and OLMo-core take) work for every master form and state dtype wherever they work
    for torch's AdamW, and bring the state back unchanged; a remainder master in the flattened form
    restarts from the params (torch rebuilds the state from the live keys, not the saved
    master_param). They once raised on the dtype options and on the remainder and absmax keys."""
    for failures, changed in run_ranks(_state_dict_helpers_worker, 2, layout, timeout=300.0):
        torch_cases = {case for case, _ in failures["torch"]}
        assert [f for f in failures["ampfuse"] if f[0] not in torch_cases] == []
        assert all(flat and master == "remainder" and name == "master_param"
                   for (_, _, flat), master, _, name in changed), changed
