"""Train a small character-level transformer twice, with ampfuse and with torch's AMP recipe.

``python -m ampfuse.demo`` (``make demo``) trains on the Python standard library's source (no
download) from the same weights, on the same batches, with the same loss scaling (initial scale
2**16, torch's default). **ampfuse** runs its most memory-efficient configuration whose training
quality holds: bf16 weights with 16-bit master remainders and bf16 AdamW moments, 8 bytes per
parameter for params + optimizer state (final validation loss within 0.02% of fp32 moments:
benchmarks/results/precision-quality-2026-12-01.json); fp16 weights keep fp32 masters, 10 bytes.
It steps through ``ampfuse.GradAccumulator`` (fp32 sums, clipping fused into the step), or with
``--accum 1`` through ``ampfuse.GradScaler`` on ``.grad``. **torch** is fp32 weights,
``torch.autocast``, ``torch.amp.GradScaler``, ``torch.optim.AdamW(fused=True)`` and the
hand-written accumulation loop with ``clip_grad_norm_``: 12 bytes per parameter. The demo prints
a table (train and validation losses with their relative difference; steps skipped and scale
backoffs; the median step time with its scaler + optimizer part; params + optimizer state, every
tensor of both counted, gradients and activations not, with the ratio ampfuse / torch), then one
line on what the numbers mean, and writes ``demo.png`` (losses and loss scales, skipped steps and
backoffs marked) and ``demo.json`` into ``--out``.

Options: ``--dtype`` the weight dtype (auto: bf16 on CPU, fp16 on CUDA); ``--master-weights true
--state-dtype fp32``: fp32 masters and fp32 moments (14 bytes per parameter); ``--growth-interval``
of both scalers; ``--config step-heavy``: a model where the optimizer step is a large share of the
time (a 65,536-row token embedding, mostly unused by the data but all stepped; batch 4, no
accumulation); ``--config small`` (d-model 64, 2 layers, context 64, no accumulation) is what
``--config auto``, the default, runs on a CPU where torch has no native matmul for the dtype,
elsewhere the default sizes. On a GPU: ``--device cuda --steps 300 --dtype fp16 --accum 8``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

import ampfuse

# ----------------------------------------------------------------------------------------------
# data: the standard library's source
# ----------------------------------------------------------------------------------------------


def load_corpus(max_bytes: int) -> str:
    """Concatenate the standard library's .py files (sorted, deterministic) up to max_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            chunks.append(text)
            total += len(text)
            if total >= max_bytes:
                return "".join(chunks)[:max_bytes]
    return "".join(chunks)[:max_bytes]


class CharData:
    """Printable-ASCII character vocabulary; train/validation split 90/10."""

    def __init__(self, text: str, context: int) -> None:
        text = "".join(c if (32 <= ord(c) < 127 or c == "\n") else "?" for c in text)
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        cut = int(0.9 * len(ids))
        self.train, self.val = ids[:cut], ids[cut:]
        self.context = context

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, split: str, batch_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.train if split == "train" else self.val
        idx = torch.randint(len(data) - self.context - 1, (batch_size,), generator=gen)
        x = torch.stack([data[i : i + self.context] for i in idx.tolist()])
        y = torch.stack([data[i + 1 : i + 1 + self.context] for i in idx.tolist()])
        return x, y


# ----------------------------------------------------------------------------------------------
# model: a small GPT
# ----------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int, embed_rows: int = 0) -> None:
        super().__init__()
        # embed_rows > vocab: a larger token table (as a big-vocabulary model has), the head unchanged
        self.tok, self.pos = nn.Embedding(max(vocab, embed_rows), d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


# ----------------------------------------------------------------------------------------------
# the two recipes
# ----------------------------------------------------------------------------------------------


INIT_SCALE = 2.0**16  # both runs' initial loss scale: torch.amp.GradScaler's default


@dataclass
class Config:
    device: str = "cpu"
    dtype: str = "auto"
    steps: int = 150
    accum: int = 4
    batch: int = 16
    context: int = 128
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    lr: float = 3e-3
    max_grad_norm: float = 1.0
    embed_rows: int = 0
    master_weights: str = "remainder"  # "remainder" (16-bit remainders on bf16 weights) or "true" (fp32 masters)
    state_dtype: str = "bf16"  # AdamW moments: "bf16" or "fp32"
    growth_interval: int = 50  # both scalers' (torch's default is 2000: no growth in a short run)
    eval_batches: int = 8
    val_every: int = 0
    corpus_bytes: int = 2_000_000
    seed: int = 0
    out: str = "demo_out"
    progress: bool = True
    preset: str = "default"

    def low_precision(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float16 if self.device.startswith("cuda") else torch.bfloat16
        return {"fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}[self.dtype]

    def masters(self) -> str:
        """The ampfuse run's master form: "remainder" only on bf16 weights (fp16 weights keep fp32
        masters under ``master_weights="remainder"``, as ampfuse.optim does), else "fp32"."""
        return "remainder" if self.master_weights == "remainder" and self.low_precision() == torch.bfloat16 else "fp32"


@dataclass
class RunResult:
    name: str
    train_loss: list[float] = field(default_factory=list)  # per optimizer step (mean of its micro-batches)
    scale: list[float] = field(default_factory=list)  # the loss scale after each step's update
    skipped: list[bool] = field(default_factory=list)  # the optimizer step was skipped (inf/NaN gradients)
    backoff: list[bool] = field(default_factory=list)  # the update lowered the loss scale
    step_seconds: list[float] = field(default_factory=list)
    fwd_bwd_seconds: list[float] = field(default_factory=list)  # forward + backward of the step's micro-batches
    val_loss: float = math.nan
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)
    state_bytes: int = 0
    param_bytes: int = 0
    n_params: int = 0

    def record_scale(self, scale: float) -> None:
        before = self.scale[-1] if self.scale else INIT_SCALE
        self.scale.append(scale)
        self.backoff.append(scale < before)


def tensor_bytes(ts) -> int:
    """Bytes of the storages behind the tensors in ``ts``, each storage counted once (views and
    shared storages are not counted twice; a tensor's whole storage is)."""
    seen: dict[tuple[str, int], int] = {}
    for t in ts:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[(str(t.device), s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def params_and_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, int]:
    """(params, optimizer state): every tensor of the model's parameters, and every tensor the
    optimizer keeps per parameter (step counters, moments, fp32 masters or master remainders),
    counted by storage; a storage shared by both is counted with the params."""
    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    p_bytes = tensor_bytes(params)
    return p_bytes, tensor_bytes(params + state) - p_bytes


@torch.no_grad()
def evaluate(model: nn.Module, data: CharData, cfg: Config, dtype: torch.dtype | None) -> float:
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(cfg.eval_batches):
        x, y = (t.to(cfg.device) for t in data.batch("val", cfg.batch, gen))
        if dtype is None:  # torch recipe: fp32 weights under autocast
            with torch.autocast(torch.device(cfg.device).type, dtype=cfg.low_precision()):
                logits = model(x)
        else:
            logits = model(x)
        losses.append(F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1)).item())
    return statistics.mean(losses)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_ampfuse(init_state: dict, data: CharData, cfg: Config, bar) -> RunResult:
    lp = cfg.low_precision()
    model = TinyGPT(data.vocab, cfg.context, cfg.d_model, cfg.layers, cfg.heads, cfg.embed_rows)
    model.load_state_dict(init_state)
    model.to(device=cfg.device, dtype=lp)  # fp16/bf16 weights: no autocast re-casting per forward
    opt = ampfuse.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01,
                              master_weights="remainder" if cfg.master_weights == "remainder" else True,
                              state_dtype=torch.bfloat16 if cfg.state_dtype == "bf16" else torch.float32)
    scaler = ampfuse.GradScaler(torch.device(cfg.device).type, init_scale=INIT_SCALE,
                                growth_interval=cfg.growth_interval)
    # With accumulation, GradAccumulator (fp32 sums, clipping fused into the step); without, the
    # scaler and the optimizer on .grad directly, as one writes a plain training step.
    direct = cfg.accum == 1
    acc = None if direct else ampfuse.GradAccumulator(model, opt, scaler, steps=cfg.accum,
                                                       max_grad_norm=cfg.max_grad_norm)
    res = RunResult("ampfuse")
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    losses: list[torch.Tensor] = []
    fb = 0.0
    steps = 0
    t0 = time.perf_counter()
    while steps < cfg.steps:
        x, y = (t.to(cfg.device) for t in data.batch("train", cfg.batch, gen))
        if direct:
            f0 = time.perf_counter()
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
            scaler.scale(loss).backward()
            _sync(cfg.device)
            fb += time.perf_counter() - f0
            scaler.unscale_and_clip_(opt, cfg.max_grad_norm)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            ended, skipped = True, scaler.last_found_inf
        else:
            assert acc is not None
            with acc.accumulate():
                f0 = time.perf_counter()
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
                acc.backward(loss)
                _sync(cfg.device)
                fb += time.perf_counter() - f0
            ended, skipped = acc.window_ended, acc.last_window_skipped
        losses.append(loss.detach())
        if ended:
            _sync(cfg.device)
            t1 = time.perf_counter()
            steps += 1
            res.step_seconds.append(t1 - t0)
            res.fwd_bwd_seconds.append(fb)
            res.train_loss.append(torch.stack(losses).mean().item())
            res.record_scale(scaler.get_scale())
            res.skipped.append(skipped is not None and bool(skipped.item()))
            losses.clear()
            bar.update(1)
            if cfg.val_every and steps % cfg.val_every == 0:
                res.val_curve.append((steps, evaluate(model, data, cfg, lp)))
            fb = 0.0
            t0 = time.perf_counter()
    res.val_loss = evaluate(model, data, cfg, lp)
    res.param_bytes, res.state_bytes = params_and_state_bytes(model, opt)
    res.n_params = sum(p.numel() for p in model.parameters())
    return res


def run_torch(init_state: dict, data: CharData, cfg: Config, bar) -> RunResult:
    lp = cfg.low_precision()
    dev_type = torch.device(cfg.device).type
    model = TinyGPT(data.vocab, cfg.context, cfg.d_model, cfg.layers, cfg.heads, cfg.embed_rows)
    model.load_state_dict(init_state)
    model.to(cfg.device)  # fp32 weights; autocast casts them to fp16/bf16 in every forward
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler(dev_type, init_scale=INIT_SCALE, growth_interval=cfg.growth_interval)
    first = next(model.parameters())  # the token embedding: it gets a gradient at every step
    res = RunResult("torch")
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    stepped = 0
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        losses = []
        fb = 0.0
        for _ in range(cfg.accum):
            x, y = (t.to(cfg.device) for t in data.batch("train", cfg.batch, gen))
            f0 = time.perf_counter()
            with torch.autocast(dev_type, dtype=lp):
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
            scaler.scale(loss / cfg.accum).backward()
            _sync(cfg.device)
            fb += time.perf_counter() - f0
            losses.append(loss.detach())
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        _sync(cfg.device)
        res.step_seconds.append(time.perf_counter() - t0)
        res.fwd_bwd_seconds.append(fb)
        res.train_loss.append(torch.stack(losses).mean().item())
        # read after the timed step (no host read inside it): a skipped step (scaler.step did not
        # call opt.step) leaves AdamW's step counter where it was
        st = opt.state.get(first)
        count = int(st["step"].item()) if st else 0
        res.skipped.append(count == stepped)
        stepped = count
        res.record_scale(scaler.get_scale())
        bar.update(1)
        if cfg.val_every and (step + 1) % cfg.val_every == 0:
            res.val_curve.append((step + 1, evaluate(model, data, cfg, None)))
    res.val_loss = evaluate(model, data, cfg, None)
    res.param_bytes, res.state_bytes = params_and_state_bytes(model, opt)
    res.n_params = sum(p.numel() for p in model.parameters())
    return res


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _steps(flags: list[bool]) -> list[int]:
    """The 1-based optimizer steps where ``flags`` is set."""
    return [i + 1 for i, f in enumerate(flags) if f]


def recipe_names(cfg: Config) -> tuple[str, str]:
    lp = str(cfg.low_precision()).replace("torch.", "")
    masters = "16-bit master remainders" if cfg.masters() == "remainder" else "fp32 masters"
    moments = "bf16 moments" if cfg.state_dtype == "bf16" else "fp32 moments"
    return f"ampfuse ({lp} weights + {masters}, {moments})", f"torch AMP (fp32 weights + autocast {lp}, fused AdamW)"


def summarize(a: RunResult, t: RunResult, cfg: Config) -> tuple[str, dict]:
    warm = min(5, max(0, len(a.step_seconds) - 1))
    ms_a = statistics.median(a.step_seconds[warm:]) * 1e3
    ms_t = statistics.median(t.step_seconds[warm:]) * 1e3
    # the rest: unscale, clip, optimizer step, scale update (and the accumulation outside backward)
    rest_a = statistics.median([s - f for s, f in zip(a.step_seconds[warm:], a.fwd_bwd_seconds[warm:])]) * 1e3
    rest_t = statistics.median([s - f for s, f in zip(t.step_seconds[warm:], t.fwd_bwd_seconds[warm:])]) * 1e3
    fb_a = statistics.median(a.fwd_bwd_seconds[warm:]) * 1e3
    fb_t = statistics.median(t.fwd_bwd_seconds[warm:]) * 1e3
    mem_a, mem_t = a.param_bytes + a.state_bytes, t.param_bytes + t.state_bytes
    mem_ratio = mem_a / mem_t
    val_rel = (a.val_loss - t.val_loss) / t.val_loss
    tail = max(1, len(a.train_loss) // 10)
    same_skips = _steps(a.skipped) == _steps(t.skipped) and _steps(a.backoff) == _steps(t.backoff)
    rows = [
        ("final train loss (last 10% of steps)", f"{statistics.mean(a.train_loss[-tail:]):.4f}", f"{statistics.mean(t.train_loss[-tail:]):.4f}"),
        ("validation loss (ampfuse vs torch)", f"{a.val_loss:.4f} ({100 * val_rel:+.2f}%)", f"{t.val_loss:.4f}"),
        ("optimizer steps taken / skipped", f"{len(a.skipped) - sum(a.skipped)} / {sum(a.skipped)}"
         + (" (the same steps as torch)" if same_skips and any(a.skipped) else ""),
         f"{len(t.skipped) - sum(t.skipped)} / {sum(t.skipped)}"),
        ("loss scale min .. max (backoffs)", f"{min(a.scale):g} .. {max(a.scale):g} ({sum(a.backoff)})",
         f"{min(t.scale):g} .. {max(t.scale):g} ({sum(t.backoff)})"),
        ("time per optimizer step (median)", f"{ms_a:.1f} ms ({ms_a / ms_t:.2f}x torch)", f"{ms_t:.1f} ms"),
        ("  scaler + optimizer (+ accumulation)", f"{rest_a:.1f} ms ({100 * rest_a / ms_a:.0f}%, {rest_a / rest_t:.2f}x torch)",
         f"{rest_t:.1f} ms ({100 * rest_t / ms_t:.0f}%)"),
        ("  forward + backward", f"{fb_a:.1f} ms", f"{fb_t:.1f} ms"),
        ("parameters", _mib(a.param_bytes), _mib(t.param_bytes)),
        ("optimizer state (+ masters)", _mib(a.state_bytes), _mib(t.state_bytes)),
        ("parameters + optimizer state", f"{_mib(mem_a)} ({mem_ratio:.2f}x torch)", _mib(mem_t)),
        ("  bytes per parameter", f"{mem_a / a.n_params:.2f}", f"{mem_t / t.n_params:.2f}"),
    ]
    head = ("", *recipe_names(cfg))
    w0 = max(len(r[0]) for r in rows + [head])
    w1 = max(len(r[1]) for r in rows + [head])
    lines = [f"{head[0]:<{w0}}  {head[1]:<{w1}}  {head[2]}", "-" * (w0 + w1 + len(head[2]) + 4)]
    lines += [f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}" for r in rows]
    summary = {
        "config": cfg.__dict__,
        "recipes": {"ampfuse": head[1], "torch": head[2], "ampfuse_masters": cfg.masters()},
        "machine": {"device": cfg.device, "torch": torch.__version__, "threads": torch.get_num_threads()},
        "ampfuse": a.__dict__,
        "torch": t.__dict__,
        "median_step_ms": {"ampfuse": ms_a, "torch": ms_t, "ratio": ms_a / ms_t},
        "median_fwd_bwd_ms": {"ampfuse": fb_a, "torch": fb_t},
        "median_rest_ms": {"ampfuse": rest_a, "torch": rest_t, "speedup": rest_t / rest_a},
        "memory_bytes": {"ampfuse": mem_a, "torch": mem_t, "ratio": mem_ratio,
                         "per_param": {"ampfuse": mem_a / a.n_params, "torch": mem_t / t.n_params}},
        "val_loss_rel_diff": val_rel,
        "skipped_steps": {"ampfuse": _steps(a.skipped), "torch": _steps(t.skipped)},
        "backoff_steps": {"ampfuse": _steps(a.backoff), "torch": _steps(t.backoff)},
        "skips_identical": same_skips,
    }
    return "\n".join(lines), summary


def takeaway(summary: dict, cfg: Config) -> str:
    """One line: what the table says, and what to run next."""
    mem, val_rel = summary["memory_bytes"], summary["val_loss_rel_diff"]
    step, rest, fb = summary["median_step_ms"], summary["median_rest_ms"], summary["median_fwd_bwd_ms"]
    quality = (f"the same validation loss as torch ({100 * val_rel:+.2f}%)" if abs(val_rel) < 0.01
               else f"a validation loss {100 * val_rel:+.2f}% from torch's")
    per = mem["per_param"]
    line = (f"In short: ampfuse reached {quality} with {mem['ratio']:.2f}x torch's params + optimizer state "
            f"({per['ampfuse']:.0f} vs {per['torch']:.0f} bytes per parameter")
    if cfg.master_weights == "remainder" and cfg.masters() != "remainder":
        line += "; fp16 weights keep fp32 masters, bf16 weights with remainders need 8"
    line += ")"
    skipped = summary["skipped_steps"]["torch"]
    if cfg.low_precision() == torch.float16:
        if summary["skips_identical"]:
            line += (f", skipping the same {len(skipped)} fp16-overflow steps as torch" if skipped
                     else ", neither run overflowed in fp16")
        else:
            line += ", skipping other fp16-overflow steps than torch (see demo.png)"
    fb_ratio = fb["ampfuse"] / fb["torch"]
    line += (f"; its scaler + optimizer took {rest['ampfuse'] / rest['torch']:.2f}x torch's time, the whole step "
             f"{step['ratio']:.2f}x; forward + backward ({100 * fb['torch'] / step['torch']:.0f}% of torch's step) took "
             + ("about the same time in both" if abs(fb_ratio - 1) < 0.15 else f"{fb_ratio:.2f}x torch's time")
             + '. Next: --config step-heavy (a model where the step is a large share of the time), and on a GPU '
               'make demo ARGS="--device cuda --steps 300 --dtype fp16 --accum 8".')
    return line


def plot(a: RunResult, t: RunResult, cfg: Config, path: str) -> dict:
    """Loss curves (skipped steps marked on them) and loss scales (backoffs marked); returns the
    steps marked, per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name_a, name_t = recipe_names(cfg)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    steps = range(1, len(a.train_loss) + 1)
    # ampfuse's marks hollow circles, torch's crosses: where the steps are the same, a circled cross
    marks = {"ampfuse": {"marker": "o", "s": 60, "facecolors": "none", "edgecolors": "red"},
             "torch": {"marker": "x", "s": 30, "color": "red"}}
    marked: dict[str, dict[str, list[int]]] = {}
    for r, label in ((a, name_a), (t, name_t)):
        marked[r.name] = {"skipped": [], "backoff": []}
        line, = ax1.plot(steps, r.train_loss, label=label, alpha=1.0 if r is a else 0.8)
        sk = _steps(r.skipped)
        if sk:
            marked[r.name]["skipped"] = sk
            ax1.scatter(sk, [r.train_loss[i - 1] for i in sk], zorder=3, label=f"{r.name}: skipped steps ({len(sk)})",
                        **marks[r.name])
        ax2.plot(steps, r.scale, color=line.get_color(), label=f"{r.name} loss scale", alpha=1.0 if r is a else 0.8)
        bo = _steps(r.backoff)
        if bo:
            marked[r.name]["backoff"] = bo
            ax2.scatter(bo, [r.scale[i - 1] for i in bo], zorder=3, label=f"{r.name}: scale backoffs ({len(bo)})",
                        **marks[r.name])
    ax1.set_ylabel("train loss")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    same = _steps(a.skipped) == _steps(t.skipped) and _steps(a.backoff) == _steps(t.backoff)
    n = sum(t.skipped)
    lp = str(cfg.low_precision()).replace("torch.", "")
    if n == 0 and same:
        title = f"{lp} loss scaling: no skipped step in either run"
    else:
        title = (f"{lp} loss scaling: {n} skipped step{'s' if n != 1 else ''} in torch's run, "
                 + ("the same steps in ampfuse's" if same else f"{sum(a.skipped)}, not all the same, in ampfuse's"))
    ax2.set_title(title, fontsize=9)
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("loss scale (after the step)")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return marked


#: --config presets (options given on the command line win)
PRESETS: dict[str, dict[str, int]] = {
    "small": {"d_model": 64, "layers": 2, "context": 64, "accum": 1},
    "step-heavy": {"embed_rows": 65536, "batch": 4, "accum": 1, "context": 64, "d_model": 256, "layers": 2},
}


def native_low_precision_matmul(device: str, dtype: torch.dtype) -> bool:
    """Whether torch multiplies ``dtype`` matrices natively on ``device``. On a CPU without
    oneDNN support for the type (no AVX-512 BF16/FP16 or AMX), torch's bf16/fp16 matmuls take
    a generic path that is far slower than fp32 ones (about 90x for a 2048x128 by 128x512
    product on a 2-core AVX2 CPU), and both of the demo's runs pay for it."""
    if not device.startswith("cpu"):
        return True
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    try:
        return probe is None or bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):
        return True  # cannot tell: say nothing


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written; each option's default shown."""


def parse_config(argv: list[str] | None = None) -> tuple[Config, bool]:
    """The run's configuration from the command line, and whether torch multiplies its
    low-precision dtype natively on the device (``--config auto`` picks ``small`` where it does
    not, unless sizes are given)."""
    p = argparse.ArgumentParser(prog="python -m ampfuse.demo", description=__doc__, formatter_class=_HelpFormatter)
    d = Config()
    p.add_argument("--device", default=d.device, help="cpu or cuda")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "fp16", "bf16"],
                   help="weight dtype of the ampfuse run, autocast dtype of the torch run (auto: bf16 on CPU, fp16 on CUDA)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per run")
    p.add_argument("--accum", type=int, default=d.accum, help="micro-batches per optimizer step")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per micro-batch")
    p.add_argument("--context", type=int, default=d.context, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=d.d_model, help="model width")
    p.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (both runs)")
    p.add_argument("--corpus-bytes", type=int, default=d.corpus_bytes, help="bytes of stdlib source to train on")
    p.add_argument("--eval-batches", type=int, default=d.eval_batches, help="validation batches")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the initial weights and the batches")
    p.add_argument("--embed-rows", type=int, default=d.embed_rows,
                   help="token-embedding rows (> vocabulary: a bigger table; 0: the vocabulary)")
    p.add_argument("--master-weights", default=d.master_weights, choices=["remainder", "true"],
                   help="ampfuse masters: remainder (16-bit remainders on bf16 weights; fp16 weights keep fp32 "
                        "masters) or true (fp32 masters)")
    p.add_argument("--state-dtype", default=d.state_dtype, choices=["bf16", "fp32"], help="ampfuse AdamW moments")
    p.add_argument("--growth-interval", type=int, default=d.growth_interval,
                   help="loss-scale growth interval of both scalers, whose initial scale is torch's default, "
                        "2**16 (torch's default interval, 2000, never grows the scale in a short run)")
    p.add_argument("--val-every", type=int, default=d.val_every, help="evaluate every N steps (the validation curves; 0: at the end only)")
    p.add_argument("--config", default="auto", choices=["auto", "default", "small", "step-heavy"],
                   help="auto: 'default' where torch multiplies the low-precision dtype natively, "
                        "else 'small' (unless sizes are given); default: the sizes above; small: d-model 64, "
                        "2 layers, context 64, no accumulation; step-heavy: 65,536-row embedding, batch 4, "
                        "context 64, d-model 256, 2 layers, no accumulation (the optimizer step a large share)")
    p.add_argument("--out", default=d.out, help="directory for demo.png and demo.json")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    explicit = {arg.split("=", 1)[0] for arg in (argv if argv is not None else sys.argv[1:])}
    lp = Config(device=a.device, dtype=a.dtype).low_precision()
    native = native_low_precision_matmul(a.device, lp)
    config = a.config
    if config == "auto":
        sized = explicit & {"--d-model", "--layers", "--context", "--batch", "--accum", "--embed-rows"}
        config = "default" if native or sized else "small"
    for key, value in PRESETS.get(config, {}).items():
        if "--" + key.replace("_", "-") not in explicit:
            setattr(a, key, value)
    cfg = Config(device=a.device, dtype=a.dtype, steps=a.steps, accum=a.accum, batch=a.batch, context=a.context,
                 d_model=a.d_model, layers=a.layers, lr=a.lr, corpus_bytes=a.corpus_bytes, embed_rows=a.embed_rows,
                 master_weights=a.master_weights, state_dtype=a.state_dtype, growth_interval=a.growth_interval,
                 val_every=a.val_every,
                 eval_batches=a.eval_batches, seed=a.seed, out=a.out, progress=not a.no_progress, preset=config)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available")
    return cfg, native


def main(argv: list[str] | None = None) -> dict:
    cfg, native = parse_config(argv)
    lp = cfg.low_precision()
    os.makedirs(cfg.out, exist_ok=True)

    text = load_corpus(cfg.corpus_bytes)
    data = CharData(text, cfg.context)
    torch.manual_seed(cfg.seed)
    init = TinyGPT(data.vocab, cfg.context, cfg.d_model, cfg.layers, cfg.heads, cfg.embed_rows).state_dict()
    n_params = sum(v.numel() for v in init.values())
    print(f"ampfuse demo: {n_params / 1e6:.2f}M-parameter character transformer on {len(text) / 1e6:.1f} MB of "
          f"Python stdlib source, {cfg.device}, {cfg.steps} optimizer steps x {cfg.accum} micro-batches of "
          f"{cfg.batch}x{cfg.context} tokens, {torch.get_num_threads()} threads")
    if not native:
        print(f"note: torch has no native {lp} matrix multiply on this CPU (no oneDNN support for it): both runs' "
              "forward and backward are much slower than on a CPU with AVX-512 BF16/AMX or a GPU"
              + ("; running --config small (--config default: the full model)." if cfg.preset == "small"
                 else ". --config small is a quicker run."))

    from tqdm import tqdm

    with tqdm(total=2 * cfg.steps, desc="training (ampfuse, then torch)", disable=not cfg.progress, unit="step") as bar:
        res_a = run_ampfuse(init, data, cfg, bar)
        res_t = run_torch(init, data, cfg, bar)
    table, summary = summarize(res_a, res_t, cfg)
    print(table)
    png = os.path.join(cfg.out, "demo.png")
    summary["plot_marks"] = plot(res_a, res_t, cfg, png)
    with open(os.path.join(cfg.out, "demo.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"wrote {png} and {os.path.join(cfg.out, 'demo.json')}")
    print(takeaway(summary, cfg))
    return summary


if __name__ == "__main__":
    main()
