"""Imports inside functions are deliberate (an optional package, start-up time) and say why; the command line
and config loading start without torch."""

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = SRC / "rlora"
# linter directives are not reasons: `# noqa: F401` alone does not explain an import
DIRECTIVE = re.compile(r"noqa(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore(\[[^\]]*\])?|pragma:[^#]*",
                       re.IGNORECASE)


def _comment_lines(source: str) -> set[int]:
    """Lines holding a comment with words in it (beyond linter directives)."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and re.search(r"\w", DIRECTIVE.sub("", token.string[1:])):
            lines.add(token.start[0])
    return lines


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
                                         or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _function_imports(tree: ast.Module) -> list[list[ast.stmt]]:
    """Imports inside function bodies (not under `if TYPE_CHECKING:`), in blocks: statements that follow each
    other in one body with nothing between them."""
    blocks: list[list[ast.stmt]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list):
                continue
            previous = None
            for child in statements:
                if _is_type_checking(child):
                    previous = None
                    continue
                if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                    if previous is not None and child.lineno == previous.end_lineno + 1:
                        blocks[-1].append(child)
                    else:
                        blocks.append([child])
                    previous = child
                    continue
                previous = None
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return blocks


def unexplained_imports(path: Path, root: Path = ROOT) -> list[str]:
    """FILE:LINE import ... for each function-level import without a reason: a comment on one of its lines, or
    on a line of its own just before it or before the block of imports it opens or belongs to."""
    source = path.read_text()
    comments = _comment_lines(source)
    lines = source.splitlines()
    found = []
    for block in _function_imports(ast.parse(source, str(path))):
        before = block[0].lineno - 1
        block_reason = before in comments and lines[before - 1].lstrip().startswith("#")
        for node in block:
            if block_reason or comments & set(range(node.lineno, node.end_lineno + 1)):
                continue
            found.append(f"{path.relative_to(root)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_every_function_level_import_says_why():
    found = [entry for path in sorted(PACKAGE.rglob("*.py")) for entry in unexplained_imports(path)]
    assert not found, ("imports inside functions without a reason: move each to the top of its module, or say in a "
                       "comment on its line (or the line before) why it is deferred (an optional extra, a heavy "
                       "module on a path that starts without it):\n  " + "\n  ".join(found))


def test_the_check_finds_what_it_should(tmp_path):
    module = tmp_path / "rlora_probe.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "\n"
        "def f():\n"
        "    import json\n"                                      # 5: no reason
        "    import csv  # noqa: F401\n"                         # 6: a directive is no reason
        "    import wave  # optional extra\n"                    # 7
        "    if TYPE_CHECKING:\n"
        "        import decimal\n"
        "    # both: only when f runs\n"
        "    import math\n"
        "    from fractions import (\n"
        "        Fraction,\n"
        "    )\n"
        "    s = '# not a comment'; import array\n"              # 15: the '#' is in a string
        "    class C:\n"
        "        def g(self):\n"
        "            import heapq\n"                             # 18
        "    return lambda: 0\n"
        "\n"
        "class D:\n"
        "    import zlib\n"                                      # a class body runs at import: not deferred
    )
    found = [entry.split(":")[1] for entry in unexplained_imports(module, root=tmp_path)]
    assert found == ["5", "6", "15", "18"]


def test_the_command_line_and_config_loading_start_without_torch():
    """`rlora --help` imports neither torch nor transformers; loading and printing a config no torch."""
    code = (
        "import contextlib, io, sys\n"
        "from rlora.cli import main\n"
        "try:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'pydantic', 'matplotlib') if m in sys.modules)\n"
        "assert not heavy, f'rlora --help imported {heavy}'\n"
        "from rlora.config import load_config, to_yaml\n"
        "to_yaml(load_config(None, ['train.steps=3']))\n"
        "assert 'torch' not in sys.modules, 'loading a config imported torch'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr[-3000:]


def _lint_imports(src: Path) -> subprocess.CompletedProcess:
    """lint-imports with the repository's contracts (.importlinter) over the package in `src`."""
    linter = Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(linter), "--no-cache", "--config", str(ROOT / ".importlinter")], cwd=src,
                          capture_output=True, text=True, env=env, timeout=300)


def test_an_upward_import_or_a_recipe_import_breaks_the_contracts(tmp_path):
    """The contracts hold for the package as it is, and fail for a copy with one deliberate upward import (a
    model module importing the training layer) or a component importing a recipe."""
    assert _lint_imports(SRC).returncode == 0
    for module, line, contract in [("models/loading.py", "import rlora.train.optim", "Layers import downwards only"),
                                   ("train/update.py", "import rlora.train.grpo",
                                    "Nothing imports a recipe but the command line")]:
        copy = tmp_path / module.replace("/", "_") / "src"
        shutil.copytree(PACKAGE, copy / "rlora", ignore=shutil.ignore_patterns("__pycache__"))
        target = copy / "rlora" / module
        target.write_text(target.read_text() + f"\n{line}  # a deliberate violation\n")
        done = _lint_imports(copy)
        assert done.returncode != 0 and f"{contract} BROKEN" in done.stdout, done.stdout[-2000:]
