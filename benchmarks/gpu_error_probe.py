"""Refused calls on the GPU: every case of the bad-input table (tests/test_bad_input.py) raises its
error, naming the argument, with nothing changed, and nothing crashes.

    python benchmarks/gpu_error_probe.py             # on the GPU machine: cpu, then cuda
    python benchmarks/gpu_error_probe.py --dry-run   # here: the cpu cases, in this process
    AMPFUSE_CPU_KERNELS=cuda-emulated python benchmarks/gpu_error_probe.py --devices cuemu
                                                     # here: the emulated CUDA device, in children

Each device's cases run in a child process, one after another; a case that kills its process is
recorded as crashed (and run again alone under gdb when gdb is there, for its native backtrace),
and a new child goes on with the next case, so a crash hides no other case. Prints one JSON line (the
counts, the cases that did not raise, then every case -> "raised" / "skipped: why" (a case the
device cannot build) / "crashed: SIG..." / "failed: ...") and exits 0 when every case run raised.
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


def _table():
    """The bad-input table's cases: (id, make, exception type, message pattern)."""
    for d in (os.path.join(ROOT, "python"), os.path.join(ROOT, "tests")):
        if d not in sys.path:
            sys.path.insert(0, d)
    import test_bad_input

    return test_bad_input, [(c.id, *c.values) for c in test_bad_input.CASES]


def run_cases(device: str, first: int, report, only: bool = False) -> None:
    """Run the table's cases from index `first` (only that one if `only`) on `device`, reporting ("start", i) before each
    case and ("done", i, result) after it."""
    import pytest

    mod, cases = _table()
    if device == "cuemu":
        import ampfuse.testing.cuemu  # noqa: F401
    for i in range(first, first + 1 if only else len(cases)):
        name, make, exc, pattern = cases[i]
        report("start", i)
        why = mod.unsupported(name, device)
        if why:
            report("done", i, f"skipped: {why}")
            continue
        try:
            mod.check_refused(make, exc, pattern, device)
            result = "raised"
        except (AssertionError, pytest.fail.Exception) as e:  # wrong error, or state changed
            result = "failed: " + str(e).splitlines()[0][:200]
        except BaseException as e:  # noqa: BLE001 - anything else is the finding
            result = f"failed: {type(e).__name__}: " + str(e).splitlines()[0][:200]
        report("done", i, result)


def child(device: str, first: int, only: bool) -> None:
    import faulthandler

    faulthandler.enable()

    def report(kind, i, result=""):
        print(f"{kind}\t{i}\t{result}", flush=True)

    run_cases(device, first, report, only)


def probe_device(device: str, in_process: bool) -> tuple[dict[str, str], list[str]]:
    _, cases = _table()
    names = [c[0] for c in cases]
    results: dict[str, str] = {}
    details: list[str] = []
    if in_process:  # the dry run: the cases run here, one import
        run_cases(device, 0, lambda kind, i, result="": results.__setitem__(names[i], result)
                  if kind == "done" else None)
        return results, details
    first = 0
    while first < len(names):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(first), "--device", device]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        started = first
        for line in p.stdout.splitlines():
            kind, i, result = (line.split("\t") + ["", ""])[:3]
            if kind == "start":
                started = int(i)
            elif kind == "done":
                results[names[int(i)]] = result
        if p.returncode == 0:
            break
        crashed = names[started]
        why = signal.Signals(-p.returncode).name if p.returncode < 0 else f"exit {p.returncode}"
        results[crashed] = f"crashed: {why}"
        detail = f"---- {device}: {crashed}: crashed: {why}\n" + p.stderr[-3000:]
        if p.returncode < 0 and shutil.which("gdb"):
            alone = [sys.executable, os.path.abspath(__file__), "--child", str(started), "--only", "--device", device]
            g = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", *alone],
                               capture_output=True, text=True, timeout=300)
            detail += "\n---- gdb\n" + "\n".join(l for l in g.stdout.splitlines() if l.startswith("#"))[-6000:]
        details.append(detail)
        first = started + 1
    return results, details


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--devices", default="cpu,cuda", help="comma-separated devices, each in child processes "
                    "(default: cpu,cuda; cuemu: the emulated CUDA device of a test build)")
    a = ap.parse_args()
    if a.child is not None:
        child(a.device, a.child, a.only)
        return 0
    devices = ["cpu"] if a.dry_run else a.devices.split(",")
    results, ok = {}, True
    for device in devices:
        found, details = probe_device(device, in_process=a.dry_run)
        for name, result in found.items():
            results[f"{device}: {name}"] = result
            ok &= result.startswith(("raised", "skipped"))
        for d in details:
            print(d, file=sys.stderr)
    bad = {k: v for k, v in results.items() if not v.startswith(("raised", "skipped"))}
    raised = sum(v.startswith("raised") for v in results.values())
    print(json.dumps({"dry_run": a.dry_run, "raised": raised, "of": len(results),
                      "not_raised": bad, "cases": results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
