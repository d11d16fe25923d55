"""Register pressure of the CUDA kernels, from ptxas's own report of the build.

Test builds (AMPFUSE_PTXAS_REPORT, on with AMPFUSE_BUILD_TESTS) compile the CUDA objects with
`-Xptxas=-v` and keep the report next to each object (cmake/ptxas_log.sh). For every kernel and
every architecture built this checks that it

  * spills nothing and has no stack frame (spills, and arguments of a device function compiled as a
    call, are local-memory traffic inside a bandwidth-bound loop), unless SPILLS_ALLOWED below names
    it with the reason and the bytes -- device functions compiled as calls are checked too;
  * can launch its block size: registers x kBlockSize fit the 64K registers of a multiprocessor.

The report is complete: every kernel the sources define appears for every architecture.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

import ampfuse

BLOCK_SIZE = 256  # kBlockSize of csrc/cuda/multi_tensor_apply.cuh
REGISTERS_PER_SM = 65536
# Kernels allowed to spill: {mangled-name regex: (max spill store bytes, max spill load bytes, why)}.
SPILLS_ALLOWED: dict[str, tuple[int, int, str]] = {}

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
PROPS = re.compile(r"Function properties for (\S+)\s*$")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def parse(text: str) -> dict[tuple[str, str], dict[str, int]]:
    """(function, arch) -> {"entry", "registers", "stack", "spill_stores", "spill_loads"} from ptxas -v
    output: every kernel, and every device function compiled as a call (its spills count too)."""
    functions: dict[tuple[str, str], dict[str, int]] = {}
    arch = None
    entry = None
    props_for = None
    for line in text.splitlines():
        if m := ENTRY.search(line):
            entry, arch = m.group(1), m.group(2)
            functions[(entry, arch)] = {"entry": 1, "registers": -1, "stack": 0, "spill_stores": 0, "spill_loads": 0}
            props_for = None
        elif m := PROPS.search(line):
            props_for = m.group(1)
            if arch is not None and (props_for, arch) not in functions:
                functions[(props_for, arch)] = {"entry": 0, "registers": 0, "stack": 0, "spill_stores": 0,
                                                "spill_loads": 0}
        elif (m := FRAME.search(line)) and props_for is not None and arch is not None:
            functions[(props_for, arch)].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                                spill_loads=int(m.group(3)))
            props_for = None
        elif (m := USED.search(line)) and entry is not None:
            functions[(entry, arch)]["registers"] = int(m.group(1))
    return functions


def test_parse_reads_ptxas_output():
    text = """ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'
ptxas info    : Function properties for _Z3fooPf
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 64 registers, used 0 barriers, 8 bytes cumulative stack size
ptxas info    : Compile time = 1.0 ms
ptxas info    : Function properties for _Z3barv
    0 bytes stack frame, 6 bytes spill stores, 4 bytes spill loads
"""
    assert parse(text) == {
        ("_Z3fooPf", "sm_90"): {"entry": 1, "registers": 64, "stack": 8, "spill_stores": 4, "spill_loads": 12},
        ("_Z3barv", "sm_90"): {"entry": 0, "registers": 0, "stack": 0, "spill_stores": 6, "spill_loads": 4},
    }


def _reports() -> list[str]:
    build = os.environ.get("AMPFUSE_CPP_BUILD_DIR", "")
    return sorted(glob.glob(os.path.join(build, "CMakeFiles", "ampfuse.dir", "**", "*.cu.o.ptxas.log"), recursive=True))


@pytest.mark.skipif(not ampfuse.build_info().get("cuda"), reason="this build has no CUDA kernels")
def test_no_kernel_spills_and_every_kernel_launches():
    reports = _reports()
    if not reports:
        pytest.fail("no ptxas report (*.cu.o.ptxas.log) under AMPFUSE_CPP_BUILD_DIR: build with "
                    "AMPFUSE_BUILD_TESTS=ON (or AMPFUSE_PTXAS_REPORT=ON) and set AMPFUSE_CPP_BUILD_DIR")
    archs = {f"sm_{a}" for a in ampfuse.build_info()["cuda_architectures"].split(",")}
    problems = []
    for path in reports:
        functions = parse(open(path, encoding="utf-8").read())
        entries = {k for (k, _), r in functions.items() if r["entry"]}
        assert entries, f"{path}: no kernel in the report"
        for name in entries:
            seen = {a for (k, a), r in functions.items() if k == name and r["entry"]}
            assert seen == archs, f"{name}: reported for {sorted(seen)}, built for {sorted(archs)}"
        for (name, arch), r in sorted(functions.items()):
            where = f"{os.path.basename(path)} {arch} {name}"
            if r["entry"] and r["registers"] < 0:
                problems.append(f"{where}: no register count in the report")
            elif r["registers"] * BLOCK_SIZE > REGISTERS_PER_SM:
                problems.append(f"{where}: {r['registers']} registers x {BLOCK_SIZE} threads exceed a multiprocessor")
            allowed = next((v for pat, v in SPILLS_ALLOWED.items() if re.search(pat, name)), (0, 0, ""))
            if r["spill_stores"] > allowed[0] or r["spill_loads"] > allowed[1] or (r["stack"] and not allowed[2]):
                problems.append(f"{where}: {r['spill_stores']} B spill stores / {r['spill_loads']} B spill loads, "
                                f"{r['stack']} B stack frame ({r['registers']} registers)")
    assert not problems, "\n".join(problems)
