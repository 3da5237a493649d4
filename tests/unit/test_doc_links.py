"""The docs' cross-references resolve: every relative Markdown link in README.md, docs/ and
benchmarks/README.md names a file that exists (and, for a ``#anchor`` into a Markdown file, one
of its headings), and every section a doc, a docstring or a test cites by name
(``docs/design.md, "Sharded blocks"``) is still written in that doc."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINKED = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CITING += sorted(p for d in ("dcparallel", "tests") for p in (ROOT / d).rglob("*.py") if p.name != Path(__file__).name)

#: a doc named, then (after its link's closing parenthesis and a comma) a quoted section name
CITATION = re.compile(r"\b(\w+)\.md\)?,\s+\"([^\"]{3,120})\"")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def broken_links(path: Path, text: str) -> list[str]:
    """The links of ``text``, written in the file ``path``, that lead nowhere."""
    bad = []
    for target in links(text):
        name, _, anchor = target.partition("#")
        file = (path.parent / name).resolve() if name else path
        if not file.exists():
            bad.append(f"{path.name}: {target} (no such file)")
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)
            if anchor not in {github_anchor(h) for h in headings}:
                bad.append(f"{path.name}: {target} (no such heading)")
    return bad


def broken_citations(text: str) -> list[str]:
    """The sections ``text`` cites by name that their doc under docs/ does not hold."""
    bad = []
    for doc, section in CITATION.findall(text):
        target = ROOT / "docs" / f"{doc}.md"
        if not target.exists():
            continue  # a report or another project's file: not cited by section here
        words = " ".join(re.sub(r"\s*#\s*", " ", section).split())  # a citation wrapped in a comment
        if words not in " ".join(target.read_text().split()):
            bad.append(f"docs/{doc}.md, {words!r} (no such section)")
    return bad


def test_every_relative_link_resolves():
    bad = [f"{p.relative_to(ROOT)}: {b}" for p in LINKED for b in broken_links(p, p.read_text())]
    assert not bad, "\n".join(bad)


def test_every_cited_section_is_in_its_doc():
    found = [c for path in CITING for c in CITATION.findall(path.read_text())]
    assert len(found) >= 10  # the pattern still finds the citations the tree makes
    bad = [f"{p.relative_to(ROOT)}: {b}" for p in CITING for b in broken_citations(p.read_text())]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "text, broken",
    [
        ("see [the design](design.md#sharded-blocks) and [a report](../benchmarks/README.md).", 0),
        ("see [the design](design.md#no-such-heading).", 1),
        ("see [a report](../benchmarks/no_such_report.md) and [x](training.md#nowhere).", 2),
    ],
)
def test_a_broken_link_is_found(text, broken):
    assert len(broken_links(ROOT / "docs" / "probe.md", text)) == broken


def test_a_renamed_section_is_found():
    text = '"""Kept (docs/design.md, "Sharded blocks"); gone ([design.md](design.md), "No such part")."""'
    bad = broken_citations(text)
    assert len(bad) == 1 and "No such part" in bad[0]
