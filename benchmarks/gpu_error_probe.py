"""Refused op calls on the GPU: each raises a RuntimeError naming the argument, and nothing crashes.

    python benchmarks/gpu_error_probe.py             # on the GPU machine
    python benchmarks/gpu_error_probe.py --dry-run   # here: the CPU cases only, in this process

Every case runs in a process of its own (a crash in one does not hide the others), on the CPU and
on CUDA, so a failure on CUDA alone points at the CUDA path. A case that dies of a signal is run
again under gdb when gdb is there, and its native backtrace is printed. Prints one JSON line
(case -> "raised: ..." / "crashed: SIG..." / "no error") and exits 0 when every case raised.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name -> code run with `torch`, `ampfuse` and `dev` defined; each must raise RuntimeError.
CASES = {
    "accumulate_grads_ accumulator dtype": (
        "ampfuse.ops.accumulate_grads_([torch.zeros(10, device=dev).half()], [torch.zeros(10, device=dev).half()],"
        " torch.zeros(1, device=dev))"),
    "accumulate_grads_ list lengths": (
        "ampfuse.ops.accumulate_grads_([torch.zeros(10, device=dev)], [], torch.zeros(1, device=dev))"),
    "unscale_check_ found_inf dtype": (
        "ampfuse.ops.unscale_check_([torch.zeros(10, device=dev)], torch.zeros(1, device=dev).half(),"
        " torch.ones(1, device=dev))"),
    "clip_coef max_norm": "ampfuse.ops.clip_coef(torch.ones((), device=dev), -1.0)",
    "torch's own check (control)": "torch.zeros(2, device=dev).view(3)",
}


def child(name: str, device: str) -> None:
    import faulthandler

    faulthandler.enable()
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch

    import ampfuse

    try:
        exec(CASES[name], {"torch": torch, "ampfuse": ampfuse, "dev": device})
    except RuntimeError as e:
        print("raised: " + str(e).splitlines()[0][:200])
        return
    print("no error")


def probe(name: str, device: str, in_process: bool) -> tuple[str, str]:
    if in_process:  # the dry run: the cases run here, one import
        import contextlib
        import io

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            child(name, device)
        return buf.getvalue().strip().splitlines()[-1], ""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", name, "--device", device]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = p.stdout.strip().splitlines()
    if p.returncode == 0 and out:
        return out[-1], ""
    if p.returncode < 0:
        result = f"crashed: {signal.Signals(-p.returncode).name}"
    else:
        result = f"exit {p.returncode}"
    detail = p.stderr[-3000:]
    if p.returncode < 0 and shutil.which("gdb"):
        g = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", *cmd],
                           capture_output=True, text=True, timeout=300)
        detail += "\n---- gdb\n" + "\n".join(l for l in g.stdout.splitlines() if l.startswith("#"))[-6000:]
    return result, detail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--child")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.device)
        return 0
    devices = ["cpu"] if a.dry_run else ["cpu", "cuda"]
    results, ok = {}, True
    for device in devices:
        for name in CASES:
            result, detail = probe(name, device, in_process=a.dry_run)
            results[f"{device}: {name}"] = result
            ok &= result.startswith("raised")
            if detail:
                print(f"---- {device}: {name}: {result}\n{detail}", file=sys.stderr)
    print(json.dumps({"dry_run": a.dry_run, "cases": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
