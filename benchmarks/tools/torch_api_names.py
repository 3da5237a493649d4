"""The names a torch release defines in its fast-moving namespaces, read from its source.

    pip download --no-deps torch==2.9.0 --platform macosx_11_0_arm64 --only-binary=:all: \\
        --python-version 3.11 -d /tmp/torch-floor
    unzip -q /tmp/torch-floor/torch-*.whl 'torch/*.py' 'torch/*.pyi' -d /tmp/torch-floor/src
    python benchmarks/tools/torch_api_names.py /tmp/torch-floor/src/torch 2.9.0 \\
        > tests/unit/torch_api_2.9.0.txt

Every wheel of a release carries the same Python API, so the small macOS one serves. The
source is parsed, never imported (the wheel's extension modules are not for this machine).
A module's names are what its top level binds (definitions, assignments, imports, star
imports resolved through the imported module's ``__all__`` or public names) and its
submodules; statements under a top-level ``if`` or ``try`` count (torch binds most of
``torch.distributed`` under ``if is_available():``). The output has one line per module,
``module: name name ...``, and one line ``members: ...``: every name a class body in these
namespaces binds (a method or attribute reached on an object, whose class a static reader
cannot know). tests/unit/test_torch_floor.py checks dcparallel's uses against it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

#: the namespaces whose API changes between releases; the package's uses in them are checked
NAMESPACES = ("torch.distributed", "torch.nn.attention", "torch.nn.utils", "torch._C._distributed_c10d")


def module_files(torch_root: Path) -> dict[str, Path]:
    """Module name -> its source (``.py``, or ``.pyi`` for an extension module)."""
    out: dict[str, Path] = {}
    for path in sorted(torch_root.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi"):
            continue
        parts = list(path.relative_to(torch_root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if name.startswith(NAMESPACES) and (path.suffix == ".py" or name not in out):
            out[name] = path
    return out


def _top_level(body: list[ast.stmt]):
    """The statements a module runs at import: its body and what top-level if/try hold."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])


def _source(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` in ``package`` reads (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    return ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))


class Reader:
    """Module names and class members of one torch source tree."""

    def __init__(self, torch_root: Path):
        self.files = module_files(torch_root)
        self.trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in self.files.items()}
        self._names: dict[str, set[str]] = {}

    def names(self, module: str) -> set[str]:
        if module in self._names:
            return self._names[module]
        self._names[module] = set()  # a star-import cycle resolves to what is known so far
        out: set[str] = {sub.rsplit(".", 1)[1] for sub in self.files if sub.rsplit(".", 1)[0] == module}
        package = module if self.files[module].stem == "__init__" else module.rsplit(".", 1)[0]
        for node in _top_level(self.trees[module].body):
            out |= self._bound(node, package)
        self._names[module] = out
        return out

    def _bound(self, node: ast.stmt, package: str) -> set[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return {node.name}
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        if isinstance(node, ast.Import):
            return {(a.asname or a.name.split(".")[0]) for a in node.names}
        if isinstance(node, ast.ImportFrom):
            source = _source(node, package)
            if any(a.name == "*" for a in node.names):
                return self.exported(source)
            return {a.asname or a.name for a in node.names}
        return set()

    def exported(self, module: str) -> set[str]:
        """What ``from module import *`` binds: its ``__all__`` when literal, else its public names."""
        if module not in self.files:
            return set()
        for node in _top_level(self.trees[module].body):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                try:
                    return set(ast.literal_eval(node.value))
                except ValueError:
                    break
        return {n for n in self.names(module) if not n.startswith("_")}

    def members(self) -> set[str]:
        out: set[str] = set()
        for tree in self.trees.values():
            for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
                for node in cls.body:
                    out |= self._bound(node, "") if not isinstance(node, (ast.Import, ast.ImportFrom)) else set()
        return out


def main(torch_root: str, release: str) -> None:
    reader = Reader(Path(torch_root))
    print(f"# names torch {release} defines in {', '.join(NAMESPACES)}; made by benchmarks/tools/torch_api_names.py")
    for module in sorted(reader.files):
        print(f"{module}: {' '.join(sorted(reader.names(module)))}")
    print(f"members: {' '.join(sorted(reader.members()))}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
