"""Functions a reader can hold: no function under ``dcparallel/`` has more than
``MAX_FUNCTION_LINES`` lines of code, and the tree is formatted and linted by ruff.

A function's lines of code are counted as the module rule counts them
(``test_architecture.code_lines``: no docstring, comment or blank line), over the whole
function, nested functions included: a factory of closures is read as one piece.
``ALLOWED`` names the functions still longer, each with the reason it stays whole; the list
only shrinks.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.unit.test_architecture import ROOT, code_lines

MAX_FUNCTION_LINES = 60

#: "module path:qualified name" -> why it stays longer than MAX_FUNCTION_LINES
ALLOWED: dict[str, str] = {}


def function_sizes(text: str) -> dict[str, int]:
    """Lines of code of every function in ``text``, by qualified name (``Class.method``,
    ``outer.<locals>.inner``)."""
    lines = text.splitlines()
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out[name] = code_lines(textwrap.dedent("\n".join(lines[first - 1 : child.end_lineno])))
                visit(child, name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(text), "")
    return out


def long_functions(root: Path = ROOT) -> dict[str, int]:
    found = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root.parent).as_posix()
        for name, n in function_sizes(p.read_text()).items():
            if n > MAX_FUNCTION_LINES:
                found[f"{rel}:{name}"] = n
    return found


def test_no_function_is_longer_than_a_reader_can_hold():
    found = long_functions()
    over = {k: n for k, n in found.items() if k not in ALLOWED}
    assert over == {}, (
        f"functions over {MAX_FUNCTION_LINES} lines of code (docstrings and comments not counted); split them: {over}"
    )


def test_the_allowlist_only_names_functions_that_are_still_long():
    stale = sorted(set(ALLOWED) - set(long_functions()))
    assert stale == [], f"these are now short enough: remove them from ALLOWED: {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_size_rule_counts_nested_code_and_skips_docstrings():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    text = (
        "class A:\n"
        "    def short(self):\n"
        '        """A docstring\n\n        of three lines."""\n'
        "        return 1\n\n\n"
        "def outer():\n" + body + "    def inner():\n        return 2\n    return inner\n"
    )
    sizes = function_sizes(text)
    assert sizes["A.short"] == 2
    assert sizes["outer.<locals>.inner"] == 2
    assert sizes["outer"] == MAX_FUNCTION_LINES + 4


RUFF = Path(sys.executable).parent / "ruff"


@pytest.mark.skipif(not RUFF.exists() and shutil.which("ruff") is None, reason="ruff is not installed")
@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_the_tree_is_linted_and_formatted(args):
    ruff = str(RUFF) if RUFF.exists() else shutil.which("ruff")
    paths = ["dcparallel", "tests", "benchmarks", "examples"]
    run = subprocess.run([ruff, *args, *paths], cwd=ROOT.parent, capture_output=True, text=True)
    assert run.returncode == 0, f"`ruff {' '.join(args)}` fails; run `make format`:\n{run.stdout}{run.stderr}"
