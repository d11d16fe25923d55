"""FSDP2 on the GPU with NCCL: the DTensor paths of ampfuse's ops on real CUDA tensors.

    torchrun --standalone --nproc_per_node=1 benchmarks/fsdp2_check.py   # on the GPU machine
    python benchmarks/fsdp2_check.py --dry-run                            # here: imports and plan only

World size 1 still runs every op through DTensor (FSDP2 shards over a 1-rank mesh). An fp16 model
trained with ampfuse.GradScaler + ampfuse.optim.AdamW (fp32 masters) under fully_shard is compared
with the same model unsharded: parameters and masters, the skipped step of an injected inf, the
clip norm. Prints one JSON line; exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

STEPS, INF_AT = 6, 3


def model(device):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(device, torch.float16)


def train(m, opt, scaler, device, log):
    import torch

    for step in range(STEPS):
        g = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(32, 64, device=device, generator=g, dtype=torch.float16)
        loss = m(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == INF_AT:
            p = next(iter(m.parameters()))
            grad = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
            grad.view(-1)[0] = math.inf
        norm = scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        log.append({"norm": float(norm), "scale": scaler.get_scale(), "skipped": float(scaler.last_found_inf)})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    import torch
    from torch.distributed.fsdp import fully_shard

    import ampfuse
    import ampfuse.distributed  # noqa: F401 -- the DTensor handlers

    if a.dry_run:
        print(json.dumps({"dry_run": True, "fully_shard": fully_shard.__module__, "steps": STEPS, "inf_at": INF_AT}))
        return 0
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = "cuda"
    logs: dict[str, list] = {"fsdp2": [], "plain": []}
    sharded = model(device)
    fully_shard(sharded[0])
    fully_shard(sharded[2])
    fully_shard(sharded)
    opt_s = ampfuse.optim.AdamW(sharded.parameters(), lr=1e-3)
    train(sharded, opt_s, ampfuse.GradScaler("cuda", init_scale=2.0**14), device, logs["fsdp2"])
    plain = model(device)
    opt_p = ampfuse.optim.AdamW(plain.parameters(), lr=1e-3)
    train(plain, opt_p, ampfuse.GradScaler("cuda", init_scale=2.0**14), device, logs["plain"])
    world = dist.get_world_size()
    diffs = []
    for ps, pp in zip(sharded.parameters(), plain.parameters()):
        full = ps.full_tensor()
        diffs.append(float((full.float() - pp.float()).abs().max()))
        ms = opt_s.state[ps]["master_param"].full_tensor()
        diffs.append(float((ms - opt_p.state[pp]["master_param"]).abs().max()))
    checks = {
        "skipped_only_inf_step": [r["skipped"] for r in logs["fsdp2"]] == [float(k == INF_AT) for k in range(STEPS)],
        "scales_equal": [r["scale"] for r in logs["fsdp2"]] == [r["scale"] for r in logs["plain"]],
        "norms_close": all(math.isclose(a["norm"], b["norm"], rel_tol=1e-3) or (math.isnan(a["norm"]) and math.isnan(b["norm"]))
                           for a, b in zip(logs["fsdp2"], logs["plain"]) if not a["skipped"]),
        "params_and_masters_close": max(diffs) <= (0.0 if world == 1 else 2e-3) + 1e-3,
    }
    result = {"rank": rank, "world": world, "max_diff": max(diffs), "checks": checks, "logs": logs}
    if rank == 0:
        print(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
