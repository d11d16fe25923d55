"""The native sources depend on each other in one direction: the op layer (csrc/ops) includes
nothing from the engine (csrc/engine) or the C++ front end (csrc/api), and the engine nothing
from the front end. The kernels (csrc/cpu, csrc/cuda) include no front end either."""

from __future__ import annotations

import pathlib
import re

import pytest

_CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

_FORBIDDEN = {
    "ops": ("engine/", "api/"),
    "engine": ("api/",),
    "cpu": ("engine/", "api/"),
    "cuda": ("engine/", "api/"),
}


@pytest.mark.parametrize("folder", sorted(_FORBIDDEN))
def test_a_layer_includes_nothing_from_the_layers_above_it(folder):
    sources = [p for p in (_CSRC / folder).rglob("*") if p.suffix in (".h", ".cuh", ".cpp", ".cu")]
    assert sources, folder
    found = []
    for path in sources:
        for header in _INCLUDE.findall(path.read_text()):
            if header.startswith(_FORBIDDEN[folder]):
                found.append(f"{path.relative_to(_CSRC)} includes {header}")
    assert not found, found
