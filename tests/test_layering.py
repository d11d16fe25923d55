"""The native sources depend on each other in one direction: the op layer (csrc/ops) includes
nothing from the engine (csrc/engine) or the C++ front end (csrc/api), and the engine nothing
from the front end. The kernels (csrc/cpu, csrc/cuda) include no front end either. The Python
modules reach each other through public names only: the optimizer, the scaler and the
accumulator hand off through documented methods (FusedOptimizer.scaler_check, SourcedGrads,
ScalerHandOff), not each other's private state."""

from __future__ import annotations

import ast
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


_PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "python" / "ampfuse"


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in _PACKAGE.rglob("*.py") if "lib" not in p.relative_to(_PACKAGE).parts)


def _is_module(name: str) -> bool:
    return (_PACKAGE.parent / pathlib.Path(*name.split("."))).with_suffix(".py").exists() or (
        _PACKAGE.parent / pathlib.Path(*name.split(".")) / "__init__.py").exists()


def test_no_module_imports_another_modules_private_names():
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ampfuse":
                for alias in node.names:
                    private = alias.name.startswith("_") and not alias.name.startswith("__")
                    if private and not _is_module(f"{node.module}.{alias.name}"):
                        found.append(f"{path.relative_to(_PACKAGE)}: from {node.module} import {alias.name}")
    assert not found, found


# The private state of the scaler and the optimizer that other modules once reached into.
_HANDED_OFF = {"_per_optimizer_states", "_scale", "_check_for_step", "_live_native", "_native", "_plans"}


@pytest.mark.parametrize("module", ["accumulation.py", "integrations"])
def test_the_accumulator_and_the_integrations_use_the_scalers_and_optimizers_public_methods(module):
    paths = [_PACKAGE / module] if module.endswith(".py") else sorted((_PACKAGE / module).glob("*.py"))
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in _HANDED_OFF
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                found.append(f"{path.relative_to(_PACKAGE)}:{node.lineno}: .{node.attr}")
    assert not found, found
