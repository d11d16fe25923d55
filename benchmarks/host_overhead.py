"""The host's cost of a training step through ampfuse's CUDA dispatch path, measured without a GPU.

    python benchmarks/host_overhead.py            # writes results/host-overhead-<date>.json
    python benchmarks/host_overhead.py --quick    # a smoke run (tests use it)

What is timed: the whole scaler path (scaler.scale -> unscale_and_clip_ -> step -> update) with a
bf16 AdamW with fp32 masters, on 10, 100, 1,000 and 10,000 tensors of 64 elements, gradients
rewritten before each call (not timed). The CPU tensors go through ampfuse's CUDA kernels' host
code (AMPFUSE_CPU_KERNELS=cuda-emulated: the same launch configuration, metadata packing and
resident-table decisions as on a GPU) with every launch stubbed (CUEMU_STUB_LAUNCHES=1: a launch
is checked and counted, and no block runs). So each time is everything the host does per step up
to the kernel launches: Python, dispatch, validation or the step plan, metadata. Not included: the
CUDA driver's own launch cost (a few µs per launch on a GPU; a step makes three launches whatever
the number of tensors) and the stream/event calls of the CUDA backend.

Candidates, interleaved in a random order in every round:
  ampfuse            the step plan (the default)
  ampfuse-no-plan    every step the validated way (AMPFUSE_STEP_PLAN=0): the previous release's path
  torch-A*           the expert torch recipe of benchmarks/run.py on the same tensors, with torch's CPU
                     kernels running (context: torch has no stubbed-launch mode; with 64-element
                     tensors its time is mostly host work too)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
COUNTS = (10, 100, 1000, 10_000)


def child(counts: list[int], rounds: int, seed: int) -> dict:
    import torch

    sys.path.insert(0, HERE)
    import run as B  # noqa: E402  (benchmarks/run.py: candidates and timing)

    import ampfuse

    assert ampfuse.cpu_kernel_info()["kernels"] == "cuda-emulated"
    rng = random.Random(seed)
    rows = []
    for n in counts:
        shapes = [(64,)] * n
        src = B.GradSource(B.make_params(shapes, torch.bfloat16, "cpu"), False)
        cands = {}
        for name, plan in (("ampfuse", "1"), ("ampfuse-no-plan", "0")):
            os.environ["AMPFUSE_STEP_PLAN"] = plan  # read when the optimizer is built
            cands[name] = B.cand_ampfuse("adamw", shapes, torch.bfloat16, "cpu", src, False)
        os.environ.pop("AMPFUSE_STEP_PLAN")
        cands["torch-A*"] = B.cand_torch_a("adamw", shapes, torch.bfloat16, "cpu", src, False, expert=True)
        samples = B.run_rounds("cpu", cands, rounds, 2.0 if rounds < 10 else 10.0, rng)
        row = {"tensors": n, "elements_per_tensor": 64, "rounds": len(samples["ampfuse"]), "candidates": {}}
        for name, ts in samples.items():
            s = B.summary(ts)
            row["candidates"][name] = {"us": s["median"] * 1e6, "min_us": s["min"] * 1e6, "max_us": s["max"] * 1e6}
        row["speedup_vs"] = {k: B.summary([t / a for a, t in zip(samples["ampfuse"], samples[k])])
                             for k in samples if k != "ampfuse"}
        rows.append(row)
    return {"rows": rows}


def per_tensor(rows: list[dict], name: str) -> dict | None:
    """Median per-step time's growth per extra tensor between the two largest counts."""
    if len(rows) < 2:
        return None
    a, b = rows[-2], rows[-1]
    d = b["tensors"] - a["tensors"]
    return {"us": (b["candidates"][name]["us"] - a["candidates"][name]["us"]) / d,
            "between": [a["tensors"], b["tensors"]]}


def table(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "| tensors | ampfuse (plan) µs/step | no plan µs/step | torch-A* µs/step | plan vs no plan | vs torch-A* |",
        "|---|---|---|---|---|---|",
    ]
    f = lambda c: f"{c['us']:.0f} [{c['min_us']:.0f}–{c['max_us']:.0f}]"  # noqa: E731
    x = lambda s: f"{s['median']:.2f}x [{s['min']:.2f}–{s['max']:.2f}]"  # noqa: E731
    for r in rows:
        c = r["candidates"]
        lines.append(f"| {r['tensors']:,} | {f(c['ampfuse'])} | {f(c['ampfuse-no-plan'])} | {f(c['torch-A*'])} | "
                     f"{x(r['speedup_vs']['ampfuse-no-plan'])} | {x(r['speedup_vs']['torch-A*'])} |")
    pt = result.get("per_extra_tensor_us", {})
    if pt:
        lines.append("")
        lines.append("Per extra tensor (median step time, " + " to ".join(f"{n:,}" for n in pt["ampfuse"]["between"])
                     + " tensors): " + ", ".join(f"{k} {v['us']:.2f} µs" for k, v in pt.items()) + ".")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10 and 100 tensors, few rounds")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    counts = [10, 100] if a.quick else list(COUNTS)
    rounds = 3 if a.quick else 15
    if a.child:
        print(json.dumps(child(counts, rounds, a.seed)))
        return ""
    env = dict(os.environ, AMPFUSE_CPU_KERNELS="cuda-emulated", CUEMU_STUB_LAUNCHES="1", CUEMU_WORKERS="1")
    env.pop("AMPFUSE_STEP_PLAN", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--seed", str(a.seed)] + (["--quick"] if a.quick else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"host_overhead: the measuring process failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    import torch

    result["machine"] = {"date": _dt.date.today().isoformat(), "torch": torch.__version__, "python": sys.version.split()[0],
                         "cpu_threads": torch.get_num_threads(), "mode": "CUDA kernels' host code (emulated table), launches stubbed"}
    pt = {k: per_tensor(result["rows"], k) for k in ("ampfuse", "ampfuse-no-plan", "torch-A*")}
    if all(pt.values()):
        result["per_extra_tensor_us"] = pt
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"{'quick-' if a.quick else ''}host-overhead-{result['machine']['date']}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(table(result))
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
