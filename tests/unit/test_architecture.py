"""The package rules of docs/architecture.md, checked on the source tree.

Every `import` of a dcparallel module is an edge, also those inside functions and those
under ``if TYPE_CHECKING:`` (an annotation that names another module's class couples the two
as much as a call does). Each
package may import only the packages its row allows; the pure core (spec, topology,
scenarios, cost, plan, sim, report) never imports torch; no module imports the front-ends
(`apps/`) except the console entry; the research planners (`plan/research/`) are imported
only by themselves and the registry that names research policies (`RESEARCH_IMPORTERS`);
and the modules form no import cycle.
"""

from __future__ import annotations

import ast
import functools
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "dcparallel"

CORE = {"spec", "vision_spec", "topology", "mixes", "scenarios", "cost", "plan", "sim", "report"}
#: package -> the packages it may import (its own always)
ALLOWED: dict[str, set[str]] = {
    "spec": {"vision_spec"},
    "vision_spec": set(),
    "topology": {"spec"},
    "mixes": {"spec"},
    "scenarios": {"spec", "vision_spec", "mixes"},
    "cost": {"spec", "topology"},
    "plan": {"spec", "topology", "cost"},
    "sim": {"spec", "topology", "cost", "plan", "scenarios"},
    "report": {"spec", "topology", "cost", "plan", "sim", "scenarios"},
    "models": set(),
    "loss": set(),
    "data": CORE | {"loss", "runtime.comm"},
    "adapters": CORE | {"models", "loss", "data", "runtime"},
    "runtime": CORE | {"models", "loss", "data", "adapters"},
    "profile": CORE | {"models", "loss", "data", "adapters", "runtime"},
    "checkpoint": CORE | {"runtime"},
    "api": CORE | {"models", "loss", "data", "adapters", "runtime", "profile", "checkpoint"},
    "apps": CORE | {"models", "loss", "data", "adapters", "runtime", "profile", "checkpoint", "api", "__init__"},
    "integrations": CORE | {"loss", "data", "adapters", "runtime", "api"},
    "__init__": {"api", "data", "adapters", "models", "runtime", "plan", "spec", "topology"},
    "__main__": {"apps"},
}
#: the ablations' and reproductions' planners: they may import the rest of `plan/`; of the
#: package only they and the registry naming research policies import them (one way)
RESEARCH = "dcparallel.plan.research"
RESEARCH_IMPORTERS = {"dcparallel.plan.policies"}


def module_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts
    return ".".join(parts)


def package_of(module: str) -> str:
    """``dcparallel.plan.bucket`` -> ``plan``; ``dcparallel.api`` -> ``api``; the package's
    own ``__init__`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@functools.cache
def parsed(source: str) -> ast.Module:
    """``ast.parse(source)``, once per source text in this process: the rule tests check the
    tree as it is, then again with one module's source replaced per planted import, so every
    other module's tree is reused (nothing modifies a tree)."""
    return ast.parse(source)


@functools.cache
def import_statements(source: str) -> tuple[tuple[int | None, str, tuple[str, ...]], ...]:
    """(level, module, names) of every import statement of ``source``, anywhere in the file,
    once per source text: ``import a, b`` is (None, "", ("a", "b")), ``from .m import x`` is
    (1, "m", ("x",)). The rule tests check many trees that differ from the real one in one
    module; the walk of every other module is reused."""
    out = []
    for node in ast.walk(parsed(source)):
        if isinstance(node, ast.Import):
            out.append((None, "", tuple(a.name for a in node.names)))
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or "", tuple(a.name for a in node.names)))
    return tuple(out)


def imports(source: str, module: str, known: set[str]) -> set[str]:
    """The dcparallel modules ``source`` (of ``module``) imports, anywhere in the file.
    ``from pkg import name`` counts as importing ``pkg.name`` when that is a module."""
    out = set()
    package = module if module in known and any(k.startswith(module + ".") for k in known) else module.rsplit(".", 1)[0]
    for level, base, names in import_statements(source):
        if level is None:
            out |= {n for n in names if n.split(".")[0] == "dcparallel"}
            continue
        if level:
            up = package.split(".")[: len(package.split(".")) - level + 1]
            base = ".".join(up + ([base] if base else []))
        if base.split(".")[0] != "dcparallel":
            continue
        for a in names:
            out.add(f"{base}.{a}" if f"{base}.{a}" in known else base)
    return out


def violations(sources: dict[str, str]) -> list[str]:
    """Every broken rule of a tree given as {module name: source}."""
    known = set(sources)
    graph = {m: imports(src, m, known) for m, src in sources.items()}
    bad = []
    for m, deps in sorted(graph.items()):
        pkg = package_of(m)
        allowed = ALLOWED.get(pkg)
        if allowed is None:
            bad.append(f"{m}: package {pkg!r} has no row in the rules (docs/architecture.md)")
            continue
        for d in sorted(deps):
            dpkg = package_of(d)
            ok = (
                dpkg == pkg
                or dpkg in allowed
                or any(d == f"dcparallel.{a}" or d.startswith(f"dcparallel.{a}.") for a in allowed if "." in a)
            )
            if not ok:
                bad.append(f"{m} imports {d}: {pkg} may import only {sorted(allowed) or 'nothing else'}")
        if not _is_research(m) and m not in RESEARCH_IMPORTERS:
            bad += [
                f"{m} imports {d}: only plan/research itself and {', '.join(sorted(RESEARCH_IMPORTERS))} import "
                f"the research planners; reach a research policy by name (plan.policies.make_planner)"
                for d in sorted(deps)
                if _is_research(d)
            ]
        if pkg in CORE:
            stmts = import_statements(sources[m])
            names = [n for level, _, names in stmts if level is None for n in names]
            names += [base for level, base, _ in stmts if level is not None]
            if any(x == "torch" or x.startswith("torch.") for x in names):
                bad.append(f"{m} imports torch: the pure core ({', '.join(sorted(CORE))}) stays torch-free")
    bad += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return bad


def _is_research(module: str) -> bool:
    return module == RESEARCH or module.startswith(RESEARCH + ".")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def read_sources(root: Path) -> dict[str, str]:
    """{module name: source} of every module of the package at ``root``."""
    return {module_name(p, root): p.read_text() for p in sorted(root.rglob("*.py"))}


@functools.cache
def _read_tree() -> tuple[tuple[str, str], ...]:
    return tuple(read_sources(ROOT).items())


def tree_sources() -> dict[str, str]:
    return dict(_read_tree())


def test_the_source_tree_follows_the_package_rules():
    assert violations(tree_sources()) == []


@pytest.mark.parametrize(
    "module,source,expected",
    [
        # the planning core reaching for the simulator (plan/bucket.py tuned with sim.replay)
        (
            "dcparallel.plan.bucket",
            "def tune():\n    from dcparallel.sim.replay import simulate\n",
            "dcparallel.plan.bucket imports dcparallel.sim.replay",
        ),
        ("dcparallel.cost.base", "import torch\n", "dcparallel.cost.base imports torch"),
        ("dcparallel.models.llama", "from dcparallel.runtime import comm\n", "dcparallel.models.llama imports"),
        (
            "dcparallel.data.loader",
            "from dcparallel.apps import cli\n",
            "dcparallel.data.loader imports dcparallel.apps",
        ),
        # a production planner reaching for a reproduction (research is one-way)
        (
            "dcparallel.plan.dcp.portfolio",
            "from dcparallel.plan.research.flexsp import FlexSPPlanner\n",
            "dcparallel.plan.dcp.portfolio imports dcparallel.plan.research.flexsp: only plan/research",
        ),
        (
            "dcparallel.sim.run",
            "def f():\n    from dcparallel.plan.research import peers\n",
            "dcparallel.sim.run imports dcparallel.plan.research.peers: only plan/research",
        ),
        ("dcparallel.api", "import dcparallel.plan.research\n", "dcparallel.api imports dcparallel.plan.research:"),
    ],
)
def test_the_rules_catch_a_forbidden_import(module, source, expected):
    sources = tree_sources()
    sources[module] = source
    assert any(v.startswith(expected) for v in violations(sources)), violations(sources)


def test_the_rules_catch_an_import_cycle_between_front_ends():
    """The circle `cli -> demo -> cli` (the demo importing the CLI's paper-scale helper)."""
    sources = tree_sources()
    sources["dcparallel.apps.x_cli"] = "from dcparallel.apps import x_demo\n"
    sources["dcparallel.apps.x_demo"] = "def f():\n    from dcparallel.apps.x_cli import paper_scale\n"
    found = [v for v in violations(sources) if v.startswith("import cycle") and "x_cli" in v]
    assert found == ["import cycle: dcparallel.apps.x_cli -> dcparallel.apps.x_demo -> dcparallel.apps.x_cli"]


def test_the_rules_catch_a_cycle_through_an_annotation_import(tmp_path):
    """A helper module that imports its planner class only to annotate ``p: Planner`` (under
    TYPE_CHECKING), imported by that planner: a circle, in a package built on disk."""
    plan = tmp_path / "dcparallel" / "plan"
    plan.mkdir(parents=True)
    (tmp_path / "dcparallel" / "__init__.py").write_text('"""the package"""\n')
    (plan / "__init__.py").write_text("")
    (plan / "planner.py").write_text("from dcparallel.plan.search import search\n\n\nclass Planner:\n    pass\n")
    (plan / "search.py").write_text(
        "from __future__ import annotations\n\nimport typing\n\nif typing.TYPE_CHECKING:\n"
        "    from dcparallel.plan.planner import Planner\n\n\ndef search(p: Planner) -> None:\n    pass\n"
    )
    assert violations(read_sources(tmp_path / "dcparallel")) == [
        "import cycle: dcparallel.plan.planner -> dcparallel.plan.search -> dcparallel.plan.planner"
    ]


#: the most lines of code a module may hold (formatted by ``ruff format``); docstrings,
#: comments and blank lines are not counted, so that explaining a module never pushes it
#: over. The unit a reader must hold is the function (tests/unit/test_function_size.py);
#: this is a backstop against a module that owns too much
MAX_CODE_LINES = 450


def code_lines(text: str) -> int:
    """The lines of ``text`` that hold code: not blank, not only a comment, not part of a
    module, class or function docstring."""
    doc: set[int] = set()
    for node in ast.walk(parsed(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                doc.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in doc)
    return len(code)


def test_code_lines_count_neither_docstrings_nor_comments():
    text = (
        '"""A module.\n\nIts docstring."""\n\nimport os  # a comment\n\n# a comment line\n'
        'def f(x):\n    """f\'s docstring,\n    two lines."""\n    s = """a string\n    that is data"""\n'
        "    return (x,\n            s)\n"
    )
    assert code_lines(text) == 6  # import, def, the two-line string, the two-line return


def test_every_module_is_short_and_says_what_it_owns():
    for p in sorted(ROOT.rglob("*.py")):
        text = p.read_text()
        if not text.strip():
            continue  # an empty package marker
        n = code_lines(text)
        assert n <= MAX_CODE_LINES, (
            f"{p.relative_to(ROOT.parent)} has {n} lines of code; split it "
            f"({MAX_CODE_LINES} at most, docstrings and comments not counted)"
        )
        doc = ast.get_docstring(parsed(text))
        assert doc and doc.strip(), f"{p.relative_to(ROOT.parent)} has no docstring saying what it owns"


def test_examples_import_nothing_from_the_front_ends():
    for p in sorted((ROOT.parent / "examples").glob("*.py")):
        mods = imports(p.read_text(), "examples." + p.stem, set(tree_sources()))
        assert not [m for m in mods if package_of(m) in ("apps", "demo", "cli", "train")], (p.name, mods)


#: the private names of torch, diffusers, transformers and the standard library a module may
#: read (module -> name -> why); the package's own objects are read through public names only
PRIVATE_ALLOWED: dict[str, dict[str, str]] = {
    "dcparallel.adapters.wan_variants": {
        "_cp_plan": "diffusers' context-parallel plan of a Wan class: the attention entries a look-alike keeps",
    },
    "dcparallel.apps.presets": {
        "_from_config": "transformers' constructor from a config that takes attn_implementation",
    },
    "dcparallel.apps.train_checkpoint": {
        "_from_config": "transformers' constructor from a config: the export's copy on the meta device",
    },
    "dcparallel.apps.train_lora": {
        "_from_config": "transformers' constructor from a config: the merged export's copy",
    },
    "dcparallel.integrations.hf_trainer": {
        "_init_training_state": "the transformers Trainer method the subclass extends (a resume inside an epoch)",
    },
    "dcparallel.loss": {
        "_log_softmax_backward_data": "torch's aten op of the log-softmax backward, run a chunk of rows at a time",
    },
    "dcparallel.profile.measure": {
        "_forward_pre_hooks": "an FSDP block's hooks, set aside while the block is skipped and put back",
        "_forward_hooks": "the same, after the forward",
        "_base": "a saved tensor's base: views of parameters are not counted as activations",
    },
    "dcparallel.runtime.compat": {
        "_scaled_dot_product_efficient_attention": "torch's fused attention kernel returning its log-sum-exp",
        "_scaled_dot_product_efficient_attention_backward": "its backward",
    },
    "dcparallel.runtime.launch": {
        "_exit": "os._exit: a rank ends without the interpreter's exit handlers (which can hang on a dead peer)",
        "_Environ": "the type of os.environ, in an annotation",
    },
    "dcparallel.runtime.meta_init": {
        "_apply": "nn.Module's walk that replaces every tensor (meta -> the device)",
        "_non_persistent_buffers_set": "nn.Module's names of the buffers no state dict holds",
        "_parameters": "nn.Module's parameter table: tied parameters tied again after the walk",
    },
    "dcparallel.runtime.sharded_checkpoint": {
        "_init_from_local_shards_and_global_metadata": "torch's ShardedTensor from local shards and given "
        "metadata, without a collective",
    },
    "dcparallel.sim.plan_worker": {
        "_exit": "os._exit: the planning process ends without the interpreter's exit handlers",
    },
}


def private_attrs(source: str) -> list[tuple[int, str, str]]:
    """(line, name, expression) of every ``x._name`` in ``source`` (dunder names aside) where
    ``x`` is not the ``self`` or ``cls`` of an enclosing method (its first parameter; a local
    variable named ``cls`` is any other object): a read or write of another object's private
    state."""
    out = []

    def visit(node: ast.AST, own: frozenset[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = (node.args.posonlyargs + node.args.args)[:1]
            own = own | {a.arg for a in first if a.arg in ("self", "cls")}
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in own):
                out.append((node.lineno, node.attr, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    visit(parsed(source), frozenset())
    return out


def private_reads(source: str, allowed: dict[str, str] | None = None) -> list[str]:
    """`private_attrs` of ``source`` whose name is not in ``allowed``, as ``line N: expr``."""
    return [f"line {n}: {expr}" for n, attr, expr in private_attrs(source) if attr not in (allowed or {})]


def test_no_module_reads_another_objects_private_state():
    """A class's state stays inside it: other modules get what they need through public
    attributes and methods (the optimizers' `owned`, the planners' `LayoutTable`); only the
    third-party internals of `PRIVATE_ALLOWED` are read, each where it is listed."""
    sources = tree_sources()
    bad = {m: private_reads(src, PRIVATE_ALLOWED.get(m)) for m, src in sources.items()}
    assert {m: v for m, v in bad.items() if v} == {}
    for m, names in PRIVATE_ALLOWED.items():  # no stale entry
        assert set(names) <= {attr for _, attr, _ in private_attrs(sources[m])}, (m, names)


def test_the_private_state_rule_catches_a_read_anywhere_in_the_package():
    sources = tree_sources()
    module = "dcparallel.runtime.sharded_checkpoint"
    planted = sources[module] + "\n\ndef first_owned(opt):\n    return opt._lo\n"
    assert private_reads(planted, PRIVATE_ALLOWED[module]) == [f"line {planted.count(chr(10))}: opt._lo"]
    # ``cls`` is a method's own class only where it is the method's first parameter
    assert private_reads("def f(model):\n    cls = type(model)\n    return cls._x\n") == ["line 3: cls._x"]
    assert private_reads("class A:\n    @classmethod\n    def f(cls):\n        return lambda: cls._x\n") == []
    # a name allowed in one module is not allowed in another
    assert private_reads("import os\nos._exit(0)\n", PRIVATE_ALLOWED.get("dcparallel.checkpoint")) == [
        "line 2: os._exit"
    ]


def test_the_private_state_rule_catches_a_helper_reading_a_planners_fields():
    sources = tree_sources()
    planted = sources["dcparallel.plan.dcp.search"] + "\n\ndef rows_of(p):\n    return p._rows\n"
    assert private_reads(planted) == [f"line {planted.count(chr(10))}: p._rows"]
    assert private_reads("class A:\n    def f(self):\n        return self._x, type(self).__name__\n") == []
