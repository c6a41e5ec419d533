"""The import contracts in pyproject.toml ([tool.importlinter], checked by ``lint-imports`` in ``make test``).

The contracts are read from the real pyproject.toml and run, renamed, on a small package built in tmp_path with
leanserve's layer names: clean it passes, and each planted wrong import (an upward import, an import between
independent siblings, torch in core, a cycle inside a package) is reported by name.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE = "planted"  # the temporary package's name; must not be importable from anywhere else
# lint-imports, run by this venv's Python (the console script is importlinter.cli:lint_imports_command)
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]


def _config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]


def _contract(kind: str) -> dict:
    (contract,) = [c for c in _config()["contracts"] if c["type"] == kind]
    return contract


def _layers() -> list[list[str]]:
    """The layers contract, top to bottom, each layer a list of module names relative to leanserve."""
    layers = []
    for layer in _contract("layers")["layers"]:
        names = [n.strip().strip("()") for n in layer.replace(":", "|").split("|")]
        assert all(n.startswith("leanserve.") for n in names), layer
        layers.append([n.removeprefix("leanserve.") for n in names])
    return layers


def _level(name: str) -> int:
    """0 for the top layer; lower layers have larger numbers."""
    (level,) = [i for i, layer in enumerate(_layers()) if name in layer]
    return level


def _below(low: str, high: str) -> bool:
    return _level(low) > _level(high)


def _renamed(value):
    """A contract value with leanserve's modules renamed into the temporary package."""
    if isinstance(value, str):
        return value.replace("leanserve.", f"{FAKE}.").replace("leanserve", FAKE)
    if isinstance(value, list):
        return [_renamed(v) for v in value]
    return value


def _write_config(path: Path) -> None:
    """The real [tool.importlinter] table, renamed, as TOML (only strings, booleans and lists of strings)."""
    config = _config()
    out = ["[tool.importlinter]"]
    out += [f"{k} = {json.dumps(_renamed(v))}" for k, v in config.items() if k != "contracts"]
    for contract in config["contracts"]:
        out.append("[[tool.importlinter.contracts]]")
        out += [f"{k} = {json.dumps(_renamed(v))}" for k, v in contract.items()]
    path.write_text("\n".join(out) + "\n")


def _module(tree: Path, name: str, source: str = "") -> None:
    """Write module ``name`` (dotted, below the package) as a package ``__init__.py`` holding ``source``."""
    folder = tree.joinpath(FAKE, *name.split("."))
    folder.mkdir(parents=True, exist_ok=True)
    init = folder / "__init__.py"
    init.write_text(init.read_text() + source if init.exists() else source)


def _build_tree(tmp_path: Path) -> Path:
    """A package with one module per layer entry, each importing the first module of the layer below (so the
    contract has imports to check), plus tools.eval -> tools.eval_report -> tools.eval_result."""
    (tmp_path / FAKE).mkdir()
    (tmp_path / FAKE / "__init__.py").write_text("")
    layers = _layers()
    for above, below in zip(layers, [*layers[1:], []], strict=True):
        for name in above:
            _module(tmp_path, name, f"import {FAKE}.{below[0]}\n" if below else "")
    _module(tmp_path, "tools.eval", f"from {FAKE}.tools.eval_report import format_table\n")
    _module(tmp_path, "tools.eval_report", f"from {FAKE}.tools.eval_result import ConfigResult\n")
    _module(tmp_path, "tools.eval_result")
    _write_config(tmp_path / "pyproject.toml")
    return tmp_path


def _lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*LINT, "--no-cache", "--no-logo"], cwd=tree, capture_output=True, text=True, timeout=120)


def test_every_top_level_module_has_a_layer():
    """Nothing in leanserve escapes the layers contract: each module and subpackage of leanserve is listed."""
    listed = {name for layer in _layers() for name in layer}
    package = ROOT / "leanserve"
    present = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    present |= {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert present == listed


def test_layers_order_the_packages_as_the_design_says():
    chain = ["cli", "entrypoints", "engine", "worker", "core"]
    assert all(_below(low, high) for high, low in zip(chain, chain[1:], strict=False)), " > ".join(chain)
    assert _below("entrypoints", "tools") and _below("entrypoints", "bench")
    assert _below("model", "worker") and _below("loader", "engine")
    assert _below("quantization", "model") and _below("quantization", "loader")
    assert _below("tokenizer", "loader") and _below("gguf_vocab", "tokenizer")
    assert _contract("forbidden")["source_modules"] == ["leanserve.core"]
    assert {"torch", "numpy"} <= set(_contract("forbidden")["forbidden_modules"])


def test_contracts_pass_on_a_clean_tree(tmp_path):
    result = _lint(_build_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


@pytest.mark.parametrize(
    ("importer", "source", "message"),
    [
        # an upward import: a model-loading helper reaching into the engine
        ("loader", "import {p}.engine\n", "{p}.loader is not allowed to import {p}.engine"),
        # the cycle broken by moving the GGUF vocabulary helpers below the tokenizer
        ("tokenizer", "from {p}.loader import gguf_vocab\n", "{p}.tokenizer is not allowed to import {p}.loader"),
        # the lowest layer importing the top one (the shape of entrypoints -> cli)
        ("errors", "import {p}.cli\n", "{p}.errors is not allowed to import {p}.cli"),
        # independent siblings: core must not use the model (torch)
        ("core", "import {p}.model\n", "{p}.core is not allowed to import {p}.model"),
        # the forbidden contract
        ("core.request", "import torch\n", "{p}.core is not allowed to import torch"),
        ("core.block_pool", "import numpy as np\n", "{p}.core is not allowed to import numpy"),
        # a cycle inside a package: eval_report using eval's ConfigResult while eval imports eval_report
        ("tools.eval_report", "from {p}.tools.eval import ConfigResult\n", "No cycles are allowed in {p}.tools"),
    ],
)
def test_contracts_catch_a_planted_import(tmp_path, importer, source, message):
    tree = _build_tree(tmp_path)
    _module(tree, importer, source.format(p=FAKE))
    result = _lint(tree)
    assert result.returncode != 0, result.stdout
    assert message.format(p=FAKE) in result.stdout, result.stdout


def test_importing_core_loads_no_torch_or_numpy():
    code = (
        "import sys, leanserve.core.scheduler, leanserve.core.kv_cache_manager, leanserve.core.block_pool; "
        "bad = {'torch', 'numpy'} & set(sys.modules); assert not bad, bad"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
