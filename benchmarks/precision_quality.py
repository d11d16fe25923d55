"""Training quality of every precision choice: the demo's character transformer (bf16 weights),
trained once per choice from the same weights on the same batches, against the reference of fp32
moments with fp32 masters.

    python benchmarks/precision_quality.py                   # every choice, both models
    python benchmarks/precision_quality.py --models demo     # the demo model only
    python benchmarks/precision_quality.py --only fp32/fp32,uint8/remainder
    python benchmarks/precision_quality.py --into results/precision-quality-DATE.json --seeds 1,2 \
        --only fp32/remainder,uint8/remainder     # the same choices again from other seeds
    python benchmarks/precision_quality.py --into results/precision-quality-DATE.json \
        --only uint8/stochastic                   # choices added to that result's own runs

The choices: AdamW moments in fp32, bf16, uint8 (the dynamic map) or fp8 (e4m3 first moment, e5m2
second), each with fp32 masters, 16-bit remainders (the same fp32 master, bit for bit), no master
with stochastic rounding of the bf16 weights, or no master (the bf16 weights updated directly,
rounded to nearest); and the 8-bit peers on the same model and batches:
bitsandbytes' AdamW8bit, torchao's AdamW8bit and AdamWFp8 (no masters; left out when not
installed, see benchmarks/requirements-peers.txt). Every run: bf16 weights, no loss scaling (bf16
needs none), gradient clipping at 1.0, AdamW lr 3e-3, weight decay 0.01.

Per choice: the validation loss at every evaluation and at the end, its gap to the reference in
nats (final, and the largest at the same steps), the training state per parameter (weights +
gradients + optimizer state, by storage) and the median step time. Writes
``precision-quality-<date>.json`` and a plot into ``--out``, prints the table. ``--seeds`` with
``--into`` trains the chosen choices and the reference again from other initial weights and
batches and adds their gaps to that result (next to the choices run from those seeds before, whose
reference must reproduce), so that a gap can be told from the run-to-run spread.
``--into`` alone adds the chosen choices to that result's runs, from its own weights and batches:
the reference is trained again first and must reproduce the result's final loss exactly (the same
machine kind and torch), else nothing is added. Each added run records its date.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import ampfuse  # noqa: E402
from ampfuse import demo  # noqa: E402

MODELS = {  # name: demo configuration
    "demo": dict(d_model=64, layers=2, context=64, batch=16, steps=1000, val_every=50),
    "larger": dict(d_model=128, layers=4, context=64, batch=16, steps=1000, val_every=50),
}
LR, WEIGHT_DECAY, MAX_NORM = 3e-3, 0.01, 1.0
REFERENCE = "fp32/fp32"
GOAL_NATS = 0.01

_MOMENTS = {"fp32": dict(state_dtype=torch.float32), "bf16": dict(state_dtype=torch.bfloat16),
            "uint8": dict(state_dtype=torch.uint8),
            "fp8": dict(state_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e5m2)}
_MASTERS = {"fp32": True, "remainder": "remainder", "stochastic": "stochastic", "none": False}
PEERS = {  # name: (module, class)
    "bnb-8bit": ("bitsandbytes.optim", "AdamW8bit"),
    "torchao-8bit": ("torchao.optim", "AdamW8bit"),
    "torchao-fp8": ("torchao.optim", "AdamWFp8"),
}


def choices() -> dict[str, Callable | tuple[str, str]]:
    """Every choice by name ("<moments>/<masters>", or a peer's name): a maker of its optimizer."""
    out: dict = {}
    for m, mo in _MOMENTS.items():
        for w, mw in _MASTERS.items():
            out[f"{m}/{w}"] = lambda ps, mo=mo, mw=mw: ampfuse.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY,
                                                                         master_weights=mw, **mo)
    for name, (module, cls) in PEERS.items():
        out[name] = (module, cls)
    return out


def _peer(module: str, cls: str) -> Callable | None:
    try:
        opt = getattr(importlib.import_module(module), cls)
    except ImportError:
        return None
    return lambda ps: opt(ps, lr=LR, weight_decay=WEIGHT_DECAY)


def _plain(states) -> list[torch.Tensor]:
    """Every plain tensor of the optimizer's per-param states; a tensor subclass (torchao's 8-bit
    state) by the tensors it holds."""
    out: list[torch.Tensor] = []

    def add(t) -> None:
        if hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                add(getattr(t, name))
        elif isinstance(t, torch.Tensor):
            out.append(t)

    for st in states:
        for v in st.values():
            add(v)
    return out


def train(make_opt: Callable, cfg: demo.Config, data: demo.CharData, init: dict) -> dict:
    """One run: bf16 weights from `init`, the batches of cfg.seed, clipping, `make_opt`'s step."""
    model = demo.TinyGPT(data.vocab, cfg.context, cfg.d_model, cfg.layers, cfg.heads, cfg.embed_rows)
    model.load_state_dict(init)
    model.to(torch.bfloat16)
    opt = make_opt(list(model.parameters()))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    curve, times = [], []
    for step in range(1, cfg.steps + 1):
        x, y = data.batch("train", cfg.batch, gen)
        t0 = time.perf_counter()
        logits = model(x)
        F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        t1 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t1)
        if step == 1:  # gradients exist: the training state is complete
            params = list(model.parameters())
            n = sum(p.numel() for p in params)
            state_bytes = demo.tensor_bytes(params + [p.grad for p in params] + _plain(opt.state.values()))
        opt.zero_grad(set_to_none=False)
        if step % cfg.val_every == 0:
            curve.append([step, demo.evaluate(model, data, cfg, torch.bfloat16)])
    final = demo.evaluate(model, data, cfg, torch.bfloat16)
    return {"val_curve": curve, "final_val_loss": final, "state_bytes_per_param": state_bytes / n,
            "optimizer_step_ms": 1e3 * statistics.median(times), "params": n}


def gaps(runs: dict[str, dict], reference: str) -> None:
    """Each run's gap to the reference (nats): final, and the largest at the evaluations both have."""
    ref = runs[reference]
    ref_curve = dict((int(s), v) for s, v in ref["val_curve"])
    for r in runs.values():
        curve = dict((int(s), v) for s, v in r["val_curve"])
        common = sorted(set(ref_curve) & set(curve))
        if not common:
            raise ValueError("the runs have no validation step in common")
        r["gap_final"] = r["final_val_loss"] - ref["final_val_loss"]
        r["gap_max_matched"] = max((curve[s] - ref_curve[s] for s in common), key=abs)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        runs = result["models"][model]["runs"]
        ref = dict((int(s), v) for s, v in runs[REFERENCE]["val_curve"])
        for name, r in runs.items():
            pts = [(s, v - ref[int(s)]) for s, v in r["val_curve"] if int(s) in ref]
            # colour by moments (or peer), line style by master form
            moments, _, masters = name.partition("/")
            style = {"fp32": "-", "remainder": "--", "stochastic": ":", "none": "-."}.get(masters, (0, (1, 3)))
            color = f"C{(list(_MOMENTS) + list(PEERS)).index(moments) % 10}" if moments in _MOMENTS or moments in PEERS else None
            ax.plot([s for s, _ in pts], [g for _, g in pts], marker=".", label=name, lw=1, ls=style, color=color)
        ax.axhspan(-GOAL_NATS, GOAL_NATS, color="0.9")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"validation loss - {REFERENCE} (nats)")
        ax.set_title(model)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_choices(model: str, spec: dict, todo: dict, corpus_bytes: int = 2_000_000,
                seed: int = 0) -> tuple[dict[str, dict], list[str]]:
    """Every choice of `todo` on `model` (its configuration `spec`) from the weights and batches
    of `seed`, with each one's gaps to the reference; and the choices left out (not installed)."""
    cfg = demo.Config(device="cpu", dtype="bf16", eval_batches=8, corpus_bytes=corpus_bytes, seed=seed, **spec)
    data = demo.CharData(demo.load_corpus(cfg.corpus_bytes), cfg.context)
    torch.manual_seed(cfg.seed)
    init = demo.TinyGPT(data.vocab, cfg.context, cfg.d_model, cfg.layers, cfg.heads, cfg.embed_rows).state_dict()
    runs, left_out = {}, []
    for name, maker in todo.items():
        make = _peer(*maker) if isinstance(maker, tuple) else maker
        if make is None:
            left_out.append(name)
            continue
        t0 = time.perf_counter()
        runs[name] = train(make, cfg, data, init)
        print(f"{model} seed {seed} {name}: val {runs[name]['final_val_loss']:.4f} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    gaps(runs, REFERENCE)
    return runs, left_out


def add_seeds(path: str, seeds: list[int], todo: dict) -> dict:
    """The choices of `todo` (and the reference) again on each model of the result at `path`,
    from each of `seeds`; their gaps are added under the model's "repeats", the file rewritten."""
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    for model, res in result["models"].items():
        repeats = res.setdefault("repeats", {})
        for seed in seeds:
            runs, _ = run_choices(model, res["config"], todo, corpus_bytes=res.get("corpus_bytes", 2_000_000), seed=seed)
            known = repeats.setdefault(str(seed), {})
            if REFERENCE in known and known[REFERENCE]["final_val_loss"] != runs[REFERENCE]["final_val_loss"]:
                raise SystemExit(f"{model} seed {seed}: the reference gave {runs[REFERENCE]['final_val_loss']!r}, the "
                                 f"result holds {known[REFERENCE]['final_val_loss']!r}: another machine or torch")
            known.update(
                {name: {k: r[k] for k in ("final_val_loss", "gap_final", "gap_max_matched")} for name, r in runs.items()})
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    import report

    print(report.precision_quality_text(result, result["machine"]["date"]))
    return result


def add_choices(path: str, todo: dict) -> dict:
    """The choices of `todo` trained on each model of the result at `path` from its own weights and
    batches and added to its runs (gaps against its reference, which must reproduce exactly)."""
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    today = _dt.date.today().isoformat()
    for model, res in result["models"].items():
        runs, _ = run_choices(model, res["config"], todo, corpus_bytes=res.get("corpus_bytes", 2_000_000))
        stored, again = res["runs"][REFERENCE]["final_val_loss"], runs[REFERENCE]["final_val_loss"]
        if again != stored:
            raise SystemExit(f"{model}: the reference gave {again!r}, the result holds {stored!r}: another machine "
                             "or torch; run the whole harness instead")
        for name, r in runs.items():
            if name != REFERENCE:
                res["runs"][name] = dict(r, date=today)
        gaps(res["runs"], REFERENCE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    plot(result, os.path.splitext(path)[0] + ".png")
    import report

    print(report.precision_quality_text(result, result["machine"]["date"]))
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    p.add_argument("--only", default=None, help="comma-separated choices (the reference always runs)")
    p.add_argument("--steps", type=int, default=None, help="override every model's steps (a smoke run)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and corpus (a smoke run, tests)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--seeds", default=None, help="with --into: comma-separated seeds to run again")
    p.add_argument("--into", default=None, help="a result JSON the --seeds runs (or, alone, the chosen choices) "
                   "are added to")
    a = p.parse_args(argv)
    if a.seeds is not None and a.into is None:
        raise SystemExit("--seeds goes with --into")
    torch.manual_seed(0)
    todo = choices()
    if a.only:
        keep = set(a.only.split(",")) | {REFERENCE}
        unknown = keep - set(todo)
        if unknown:
            raise SystemExit(f"unknown choices: {', '.join(sorted(unknown))}")
        todo = {k: v for k, v in todo.items() if k in keep}
    result: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                                "torch": torch.__version__, "date": _dt.date.today().isoformat()},
                    "reference": REFERENCE, "goal_nats": GOAL_NATS, "models": {}}
    if a.into is not None and a.seeds is not None:
        return add_seeds(a.into, [int(x) for x in a.seeds.split(",")], todo)
    if a.into is not None:
        return add_choices(a.into, todo)
    for model in a.models.split(","):
        spec = dict(MODELS[model])
        if a.tiny:
            spec.update(d_model=32, layers=1, context=32, batch=4, steps=4, val_every=2)
        if a.steps is not None:
            spec.update(steps=a.steps, val_every=max(1, min(spec["val_every"], a.steps)))
        corpus = 200_000 if a.tiny else 2_000_000
        runs, left_out = run_choices(model, spec, todo, corpus_bytes=corpus)
        result["models"][model] = {"config": spec, "corpus_bytes": corpus, "params": runs[REFERENCE]["params"],
                                   "runs": runs, "left_out": left_out}
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"precision-quality-{result['machine']['date']}")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    if not a.no_plot:
        plot(result, stem + ".png")
    import report

    print(report.precision_quality_text(result, result["machine"]["date"]))
    print(f"wrote {stem}.json")
    return result


if __name__ == "__main__":
    main()
