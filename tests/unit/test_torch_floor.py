"""dcparallel uses only what its oldest supported torch has, in the namespaces that change.

`torch_api_2.9.0.txt` lists the names torch 2.9.0 defines in torch.distributed (with fsdp,
checkpoint, tensor, device_mesh, _functional_collectives, ...), torch.nn.attention and
torch.nn.utils, made from the release's source by benchmarks/tools/torch_api_names.py. Every
name the package reaches in those namespaces (an import, an attribute of an imported module,
a method called on an object of their classes) must be in it, unless the use sits behind a
guard this test can see: a ``try`` whose handler catches ImportError or AttributeError, an
``if`` that asks ``hasattr``, or `dcparallel/runtime/compat.py`, the one home of version
fallbacks.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import re
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FLOOR = "2.9.0"
NAMESPACES = ("torch.distributed", "torch.nn.attention", "torch.nn.utils", "torch._C._distributed_c10d")
GUARD_ERRORS = {"ImportError", "ModuleNotFoundError", "AttributeError"}
COMPAT = "dcparallel/runtime/compat.py"


def floor_api() -> tuple[dict[str, set[str]], set[str]]:
    """{module: the names it defines}, and every class member, in torch ``FLOOR``."""
    modules, members = {}, set()
    for line in (HERE / f"torch_api_{FLOOR}.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        key, _, names = line.partition(": ")
        if key == "members":
            members = set(names.split())
        else:
            modules[key] = set(names.split())
    return modules, members


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try) and node in parent.body:
            caught = {
                n.id
                for h in parent.handlers
                for n in ast.walk(h.type or ast.Name("BaseException"))
                if isinstance(n, ast.Name)
            }
            if caught & GUARD_ERRORS:
                return True
        asks = {n.id for n in ast.walk(parent.test) if isinstance(n, ast.Name)} if isinstance(parent, ast.If) else ()
        if "hasattr" in asks:
            return True
        node = parent
    return False


def uses(source: str) -> tuple[set[str], set[str]]:
    """The unguarded dotted names under ``torch`` one file reaches (``torch.distributed.fsdp.
    fully_shard``), and the attribute names it reads on anything that is not a torch module."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    alias: dict[str, str] = {}
    dotted, attrs = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch" and not node.level:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                if not _guarded(node, parents):
                    dotted.add(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or _guarded(node, parents):
            continue
        chain, root = [node.attr], node.value
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if isinstance(root, ast.Name) and root.id in alias:
            dotted.add(".".join([alias[root.id], *reversed(chain)]))
        else:
            attrs.add(node.attr)
    return dotted, attrs


def missing_names(dotted: set[str], modules: dict[str, set[str]]) -> list[str]:
    """The dotted names whose first part past their longest known module the floor lacks."""
    bad = []
    for name in sorted(dotted):
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            if module in modules:
                if module.startswith(NAMESPACES) and parts[cut] not in modules[module]:
                    bad.append(name)
                break
    return bad


#: objects whose method names say nothing about a torch-distributed class (``x.clone()`` on a
#: tensor is not a `Store.clone`): their names are left out of the member check
COMMON = (torch.Tensor, torch.nn.Module, object, tuple, list, dict, str, enum.Enum, Path)


def installed_members(module_names: set[str]) -> set[str]:
    """Every method name the installed torch's classes of the namespaces define, reached from
    the modules the package imports (inherited members of other namespaces, dunders and the
    methods of `COMMON` objects left out)."""
    out = set()
    for name in module_names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for value in vars(module).values():
            if inspect.isclass(value):
                out |= {
                    k
                    for c in value.__mro__
                    if (c.__module__ or "").startswith(NAMESPACES)
                    for k, v in vars(c).items()
                    if callable(v) and not k.startswith("__")
                }
    return out - {k for c in COMMON for k in dir(c)}


def package_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "dcparallel").rglob("*.py"))}


def floor_violations(sources: dict[str, str]) -> list[str]:
    modules, floor_members = floor_api()
    all_dotted, all_attrs, bad = set(), {}, []
    for path, source in sources.items():
        if path == COMPAT:
            continue
        dotted, attrs = uses(source)
        bad += [f"{path}: {n} is not in torch {FLOOR}" for n in missing_names(dotted, modules)]
        all_dotted |= dotted
        for a in attrs:
            all_attrs.setdefault(a, path)
    imported = {d for d in all_dotted if d.startswith(NAMESPACES)}
    imported |= {d.rsplit(".", 1)[0] for d in imported}
    new_members = installed_members(imported) - floor_members
    bad += [
        f"{all_attrs[a]}: .{a} (a member of a torch class) is not in torch {FLOOR}"
        for a in sorted(set(all_attrs) & new_members)
    ]
    return bad


def test_the_package_uses_only_names_of_its_oldest_torch_or_guards_them():
    assert floor_violations(package_sources()) == []


@pytest.mark.parametrize(
    "source,expected",
    [
        ("import torch.distributed as dist\ndist.all_gather_single(a, b)\n", "torch.distributed.all_gather_single"),
        ("from torch.nn.attention.varlen import varlen_attn\n", "torch.nn.attention.varlen.varlen_attn"),
        ("import torch\ntorch.distributed.fsdp.no_such_thing(m)\n", "torch.distributed.fsdp.no_such_thing"),
    ],
)
def test_the_check_catches_a_name_newer_than_the_floor(source, expected):
    bad = floor_violations({"dcparallel/x.py": source})
    assert any(expected in b for b in bad), bad


def test_the_check_accepts_a_name_behind_a_guard_it_can_see():
    source = (
        "import torch.distributed as dist\n"
        "try:\n    from torch.nn.attention.varlen import varlen_attn\n"
        "except ImportError:\n    varlen_attn = None\n"
        "if hasattr(dist, 'all_gather_single'):\n    dist.all_gather_single(a, b)\n"
    )
    assert floor_violations({"dcparallel/x.py": source}) == []


def test_the_declared_floor_is_the_release_the_list_was_made_from():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=(\d+\.\d+)', pyproject).group(1) == FLOOR.rsplit(".", 1)[0]


def test_the_check_catches_a_method_newer_than_the_floor(monkeypatch):
    """A method of an FSDP2 module called on a loop variable: no import names it, the member
    list does (here the floor's list with that method taken out)."""
    modules, members = floor_api()
    monkeypatch.setattr(
        sys.modules[__name__], "floor_api", lambda: (modules, members - {"set_force_sum_reduction_for_comms"})
    )
    source = (
        "from torch.distributed.fsdp import FSDPModule\n"
        "for m in model.modules():\n    m.set_force_sum_reduction_for_comms(True)\n"
    )
    assert floor_violations({"dcparallel/x.py": source}) == [
        f"dcparallel/x.py: .set_force_sum_reduction_for_comms (a member of a torch class) is not in torch {FLOOR}"
    ]
