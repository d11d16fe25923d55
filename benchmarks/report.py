"""Tables, targets and plots from benchmark results (benchmarks/results/*.json).

    python benchmarks/report.py                     # the tables of the newest results
    python benchmarks/report.py --readme README.md  # rewrite the README's results block from them
"""

from __future__ import annotations

import argparse
import glob
import json
import operator
import os

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

CASE_NAMES = {
    "step_adamw_master": "AdamW step, fp32 masters",
    "step_adamw_precision": "AdamW step, remainder masters + bf16 moments",
    "step_sgd_master": "SGD-momentum step, fp32 masters",
    "step_adamw_fp32": "AdamW step, fp32 params",
    "skip_adamw_master": "skipped step (overflow), masters",
    "unscale_check": "unscale + inf check",
    "unscale_check_norm": "unscale + check + norm + clip",
    "accumulate": "fp32 grad accumulation",
    "host_scaling": "whole scaler path, 64-element tensors (host cost)",
}
OPS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq}


def _fmt_n(n: int) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v >= 10 or v == int(v) else f"{v:.1f}{unit}"
    return str(n)


def _ms(c: dict) -> str:
    return f"{c['ms']:.3g} [{c['min_ms']:.3g}–{c['max_ms']:.3g}]"


def _x(s: dict) -> str:
    return f"{s['median']:.2f}x [{s['min']:.2f}–{s['max']:.2f}]"


def markdown_table(result: dict) -> str:
    m = result["machine"]
    where = m.get("gpu") or f"{m.get('cpu', 'CPU')}, {m.get('threads')} threads, {m.get('cpu_kernels')} kernels"
    rows = result["rows"]
    rounds = sorted({r["rounds"] for r in rows}) if rows else [0]
    lines = [
        f"Measured on {where} (torch {m['torch']}, {m['date']}), {rounds[0]}–{rounds[-1]} shuffled rounds per case, "
        "gradients rewritten before every timed call. Times: median [min–max] ms. Speedup: per-round ratio "
        "best-torch time / ampfuse time, median [min–max]. % in-place: the case's useful bytes (byte model in "
        "benchmarks/run.py) per second over the in-place stream x *= s of the same rounds.",
        "",
        "| case | params | tensors | dtype | B/param | ampfuse ms | torch candidates ms | speedup vs best torch | ampfuse % in-place | in-place GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["case"] == "small_model":
            continue
        c = r["candidates"]
        others = "; ".join(f"{k}: {_ms(v)}" for k, v in c.items() if k != "ampfuse")
        lines.append(
            f"| {CASE_NAMES.get(r['case'], r['case'])} | {_fmt_n(r['params'])} | {r['tensors']} | {r['dtype']} | "
            f"{r['bytes_per_param']:g} | {_ms(c['ampfuse'])} | {others} | {_x(r['speedup_vs_best_torch'])} ({r['best_torch']}) | "
            f"{100 * c['ampfuse']['frac_inplace']:.0f}% | {r['roofs']['inplace']['gbps']:.1f} |"
        )
    for r in rows:
        if r["case"] == "step_adamw_precision" and "ampfuse-fp32-masters" in r.get("speedup_vs", {}):
            s = r["speedup_vs"]["ampfuse-fp32-masters"]
            sb = r.get("state_bytes_per_param", {})
            lines.append("")
            lines.append(
                f"Remainder masters + bf16 moments at {_fmt_n(r['params'])} params: {_x(s)} the fp32-master step; "
                f"{r['bytes_per_param']:g} B/param moved per step; training state "
                + ", ".join(f"{k} {v:g} B/param" for k, v in sb.items()) + "."
            )
    for r in rows:
        if r["case"] == "small_model":
            c = r["candidates"]
            s, t = r["per_tensor_us"], r["torch_per_tensor_us"]
            lines += ["", (
                f"Small models (bf16 AdamW + masters, whole scaler path): 1,000 tensors x 1,000 elements "
                f"{_ms(c['ampfuse-1000'])} ms vs 10 tensors x 100,000 {_ms(c['ampfuse-10'])} ms: "
                f"{s['median']:.2f} µs [{s['min']:.2f}–{s['max']:.2f}] per extra tensor "
                f"(expert torch recipe: {t['median']:.2f} µs [{t['min']:.2f}–{t['max']:.2f}]; "
                f"{_ms(c['torch-A*-1000'])} ms and {_ms(c['torch-A*-10'])} ms)."
            )]
    host = sorted((r for r in rows if r["case"] == "host_scaling"), key=lambda r: r["tensors"])
    if len(host) >= 2:
        def per_step(r, name):
            c = r["candidates"][name]
            return f"{1e3 * c['ms']:.0f} [{1e3 * c['min_ms']:.0f}–{1e3 * c['max_ms']:.0f}]"
        a, b = host[-2], host[-1]
        slope = lambda name: 1e3 * (b["candidates"][name]["ms"] - a["candidates"][name]["ms"]) / (b["tensors"] - a["tensors"])
        lines += ["", (
            "Host cost, whole scaler path on 64-element tensors, µs per step at "
            + ", ".join(f"{r['tensors']:,}" for r in host) + " tensors: ampfuse "
            + "; ".join(per_step(r, "ampfuse") for r in host) + "; expert torch recipe "
            + "; ".join(per_step(r, "torch-A*") for r in host)
            + f". Per extra tensor between {a['tensors']:,} and {b['tensors']:,}: ampfuse {slope('ampfuse'):.2f} µs, "
            f"torch {slope('torch-A*'):.2f} µs (medians)."
        )]
    diag = result.get("step_diagnostics")
    if diag:
        a, t = diag.get("ampfuse", {}), diag.get("torch-A*", {})
        lines += ["", (
            f"One step with {diag['tensors']} tensors: ampfuse {a.get('kernel_launches')} kernel launches "
            f"({a.get('memcpy_memset')} copies/memsets), {a.get('host_syncs')} host syncs, CUDA-graph capture "
            f"{a.get('graph_capture')}; expert torch recipe {t.get('kernel_launches')} kernel launches."
        )]
    return "\n".join(lines)


# ---- targets ----------------------------------------------------------------------------------


def load_targets() -> list[dict]:
    with open(os.path.join(HERE, "targets.json"), encoding="utf-8") as f:
        return json.load(f)["targets"]


def _metric(row: dict, metric: str):
    if metric == "per_tensor_us":
        return row["per_tensor_us"]["median"]
    if metric == "speedup_vs_best_torch":
        return row["speedup_vs_best_torch"]["median"]
    if metric.startswith("speedup_vs:"):
        return row["speedup_vs"][metric.split(":", 1)[1]]["median"]
    if metric == "frac_inplace":
        return row["candidates"]["ampfuse"]["frac_inplace"]
    if metric == "bytes_per_param":
        return row["bytes_per_param"]
    if metric == "state_bytes_per_param":
        return row["state_bytes_per_param"]["ampfuse"]
    raise KeyError(metric)


def evaluate_targets(result: dict) -> list[dict]:
    """Each target of targets.json for this run: PASS / FAIL per measured row, or not measured."""
    device = result["machine"]["device"]
    out = []
    for t in load_targets():
        if t["device"] not in ("any", device):
            continue
        sel = t["select"]
        checks = []
        if "diagnostics" in sel:
            d = (result.get("step_diagnostics") or {}).get(sel["diagnostics"])
            if d is not None and t["metric"] in d:
                v = d[t["metric"]]
                checks.append({"row": f"{sel['diagnostics']} step", "value": v, "pass": bool(OPS[t["op"]](v, t["value"]))})
        else:
            for r in result["rows"]:
                if r["case"] != sel["case"] or ("layout" in sel and r["layout"] != sel["layout"]):
                    continue
                if r["params"] < sel.get("params_min", 0):
                    continue
                v = _metric(r, t["metric"])
                checks.append({"row": f"{r['case']} {_fmt_n(r['params'])} {r['dtype']}", "value": v,
                               "pass": bool(OPS[t["op"]](v, t["value"]))})
        status = "not measured" if not checks else ("PASS" if all(c["pass"] for c in checks) else "FAIL")
        out.append({"id": t["id"], "what": t["what"], "target": f"{t['op']} {t['value']}{t.get('unit', '')}",
                    "status": status, "checks": checks})
    return out


def _fmt_v(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def targets_table(result: dict) -> str:
    targets = result.get("targets") or evaluate_targets(result)
    lines = ["| target | measured | goal | result |", "|---|---|---|---|"]
    for t in targets:
        measured = "; ".join(f"{c['row']}: {_fmt_v(c['value'])}" for c in t["checks"]) or "—"
        lines.append(f"| {t['what']} | {measured} | {t['target']} | **{t['status']}** |")
    return "\n".join(lines)


# ---- plot -------------------------------------------------------------------------------------


def plot(result: dict, out_dir: str, prefix: str = "") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dev = result["machine"]["device"]
    date = result["machine"]["date"]
    rows = sorted((r for r in result["rows"] if r["case"] == "step_adamw_master" and r["layout"] == "gpt2"),
                  key=lambda r: r["params"])
    if rows:
        dtype = rows[0]["dtype"]
        rows = [r for r in rows if r["dtype"] == dtype]
    prec = sorted((r for r in result["rows"] if r["case"] == "step_adamw_precision"), key=lambda r: r["params"])
    if not rows:
        return []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    n = [r["params"] for r in rows]
    ax1.loglog(n, [r["candidates"]["ampfuse"]["ms"] for r in rows], "o-", label="ampfuse, fp32 masters (32 B/param)")
    if prec:
        ax1.loglog([r["params"] for r in prec], [r["candidates"]["ampfuse"]["ms"] for r in prec], "^-",
                   label="ampfuse, remainders + bf16 moments (20 B/param)")
    for name, style in (("torch-A", "s--"), ("torch-A*", "d-")):
        if all(name in r["candidates"] for r in rows):
            ax1.loglog(n, [r["candidates"][name]["ms"] for r in rows], style, label=name)
    floor = [r["params"] * r["bytes_per_param"] / (r["roofs"]["inplace"]["gbps"] * 1e9) * 1e3 for r in rows]
    ax1.loglog(n, floor, "k:", label="32 B/param at the in-place stream's speed")
    ax1.set_xlabel(f"parameters (GPT-2-small shapes, {rows[0]['dtype']})")
    ax1.set_ylabel("time per step, median (ms)")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3, which="both")
    for name, style in (("torch-A", "s--"), ("torch-A*", "d-")):
        if all(name in r["speedup_vs"] for r in rows):
            s = [r["speedup_vs"][name] for r in rows]
            ax2.semilogx(n, [v["median"] for v in s], style, label=f"ampfuse (fp32 masters) vs {name}")
            ax2.fill_between(n, [v["min"] for v in s], [v["max"] for v in s], alpha=0.15)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xlabel("parameters")
    ax2.set_ylabel("speedup, median [min–max] of rounds")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3, which="both")
    fig.suptitle(f"AdamW mixed-precision step — {dev}, {date}")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{prefix}{dev}-{date}-adamw.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


# ---- README -----------------------------------------------------------------------------------


def latest(device: str | None = None) -> str | None:
    files = [f for f in glob.glob(os.path.join(HERE, "results", "*.json"))
             if not os.path.basename(f).startswith(("quick-", "plan-"))]
    if device:
        files = [f for f in files if os.path.basename(f).startswith(device)]
    return max(files, key=os.path.getmtime) if files else None


def update_readme(readme: str, results: list[str]) -> None:
    blocks = []
    base = os.path.dirname(os.path.abspath(readme))
    for path in results:
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        rel = os.path.relpath(path, base)
        blocks.append(f"From `{rel}`:\n\n{markdown_table(res)}\n\nTargets (`benchmarks/targets.json`) in this run:\n\n{targets_table(res)}")
        png = path[: -len(".json")] + "-adamw.png"
        if os.path.exists(png):
            blocks.append(f"![AdamW step]({os.path.relpath(png, base)})")
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
                res = json.load(fh)
            print(markdown_table(res))
            print()
            print(targets_table(res))


if __name__ == "__main__":
    main()
