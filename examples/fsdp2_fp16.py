"""fp16 training with fp32 master weights under FSDP2 (``torch.distributed.fsdp.fully_shard``).

Trains one small MLP two ways, on the same data from the same initial weights:

* **ampfuse**: the model itself is fp16 (fp16 params, sharded by ``fully_shard`` per layer and at
  the root, gradients reduced in fp32 by ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``),
  fp32 master weights inside ``ampfuse.optim.AdamW(master_weights=True)``, ``ampfuse.GradScaler``
  with ``unscale_and_clip_``: no host sync in the training loop.
* **torch**: torch has no fp16-params-with-fp32-masters path (``torch.amp.GradScaler.unscale_``
  raises "Attempting to unscale FP16 gradients."; ``ShardedGradScaler`` accepts fp16 gradients,
  but no torch optimizer keeps fp32 masters, so fp16 params would be updated in fp16), so the
  torch recipe keeps fp32 params and computes in fp16 through
  ``MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)``, with
  ``torch.optim.AdamW``, ``ShardedGradScaler`` and ``clip_grad_norm_``.

Both start at a loss scale that overflows fp16 gradients, so the first steps are skipped on both
sides. The script prints, per run, the steps taken and skipped, the final loss and the bytes of
params + optimizer state per parameter.

Run (2 CPU processes)::

    torchrun --nproc_per_node=2 examples/fsdp2_fp16.py --backend gloo --device cpu

or on GPUs: ``--backend nccl --device cuda``. ``run(rank, world_size, ...)`` is the same
comparison for a caller that has already initialised the process group (the test does).
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

import ampfuse

IN, HIDDEN, OUT = 32, 128, 8
GLOBAL_BATCH = 32
STEPS = 40
LR = 1e-3
WEIGHT_DECAY = 0.01
MAX_NORM = 1.0
INIT_SCALE = 2.0**24  # fp16 gradients overflow at this scale: the first steps are skipped
GROWTH_INTERVAL = 2000  # torch's default: after the initial backoffs the scale stays put


def make_model(seed: int = 0) -> torch.nn.Sequential:
    """The fp32 model both runs start from, its weights rounded to fp16 values so that the fp16
    model (ampfuse) and the fp32 model (torch) hold the same numbers at step 0."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    return model


def make_batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole run's data, the same on every rank (each rank then takes its shard): inputs
    and the targets of a fixed random teacher network."""
    g = torch.Generator().manual_seed(1000 + seed)
    teacher_a = torch.randn(IN, HIDDEN, generator=g) / IN**0.5
    teacher_b = torch.randn(HIDDEN, OUT, generator=g) / HIDDEN**0.5
    batches = []
    for _ in range(steps):
        x = torch.randn(GLOBAL_BATCH, IN, generator=g)
        batches.append((x, torch.tanh(x @ teacher_a) @ teacher_b))
    return batches


def _shard(model: torch.nn.Module, mp_policy: MixedPrecisionPolicy) -> torch.nn.Module:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def _memory(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> dict[str, float]:
    """Bytes of the params, their gradients and the optimizer state over all ranks (sharded: each
    rank holds its shard), per parameter element."""
    params, grads, masters, moments, steps, numel = 0, 0, 0, 0, 0, 0
    for p in model.parameters():
        lp = _local(p)
        numel += lp.numel()
        params += lp.numel() * lp.element_size()
        if p.grad is not None:
            grads += _local(p.grad).numel() * _local(p.grad).element_size()
        for key, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                n = _local(v).numel() * _local(v).element_size()
                if key == "master_param":
                    masters += n
                elif key == "step":
                    steps += n
                else:
                    moments += n
    totals = torch.tensor([params, grads, masters, moments, steps, numel], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    params, grads, masters, moments, steps, numel = totals.tolist()
    return {"numel": int(numel), "param": params / numel, "grad": grads / numel, "master": masters / numel,
            "moments": moments / numel, "step_counters": steps / numel,
            "params_and_state": (params + masters + moments + steps) / numel}


def _shard_of(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world_size: int, device: torch.device):
    per = GLOBAL_BATCH // world_size
    x, y = batch
    return x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)


def train_ampfuse(model: torch.nn.Module, batches: list, rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    """fp16 params under FSDP2, fp32 masters in the optimizer, ampfuse's scaler. No host sync in
    the loop: losses, skip flags and scales stay device tensors until the loop is over."""
    model = _shard(model.half().to(device), MixedPrecisionPolicy(reduce_dtype=torch.float32))
    opt = ampfuse.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, master_weights=True)
    scaler = ampfuse.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    data = [_shard_of(b, rank, world_size, device) for b in batches]
    losses, skipped, scales = [], [], []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_and_clip_(opt, MAX_NORM)  # one read of the grads: found_inf, global norm, clip coefficient
        scaler.step(opt)  # skipped in the kernel when found_inf is set
        scaler.update()
        losses.append(loss.detach())
        skipped.append(scaler.last_found_inf.clone())
        scales.append(scaler.stats()["scale"].clone())
    # after the loop: read the results (the first host syncs)
    result = _summary(model, opt, device, losses, [bool(s > 0) for s in skipped], [float(s) for s in scales])
    result["masters"] = [_full(opt.state[p]["master_param"]) for p in model.parameters()]
    result["skipped_count"] = int(scaler.stats()["skipped"])
    return result


def train_torch(model: torch.nn.Module, batches: list, rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    """fp32 params under FSDP2 computing in fp16 (param_dtype), torch's optimizer, sharded scaler
    and clipping."""
    model = _shard(model.to(device), MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scaler = ShardedGradScaler(device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    data = [_shard_of(b, rank, world_size, device) for b in batches]
    losses, skipped, scales = [], [], []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)  # FSDP casts x to fp16
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
        scales.append(scaler.get_scale())
        skipped.append(scales[-1] < before)  # torch's rule backs off exactly on a skipped step
    result = _summary(model, opt, device, losses, skipped, scales)
    result["masters"] = [_full(p) for p in model.parameters()]  # the fp32 params are torch's masters
    result["skipped_count"] = sum(skipped)
    return result


def _summary(model, opt, device, losses, skipped, scales) -> dict[str, Any]:
    local = torch.stack(losses).float()
    dist.all_reduce(local)  # equal shards: the mean of the ranks' losses is the global batch's loss
    losses = (local / dist.get_world_size()).tolist()
    counters = {float(_local(st["step"]).item()) for st in opt.state.values()}
    assert len(counters) == 1, f"the params took different numbers of steps: {counters}"
    return {"steps": len(losses), "steps_taken": int(counters.pop()), "skipped": skipped, "scales": scales,
            "losses": losses, "final_loss": losses[-1], "bytes_per_param": _memory(model, opt, device),
            "params": [_full(p) for p in model.parameters()]}


def run(rank: int, world_size: int, device: str = "cpu", steps: int = STEPS, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Both trainings on an initialised process group; every rank returns the same dict
    ``{"ampfuse": ..., "torch": ...}`` of steps, skips, losses, bytes per param and the final
    fp32 weights (ampfuse's masters, torch's params), gathered."""
    if GLOBAL_BATCH % world_size:
        raise ValueError(f"the batch of {GLOBAL_BATCH} does not split into {world_size} equal shards.")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device(device, local_rank % torch.cuda.device_count()) if device == "cuda" else torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    base = make_model(seed)
    batches = make_batches(steps, seed)
    return {"ampfuse": train_ampfuse(copy.deepcopy(base), batches, rank, world_size, dev),
            "torch": train_torch(copy.deepcopy(base), batches, rank, world_size, dev)}


def _report(name: str, r: dict[str, Any]) -> str:
    b = r["bytes_per_param"]
    pattern = "".join("x" if s else "." for s in r["skipped"])
    return (f"{name:8s} steps taken {r['steps_taken']}/{r['steps']}, skipped {r['skipped_count']} ({pattern}), "
            f"final loss {r['final_loss']:.6f}, final scale {r['scales'][-1]:g}\n"
            f"{'':8s} bytes/param: params {b['param']:g} + masters {b['master']:g} + moments {b['moments']:g} "
            f"(+ step counters {b['step_counters']:.4f}) = {b['params_and_state']:.4f}; grads {b['grad']:g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    dist.init_process_group(args.backend)
    try:
        res = run(rank, world_size, args.device, args.steps)
        if rank == 0:
            print(f"{world_size} ranks, {args.backend}, {args.device}, {sum(r.numel() for r in res['torch']['params'])} params")
            print(_report("ampfuse", res["ampfuse"]))
            print(_report("torch", res["torch"]))
            diff = max(float((a - t).abs().max()) for a, t in zip(res["ampfuse"]["masters"], res["torch"]["masters"]))
            print(f"max |ampfuse master - torch param| = {diff:.3g}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
