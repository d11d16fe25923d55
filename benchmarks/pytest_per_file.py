"""Run pytest once per test file, several files at a time, so that a crash (a segfault in native
code) costs the one file it happened in and the other files still report.

    python benchmarks/pytest_per_file.py --jobs 4 FILE... -- PYTEST_ARGS...
    python benchmarks/pytest_per_file.py --one-process FILE... -- PYTEST_ARGS...   # one pytest for all

Each file's output is printed whole, in the order given, then one summary line: the counts summed
over the files (``N passed, M failed, ...``; with ``--collect-only``, ``N tests collected``) and
the files whose pytest died of a signal. Exit status: 0 when every file passed (pytest's 5, "no
test selected", counts as passed), else 1.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")
COLLECTED = re.compile(r"(\d+)(?:/\d+)? tests? collected")


def run(file: str, args: list[str]) -> tuple[str, int, str]:
    p = subprocess.run([sys.executable, "-m", "pytest", file, *args], capture_output=True, text=True)
    return file, p.returncode, p.stdout + p.stderr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--one-process", action="store_true",
                    help="one pytest over every file (the GPU check's dry run: the same arguments, parsed once)")
    ap.add_argument("files", nargs="+")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:split])
    pytest_args = argv[split + 1:]
    if a.one_process:
        results = [run(a.files[0], [*a.files[1:], *pytest_args])]
    else:
        with ThreadPoolExecutor(a.jobs) as pool:
            results = list(pool.map(lambda f: run(f, pytest_args), a.files))
    totals: dict[str, int] = {}
    collected = 0
    crashed, failed = [], []
    for file, rc, out in results:
        print(f"==== {file} (rc={rc})")
        print(out, end="" if out.endswith("\n") else "\n")
        tail = out.strip().splitlines()[-1] if out.strip() else ""
        for n, what in COUNT.findall(tail):
            key = "errors" if what.startswith("error") else what
            totals[key] = totals.get(key, 0) + int(n)
        m = COLLECTED.search(out)
        collected += int(m.group(1)) if m else 0
        if rc < 0 or rc >= 128:
            sig = -rc if rc < 0 else rc - 128
            crashed.append(f"{file} ({signal.Signals(sig).name if sig in signal.valid_signals() else sig})")
        elif rc not in (0, 5):
            failed.append(file)
    counts = ", ".join(f"{n} {k}" for k, n in totals.items())
    if "--collect-only" in pytest_args:
        print(f"{collected} tests collected in {len(results)} files")
    print(f"per file: {counts or 'nothing ran'}; crashed: {', '.join(crashed) or 'none'}")
    return 1 if crashed or failed else 0


if __name__ == "__main__":
    sys.exit(main())
