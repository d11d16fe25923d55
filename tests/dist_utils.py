"""Running a test body in several processes (torch.distributed, gloo on the CPU) so that it
cannot flake or hang a test run: the ranks rendezvous through a file (no port to race for),
every rank passes a barrier before tearing its process group down (a rank that exits while
another still talks to it aborts in gloo), failures come back with the rank's traceback, and
the whole run has a deadline after which the ranks are killed."""

from __future__ import annotations

import datetime
import io
import os
import queue
import tempfile
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def _entry(fn: Callable[..., Any], rank: int, world: int, init_file: str, results: Any, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        value = fn(rank, world, *args)
        dist.barrier()  # nobody tears down while another rank still communicates
        dist.destroy_process_group()
        buf = io.BytesIO()  # as bytes: tensors sent through the queue itself need this process alive
        torch.save(value, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """fn(rank, world, *args) in `world` processes with an initialised gloo process group; returns
    each rank's return value (picklable), or raises naming the rank that failed or hung."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(fn, rank, world, init_file, results, args), daemon=True)
                 for rank in range(world)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}  # in the order they arrived: the first is usually the cause
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(out) + len(errors) < world:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and not errors:
                    # a rank died without reporting (a crash); give the others a moment, then stop
                    deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=5))
                continue
            (out if status == "ok" else errors)[rank] = value
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        if errors:
            report = "\n".join(f"rank {r} of {world} failed:\n{tb}" for r, tb in errors.items())
            raise AssertionError(report)
        missing = [r for r in range(world) if r not in out]
        if missing:
            codes = {r: procs[r].exitcode for r in missing}
            raise AssertionError(f"ranks {missing} of {world} did not finish within {timeout:.0f}s (exit codes {codes})")
        import torch

        return [torch.load(io.BytesIO(out[r]), weights_only=False) for r in range(world)]
