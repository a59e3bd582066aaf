"""The project's docs (``docs/``): every ``docs/<page>.md#<anchor>`` reference in the code, tests,
benchmarks and docs names an existing page and heading, and no source cites a design note that is not
in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCE_DIRS = ("lowp_ops", "tests", "benchmarks", "examples", "scripts", "docs")
SOURCE_SUFFIXES = {".py", ".md", ".sh", ".toml"}
# docs/<page>.md, optionally followed by #<anchor> and by " and #<other anchor>"
CODE_REFERENCE = re.compile(r"docs/(\w+\.md)((?:#[\w\-]+)?)((?: and #[\w\-]+)?)")
# Markdown links inside docs/: a page, a page with an anchor, or an anchor alone
DOC_LINK = re.compile(r"\]\((\w+\.md)?(#[\w\-]+)?\)")
# The design notes kept outside the repository: TE-derived specs ("te_<topic>.md") and the torch.library
# experiments ("torch_library_<topic>.md"); any name of either family in a source is a dangling citation.
NOTE_OUTSIDE_THE_REPO = re.compile(r"\b(?:te|torch_library)_[a-z0-9_]+\.md\b")

pytestmark = pytest.mark.skipif(not DOCS.is_dir(), reason="docs/ is not part of this installation")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def page_anchors() -> dict[str, set[str]]:
    return {
        page.name: {
            github_anchor(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")
        }
        for page in DOCS.glob("*.md")
    }


def source_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in SOURCE_DIRS:
        files += [
            p for p in (ROOT / folder).rglob("*") if p.suffix in SOURCE_SUFFIXES and ".venv" not in p.parts
        ]
    return [p for p in files if p.is_file()]


def references(path: Path) -> list[tuple[str, str]]:
    """(page, anchor or "") of every docs reference in ``path``."""
    text = path.read_text(errors="replace")
    found = []
    for page, anchor, other in CODE_REFERENCE.findall(text):
        found += [(page, anchor[1:])] + ([(page, other.split("#")[1])] if other else [])
    if path.parent == DOCS:
        found += [(page or path.name, anchor[1:]) for page, anchor in DOC_LINK.findall(text)]
    return found


def test_every_docs_reference_names_an_existing_page_and_heading():
    anchors = page_anchors()
    broken = [
        f"{path.relative_to(ROOT)}: docs/{page}{'#' + anchor if anchor else ''}"
        for path in source_files()
        for page, anchor in references(path)
        if page not in anchors or (anchor and anchor not in anchors[page])
    ]
    assert not broken, "broken docs references:\n" + "\n".join(broken)


def test_no_source_cites_a_design_note_outside_the_repository():
    cited = [
        f"{path.relative_to(ROOT)}: {note}"
        for path in source_files()
        for note in NOTE_OUTSIDE_THE_REPO.findall(path.read_text(errors="replace"))
    ]
    assert not cited, "cite docs/ or a public source instead:\n" + "\n".join(cited)


def test_the_note_pattern_finds_the_outside_notes_and_spares_docs_pages():
    # Built from parts, so this file cites no outside note itself.
    names = "see te_cross_entropy_mxfp8.{0} and torch_library_compile.{0}, docs/mxfp8.md".format("md")
    assert len(NOTE_OUTSIDE_THE_REPO.findall(names)) == 2


def test_github_anchor_drops_punctuation_and_joins_words():
    assert github_anchor(" Why custom_op and not triton_op") == "why-custom_op-and-not-triton_op"
    assert github_anchor("FC1 gradient amaxes from the dGLU") == "fc1-gradient-amaxes-from-the-dglu"
    assert github_anchor("The 4x bound") == "the-4x-bound"
