"""ampfuse benchmarks: every figure a ratio against the best torch path for the same job, measured
in the same run, and a bandwidth against the in-place stream measured in the same rounds.

    python benchmarks/run.py                 # CPU (make bench)
    python benchmarks/run.py --device cuda   # GPU (benchmarks/gpu_check.sh)
    python benchmarks/run.py --quick         # a smoke run (tests use it)

How a case is timed:
  * every candidate owns its tensors; before each timed call its gradients are rewritten from a
    source (not timed), so each step starts as after a backward pass, with freshly written grads;
  * candidates and the roof references (in-place stream x *= s, copy, and on CPU a triad
    a = b + s*c) run in one randomly shuffled order per round, for at least 15 rounds (more for
    fast cases, within a time budget), after two warm-up rounds;
  * each call is timed alone (wall clock with a device sync on CPU, CUDA events on GPU); tables
    show median [min-max] over the rounds, and ratios are taken per round (same round, same
    machine state) and summarised the same way.

Candidates (per case; the headline ratio is against the fastest torch candidate of the run):
  ampfuse     GradScaler.unscale_and_clip_ -> step -> update with an ampfuse optimizer (the
              scaler's check pass plus one fused step pass; no host sync)
  torch-A     fp16/bf16 params kept with fp32 masters by hand: grads copied to fp32,
              GradScaler.unscale_, clip_grad_norm_, fused AdamW/SGD on the masters via the
              scaler, masters copied back (the common recipe)
  torch-A*    the expert version: grads copied to fp32, one _foreach_norm of the scaled grads,
              fused AdamW/SGD with grad_scale = scale / clip_coef and found_inf from the norm (the
              unscale and the clip folded into the fused step), _amp_update_scale_, masters copied
              back
  torch-B     fp32 params: GradScaler.unscale_, clip_grad_norm_, scaler.step(fused AdamW/SGD)
  torch-B*    fp32 params, expert: one _foreach_norm of the scaled grads, fused step with
              grad_scale = scale / clip_coef and found_inf, _amp_update_scale_

  8-bit moments (step_adamw_8bit, CPU and GPU): the optimizer step alone (no scaler: the peers have no
  found_inf), bf16 params and grads, the same tensors for every candidate:
    ampfuse        AdamW, uint8 moments (dynamic map, blocks of 256), 16-bit remainders
    ampfuse-fp8    AdamW, e4m3 first and e5m2 second moment, 16-bit remainders
    ampfuse-bf16   AdamW, bf16 moments, 16-bit remainders (what the 8-bit moments replace;
                   18 B moved per param)
    ampfuse-sr-8bit  AdamW, uint8 moments, stochastic rounding into the bf16 params (no master;
                   10 B moved per param)
    bnb-8bit       bitsandbytes.optim.AdamW8bit (updates the bf16 params directly)
    torchao-8bit   torchao.optim.AdamW8bit, torchao-fp8: torchao.optim.AdamWFp8 (likewise)
    torch          torch.optim.AdamW(fused=True) on the bf16 params (bf16 moments: the least
                   state a torch optimizer keeps)
  The peers come from benchmarks/requirements-peers.txt (`make bench` installs them); a peer
  that is not installed is left out and the row says so.

Byte model (useful bytes per parameter element that the job must move; lp = 2 for fp16/bf16):
  step, AdamW, fp32 masters     check: grad lp; step: read grad lp, param lp (it tells an edited
                                param), master 4, m 4, v 4; write param lp, master, m, v  = 32 B
  step, AdamW, remainder +      check lp; read grad, param, remainder, m, v (2 each); write
    bf16 state                  param, remainder, m, v                                  = 20 B
  step, AdamW, fp32 params      4 + (4 + 4 + 4 + 4) + 3*4                               = 32 B
  step, SGD-momentum, masters   lp + (lp + lp + 4 + 4) + (lp + 4 + 4)                   = 24 B
  step, AdamW, remainders +     read grad, param, remainder (2 each), m, v (1 each); write param,
    8-bit moments               remainder, m, v (block absmax: 8 B per 256 elements)   = 14 B
  skipped step (overflow)       the check pass only                                     lp
  unscale+check (+norm)         read + write the grad                                   2*g
  accumulate                    read grad (g), read + write the fp32 buffer             g + 8
Torch candidates are measured against the same model (useful work per second).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
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

MIN_ROUNDS = 15
ROOF_CAP_BYTES = 1 << 30  # beyond the caches a stream's bandwidth does not depend on its size


def layout_shapes(layout: str, total: int) -> list[tuple[int, ...]]:
    """Tensor shapes with about `total` elements: one tensor, GPT-2-small's list scaled to the
    total (same number of tensors and relative sizes), 10,000 equal tensors, or `Nx` equal
    tensors (e.g. "1000x": 1,000 tensors)."""
    if layout == "1":
        return [(total,)]
    if layout == "gpt2":
        full = sum(math.prod(s) for s in GPT2_SMALL)
        f = total / full
        return [(max(1, round(math.prod(s) * f)),) for s in GPT2_SMALL]
    if layout == "10k":
        return [(max(1, total // 10_000),)] * 10_000
    if layout.endswith("x"):
        k = int(layout[:-1])
        return [(max(1, total // k),)] * k
    raise ValueError(layout)


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


@dataclass
class Candidate:
    """One timed thing: prepare() (not timed: e.g. rewrite the gradients) then fn() (timed)."""

    fn: Callable[[], object]
    prepare: Callable[[], object] = lambda: None
    bytes_moved: float | None = None  # for roofs: the bytes one call moves (else the case's model)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_once(device: str, c: Candidate) -> float:
    c.prepare()
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        c.fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    c.fn()
    return time.perf_counter() - t0


def run_rounds(device: str, cands: dict[str, Candidate], min_rounds: int, budget_s: float, rng: random.Random,
               max_rounds: int = 200) -> dict[str, list[float]]:
    """Shuffled rounds over every candidate: two warm-up rounds, then at least `min_rounds`, more
    while the budget lasts (up to `max_rounds`). Returns the seconds of each call per candidate."""
    names = list(cands)
    for _ in range(2):
        for k in names:
            time_once(device, cands[k])
    samples: dict[str, list[float]] = {k: [] for k in names}
    started = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (rounds < max_rounds and time.perf_counter() - started < budget_s):
        order = names[:]
        rng.shuffle(order)
        for k in order:
            samples[k].append(time_once(device, cands[k]))
        rounds += 1
    return samples


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def roof_candidates(device: str, nbytes: float) -> dict[str, Candidate]:
    """In-place stream (x *= s: reads and writes each fp32 once, 8 B per element), copy (8 B per
    element; on a CPU the destination is also read, write-allocate) and on CPU a triad a = b + s*c
    (12 B per element), each moving min(nbytes, 1 GiB)."""
    moved = max(1 << 16, min(float(nbytes), float(ROOF_CAP_BYTES)))
    n = int(moved // 8)
    buf = torch.rand(n, device=device)
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    out = {
        "roof:inplace": Candidate(lambda: buf.mul_(1.0000001), bytes_moved=8 * n),
        "roof:copy": Candidate(lambda: dst.copy_(src), bytes_moved=8 * n),
    }
    if device == "cpu":
        nt = int(moved // 12)
        b, c = torch.rand(nt), torch.rand(nt)
        a = torch.empty(nt)
        out["roof:triad"] = Candidate(lambda: torch.add(b, c, alpha=0.5, out=a), bytes_moved=12 * nt)
    return out


# ----------------------------------------------------------------------------------------------
# the cases
# ----------------------------------------------------------------------------------------------

SCALE = 1024.0
MAX_NORM = 1.0


def make_params(shapes, dtype, device, seed=0):
    """Params with grads (scaled by SCALE), generated on the device itself."""
    g = torch.Generator(device=device).manual_seed(seed)
    ps = []
    for s in shapes:
        p = (torch.randn(s, generator=g, device=device) * 0.02).to(dtype)
        p.requires_grad_(True)
        p.grad = (torch.randn(s, generator=g, device=device) * 1e-3 * SCALE).to(dtype)
        ps.append(p)
    return ps


class GradSource:
    """Fresh gradients for a candidate's params before each call (as backward writes them)."""

    def __init__(self, params, skip: bool) -> None:
        self.src = [p.grad.detach().clone() for p in params]
        if skip:
            self.src[-1].view(-1)[0] = math.inf  # every step overflows
        self.params = params

    def writer(self, grads: list[torch.Tensor]) -> Callable[[], None]:
        def write() -> None:
            torch._foreach_copy_(grads, self.src)
        return write


def _torch_opt(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, fused=True)


def cand_ampfuse(kind, shapes, dtype, device, src: GradSource | None, skip, precision=None, clip=True) -> Candidate:
    params = make_params(shapes, dtype, device)
    source = src or GradSource(params, skip)
    kw = {}
    if precision == "remainder-bf16":
        kw = dict(master_weights="remainder", state_dtype=torch.bfloat16)
    opt = ampfuse.optim.AdamW(params, lr=1e-4, **kw) if kind == "adamw" else ampfuse.optim.SGD(params, lr=1e-3, momentum=0.9, **kw)
    dev_type = torch.device(device).type
    scaler = ampfuse.GradScaler(dev_type, init_scale=SCALE, growth_interval=10**9, on_min_scale="ignore")
    loss = torch.ones((), device=device)
    scaler.scale(loss)  # creates the scale tensor
    grads = [p.grad for p in params]
    write = source.writer(grads)

    def prepare() -> None:
        write()
        if skip:
            scaler._scale.fill_(SCALE)  # keep overflowing at the same scale

    def step() -> None:
        scaler.scale(loss)
        if clip:
            scaler.unscale_and_clip_(opt, MAX_NORM)
        scaler.step(opt)
        scaler.update()

    return Candidate(step, prepare)


def cand_torch_a(kind, shapes, dtype, device, src: GradSource, skip, expert: bool) -> Candidate:
    """Baselines A (lp params, fp32 masters by hand) and B (fp32 params); `expert` as documented
    at the top of this file."""
    params = make_params(shapes, dtype, device)
    lp = dtype != torch.float32
    lp_grads = [p.grad for p in params]
    write = src.writer(lp_grads)
    if lp:
        masters = [p.detach().float() for p in params]
        for m in masters:
            m.grad = torch.empty_like(m)
        mgrads = [m.grad for m in masters]
        lp_data = [p.detach() for p in params]
        opt = _torch_opt(kind, masters)
        step_params, step_grads = masters, mgrads
    else:
        opt = _torch_opt(kind, params)
        step_params, step_grads = params, lp_grads
    dev_type = torch.device(device).type
    loss = torch.ones((), device=device)
    if not expert:
        tscaler = torch.amp.GradScaler(dev_type, init_scale=SCALE, growth_interval=10**9)
        tscaler.scale(loss)

        def prepare() -> None:
            write()
            if skip:
                tscaler._scale.fill_(SCALE)

        def step() -> None:
            tscaler.scale(loss)
            if lp:
                torch._foreach_copy_(mgrads, lp_grads)
            tscaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(step_params, MAX_NORM, foreach=True)
            tscaler.step(opt)
            tscaler.update()
            if lp:
                torch._foreach_copy_(lp_data, masters)

        return Candidate(step, prepare)

    scale = torch.full((), SCALE, device=device)
    growth = torch.zeros((), dtype=torch.int32, device=device)
    found = torch.zeros((), device=device)

    def prepare_e() -> None:
        write()
        if skip:
            scale.fill_(SCALE)

    def step_e() -> None:
        loss * scale  # scaler.scale(loss)
        if lp:
            torch._foreach_copy_(mgrads, lp_grads)
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(step_grads)))  # of the scaled grads
        found.copy_(torch.logical_not(torch.isfinite(total)))
        # clip coefficient of the unscaled grads, folded with the scale into the fused step
        coef = torch.clamp(MAX_NORM / (total / scale + 1e-6), max=1.0)
        opt.grad_scale = (scale / coef).to(torch.float32)
        opt.found_inf = found
        opt.step()
        torch._amp_update_scale_(scale, growth, found, 2.0, 0.5, 10**9)
        if lp:
            torch._foreach_copy_(lp_data, masters)

    return Candidate(step_e, prepare_e)


def bytes_per_param(kind: str, dtype: torch.dtype, skip: bool, precision: str | None) -> float:
    g = torch.finfo(dtype).bits // 8
    if skip:
        return g
    if precision == "remainder-bf16":
        return 20 if kind == "adamw" else 14  # SGD: check 2 + read g, p, rem, mom + write p, rem, mom
    if kind == "adamw":
        return 32
    return 24 if dtype != torch.float32 else 28  # fp32 SGD: 4 + (4 + 4 + 4) + (4 + 4)


def case_step(shapes, dtype, device, kind: str, skip: bool = False) -> tuple[dict[str, Candidate], float]:
    ours = cand_ampfuse(kind, shapes, dtype, device, None, skip)
    src = GradSource(make_params(shapes, dtype, device), skip)
    a = "torch-A" if dtype != torch.float32 else "torch-B"
    return {
        "ampfuse": ours,
        a: cand_torch_a(kind, shapes, dtype, device, src, skip, expert=False),
        a + "*": cand_torch_a(kind, shapes, dtype, device, src, skip, expert=True),
    }, bytes_per_param(kind, dtype, skip, None)


def case_precision(shapes, dtype, device) -> tuple[dict[str, Candidate], float]:
    """bf16 params, AdamW: remainder masters + bf16 moments against ampfuse's fp32-master step and
    the expert torch recipe."""
    src = GradSource(make_params(shapes, dtype, device), False)
    return {
        "ampfuse": cand_ampfuse("adamw", shapes, dtype, device, src, False, precision="remainder-bf16"),
        "ampfuse-fp32-masters": cand_ampfuse("adamw", shapes, dtype, device, src, False),
        "torch-A*": cand_torch_a("adamw", shapes, dtype, device, src, False, expert=True),
    }, bytes_per_param("adamw", dtype, False, "remainder-bf16")


PEERS_8BIT = {  # candidate: (module, optimizer class)
    "bnb-8bit": ("bitsandbytes.optim", "AdamW8bit"),
    "torchao-8bit": ("torchao.optim", "AdamW8bit"),
    "torchao-fp8": ("torchao.optim", "AdamWFp8"),
}


def case_8bit(shapes, dtype, device, quick: bool) -> tuple[dict[str, Candidate], float, list[str]]:
    """The AdamW step with 8-bit moments against bitsandbytes' and torchao's (see the top of this
    file). Returns the candidates, the byte model and the peers left out (not installed; all of
    them in a quick run, whose rounds are too few for torchao's per-shape compilation)."""
    import importlib

    src = GradSource(make_params(shapes, dtype, device), False)

    def opt_cand(make) -> Candidate:
        params = make_params(shapes, dtype, device)
        opt = make(params)
        write = src.writer([p.grad for p in params])
        return Candidate(opt.step, write)

    cands = {
        "ampfuse": opt_cand(lambda ps: ampfuse.optim.AdamW(ps, lr=1e-4, master_weights="remainder",
                                                            state_dtype=torch.uint8)),
        "ampfuse-fp8": opt_cand(lambda ps: ampfuse.optim.AdamW(ps, lr=1e-4, master_weights="remainder",
                                                                state_dtype=torch.float8_e4m3fn,
                                                                exp_avg_sq_dtype=torch.float8_e5m2)),
        "ampfuse-sr-8bit": opt_cand(lambda ps: ampfuse.optim.AdamW(ps, lr=1e-4, master_weights="stochastic",
                                                                    state_dtype=torch.uint8)),
        "ampfuse-bf16": opt_cand(lambda ps: ampfuse.optim.AdamW(ps, lr=1e-4, master_weights="remainder",
                                                                 state_dtype=torch.bfloat16)),
        "torch": opt_cand(lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
    }
    missing = []
    for name, (module, cls) in PEERS_8BIT.items():
        try:
            if quick:
                raise ImportError("quick run")
            peer = getattr(importlib.import_module(module), cls)
        except ImportError:
            missing.append(name)
            continue
        cands[name] = opt_cand(lambda ps, peer=peer: peer(ps, lr=1e-4))
    return cands, 14.0, missing


#: Bytes per parameter a candidate moves where it differs from its row's byte model (stochastic
#: rounding keeps no remainder: read grad 2, param 2, m 1, v 1; write param, m, v; bf16 moments:
#: m and v 2 each way).
CANDIDATE_BYTES_PER_PARAM = {"ampfuse-sr-8bit": 10.0, "ampfuse-bf16": 18.0}

#: The 8-bit row's own candidates, each compared with the fastest peer and with the bf16 moments.
OWN_8BIT = ("ampfuse", "ampfuse-fp8")


def case_unscale(shapes, dtype, device, with_norm: bool):
    def cand(fn_kind: str) -> Candidate:
        params = make_params(shapes, dtype, device)
        grads = [p.grad for p in params]
        write = GradSource(params, False).writer(grads)
        inv = torch.full((1,), 1.0 / SCALE, device=device)
        fi = torch.zeros(1, device=device)
        if fn_kind == "ampfuse":
            if with_norm:
                def fn():
                    norm, coef = ops.unscale_check_norm_(grads, fi, inv, max_norm=MAX_NORM)
                    torch._foreach_mul_(grads, coef)  # clip_grad_norm_ multiplies too
                    return norm
            else:
                def fn():
                    ops.unscale_check_(grads, fi, inv)
        else:
            if with_norm:
                def fn():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, fi, inv)
                    return torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
            else:
                def fn():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, fi, inv)
        return Candidate(fn, write)

    eb = torch.finfo(dtype).bits // 8
    return {"ampfuse": cand("ampfuse"), "torch": cand("torch")}, 2 * eb


def case_accumulate(shapes, dtype, device):
    def cand(fn_kind: str) -> Candidate:
        grads = [p.grad for p in make_params(shapes, dtype, device)]
        bufs = [torch.zeros(g.shape, device=device) for g in grads]
        fi = torch.zeros(1, device=device)
        if fn_kind == "ampfuse":
            return Candidate(lambda: ops.accumulate_grads_(bufs, grads, fi, zero_grads=False))
        return Candidate(lambda: torch._foreach_add_(bufs, grads))  # the same sums, no inf check

    eb = torch.finfo(dtype).bits // 8
    return {"ampfuse": cand("ampfuse"), "torch": cand("torch")}, eb + 8


def case_small_model(device):
    """The whole scaler.scale -> unscale_and_clip_ -> step -> update path, bf16 AdamW with fp32
    masters, for 1,000 tensors of 1,000 elements and for the same bytes in 10 tensors (and the
    expert torch recipe on both, for context)."""
    dtype = torch.bfloat16
    out = {}
    for name, shapes in (("1000", [(1000,)] * 1000), ("10", [(100_000,)] * 10)):
        src = GradSource(make_params(shapes, dtype, device), False)
        out[f"ampfuse-{name}"] = cand_ampfuse("adamw", shapes, dtype, device, src, False)
        out[f"torch-A*-{name}"] = cand_torch_a("adamw", shapes, dtype, device, src, False, expert=True)
    return out, 32.0


def case_host(shapes, dtype, device):
    """The whole scaler.scale -> unscale_and_clip_ -> step -> update path on many 64-element
    tensors (bf16 AdamW + masters): the kernel work is a few bytes per tensor, so the time is the
    host's (Python, dispatch, validation or the step plan) plus the per-tensor kernel overhead.
    Rows at 10, 100, 1,000 and 10,000 tensors; the expert torch recipe on the same tensors."""
    src = GradSource(make_params(shapes, dtype, device), False)
    return {"ampfuse": cand_ampfuse("adamw", shapes, dtype, device, src, False),
            "torch-A*": cand_torch_a("adamw", shapes, dtype, device, src, False, expert=True)}, 32.0


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------


def plan(device: str, quick: bool, max_params: int | None = None) -> list[tuple]:
    """(case, layout, params, dtype, kwargs); no case above max_params."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    lp = fp16 if device == "cuda" else bf16
    if quick:
        sizes, big = [10**5], 10**5
    elif device == "cuda":
        sizes, big = [10**6, 10**7, 10**8], 10**8
    else:
        sizes, big = [10**6, 10**7, 10**8], 10**7
    rows = [("small_model", "1000x", 10**6, bf16, {})]
    for k in ((10, 100) if quick else (10, 100, 1000, 10_000)):  # host cost vs number of tensors
        rows.append(("host_scaling", f"{k}x", 64 * k, bf16, {}))
    for n in sizes:  # the headlines: parameter-count sweeps, GPT-2 shapes
        rows.append(("step_adamw_master", "gpt2", n, lp, {}))
    for n in sizes:
        rows.append(("step_adamw_precision", "gpt2", n, bf16, {}))
    for n in sizes:
        rows.append(("step_adamw_fp32", "gpt2", n, fp32, {}))
    rows.append(("step_adamw_master", "10k", big, lp, {}))
    # One shape per layout (torchao compiles its step once per shape): few large tensors, the
    # middle, many small ones. On a GPU, first: the rows measured least.
    rows_8bit = [("step_adamw_8bit", layout, 10**5 if quick else 10**7, bf16, {})
                 for layout in (("40x",) if quick else ("4x", "40x", "400x"))]
    if device == "cpu":
        rows += rows_8bit
    else:
        rows[:0] = rows_8bit
    other = fp16 if lp == bf16 else bf16
    rows += [
        ("step_adamw_master", "gpt2", big, other, {}),
        ("step_sgd_master", "gpt2", big, lp, {}),
        ("skip_adamw_master", "gpt2", big, lp, {}),
        ("unscale_check", "gpt2", big, fp32, {}),
        ("unscale_check", "gpt2", big, lp, {}),
        ("unscale_check_norm", "gpt2", big, fp32, {}),
        ("accumulate", "gpt2", big, lp, {}),
    ]
    if max_params is not None:
        rows = [r for r in rows if r[2] <= max_params]
    return rows


def build(case: str, shapes, dtype, device):
    if case == "small_model":
        return case_small_model(device)
    if case == "host_scaling":
        return case_host(shapes, dtype, device)
    if case == "unscale_check":
        return case_unscale(shapes, dtype, device, with_norm=False)
    if case == "unscale_check_norm":
        return case_unscale(shapes, dtype, device, with_norm=True)
    if case == "accumulate":
        return case_accumulate(shapes, dtype, device)
    if case == "step_adamw_precision":
        return case_precision(shapes, dtype, device)
    kind = "adamw" if "adamw" in case else "sgd"
    return case_step(shapes, dtype, device, kind, skip=case.startswith("skip"))


def state_bytes_per_param(case: str, dtype: torch.dtype) -> dict[str, float] | None:
    """Training state per parameter (param + grad + master + optimizer state), for the AdamW rows
    (8-bit moments: the block absmax adds 8 B per 256 elements, 0.03 B)."""
    if case == "step_adamw_precision":
        return {"ampfuse": 2 + 2 + 2 + 4, "ampfuse-fp32-masters": 2 + 2 + 4 + 8, "torch (fp32 params, AMP)": 4 + 4 + 8}
    if case == "step_adamw_8bit":
        return {"ampfuse": 2 + 2 + 2 + 2, "ampfuse-fp8": 2 + 2 + 2 + 2, "ampfuse-sr-8bit": 2 + 2 + 2,
                "ampfuse-bf16": 2 + 2 + 2 + 4, "bnb-8bit": 2 + 2 + 2,
                "torchao-8bit": 2 + 2 + 2, "torchao-fp8": 2 + 2 + 2, "torch": 2 + 2 + 4}
    return None


def measure_case(device, case, layout, n, dtype, quick, rng) -> dict:
    shapes = layout_shapes(layout, n)
    params = sum(math.prod(s) for s in shapes)
    missing: list[str] = []
    if case == "step_adamw_8bit":
        cands, bpp, missing = case_8bit(shapes, dtype, device, quick)
    else:
        cands, bpp = build(case, shapes, dtype, device)
    nbytes = params * bpp
    cands.update(roof_candidates(device, nbytes))
    budget = 0.3 if quick else (20.0 if nbytes > (256 << 20) else 8.0)
    samples = run_rounds(device, cands, 3 if quick else MIN_ROUNDS, budget, rng)
    row: dict = {
        "case": case, "layout": layout, "params": params, "tensors": len(shapes), "dtype": str(dtype).replace("torch.", ""),
        "bytes_per_param": bpp, "rounds": len(next(iter(samples.values()))), "candidates": {}, "roofs": {},
    }
    for name, ts in samples.items():
        s = summary(ts)
        if name.startswith("roof:"):
            moved = cands[name].bytes_moved
            row["roofs"][name[5:]] = {"gbps": moved / s["median"] / 1e9, "gbps_min": moved / s["max"] / 1e9,
                                      "gbps_max": moved / s["min"] / 1e9}
        else:
            row["candidates"][name] = {"ms": s["median"] * 1e3, "min_ms": s["min"] * 1e3, "max_ms": s["max"] * 1e3}
    inplace = row["roofs"]["inplace"]["gbps"]
    if case == "small_model":
        diff = [(a - b) / 990 * 1e6 for a, b in zip(samples["ampfuse-1000"], samples["ampfuse-10"])]
        tdiff = [(a - b) / 990 * 1e6 for a, b in zip(samples["torch-A*-1000"], samples["torch-A*-10"])]
        row["per_tensor_us"] = summary(diff)
        row["torch_per_tensor_us"] = summary(tdiff)
        return row
    for name, c in row["candidates"].items():
        own = CANDIDATE_BYTES_PER_PARAM.get(name)
        if own is not None:
            c["bytes_per_param"] = own
        c["gbps"] = (params * own if own is not None else nbytes) / (c["ms"] / 1e3) / 1e9
        c["frac_inplace"] = c["gbps"] / inplace
    if case == "step_adamw_8bit":  # the headline: against the fastest 8-bit peer measured
        row["peers_missing"] = missing
        peers = [k for k in row["candidates"] if k in PEERS_8BIT]
        if peers:
            best_peer = min(peers, key=lambda k: row["candidates"][k]["ms"])
            row["best_peer"] = best_peer
            row["speedup_vs_best_peer"] = {k: summary([t / a for a, t in zip(samples[k], samples[best_peer])])
                                           for k in OWN_8BIT}
        row["time_vs_bf16_moments"] = {k: summary([a / t for a, t in zip(samples[k], samples["ampfuse-bf16"])])
                                       for k in OWN_8BIT}
    torch_names = [k for k in row["candidates"] if k.startswith("torch") and k not in PEERS_8BIT]
    best = min(torch_names, key=lambda k: row["candidates"][k]["ms"])
    row["best_torch"] = best
    row["speedup_vs_best_torch"] = summary([t / a for a, t in zip(samples["ampfuse"], samples[best])])
    row["speedup_vs"] = {k: summary([t / a for a, t in zip(samples["ampfuse"], samples[k])])
                         for k in row["candidates"] if k != "ampfuse"}
    sb = state_bytes_per_param(case, dtype)
    if sb:
        row["state_bytes_per_param"] = sb
    del cands
    return row


def gpu_step_diagnostics(device: str) -> dict:
    """Per step, 1,000 tensors, fp16 AdamW: kernel launches (profiler) of ampfuse and of the
    expert torch recipe, host syncs of ampfuse (set_sync_debug_mode), and whether ampfuse's whole
    step can be captured in a CUDA graph and replayed (the strict test of no host sync)."""
    from torch.profiler import ProfilerActivity, profile

    shapes = [(1000,)] * 1000
    out: dict = {"tensors": 1000}
    src = GradSource(make_params(shapes, torch.float16, device), False)
    cands = {"ampfuse": cand_ampfuse("adamw", shapes, torch.float16, device, src, False),
             "torch-A*": cand_torch_a("adamw", shapes, torch.float16, device, src, False, expert=True)}
    for name, c in cands.items():
        c.prepare()
        c.fn()
        c.prepare()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            c.fn()
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = [e for e in evs if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
        out[name] = {"kernel_launches": len(kernels), "memcpy_memset": len(evs) - len(kernels),
                     "kernels": sorted({e.name[:70] for e in kernels})}
    import warnings

    c = cands["ampfuse"]
    c.prepare()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            c.fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in rec if "synchroniz" in str(w.message).lower()]
    out["ampfuse"]["host_syncs"] = len(syncs)
    # where each was raised (the Python line that called the synchronizing op) and what torch said
    out["ampfuse"]["host_sync_sites"] = [f"{os.path.relpath(w.filename, os.path.dirname(HERE))}:{w.lineno}: {str(w.message)[:160]}"
                                         for w in syncs]
    try:
        c.prepare()
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            c.fn()  # warm-up on the side stream (tables resident there)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            c.fn()
        for _ in range(3):
            c.prepare()
            g.replay()
        torch.cuda.synchronize()
        out["ampfuse"]["graph_capture"] = "ok"
    except Exception as e:  # noqa: BLE001 -- reported, not raised
        out["ampfuse"]["graph_capture"] = f"failed: {type(e).__name__}: {e}"[:300]
    return out


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
    ap.add_argument("--quick", action="store_true", help="tiny sizes, few rounds (a smoke run)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--seed", type=int, default=0, help="seed of the candidates' order in each round")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated case names to run")
    ap.add_argument("--max-params", type=int, default=None, help="skip cases with more parameters")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="stop starting new cases after this many seconds (the JSON holds what was measured)")
    ap.add_argument("--plan-only", action="store_true", help="write the planned cases, measure nothing")
    a = ap.parse_args(argv)
    device = a.device
    cases = plan(device, a.quick, a.max_params)
    if a.only:
        keep = set(a.only.split(","))
        cases = [c for c in cases if c[0] in keep]
    os.makedirs(a.out, exist_ok=True)
    if a.plan_only:
        path = os.path.join(a.out, f"plan-{device}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"device": device, "planned": [[c, l, n, str(d).replace("torch.", "")] for c, l, n, d, _ in cases]}, f, indent=1)
        print(f"{len(cases)} cases planned for {device}, at most {max(n for _, _, n, _, _ in cases):.0e} parameters; wrote {path}")
        return path
    torch.set_num_threads(torch.get_num_threads())  # explicit: all cores
    from tqdm import tqdm

    rng = random.Random(a.seed)
    rows: list[dict] = []
    started = time.perf_counter()
    tag = "quick-" if a.quick else ""
    info = machine_info(device)
    info["seed"] = a.seed
    path = os.path.join(a.out, f"{tag}{device}-{info['date']}.json")
    result: dict = {"machine": info, "rows": rows}

    def save() -> None:  # after every case: a run cut off by a time limit keeps its rows
        import report

        result["targets"] = report.evaluate_targets(result)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)

    for case, layout, n, dtype, _ in tqdm(cases, desc=f"benchmarks ({device})", disable=a.no_progress):
        if a.deadline_s is not None and time.perf_counter() - started > a.deadline_s:
            print(f"deadline reached: {len(rows)} of {len(cases)} cases measured")
            break
        rows.append(measure_case(device, case, layout, n, dtype, a.quick, rng))
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        save()
    if device == "cuda" and (a.deadline_s is None or time.perf_counter() - started < a.deadline_s + 60):
        result["step_diagnostics"] = gpu_step_diagnostics(device)
    save()
    print(f"wrote {path}")
    import report

    print(report.markdown_table(result))
    print()
    print(report.targets_table(result))
    if not a.no_plots:
        for p in report.plot(result, a.out, prefix=tag):
            print(f"wrote {p}")
    return path


if __name__ == "__main__":
    main()
