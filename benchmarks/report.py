"""Tables, targets and plots from benchmark results (benchmarks/results/*.json).

    python benchmarks/report.py                     # the tables of the newest results
    python benchmarks/report.py --readme README.md  # rewrite the README's headline block from them
    python benchmarks/report.py --docs OUT.md       # the manual's results section (make docs)

"Newest" is by the date in the file name (``cpu-2026-12-02.json``), so a clean clone, whose files
all have one mtime, picks the same results as the machine that wrote them.
"""

from __future__ import annotations

import argparse
import glob
import json
import operator
import os
import re

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
    "step_adamw_8bit": "AdamW step alone, uint8 moments + remainders (peers: no masters)",
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
        if r["case"] == "step_adamw_8bit":
            sb = r.get("state_bytes_per_param", {})
            peers, bf16 = _per_candidate(r.get("speedup_vs_best_peer")), _per_candidate(r.get("time_vs_bf16_moments"))
            missing = f" (not installed: {', '.join(r['peers_missing'])})" if r.get("peers_missing") else ""
            parts = []
            for name, what in (("ampfuse", "uint8 moments"), ("ampfuse-fp8", "FP8 moments")):
                said = []
                if name in peers:
                    said.append(f"{_x(peers[name])} the fastest 8-bit peer ({r['best_peer']})")
                if name in bf16:
                    said.append(f"{_x(bf16[name])} the time of the bf16-moment step")
                if said:
                    parts.append(f"{what} " + " and ".join(said))
            lines.append("")
            lines.append(
                f"8-bit moments at {_fmt_n(r['params'])} params, exact remainder masters: "
                + ("; ".join(parts) or "no 8-bit peer measured") + f"{missing}; {r['bytes_per_param']:g} B/param "
                "moved per step; training state " + ", ".join(f"{k} {v:g} B/param" for k, v in sb.items()) + "."
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


def _per_candidate(v: dict | None) -> dict:
    """A per-candidate summary ({candidate: summary}); a bare summary is the uint8 candidate's."""
    if not v:
        return {}
    return {"ampfuse": v} if "median" in v else v


def _metric(row: dict, metric: str):
    if metric == "per_tensor_us":
        return row["per_tensor_us"]["median"]
    if metric == "speedup_vs_best_torch":
        return row["speedup_vs_best_torch"]["median"]
    name, _, cand = metric.partition(":")
    if name in ("speedup_vs_best_peer", "time_vs_bf16_moments"):  # per own candidate (8-bit row)
        c = _per_candidate(row.get(name)).get(cand or "ampfuse")
        return c["median"] if c else None
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
                if v is None:  # a comparison whose other side the run did not measure
                    continue
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


def latest(prefix: str) -> str | None:
    """The newest ``results/<prefix>-<date>.json`` (by the date in its name)."""
    files = [f for f in glob.glob(os.path.join(HERE, "results", f"{prefix}-*.json"))
             if re.fullmatch(rf"{re.escape(prefix)}-\d{{4}}-\d{{2}}-\d{{2}}\.json", os.path.basename(f))]
    return max(files, key=os.path.basename) if files else None


def _load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# The README's headline: one row per claim, the speedup over the best torch recipe of the same run.
HEADLINE = [  # (case, params, dtype (None: the 16-bit one measured), tensors, name)
    ("step_adamw_master", 100_000_000, None, 148, "AdamW step, 16-bit params + fp32 masters"),
    ("step_adamw_precision", 100_000_000, "bfloat16", 148, "AdamW step, bf16 params + remainders + bf16 moments"),
    ("step_adamw_precision", 1_000_000, "bfloat16", 148, "AdamW step, bf16 params + remainders + bf16 moments"),
    ("step_adamw_fp32", 100_000_000, "float32", 148, "AdamW step, fp32 params"),
    ("step_adamw_master", 10_000_000, "bfloat16", 10000, "AdamW step, fp32 masters, 10,000 tensors"),
    ("host_scaling", 640_000, "bfloat16", 10000, "whole scaler path, 10,000 small tensors (host cost)"),
    ("skip_adamw_master", 10_000_000, "bfloat16", 148, "skipped step (overflow)"),
    ("unscale_check_norm", 10_000_000, "float32", 148, "unscale + inf check + norm + clip"),
    ("accumulate", 10_000_000, "bfloat16", 148, "fp32 gradient accumulation"),
]


def _near(n: int, target: int) -> bool:
    return abs(n - target) <= 0.01 * target


def headline_table(result: dict) -> str:
    m = result["machine"]
    where = m.get("gpu") or f"{m.get('cpu', 'CPU')}, {m.get('threads')} threads"
    lines = ["| what | params | dtype | bytes moved per param | speedup vs the best torch recipe |", "|---|---|---|---|---|"]
    shown = set()
    for case, params, dtype, tensors, name in HEADLINE:  # the first measured row of each name
        for r in result["rows"] if name not in shown else ():
            if (r["case"] == case and r["tensors"] == tensors and _near(r["params"], params)
                    and (r["dtype"] == dtype or (dtype is None and r["dtype"] in ("float16", "bfloat16")))):
                lines.append(f"| {name} | {_fmt_n(r['params'])} | {r['dtype']} | {r['bytes_per_param']:g} | "
                             f"{_x(r['speedup_vs_best_torch'])} ({r['best_torch']}) |")
                shown.add(name)
                break
    how = "`benchmarks/gpu_check.sh`" if m.get("gpu") else "`make bench`"
    lines += ["", f"Median [min–max] of per-round ratios; {where}, torch {m['torch']}, {m['date']} "
              f"({how}; every case and the method: the manual's Performance page)."]
    return "\n".join(lines)


def readme_block(readme: str) -> str:
    """The README's results block, between the markers, for the newest CPU (and GPU) results."""
    base = os.path.dirname(os.path.abspath(readme))
    blocks = []
    for prefix in ("cpu", "cuda"):
        path = latest(prefix)
        if path:
            blocks.append(f"From `{os.path.relpath(path, base)}`:\n\n{headline_table(_load(path))}")
    return BEGIN + "\n" + "\n\n".join(blocks) + "\n" + END


def update_readme(readme: str) -> None:
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w", encoding="utf-8") as f:
        f.write(head + readme_block(readme) + tail)


def host_overhead_table(result: dict) -> str:
    m = result["machine"]
    rows = sorted(result["rows"], key=lambda r: r["tensors"])
    names = list(rows[0]["candidates"])
    lines = [
        f"Measured with {m.get('cpu_threads')} CPU threads (torch {m.get('torch')}, {m.get('date')}): CPU tensors through the CUDA "
        "kernels' host code under the emulator with every launch stubbed, so only what the host does up to the "
        "launches is timed. µs per step, median [min–max].",
        "",
        "| tensors | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for r in rows:
        c = r["candidates"]
        lines.append(f"| {r['tensors']:,} | " + " | ".join(
            f"{c[n]['us']:.0f} [{c[n]['min_us']:.0f}–{c[n]['max_us']:.0f}]" for n in names) + " |")
    per = result.get("per_extra_tensor_us") or {}
    if per:
        lines += ["", "Per extra tensor (medians, between the two largest counts): "
                  + ", ".join(f"{k} {v['us']:.2f} µs" for k, v in per.items()) + "."]
    return "\n".join(lines)


def precision_quality_text(result: dict, date: str) -> str:
    """The precision-quality table (benchmarks/precision_quality.py): per model, every choice's
    validation loss and its gap to the reference, training state and optimizer step time."""
    m, ref, goal = result["machine"], result["reference"], result["goal_nats"]
    lines = [f"Measured on {m['cpu']}, {m['threads']} threads (torch {m['torch']}, {date}). Choices are "
             "moments/masters; every run bf16 weights from the same initial weights on the same batches. "
             f"Gap: validation loss minus the reference's ({ref}), in nats; goal |gap| <= {goal} at the end and at "
             "every evaluation. State: weights + gradients + optimizer state per parameter."]
    for model, res in result["models"].items():
        c = res["config"]
        lines += ["", f"**{model}**: {res['params'] / 1e6:.2f}M params (d-model {c['d_model']}, {c['layers']} layers, "
                  f"context {c['context']}, batch {c['batch']}), {c['steps']} steps, evaluated every {c['val_every']}; "
                  f"reference validation loss {res['runs'][ref]['final_val_loss']:.4f}.",
                  "",
                  "| choice | final val loss | gap at the end | largest gap at matched steps | state B/param | optimizer step ms | goal |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in res["runs"].items():
            ok = max(abs(r["gap_final"]), abs(r["gap_max_matched"])) <= goal
            name = f"{name} (added {r['date']})" if "date" in r else name
            lines.append(f"| {name} | {r['final_val_loss']:.4f} | {r['gap_final']:+.4f} | {r['gap_max_matched']:+.4f} | "
                         f"{r['state_bytes_per_param']:.2f} | {r['optimizer_step_ms']:.2f} | {'met' if ok else 'missed'} |")
        repeats = res.get("repeats") or {}
        if repeats:
            seeds = ["0", *sorted(repeats, key=int)]
            names = [n for n in res["runs"] if all(n in repeats[k] for k in repeats)]
            lines += ["", f"The gap at the end from {len(seeds)} seeds (initial weights and batches) for the choices run "
                      "again: seed 0 as above, mean and range over the seeds.", "",
                      "| choice | " + " | ".join(f"seed {k}" for k in seeds) + " | mean [min–max] |",
                      "|---|" + "---|" * (len(seeds) + 1)]
            for n in names:
                g = [res["runs"][n]["gap_final"]] + [repeats[k][n]["gap_final"] for k in seeds[1:]]
                lines.append(f"| {n} | " + " | ".join(f"{v:+.4f}" for v in g)
                             + f" | {sum(g) / len(g):+.4f} [{min(g):+.4f} – {max(g):+.4f}] |")
        floor = res["runs"].get(ref.split("/")[0] + "/remainder")
        if floor is not None:
            lines += ["", f"{ref.split('/')[0]}/remainder runs the reference's arithmetic but for exact ties (one master "
                      f"in 65,536, where the bf16 weight is one ulp off): its gap "
                      f"({floor['gap_final']:+.4f} at the end, {floor['gap_max_matched']:+.4f} at most) is how far one "
                      "run drifts from another by the chaos of training alone, the floor below which a gap says "
                      "nothing about a choice."]
        if res.get("left_out"):
            lines += ["", "Not installed, left out: " + ", ".join(res["left_out"]) + "."]
    return "\n".join(lines)


def docs_page(out: str) -> None:
    """The manual's generated results: the newest CPU/GPU benchmark tables with their targets and
    plot, the host cost of the CUDA dispatch path, the precision-quality comparison."""
    base = os.path.dirname(os.path.abspath(out))
    parts = []
    for prefix, title in (("cpu", "CPU"), ("cuda", "GPU")):
        path = latest(prefix)
        if not path:
            continue
        res = _load(path)
        parts.append(f"## {title}: every case\n\nFrom `benchmarks/results/{os.path.basename(path)}`.\n\n"
                     f"{markdown_table(res)}\n\n### Targets in this run\n\n{targets_table(res)}")
        png = path[: -len(".json")] + "-adamw.png"
        if os.path.exists(png):
            parts.append(f"![AdamW step]({os.path.relpath(png, base)})")
    path = latest("host-overhead")
    if path:
        parts.append(f"## Host cost of the CUDA dispatch path\n\nFrom `benchmarks/results/{os.path.basename(path)}`.\n\n"
                     + host_overhead_table(_load(path)))
    path = latest("precision-quality")
    if path:
        parts.append(f"## Training quality of the precision options\n\nFrom `benchmarks/results/{os.path.basename(path)}`.\n\n"
                     + precision_quality_text(_load(path), os.path.basename(path)[len("precision-quality-"):-len(".json")]))
        png = path[: -len(".json")] + ".png"
        if os.path.exists(png):
            parts.append(f"![validation loss]({os.path.relpath(png, base)})")
    os.makedirs(base, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n\n".join(parts) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", help="README to update between the bench markers")
    ap.add_argument("--docs", help="write the manual's generated results section to this file")
    ap.add_argument("results", nargs="*", help="result JSON files to print (default: newest CPU and CUDA)")
    a = ap.parse_args()
    if a.readme:
        update_readme(a.readme)
        print(f"updated {a.readme}")
    if a.docs:
        docs_page(a.docs)
        print(f"wrote {a.docs}")
    if a.readme or a.docs:
        return
    files = a.results or [f for f in (latest("cpu"), latest("cuda")) if f]
    if not files:
        raise SystemExit("no results under benchmarks/results/; run `make bench` first")
    for f in files:
        res = _load(f)
        print(markdown_table(res))
        print()
        print(targets_table(res))


if __name__ == "__main__":
    main()
