"""The layer contracts in .importlinter hold, and they catch what they are there to catch."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint(src: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(src), "PATH": str(Path(sys.executable).parent)}
    lint_imports = Path(sys.executable).parent / "lint-imports"  # import-linter's command, beside this Python
    return subprocess.run([str(lint_imports), "--no-cache", str(ROOT / ".importlinter")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_the_contracts_hold():
    done = _lint(ROOT / "src")
    assert done.returncode == 0 and "0 broken" in done.stdout, done.stdout[-3000:]


@pytest.mark.parametrize("module, line, broken", [
    ("models/loading.py", "import rlora.rollout.engine", "Layers import downwards only"),  # upward
    ("train/step.py", "import rlora.train.grpo", "Nothing imports a recipe but the command line"),
    ("train/sft.py", "import rlora.train.rm", "The recipes do not import each other"),
    ("algos/advantages.py", "import rlora.algos.registry", "No import cycles between the modules of a package"),  # registry imports advantages
])
def test_a_forbidden_import_breaks_a_contract(module, line, broken, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "rlora", src / "rlora", ignore=shutil.ignore_patterns("__pycache__"))
    path = src / "rlora" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")
    done = _lint(src)
    assert done.returncode != 0, done.stdout[-3000:]
    # lint-imports prints every contract with KEPT or BROKEN: the planted import breaks this one
    assert re.search(rf"^{re.escape(broken)}.* BROKEN$", done.stdout, flags=re.M), done.stdout[-3000:]
