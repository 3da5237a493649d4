"""The keyword contract of dcparallel's transformers attention function: every keyword the
installed transformers' models pass to the attention interface is on `HANDLED` or
`REFUSED` (dcparallel.adapters.hf_attention), and anything else is refused at run time.

The keywords are read from the source of every ``transformers/models/*/modeling_*.py``
(the AST, nothing imported but transformers' kwargs TypedDicts):

* the explicit keywords of each call of the attention interface — a name bound from
  ``ALL_ATTENTION_FUNCTIONS`` (``attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
  ...)``) or the registry subscripted and called directly;
* what reaches such a call through ``**kwargs``: the keys of the TypedDict annotating the
  ``**kwargs`` of every module class whose forward forwards them there (directly, or down
  to a child module that does: decoder layer -> attention), and every keyword a caller
  passes to such a module (``self.self_attn(..., use_cache=...)``, ``decoder_layer(...)``)
  that its forward does not name.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from dcparallel.adapters.hf_attention import HANDLED, REFUSED, hf_attention  # noqa: E402
from dcparallel.runtime.ulysses import UlyssesAttention  # noqa: E402

REGISTRY = "ALL_ATTENTION_FUNCTIONS"


def _mentions(node: ast.AST, name: str) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name)
        for n in ast.walk(node)
    )


@dataclass
class _Function:
    node: ast.FunctionDef | ast.AsyncFunctionDef
    cls: str | None
    calls: list[ast.Call] = field(default_factory=list)
    bound: set[str] = field(default_factory=set)  # names bound from the registry
    loops: dict[str, list[ast.AST]] = field(default_factory=lambda: defaultdict(list))  # loop var -> iterables

    @property
    def kwarg(self) -> str | None:
        return self.node.args.kwarg.arg if self.node.args.kwarg else None

    def splats_kwargs(self, call: ast.Call) -> bool:
        return self.kwarg is not None and any(
            k.arg is None and isinstance(k.value, ast.Name) and k.value.id == self.kwarg for k in call.keywords
        )

    def interface_calls(self) -> list[ast.Call]:
        return [
            c
            for c in self.calls
            if (isinstance(c.func, ast.Name) and c.func.id in self.bound)
            or (isinstance(c.func, (ast.Subscript, ast.Call)) and _mentions(c.func, REGISTRY))
        ]


#: nodes with nothing below them the index looks at (a name, a constant, a name's context)
_LEAVES = frozenset({ast.Name, ast.Constant, ast.Load, ast.Store, ast.Del})


class _File:
    """One modeling file, indexed in one pass: its classes, each function's calls, names
    bound from the attention registry and loops, and what each class assigns to ``self.x``.
    (A plain recursive walk over the fields: `ast.NodeVisitor`'s dispatch took half the
    scan's time.)"""

    def __init__(self, parts: list[tuple[list[ast.stmt], bool]]):
        """``parts``: the module's top-level statements, in pieces, each with whether its
        source names the registry (only then can an assignment in it bind the interface)."""
        self.classes = {c.name: c for body, _ in parts for c in body if isinstance(c, ast.ClassDef)}
        self.functions: list[_Function] = []
        self.assigned: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        for body, self._registry in parts:
            self._walk(ast.Module(body=body, type_ignores=[]), None, None)

    def _walk(self, node: ast.AST, cls: str | None, fn: _Function | None) -> None:
        """Indexes every node below ``node``; ``cls`` and ``fn``: the innermost class and
        function around it."""
        for name in node._fields:
            value = getattr(node, name, None)
            for child in value if isinstance(value, list) else (value,):
                if not isinstance(child, ast.AST):
                    continue
                kind = type(child)
                if kind in _LEAVES:
                    continue
                if kind is ast.ClassDef:
                    self._walk(child, child.name, fn)
                    continue
                if kind is ast.FunctionDef or kind is ast.AsyncFunctionDef:
                    inner = _Function(child, cls)
                    self.functions.append(inner)
                    self._walk(child, cls, inner)
                    continue
                if kind is ast.Call:
                    if fn is not None:
                        fn.calls.append(child)
                elif kind is ast.For:
                    if fn is not None and isinstance(child.target, ast.Name):
                        fn.loops[child.target.id].append(child.iter)
                elif kind is ast.Assign:
                    self._assign(child.targets, child.value, cls, fn)
                elif kind is ast.AnnAssign:
                    self._assign([child.target], child.value, cls, fn)
                self._walk(child, cls, fn)

    def _assign(self, targets: list[ast.AST], value: ast.AST | None, cls: str | None, fn: _Function | None) -> None:
        if value is not None:
            for t in targets:
                if isinstance(t, ast.Name) and fn is not None and self._registry and _mentions(value, REGISTRY):
                    fn.bound.add(t.id)
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                    and cls is not None
                ):
                    self.assigned[cls][t.attr] |= {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}

    def _bases(self, cls: str, seen=()) -> list[str]:
        """``cls`` and its base classes defined in this file, nearest first."""
        c = self.classes.get(cls)
        if c is None or cls in seen:
            return []
        out = [cls]
        for b in c.bases:
            if isinstance(b, ast.Name):
                out += self._bases(b.id, (*seen, cls))
        return out

    def forward(self, cls: str):
        for c in self._bases(cls):
            for f in self.classes[c].body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == "forward":
                    return f
        return None

    def attribute_classes(self, cls: str, attr: str) -> set[str]:
        """Classes of this file named where class ``cls`` (or a base) assigns ``self.<attr>``."""
        return {n for c in self._bases(cls) for n in self.assigned[c].get(attr, ()) if n in self.classes}

    def callees(self, f: _Function, call: ast.Call) -> set[str]:
        """Module classes a call in ``f`` may call: ``self.attr(...)``, or a loop variable over
        ``self.attr`` (``for layer in self.layers: layer(...)``)."""
        fn = call.func
        if f.cls is None:
            return set()
        if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "self":
            return self.attribute_classes(f.cls, fn.attr)
        if isinstance(fn, ast.Name):
            return {
                c
                for it in f.loops.get(fn.id, ())
                for a in ast.walk(it)
                if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id == "self"
                for c in self.attribute_classes(f.cls, a.attr)
            }
        return set()

    def typed_dict_keys(self, name: str, where: str) -> set[str]:
        """Keys of a TypedDict of this file (with its bases) or of transformers' own."""
        c = self.classes.get(name)
        if c is not None:
            keys = {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            for b in c.bases:
                if isinstance(b, ast.Name) and b.id != "TypedDict":
                    keys |= self.typed_dict_keys(b.id, where)
            return keys
        td = getattr(transformers.utils.generic, name, None) or getattr(
            transformers.modeling_flash_attention_utils, name, None
        )
        if td is None or not hasattr(td, "__optional_keys__"):
            raise AssertionError(
                f"{where}: **kwargs annotated with {name}: cannot resolve it to a TypedDict; teach "
                f"this test where it lives"
            )
        return set(td.__required_keys__) | set(td.__optional_keys__)

    def kwargs_keys(self, forward, where: str) -> set[str]:
        """Keys of ``**kwargs: Unpack[SomeKwargs]``; an untyped ``**kwargs`` (no annotation,
        ``Any``) declares none: its keys are its callers'."""
        ann = forward.args.kwarg.annotation if forward.args.kwarg else None
        if ann is None:
            return set()
        return {
            k
            for n in ast.walk(ann)
            if isinstance(n, ast.Name) and n.id.endswith("Kwargs")
            for k in self.typed_dict_keys(n.id, where)
        }


_PIECE = re.compile(r"^(?![\s)\]}#])", re.M)  # a column-0 line that can begin a statement
_HEAD = re.compile(r"(?:async\s+)?(class|def)\s+(\w+)")
_BASES = re.compile(r"(?:@.*\n)*class\s+\w+\s*\(([^:]*)\)\s*:")
_WORD = re.compile(r"[A-Za-z_]\w*")


def _pieces(src: str) -> list[tuple[str | None, str | None, str]]:
    """The top-level pieces of a module's source: (``class``/``def``/None, name, text), a
    piece starting at each column-0 line that can begin a statement, decorators with their
    definition."""
    cuts = [m.start() for m in _PIECE.finditer(src)]
    cuts = [0, *cuts] if not cuts or cuts[0] else cuts
    out, deco = [], None
    for s, e in zip(cuts, [*cuts[1:], len(src)]):
        if src.startswith("@", s):
            deco = s if deco is None else deco
            continue
        m = _HEAD.match(src, s)
        out.append((m[1], m[2], src[s if deco is None else deco : e]) if m else (None, None, src[s:e]))
        deco = None
    return out


def _needed_classes(classes: dict[str, list[str]]) -> set[str]:
    """Classes the scan can learn anything from: those naming the registry, the ``*Kwargs``
    TypedDicts, then (to a fixed point) every class whose text names a needed class (a
    caller assigning it to ``self.x``, a subclass) and the bases of every needed class."""
    mentions = {n: {w for t in ts for w in _WORD.findall(t) if w in classes and w != n} for n, ts in classes.items()}
    bases = {
        n: {w for t in ts if (m := _BASES.match(t)) for w in _WORD.findall(m[1]) if w in classes}
        for n, ts in classes.items()
    }
    need = {n for n, ts in classes.items() if n.endswith("Kwargs") or any(REGISTRY in t for t in ts)}
    while True:
        more = {n for n in classes if n not in need and mentions[n] & need}
        more |= {b for n in need for b in bases[n] if b not in need}
        if not more:
            return need
        need |= more


def parse_whole(src: str) -> list[tuple[list[ast.stmt], bool]]:
    return [(ast.parse(src).body, True)]


def parse_relevant(src: str) -> list[tuple[list[ast.stmt], bool]]:
    """The module's AST less the top-level classes and functions that cannot change the scan
    (see `_needed_classes`; a function matters only if it names the registry). Each kept
    piece is parsed on its own and must be exactly its definition, and each dropped piece
    must close its triple-quoted strings; otherwise (a column-0 line inside a string) the
    whole source is parsed."""
    pieces = _pieces(src)
    classes: dict[str, list[str]] = defaultdict(list)
    for kind, name, text in pieces:
        if kind == "class":
            classes[name].append(text)
    need = _needed_classes(classes)
    parts: list[tuple[list[ast.stmt], bool]] = []
    for kind, name, text in pieces:
        if kind is None or (kind == "class" and name in need) or (kind == "def" and REGISTRY in text):
            try:
                nodes = ast.parse(text).body
            except SyntaxError:
                return parse_whole(src)
            if kind is not None and [getattr(n, "name", None) for n in nodes] != [name]:
                return parse_whole(src)
            parts.append((nodes, REGISTRY in text))
        elif text.count('"""') % 2 or text.count("'''") % 2:
            return parse_whole(src)
    return parts


MODELS = pathlib.Path(transformers.__file__).parent / "models"


def attention_keywords(paths=None, parse=parse_relevant) -> tuple[dict[str, set[str]], int]:
    """{keyword: families passing it to the attention interface}, and how many files call it,
    over ``paths`` (every modeling file of transformers by default)."""
    found: dict[str, set[str]] = defaultdict(set)
    num_files = 0
    for path in paths or sorted(MODELS.glob("*/modeling_*.py")):
        src = path.read_text()
        if REGISTRY not in src:
            continue
        family = path.parent.name
        file = _File(parse(src))
        reaching: set[str] = set()  # classes whose forward's **kwargs reach the interface
        sub_calls = []  # (function, call, classes it may call) for calls of sub-modules
        any_call = False
        for f in file.functions:
            for call in f.interface_calls():
                any_call = True
                found.update({k.arg: found[k.arg] | {family} for k in call.keywords if k.arg is not None})
                if f.splats_kwargs(call) and f.cls is not None:
                    reaching.add(f.cls)
            for call in f.calls:
                if call.keywords and isinstance(call.func, (ast.Name, ast.Attribute)):
                    callees = file.callees(f, call)
                    if callees:
                        sub_calls.append((f, call, callees))
        num_files += any_call
        changed = True
        while changed:  # a class forwarding its **kwargs to a reaching child reaches too
            changed = False
            for f, call, callees in sub_calls:
                if f.cls not in reaching and f.splats_kwargs(call) and callees & reaching:
                    reaching.add(f.cls)
                    changed = True
        for cls in reaching:
            fwd = file.forward(cls)
            if fwd is None or fwd.args.kwarg is None:
                continue
            named = {a.arg for a in fwd.args.posonlyargs + fwd.args.args + fwd.args.kwonlyargs}
            words = file.kwargs_keys(fwd, f"{family}.{cls}")
            words |= {
                k.arg
                for _, call, callees in sub_calls
                if cls in callees
                for k in call.keywords
                if k.arg is not None and k.arg not in named
            }
            for k in words:
                found[k].add(family)
    return dict(found), num_files


@pytest.fixture(scope="module")
def scanned():
    return attention_keywords()


def test_every_attention_keyword_of_installed_transformers_is_handled_or_refused(scanned):
    found, num_files = scanned
    unlisted = {k: sorted(v)[:5] for k, v in found.items() if k not in HANDLED and k not in REFUSED}
    assert not unlisted, (
        f"transformers {transformers.__version__} passes keywords dcparallel's attention neither "
        f"handles nor refuses (keyword: some families): {unlisted}; add each to HANDLED (with an "
        f"exact implementation and a parity test) or REFUSED in dcparallel/adapters/hf_attention.py"
    )
    assert num_files > 100


@pytest.mark.parametrize(
    "families", [("llama", "gemma2", "gpt_oss", "deepseek_v3"), ("qwen2_5_vl", "sam2_video", "musicgen", "bart")]
)
def test_the_scan_of_the_needed_classes_finds_what_the_whole_files_give(families):
    """`parse_relevant` drops the classes and functions that cannot change the scan: on
    decoder-only, vision-language, video, audio and encoder-decoder files it finds the same
    keywords, families and files as parsing the whole source."""
    paths = [p for f in families for p in sorted((MODELS / f).glob("modeling_*.py"))]
    assert len(paths) >= len(families)
    assert attention_keywords(paths) == attention_keywords(paths, parse_whole)


def test_the_scan_sees_what_models_pass_at_run_time(scanned):
    """The keywords these families' attention functions receive at run time (read by a probe
    function in the interface): the scan must find them, including those forwarded through
    ``**kwargs`` from the decoder layer (``use_cache``) and the model (``position_ids``)."""
    found, _ = scanned
    expected = {
        "llama": {"dropout", "scaling", "position_ids", "use_cache"},
        "gemma2": {"dropout", "scaling", "sliding_window", "softcap", "position_ids"},
        "gpt_oss": {
            "dropout",
            "scaling",
            "sliding_window",
            "s_aux",
            "position_ids",
            "use_cache",
            "output_router_logits",
        },
        "deepseek_v3": {"dropout", "scaling", "position_ids", "use_cache"},
    }
    for family, words in expected.items():
        missing = {w for w in words if family not in found.get(w, set())}
        assert not missing, (family, missing)


def _module_with_attention(cls_name: str = "ToyAttention") -> nn.Module:
    m = type(cls_name, (nn.Module,), {})()
    m.dcparallel_attention = UlyssesAttention()
    return m


def test_unknown_and_refused_keywords_are_refused_naming_them_and_the_module():
    m = _module_with_attention()
    q, kv = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match=r"ToyAttention passes `future_bias` .* refuses it rather than ignore it"):
        hf_attention(m, q, kv, kv, None, scaling=0.3, future_bias=torch.ones(4))
    with pytest.raises(ValueError, match=r"ToyAttention passes `position_bias` .*relative-position bias"):
        hf_attention(m, q, kv, kv, None, position_bias=torch.zeros(1, 4, 6, 6))
    with pytest.raises(ValueError, match=r"ToyAttention passes `future_bias` .* refuses it rather than ignore it"):
        hf_attention(m, q, kv, kv, None, future_bias=None)  # an unknown keyword, whatever its value
    hf_attention(m, q, kv, kv, None, position_bias=None, indices=None)  # refused features, passed as off
    with pytest.raises(ValueError, match=r"`is_causal` .*bidirectional"):
        hf_attention(m, q, kv, kv, None, is_causal=False)
    m.is_causal = False
    with pytest.raises(ValueError, match=r"`is_causal` .*bidirectional"):
        hf_attention(m, q, kv, kv, None)
    m.is_causal = True
    with pytest.raises(ValueError, match=r"`output_attentions`"):
        hf_attention(m, q, kv, kv, None, output_attentions=True)
    with pytest.raises(ValueError, match=r"`cu_seq_lens_q` .*\[0, 2, 6\] differ from the micro-batch's documents"):
        hf_attention(m, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 2, 6]))
    # harmless metadata passes: the result equals the call without it
    out, _ = hf_attention(
        m,
        q,
        kv,
        kv,
        None,
        position_ids=torch.arange(6)[None],
        use_cache=False,
        cu_seq_lens_q=torch.tensor([0, 6]),
        max_length_q=6,
        is_causal=True,
    )
    assert torch.equal(out, hf_attention(m, q, kv, kv, None)[0])
