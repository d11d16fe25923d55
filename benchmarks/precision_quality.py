"""Training quality of ampfuse's precision options: the demo's model trained with fp32 masters and
fp32 moments, and again with 16-bit master remainders and bf16 moments, same weights and batches.

    python benchmarks/precision_quality.py                       # both runs, then the comparison
    python benchmarks/precision_quality.py --reuse A/demo.json B/demo.json   # compare saved runs

Writes ``precision-quality-<date>.json`` (both validation curves, the relative difference at each
evaluation) and a plot of the curves into ``--out``, and prints the final validation losses and
the largest relative difference. The default configuration is a small model (0.12M params, 1,000
steps of 16x64 tokens) so that it finishes in minutes on CPUs whose bf16 matmuls are slow; any
demo option can be passed after ``--``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import tempfile

DEFAULT_DEMO_ARGS = ["--steps", "1000", "--accum", "1", "--batch", "16", "--context", "64", "--d-model", "64",
                     "--layers", "2", "--val-every", "50"]
VARIANTS = {"fp32-state": ["--master-weights", "true", "--state-dtype", "fp32"],
            "remainder+bf16-state": ["--master-weights", "remainder", "--state-dtype", "bf16"]}


def _run(demo_args: list[str], extra: list[str], out: str) -> dict:
    from ampfuse import demo

    return demo.main([*demo_args, *extra, "--no-progress", "--out", out])


def compare(runs: dict[str, dict]) -> dict:
    """The two ampfuse validation curves and their relative difference (bf16 state vs fp32)."""
    (ref_name, ref), (name, other) = runs.items()
    ref_curve = dict((int(s), v) for s, v in ref["ampfuse"]["val_curve"])
    curve = dict((int(s), v) for s, v in other["ampfuse"]["val_curve"])
    common = sorted(set(ref_curve) & set(curve))
    if not common:
        raise ValueError("the runs have no validation step in common (run the demo with --val-every)")
    rel = [(s, (curve[s] - ref_curve[s]) / ref_curve[s]) for s in common]
    return {
        "reference": ref_name,
        "variant": name,
        "config": ref["config"],
        "val_curve": {ref_name: [[s, ref_curve[s]] for s in common], name: [[s, curve[s]] for s in common]},
        "final_val_loss": {ref_name: ref["ampfuse"]["val_loss"], name: other["ampfuse"]["val_loss"]},
        "final_rel_diff": (other["ampfuse"]["val_loss"] - ref["ampfuse"]["val_loss"]) / ref["ampfuse"]["val_loss"],
        "rel_diff_per_eval": rel,
        "max_abs_rel_diff": max(abs(r) for _, r in rel),
        "state_bytes": {ref_name: ref["ampfuse"]["state_bytes"], name: other["ampfuse"]["state_bytes"]},
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in result["val_curve"].items():
        ax.plot([s for s, _ in curve], [v for _, v in curve], marker=".", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"ampfuse AdamW, bf16 params: max |relative difference| {result['max_abs_rel_diff']:.2%}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reuse", nargs=2, metavar=("FP32_STATE_JSON", "BF16_STATE_JSON"),
                   help="compare two saved demo.json files instead of training")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("demo_args", nargs="*", help="demo options (after --); default: a 0.12M-param, 1,000-step run")
    a = p.parse_args(argv)
    if a.reuse:
        runs = {}
        for name, path in zip(VARIANTS, a.reuse):
            with open(path, encoding="utf-8") as f:
                runs[name] = json.load(f)
        if runs["remainder+bf16-state"]["config"].get("state_dtype") != "bf16":
            p.error(f"{a.reuse[1]} is not a run with --state-dtype bf16")
    else:
        demo_args = a.demo_args or DEFAULT_DEMO_ARGS
        with tempfile.TemporaryDirectory() as d:
            runs = {name: _run(demo_args, extra, os.path.join(d, str(i))) for i, (name, extra) in enumerate(VARIANTS.items())}
    result = compare(runs)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, f"precision-quality-{_dt.date.today().isoformat()}")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    plot(result, stem + ".png")
    fl = result["final_val_loss"]
    print(f"final validation loss: fp32 state {fl['fp32-state']:.4f}, remainder masters + bf16 state "
          f"{fl['remainder+bf16-state']:.4f} ({result['final_rel_diff']:+.2%}); largest relative difference over "
          f"{len(result['rel_diff_per_eval'])} evaluations {result['max_abs_rel_diff']:.2%}")
    print(f"wrote {stem}.json and {stem}.png")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
