"""ampfuse benchmarks: every figure against the torch path it replaces, measured in the same run.

    python benchmarks/run.py                 # CPU (make bench), < 10 minutes on 2 cores
    python benchmarks/run.py --device cuda   # GPU (benchmarks/gpu_check.sh)
    python benchmarks/run.py --quick         # a smoke run (tests use it)

For each case: median time per call and spread (interquartile range over interleaved repeats),
the bytes a call must move per parameter (the byte model below), achieved GB/s, the fraction of
a plain copy's bandwidth measured on the same device in the same run for the same number of bytes
(on CPU also of a triad a = b + s*c), and the ratio ampfuse / torch (< 1: ampfuse is faster).

Byte model (per parameter element; lp = 2 bytes for fp16/bf16 weights and grads):
  unscale+check         read + write the grad                          2*g
  unscale+check+norm    the same pass (norm in registers)              2*g
  step, AdamW + masters check pass: read grad (lp); step pass: read grad (lp), master, exp_avg,
                        exp_avg_sq (3*4); write param (lp), master, exp_avg, exp_avg_sq   = 30 B
  step, SGD-momentum + masters   lp + (lp + 2*4) + (lp + 2*4)                               = 22 B
  step, AdamW fp32 params        4 + (4 + 3*4) + 3*4                                        = 32 B
  skip path (overflow)  the check pass only (the step reads found_inf and returns)         lp
  accumulate            read grad (lp), read + write the fp32 buffer                       lp + 8
                        (benchmarked without zeroing the grad, like the torch baseline)
Torch baselines move more bytes for the same result; their GB/s is computed with the same model
(useful work per second), so their fraction of copy bandwidth is directly comparable.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import ampfuse  # noqa: E402
from ampfuse import ops  # noqa: E402

# GPT-2 small (124M): embeddings + 12 blocks + final LayerNorm, 148 tensors.
GPT2_SMALL = [(50257, 768), (1024, 768)]
for _ in range(12):
    GPT2_SMALL += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
GPT2_SMALL += [(768,), (768,)]


def layout_shapes(layout: str, total: int) -> list[tuple[int, ...]]:
    """Tensor shapes with about `total` elements: one tensor, GPT-2-small's list scaled to the
    total (same number of tensors and relative sizes), or 10,000 equal small tensors."""
    if layout == "1":
        return [(total,)]
    if layout == "gpt2":
        full = sum(math.prod(s) for s in GPT2_SMALL)
        f = total / full
        return [(max(1, round(math.prod(s) * f)),) for s in GPT2_SMALL]
    if layout == "10k":
        return [(max(1, total // 10_000),)] * 10_000
    raise ValueError(layout)


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


class Clock:
    """Times fn() calls on one device: CUDA events (with warm-up and an L2 flush between calls for
    small sizes) or wall time with torch.utils.benchmark.Timer on CPU (threads set explicitly)."""

    def __init__(self, device: str, threads: int) -> None:
        self.device = device
        self.threads = threads
        self._flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device == "cuda" else None

    def time(self, fn: Callable[[], object], inner: int) -> float:
        """Seconds per call, averaged over `inner` consecutive calls."""
        if self.device == "cuda":
            total = 0.0
            for _ in range(inner):
                self._flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                total += start.elapsed_time(end) / 1e3
            return total / inner
        import torch.utils.benchmark as tb

        return tb.Timer(stmt="fn()", globals={"fn": fn}, num_threads=self.threads).timeit(inner).mean


@dataclass
class Measurement:
    median_s: float
    q1_s: float
    q3_s: float


def interleaved(clock: Clock, fns: dict[str, Callable[[], object]], repeats: int, budget_s: float) -> dict[str, Measurement]:
    """Warm each fn up, then alternate them `repeats` times (so drifts hit all alike)."""
    for fn in fns.values():
        fn()
    if clock.device == "cuda":
        torch.cuda.synchronize()
    # calls per sample: enough to fill ~budget/repeats/len(fns) seconds
    t0 = time.perf_counter()
    for fn in fns.values():
        fn()
    if clock.device == "cuda":
        torch.cuda.synchronize()
    one = max((time.perf_counter() - t0) / len(fns), 1e-6)
    inner = int(max(1, min(200, budget_s / repeats / len(fns) / one)))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            samples[k].append(clock.time(fn, inner))
    out = {}
    for k, v in samples.items():
        q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
        out[k] = Measurement(statistics.median(v), q[0], q[2])
    return out


def copy_bandwidth(clock: Clock, nbytes: int, repeats: int) -> tuple[float, float | None, float]:
    """GB/s, for streams moving `nbytes` (counting bytes read and written once each), of a plain
    copy, of a triad a = b + s*c (CPU only), and of an in-place scale x *= s. The copy and the
    triad write a separate array, which costs a CPU an extra read of each destination line
    (write-allocate) that the in-place stream, like ampfuse's in-place kernels, does not pay."""
    n = max(1024, nbytes // 8)  # fp32 elements: copy moves 8 bytes per element
    src = torch.rand(n, device=clock.device)
    dst = torch.empty_like(src)
    buf = torch.rand(n, device=clock.device)
    fns = {"copy": lambda: dst.copy_(src), "inplace": lambda: buf.mul_(1.0000001)}
    triad = None
    if clock.device == "cpu":
        nt = max(1024, nbytes // 12)
        b, c = torch.rand(nt), torch.rand(nt)
        a = torch.empty(nt)
        fns["triad"] = lambda: torch.add(b, c, alpha=0.5, out=a)
    m = interleaved(clock, fns, repeats, budget_s=0.6)
    copy = 8 * n / m["copy"].median_s / 1e9
    inplace = 8 * n / m["inplace"].median_s / 1e9
    if "triad" in m:
        triad = 12 * nt / m["triad"].median_s / 1e9
    return copy, triad, inplace


# ----------------------------------------------------------------------------------------------
# the cases
# ----------------------------------------------------------------------------------------------


def make_params(shapes, dtype, device, seed=0):
    """Params and (scaled by 1024) grads, generated on the device itself."""
    g = torch.Generator(device=device).manual_seed(seed)
    ps = []
    for s in shapes:
        p = (torch.randn(s, generator=g, device=device) * 0.02).to(dtype)
        p.requires_grad_(True)
        p.grad = (torch.randn(s, generator=g, device=device) * 1e-3 * 1024).to(dtype)
        ps.append(p)
    return ps


def case_unscale(shapes, dtype, device, with_norm: bool):
    params = make_params(shapes, dtype, device)
    grads = [p.grad for p in params]  # clip_grad_norm_ reads .grad
    # inv_scale != 1 so that both kernels really write, close to 1 so that repeated calls keep the
    # values in range (no denormals); max_norm large so that clipping leaves them in range too.
    inv = torch.full((1,), 1.0 + 2.0**-23, device=device)
    fi = torch.zeros(1, device=device)
    fi_t = torch.zeros(1, device=device)

    if with_norm:
        def ours():
            norm, coef = ops.unscale_check_norm_(grads, fi, inv, max_norm=1e9)
            torch._foreach_mul_(grads, coef)  # clip_grad_norm_ multiplies too
            return norm

        def theirs():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, fi_t, inv)
            return torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True)
    else:
        def ours():
            ops.unscale_check_(grads, fi, inv)

        def theirs():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, fi_t, inv)
    eb = torch.finfo(dtype).bits // 8
    return {"ampfuse": ours, "torch": theirs}, 2 * eb


def case_step(shapes, dtype, device, kind: str, skip: bool = False):
    """Full mixed-precision step with clipping. dtype fp16/bf16: master weights (baseline A);
    fp32: torch's native AMP recipe (baseline B)."""
    lp = dtype != torch.float32
    dev_type = torch.device(device).type
    ours_p = make_params(shapes, dtype, device)
    ref_p = make_params(shapes, dtype, device)
    if skip:
        for ps in (ours_p, ref_p):
            ps[-1].grad.view(-1)[0] = math.inf
    # fp32 params (baseline B): torch's unscale_ and clip write the grads in place, so repeated
    # calls use scale 1 and a max_norm that never clips, keeping the values stable; the passes
    # are made all the same.
    scale = 1024.0 if lp else 1.0
    max_norm = 1.0 if lp else 1e9
    if kind == "adamw":
        opt = ampfuse.optim.AdamW(ours_p, lr=1e-4)
    else:
        opt = ampfuse.optim.SGD(ours_p, lr=1e-3, momentum=0.9)
    scaler = ampfuse.GradScaler(dev_type, init_scale=scale, growth_interval=10**9, on_min_scale="ignore")
    scaler.scale(torch.ones((), device=device))

    def ours():
        scaler.unscale_and_clip_(opt, max_norm)
        scaler.step(opt)
        scaler.update()
        if skip:
            scaler._scale.fill_(scale)  # keep overflowing at the same scale

    tscaler = torch.amp.GradScaler(dev_type, init_scale=scale, growth_interval=10**9)
    tscaler.scale(torch.ones((), device=device))

    def make_torch_opt(ps):
        if kind == "adamw":
            return torch.optim.AdamW(ps, lr=1e-4, fused=True)
        return torch.optim.SGD(ps, lr=1e-3, momentum=0.9, fused=True)

    if lp:  # baseline A: fp32 masters kept by hand around torch's fused optimizer
        masters = [p.detach().float() for p in ref_p]
        for m in masters:
            m.grad = torch.empty_like(m)
        mgrads = [m.grad for m in masters]
        lp_grads = [p.grad for p in ref_p]
        lp_data = [p.detach() for p in ref_p]
        topt = make_torch_opt(masters)
        clip_params = masters
    else:  # baseline B: torch's native AMP recipe on fp32 params
        topt = make_torch_opt(ref_p)
        clip_params = ref_p

    def theirs():
        if lp:
            torch._foreach_copy_(mgrads, lp_grads)
        tscaler.unscale_(topt)
        torch.nn.utils.clip_grad_norm_(clip_params, max_norm, foreach=True)
        tscaler.step(topt)
        tscaler.update()
        if lp:
            torch._foreach_copy_(lp_data, masters)
        if skip:
            tscaler._scale.fill_(scale)

    g = torch.finfo(dtype).bits // 8
    if skip:
        bpp = g
    elif kind == "adamw":
        bpp = 30 if lp else 32
    else:
        bpp = 22 if lp else 24
    return {"ampfuse": ours, "torch": theirs}, bpp


def case_accumulate(shapes, dtype, device):
    grads = [p.grad for p in make_params(shapes, dtype, device)]
    bufs = [torch.zeros(g.shape, device=device) for g in grads]
    fi = torch.zeros(1, device=device)

    def ours():
        ops.accumulate_grads_(bufs, grads, fi, zero_grads=False)

    def theirs():  # the same work with torch's foreach ops (no inf check)
        torch._foreach_add_(bufs, grads)

    eb = torch.finfo(dtype).bits // 8
    return {"ampfuse": ours, "torch": theirs}, eb + 8


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    params: int
    tensors: int
    layout: str
    dtype: str
    bytes_per_param: float
    ampfuse_ms: float
    ampfuse_iqr_ms: tuple[float, float]
    torch_ms: float
    torch_iqr_ms: tuple[float, float]
    ratio: float  # ampfuse / torch time
    ampfuse_gbps: float
    torch_gbps: float
    copy_gbps: float
    triad_gbps: float | None
    ampfuse_frac_copy: float
    torch_frac_copy: float
    ampfuse_frac_triad: float | None
    inplace_gbps: float = 0.0
    ampfuse_frac_inplace: float = 0.0
    torch_frac_inplace: float = 0.0


def plan(device: str, quick: bool, max_params: int | None = None) -> list[tuple]:
    """(case, layout, params, dtype, kwargs); no case above max_params."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    if quick:
        sizes, big = [10**5], 10**5
    elif device == "cuda":
        sizes, big = [10**5, 10**6, 10**7, 10**8, 10**9], 10**8
    else:
        sizes, big = [10**5, 10**6, 10**7, 10**8], 10**7
    rows = _plan_rows(device, quick, sizes, big, bf16, fp16, fp32)
    if max_params is not None:
        rows = [r for r in rows if r[2] <= max_params]
    return rows


def _plan_rows(device, quick, sizes, big, bf16, fp16, fp32):
    lp = fp16 if device == "cuda" else bf16
    rows = []
    for n in sizes:  # the headline: AdamW with masters, parameter-count sweep, GPT-2 shapes
        rows.append(("step_adamw_master", "gpt2", n, lp, {}))
    for layout in ["1", "10k"]:  # tensor-count sweep
        rows.append(("step_adamw_master", layout, big, lp, {}))
    other = fp16 if lp == bf16 else bf16
    rows += [
        ("step_adamw_master", "gpt2", big, other, {}),
        ("step_sgd_master", "gpt2", big, lp, {}),
        ("step_sgd_master", "gpt2", big, other, {}),
        ("step_adamw_fp32", "gpt2", big, fp32, {}),
        ("skip_adamw_master", "gpt2", big, lp, {}),
        ("unscale_check", "gpt2", big, fp32, {}),
        ("unscale_check", "gpt2", big, lp, {}),
        ("unscale_check", "10k", big, fp32, {}),
        ("unscale_check_norm", "gpt2", big, fp32, {}),
        ("accumulate", "gpt2", big, lp, {}),
    ]
    if not quick and device == "cpu":
        rows.append(("step_adamw_fp32", "gpt2", 10**8, fp32, {}))
        rows.append(("unscale_check", "1", 10**8, fp32, {}))
    if not quick and device == "cuda":
        for n in [10**8, 10**9]:
            rows.append(("step_adamw_fp32", "gpt2", n, fp32, {}))
    return rows


def build(case: str, shapes, dtype, device):
    if case == "unscale_check":
        return case_unscale(shapes, dtype, device, with_norm=False)
    if case == "unscale_check_norm":
        return case_unscale(shapes, dtype, device, with_norm=True)
    if case == "accumulate":
        return case_accumulate(shapes, dtype, device)
    kind = "adamw" if "adamw" in case else "sgd"
    return case_step(shapes, dtype, device, kind, skip=case.startswith("skip"))


def gpu_step_diagnostics(device: str) -> dict:
    """Host syncs and kernel launches of one fused step (GPU only), for 1,000 tensors."""
    shapes = [(1000,)] * 1000
    p = make_params(shapes, torch.float16, device)
    opt = ampfuse.optim.AdamW(p, lr=1e-4)
    scaler = ampfuse.GradScaler("cuda", init_scale=1024.0, on_min_scale="ignore")
    scaler.scale(torch.ones((), device=device))

    def step():
        scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    step()
    torch.cuda.synchronize()
    import warnings

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message).lower() for w in rec)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "memset" not in e.name.lower() and "memcpy" not in e.name.lower()]
    return {"tensors": 1000, "host_syncs": syncs, "kernel_launches": len(kernels), "kernels": sorted({e.name[:60] for e in kernels})}


def machine_info(device: str) -> dict:
    info = {
        "device": device,
        "torch": torch.__version__,
        "ampfuse": ampfuse.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "date": _dt.date.today().isoformat(),
    }
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info["cpu_cores"] = os.cpu_count()
    info["cpu_kernels"] = ampfuse.cpu_kernel_info()["kernels"]
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (a smoke run)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--max-params", type=int, default=None, help="skip cases with more parameters")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop starting new cases after this many seconds (the JSON holds what was measured)")
    ap.add_argument("--plan-only", action="store_true", help="write the planned cases, measure nothing")
    a = ap.parse_args(argv)
    device = a.device
    if a.plan_only:
        cases = plan(device, a.quick, a.max_params)
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"plan-{device}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"device": device, "planned": [[c, l, n, str(d).replace("torch.", "")] for c, l, n, d, _ in cases]}, f, indent=1)
        print(f"{len(cases)} cases planned for {device}, at most {max(n for _, _, n, _, _ in cases):.0e} parameters; wrote {path}")
        return path
    threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # explicit: all cores
    repeats = a.repeats or (3 if a.quick else 7)
    clock = Clock(device, threads)
    from tqdm import tqdm

    rows: list[Row] = []
    cases = plan(device, a.quick, a.max_params)
    started = time.perf_counter()
    os.makedirs(a.out, exist_ok=True)
    tag = "quick-" if a.quick else ""
    info = machine_info(device)
    path = os.path.join(a.out, f"{tag}{device}-{info['date']}.json")

    def save(extra=None) -> None:  # after every case: a run cut off by a time limit keeps its rows
        result = {"machine": info, "rows": [asdict(r) for r in rows], **(extra or {})}
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)

    for case, layout, n, dtype, _ in tqdm(cases, desc=f"benchmarks ({device})", disable=a.no_progress):
        if a.deadline_s is not None and time.perf_counter() - started > a.deadline_s:
            print(f"deadline reached: {len(rows)} of {len(cases)} cases measured")
            break
        shapes = layout_shapes(layout, n)
        params = sum(math.prod(s) for s in shapes)
        fns, bpp = build(case, shapes, dtype, device)
        big = params * bpp > (400 << 20)
        m = interleaved(clock, fns, max(3, repeats - (3 if big else 0)), budget_s=0.5 if a.quick else (6.0 if big else 3.0))
        copy_gbps, triad_gbps, inplace_gbps = copy_bandwidth(clock, int(params * bpp), max(3, repeats // 2))
        nbytes = params * bpp
        ga = nbytes / m["ampfuse"].median_s / 1e9
        gt = nbytes / m["torch"].median_s / 1e9
        rows.append(Row(
            case, params, len(shapes), layout, str(dtype).replace("torch.", ""), bpp,
            m["ampfuse"].median_s * 1e3, (m["ampfuse"].q1_s * 1e3, m["ampfuse"].q3_s * 1e3),
            m["torch"].median_s * 1e3, (m["torch"].q1_s * 1e3, m["torch"].q3_s * 1e3),
            m["ampfuse"].median_s / m["torch"].median_s, ga, gt, copy_gbps, triad_gbps,
            ga / copy_gbps, gt / copy_gbps, (ga / triad_gbps) if triad_gbps else None,
            inplace_gbps, ga / inplace_gbps, gt / inplace_gbps,
        ))
        del fns
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        save()
    result = {"machine": info, "rows": [asdict(r) for r in rows]}
    if device == "cuda":
        result["step_diagnostics"] = gpu_step_diagnostics(device)
    save({k: v for k, v in result.items() if k not in ("machine", "rows")})
    print(f"wrote {path}")
    from report import markdown_table, plot

    print(markdown_table(result))
    if not a.no_plots:
        for p in plot(result, a.out, prefix=tag):
            print(f"wrote {p}")
    return path


if __name__ == "__main__":
    main()
