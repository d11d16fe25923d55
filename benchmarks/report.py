"""Tables and plots from benchmark results (benchmarks/results/*.json).

    python benchmarks/report.py                     # print the table of the newest results
    python benchmarks/report.py --readme README.md  # rewrite the README's results block
"""

from __future__ import annotations

import argparse
import glob
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

CASE_NAMES = {
    "step_adamw_master": "AdamW step, fp32 masters (vs baseline A)",
    "step_sgd_master": "SGD-momentum step, fp32 masters (vs baseline A)",
    "step_adamw_fp32": "AdamW step, fp32 params (vs baseline B)",
    "skip_adamw_master": "skipped step (overflow), masters (vs baseline A)",
    "unscale_check": "unscale + inf check (vs torch._amp_foreach_...)",
    "unscale_check_norm": "unscale + check + norm + clip (vs unscale + clip_grad_norm_)",
    "accumulate": "fp32 grad accumulation (vs torch._foreach_add_)",
}


def _fmt_n(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v >= 10 or v == int(v) else f"{v:.1f}{unit}"
    return str(n)


def markdown_table(result: dict) -> str:
    m = result["machine"]
    where = m.get("gpu") or f"{m.get('cpu', 'CPU')}, {m.get('threads')} threads, {m.get('cpu_kernels')} kernels"
    lines = [
        f"Measured on {where} (torch {m['torch']}, {m['date']}). Times are medians over interleaved repeats; "
        "speedup = torch time / ampfuse time; bandwidth = the case's useful bytes (byte model) per second, as a "
        "fraction of a same-size copy and of a same-size in-place stream (x *= s) measured in the same run. "
        "On a CPU a copy also pays a read of every destination line (write-allocate) that in-place kernels do not, "
        "which is how an in-place kernel can exceed 100% of copy.",
        "",
        "| case | params | tensors | dtype | B/param | ampfuse ms | torch ms | speedup | ampfuse % copy | torch % copy | ampfuse % in-place |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {CASE_NAMES.get(r['case'], r['case'])} | {_fmt_n(r['params'])} | {r['tensors']} | {r['dtype']} | "
            f"{r['bytes_per_param']:g} | {r['ampfuse_ms']:.3f} | {r['torch_ms']:.3f} | {1 / r['ratio']:.2f}x | "
            f"{100 * r['ampfuse_frac_copy']:.0f}% | {100 * r['torch_frac_copy']:.0f}% | "
            f"{100 * r.get('ampfuse_frac_inplace', 0):.0f}% |"
        )
    diag = result.get("step_diagnostics")
    if diag:
        lines += ["", f"Fused AdamW step with {diag['tensors']} tensors: {diag['host_syncs']} host syncs, "
                  f"{diag['kernel_launches']} kernel launches."]
    return "\n".join(lines)


def plot(result: dict, out_dir: str, prefix: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dev = result["machine"]["device"]
    date = result["machine"]["date"]
    rows = [r for r in result["rows"] if r["case"] == "step_adamw_master" and r["layout"] == "gpt2"]
    dtype = rows[0]["dtype"] if rows else None
    rows = sorted((r for r in rows if r["dtype"] == dtype), key=lambda r: r["params"])
    if not rows:
        return []
    n = [r["params"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.loglog(n, [r["ampfuse_ms"] for r in rows], "o-", label="ampfuse (check pass + fused step)")
    ax1.loglog(n, [r["torch_ms"] for r in rows], "s-", label="baseline A (torch: copies + unscale_ + clip + fused AdamW)")
    floor = [r["params"] * r["bytes_per_param"] / (r["copy_gbps"] * 1e9) * 1e3 for r in rows]
    ax1.loglog(n, floor, "k--", label=f"bandwidth floor ({rows[0]['bytes_per_param']:g} B/param at copy speed)")
    ax1.set_xlabel("parameters (GPT-2-small shapes)")
    ax1.set_ylabel("time per step (ms)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3, which="both")
    ax2.semilogx(n, [100 * r["ampfuse_frac_copy"] for r in rows], "o-", label="ampfuse")
    ax2.semilogx(n, [100 * r["torch_frac_copy"] for r in rows], "s-", label="baseline A")
    ax2.semilogx(n, [100 * r.get("ampfuse_frac_inplace", 0) for r in rows], "o:", label="ampfuse vs in-place stream")
    ax2.axhline(100, color="k", ls="--", label="same-size copy / in-place stream")
    ax2.set_xlabel("parameters")
    ax2.set_ylabel("% of copy bandwidth (useful bytes)")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3, which="both")
    fig.suptitle(f"AdamW mixed-precision step with fp32 masters, {dtype} weights — {dev}, {date}")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{prefix}{dev}-{date}-adamw.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def latest(device: str | None = None) -> str | None:
    files = [f for f in glob.glob(os.path.join(HERE, "results", "*.json")) if not os.path.basename(f).startswith("quick-")]
    if device:
        files = [f for f in files if os.path.basename(f).startswith(device)]
    return max(files, key=os.path.getmtime) if files else None


def update_readme(readme: str, results: list[str]) -> None:
    blocks = []
    for path in results:
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        rel = os.path.relpath(path, os.path.dirname(os.path.abspath(readme)))
        blocks.append(f"From `{rel}`:\n\n{markdown_table(res)}")
        png = path[: -len(".json")] + "-adamw.png"
        if os.path.exists(png):
            blocks.append(f"![AdamW step vs baseline A]({os.path.relpath(png, os.path.dirname(os.path.abspath(readme)))})")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w", encoding="utf-8") as f:
        f.write(head + BEGIN + "\n" + "\n\n".join(blocks) + "\n" + END + tail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", help="README to update between the bench markers")
    ap.add_argument("results", nargs="*", help="result JSON files (default: newest CPU and CUDA)")
    a = ap.parse_args()
    files = a.results or [f for f in (latest("cpu"), latest("cuda")) if f]
    if not files:
        raise SystemExit("no results under benchmarks/results/; run `make bench` first")
    if a.readme:
        update_readme(a.readme, files)
        print(f"updated {a.readme} from {', '.join(files)}")
    else:
        for f in files:
            with open(f, encoding="utf-8") as fh:
                print(markdown_table(json.load(fh)))


if __name__ == "__main__":
    main()
