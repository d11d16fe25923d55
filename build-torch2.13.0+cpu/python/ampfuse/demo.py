"""Train a small character-level transformer twice, with ampfuse and with torch's AMP recipe.

``python -m ampfuse.demo`` (``make demo``) trains on the Python standard library's own source files
(present on every machine, no download):

* **ampfuse**: low-precision weights (bf16 on CPU, fp16 on CUDA) with fp32 master weights in
  ``ampfuse.optim.AdamW``, ``ampfuse.GradScaler`` (dynamic loss scaling), ``ampfuse.GradAccumulator``
  (fp32 gradient accumulation, clipping fused into the step); with ``--accum 1``, no accumulator:
  ``scaler.unscale_and_clip_``, ``scaler.step``, ``scaler.update`` on ``.grad``.
* **torch**: torch's best AMP recipe: fp32 weights, ``torch.autocast``, ``torch.amp.GradScaler``,
  ``torch.optim.AdamW(fused=True)`` and the hand-written accumulation loop with ``clip_grad_norm_``.

Both start from the same weights and see the same batches. The demo prints a side-by-side table
(losses, steps taken/skipped, loss-scale range, time per training step split into
forward/backward and the rest -- unscale, clip, optimizer step, scale update, accumulation --,
parameter + optimizer memory) and writes ``demo.png`` (loss curves; loss scale with skipped steps
marked) and ``demo.json`` into ``--out``.

``--config step-heavy`` trains a model where the optimizer step is a large share of the time, as
in models with a large embedding table and small batches: a 65,536-row token embedding (most rows
unused by the data, all of them stepped), batch 4, no accumulation. ``--config small`` (d-model 64,
2 layers, context 64, no accumulation) is what ``--config auto``, the default, runs on a CPU where
torch has no native bf16 matmul (there both runs' forward and backward are far slower); elsewhere
auto is the default sizes. ``--master-weights remainder`` and ``--state-dtype bf16`` run ampfuse
with 16-bit master remainders and bf16 moments.
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


INIT_SCALE = 2.0**16  # both runs' initial loss scale


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
    master_weights: str = "true"  # "true" (fp32 masters) or "remainder"
    state_dtype: str = "fp32"  # "fp32" or "bf16"
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


@dataclass
class RunResult:
    name: str
    train_loss: list[float] = field(default_factory=list)  # per optimizer step (mean of its micro-batches)
    scale: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    fwd_bwd_seconds: list[float] = field(default_factory=list)  # forward + backward of the step's micro-batches
    val_loss: float = math.nan
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)
    state_bytes: int = 0
    param_bytes: int = 0


def tensor_bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(st.values()) for st in opt.state.values())


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
    scaler = ampfuse.GradScaler(torch.device(cfg.device).type, init_scale=INIT_SCALE, growth_interval=50)
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
            res.scale.append(scaler.get_scale())
            res.skipped.append(bool(skipped.item()))
            losses.clear()
            bar.update(1)
            if cfg.val_every and steps % cfg.val_every == 0:
                res.val_curve.append((steps, evaluate(model, data, cfg, lp)))
            fb = 0.0
            t0 = time.perf_counter()
    res.val_loss = evaluate(model, data, cfg, lp)
    res.param_bytes = tensor_bytes(model.parameters())
    res.state_bytes = optimizer_state_bytes(opt)
    return res


def run_torch(init_state: dict, data: CharData, cfg: Config, bar) -> RunResult:
    lp = cfg.low_precision()
    dev_type = torch.device(cfg.device).type
    model = TinyGPT(data.vocab, cfg.context, cfg.d_model, cfg.layers, cfg.heads, cfg.embed_rows)
    model.load_state_dict(init_state)
    model.to(cfg.device)  # fp32 weights; autocast casts them to fp16/bf16 in every forward
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler(dev_type, init_scale=INIT_SCALE, growth_interval=50)
    res = RunResult("torch")
    gen = torch.Generator().manual_seed(cfg.seed + 1)
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
        # read after the timed step (no host read inside it): a skipped step backs the scale off
        scale_before = res.scale[-1] if res.scale else INIT_SCALE
        res.scale.append(scaler.get_scale())
        res.skipped.append(res.scale[-1] < scale_before)
        bar.update(1)
        if cfg.val_every and (step + 1) % cfg.val_every == 0:
            res.val_curve.append((step + 1, evaluate(model, data, cfg, None)))
    res.val_loss = evaluate(model, data, cfg, None)
    res.param_bytes = tensor_bytes(model.parameters())
    res.state_bytes = optimizer_state_bytes(opt)
    return res


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def summarize(a: RunResult, t: RunResult, cfg: Config) -> tuple[str, dict]:
    warm = min(5, max(0, len(a.step_seconds) - 1))
    ms_a = statistics.median(a.step_seconds[warm:]) * 1e3
    ms_t = statistics.median(t.step_seconds[warm:]) * 1e3
    # the rest: unscale, clip, optimizer step, scale update (and the accumulation outside backward)
    rest_a = statistics.median([s - f for s, f in zip(a.step_seconds[warm:], a.fwd_bwd_seconds[warm:])]) * 1e3
    rest_t = statistics.median([s - f for s, f in zip(t.step_seconds[warm:], t.fwd_bwd_seconds[warm:])]) * 1e3
    fb_a = statistics.median(a.fwd_bwd_seconds[warm:]) * 1e3
    fb_t = statistics.median(t.fwd_bwd_seconds[warm:]) * 1e3
    tail = max(1, len(a.train_loss) // 10)
    rows = [
        ("final train loss (last 10% of steps)", f"{statistics.mean(a.train_loss[-tail:]):.4f}", f"{statistics.mean(t.train_loss[-tail:]):.4f}"),
        ("validation loss", f"{a.val_loss:.4f}", f"{t.val_loss:.4f}"),
        ("optimizer steps taken / skipped", f"{len(a.skipped) - sum(a.skipped)} / {sum(a.skipped)}", f"{len(t.skipped) - sum(t.skipped)} / {sum(t.skipped)}"),
        ("loss scale min .. max", f"{min(a.scale):g} .. {max(a.scale):g}", f"{min(t.scale):g} .. {max(t.scale):g}"),
        ("time per training step (median)", f"{ms_a:.1f} ms", f"{ms_t:.1f} ms"),
        ("  forward + backward", f"{fb_a:.1f} ms", f"{fb_t:.1f} ms"),
        ("  scaler + optimizer (+ accumulation)", f"{rest_a:.1f} ms ({100 * rest_a / ms_a:.0f}%)", f"{rest_t:.1f} ms ({100 * rest_t / ms_t:.0f}%)"),
        ("  ampfuse speedup: whole step / scaler + optimizer", f"{ms_t / ms_a:.2f}x / {rest_t / rest_a:.2f}x", ""),
        ("parameters", _mib(a.param_bytes), _mib(t.param_bytes)),
        ("optimizer state (+ fp32 masters)", _mib(a.state_bytes), _mib(t.state_bytes)),
        ("parameters + optimizer state", _mib(a.param_bytes + a.state_bytes), _mib(t.param_bytes + t.state_bytes)),
    ]
    lp = str(cfg.low_precision()).replace("torch.", "")
    masters = "remainder masters" if cfg.master_weights == "remainder" else "fp32 masters"
    state = ", bf16 moments" if cfg.state_dtype == "bf16" else ""
    head = ("", f"ampfuse ({lp} weights + {masters}{state})", f"torch AMP (fp32 weights + autocast {lp}, fused AdamW)")
    w0 = max(len(r[0]) for r in rows + [head])
    w1 = max(len(r[1]) for r in rows + [head])
    lines = [f"{head[0]:<{w0}}  {head[1]:<{w1}}  {head[2]}", "-" * (w0 + w1 + len(head[2]) + 4)]
    lines += [f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}" for r in rows]
    summary = {
        "config": cfg.__dict__,
        "machine": {"device": cfg.device, "torch": torch.__version__, "threads": torch.get_num_threads()},
        "ampfuse": a.__dict__,
        "torch": t.__dict__,
        "median_step_ms": {"ampfuse": ms_a, "torch": ms_t, "ratio": ms_a / ms_t},
        "median_fwd_bwd_ms": {"ampfuse": fb_a, "torch": fb_t},
        "median_rest_ms": {"ampfuse": rest_a, "torch": rest_t, "speedup": rest_t / rest_a},
    }
    return "\n".join(lines), summary


def plot(a: RunResult, t: RunResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    steps = range(1, len(a.train_loss) + 1)
    ax1.plot(steps, a.train_loss, label="ampfuse (low-precision weights, fp32 masters)")
    ax1.plot(steps, t.train_loss, label="torch AMP (fp32 weights, autocast)", alpha=0.8)
    ax1.set_ylabel("train loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    for r, marker in ((a, "o"), (t, "x")):
        ax2.plot(steps, r.scale, label=f"{r.name} loss scale")
        sk = [i + 1 for i, s in enumerate(r.skipped) if s]
        ax2.scatter(sk, [r.scale[i - 1] for i in sk], marker=marker, color="red", zorder=3, label=f"{r.name} skipped steps" if sk else None)
    ax2.set_yscale("log", base=2)
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("loss scale")
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def parse_config(argv: list[str] | None = None) -> tuple[Config, bool]:
    """The run's configuration from the command line, and whether torch multiplies its
    low-precision dtype natively on the device (``--config auto`` picks ``small`` where it does
    not, unless sizes are given)."""
    p = argparse.ArgumentParser(prog="python -m ampfuse.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    p.add_argument("--device", default=d.device, help="cpu (default) or cuda")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "fp16", "bf16"], help="weight dtype of the ampfuse run (auto: bf16 on CPU, fp16 on CUDA)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps per run")
    p.add_argument("--accum", type=int, default=d.accum, help="micro-batches per optimizer step")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per micro-batch")
    p.add_argument("--context", type=int, default=d.context)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--corpus-bytes", type=int, default=d.corpus_bytes)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--embed-rows", type=int, default=d.embed_rows, help="token-embedding rows (> vocabulary: a bigger table)")
    p.add_argument("--master-weights", default=d.master_weights, choices=["true", "remainder"],
                   help="ampfuse masters: fp32 (true) or 16-bit remainders (bf16 weights)")
    p.add_argument("--state-dtype", default=d.state_dtype, choices=["fp32", "bf16"], help="ampfuse AdamW moments")
    p.add_argument("--val-every", type=int, default=0, help="evaluate every N steps (the validation curves)")
    p.add_argument("--config", default="auto", choices=["auto", "default", "small", "step-heavy"],
                   help="auto (default): 'default' where torch multiplies the low-precision dtype natively, "
                        "else 'small' (unless sizes are given); default: the sizes above; small: d-model 64, "
                        "2 layers, context 64, no accumulation; step-heavy: 65,536-row embedding, batch 4, "
                        "no accumulation (the optimizer step dominates)")
    p.add_argument("--out", default=d.out, help="directory for demo.png and demo.json")
    p.add_argument("--no-progress", action="store_true")
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
                 master_weights=a.master_weights, state_dtype=a.state_dtype, val_every=a.val_every,
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
    plot(res_a, res_t, png)
    with open(os.path.join(cfg.out, "demo.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, default=str)
    print(f"wrote {png} and {os.path.join(cfg.out, 'demo.json')}")
    return summary


if __name__ == "__main__":
    main()
