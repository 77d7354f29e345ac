"""The import contracts (pyproject.toml's [tool.importlinter]) hold on the tree, and they bite: a copy of
the package with one import against the layers, or one cycle between two files, is refused."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (scripts/setup.sh test)")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    # lint-imports reads the package from its working directory first, so a copy is linted as itself.
    return subprocess.run([str(LINT), "--no-logo", "--no-cache"], cwd=root, capture_output=True, text=True,
                          timeout=120)


def refused(tmp_path: Path, files: dict[str, str]) -> str:
    """Lint a copy of the package with these files added; it must fail. Its report."""
    shutil.copytree(ROOT / "tandem", tmp_path / "tandem", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for path, text in files.items():
        (tmp_path / path).write_text(text)
    result = lint(tmp_path)
    assert result.returncode != 0, result.stdout
    return result.stdout


def test_the_tree_keeps_every_contract() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().replace("0 broken", "")


def test_an_import_against_the_layers_is_refused(tmp_path: Path) -> None:
    report = refused(tmp_path, {"tandem/kv/reaches_up.py": "import tandem.cli\n"})
    assert "tandem.kv.reaches_up -> tandem.cli" in report


def test_a_cycle_between_two_files_is_refused(tmp_path: Path) -> None:
    report = refused(tmp_path, {"tandem/engine/cycle_a.py": "from tandem.engine import cycle_b\n",
                                "tandem/engine/cycle_b.py": "from tandem.engine import cycle_a\n"})
    assert "No cycles are allowed in tandem.engine" in report and "cycle_" in report


def test_the_benchmark_client_may_not_load_the_model_or_torch(tmp_path: Path) -> None:
    report = refused(tmp_path, {"tandem/bench/loads_model.py": "from tandem.model import loader\n",
                                "tandem/bench/loads_torch.py": "import torch\n"})
    assert "tandem.bench.loads_model -> tandem.model" in report
    assert "tandem.bench.loads_torch -> torch" in report
