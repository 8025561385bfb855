"""The repository explains itself: every file it cites is in it, every section it cites exists,
every module or name it quotes exists, and nothing sends the reader to documents the repository
does not hold.

Citations are repository paths (`docs/hardware.md#moving-data`, `runtime_sim/perf/tcp_cost.py`,
`examples/mixtral.moe`, `README.md#layout`) in any source, test, grammar, lit config, IR, program
or markdown file, and relative markdown links in every markdown file (the README, `docs/`,
`benchmarks/README.md`). A `#section` must be
a heading of the cited markdown file (GitHub's anchor for it).
"""

from __future__ import annotations

import importlib
import re
import subprocess
import tomllib
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".lark", ".cfg", ".mlir", ".moe"}
SKIPPED_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", "Output"}
TOP_LEVEL = ("docs", "dialects", "passes", "runtime_sim", "tcpc", "tests", "examples", "benchmarks")

PATH_CITATION = re.compile(
    r"(?<![\w./-])((?:" + "|".join(TOP_LEVEL) + r")/[\w./-]*[\w/]|README\.md)(#[\w-]+)?"
)
"""A repository path, optionally with a section: not preceded by a path character, so a path
inside a URL or another repository's path (`furiosa-opt-examples/src/...`) is not one."""

MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")

DOTTED_REFERENCE = re.compile(r"`((?:dialects|passes|runtime_sim|tcpc)(?:\.\w+)+)")
"""A module or a name in one, quoted in backticks: `runtime_sim.semantics.tolerance.ULPS`."""

IR_ATTRIBUTES = {"tcpc.phase", "tcpc.routing_experts", "tcpc.plan", "tcpc.space", "tcpc.cluster", "tcpc.own_dma", "tcpc.expert_indices",
                 "tcpc.pair_sum"}
"""Attribute names tcpc puts on IR, spelled like dotted references but not Python names."""

PLACEHOLDERS = {"passes/<level>/my_pass.py", "tests/filecheck/<level>/my_pass/", "benchmarks/NAME.py"}
"""Paths that stand for files the reader writes (the "Adding a pass" recipe of docs/passes.md) or for any
file of a kind (`benchmarks/NAME.py`)."""

OUTSIDE_DOCUMENTS = [  # first letters bracketed, so grepping the repo for them finds no pattern
    re.compile(r"\b[D]ESIGN\s*(?:sections?\b|§)"),
    re.compile(r"(?<![\w./-])[n]otes/[\w-]+\.md"),
    re.compile(r"\bTCP\sMoE\sdesign\b"),
    re.compile(r"\bMoE\sdocument\b"),
    re.compile(r"\bshared\snotes\b"),
]
"""Citations of the design document and notes tcpc started from, which live outside the repo."""


def repo_files() -> list[Path]:
    """The repository's own files: git's (tracked, and untracked but not ignored, so a virtual
    environment inside the checkout, like CI's .ci-venv, is not read); every file outside git."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return sorted(REPO.rglob("*"))
    return sorted(REPO / name for name in listed)


def text_files() -> Iterator[Path]:
    for path in repo_files():
        parts = path.relative_to(REPO).parts
        if any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name == "lit.cfg"):
            yield path


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(markdown: Path) -> frozenset[str]:
    """Every heading anchor of a markdown file (outside code fences), duplicates numbered."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in markdown.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if match:
            base = github_anchor(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def broken(target: Path, section: str | None) -> str | None:
    """Why a citation of `target` (and its `#section`) does not resolve, or None."""
    if not target.exists():
        return "no such file"
    if section and target.suffix == ".md" and section not in anchors(target):
        return f"no section #{section} in {target.relative_to(REPO)}"
    return None


def cited_paths(path: Path) -> Iterator[tuple[int, str, Path, str | None]]:
    """(line, citation, resolved target, section) for every citation in one file."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for match in PATH_CITATION.finditer(line):
            cited, section = match.group(1), match.group(2)
            if cited in PLACEHOLDERS:
                continue
            yield number, match.group(0), REPO / cited, section[1:] if section else None
        if path.suffix != ".md":
            continue
        for match in MARKDOWN_LINK.finditer(line):
            link = match.group(1)
            if re.match(r"[a-z]+:", link):
                continue  # a URL
            file_part, _, section = link.partition("#")
            target = (path.parent / file_part).resolve() if file_part else path
            yield number, link, target, section or None


def test_citations_resolve() -> None:
    problems = []
    for path in text_files():
        for number, citation, target, section in cited_paths(path):
            why = broken(target, section)
            if why:
                problems.append(f"{path.relative_to(REPO)}:{number}: {citation}: {why}")
    assert not problems, "citations that do not resolve:\n" + "\n".join(problems)


def resolves(dotted: str) -> bool:
    """Whether `a.b.c` names a module of the repository or a name defined in one."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def test_dotted_references_resolve() -> None:
    problems = []
    for path in text_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in DOTTED_REFERENCE.finditer(line):
                dotted = match.group(1)
                if dotted not in IR_ATTRIBUTES and not resolves(dotted):
                    problems.append(f"{path.relative_to(REPO)}:{number}: {dotted}")
    assert not problems, "references to modules or names that do not exist:\n" + "\n".join(problems)


def test_nothing_cites_documents_outside_the_repository() -> None:
    problems = []
    for path in text_files():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in OUTSIDE_DOCUMENTS:
                for match in pattern.finditer(line):
                    problems.append(f"{path.relative_to(REPO)}:{number}: {match.group(0)!r}")
    assert not problems, (
        "citations of documents the repository does not hold (cite docs/ instead):\n"
        + "\n".join(problems)
    )


def test_every_machine_source_names_its_docs_section() -> None:
    """Each sourced number of the default machine names the docs/hardware.md section that
    holds the fact (test_citations_resolve checks that the section exists)."""
    machine = tomllib.loads((REPO / "target/machines/rngd.toml").read_text())
    sources = {
        f"{section}.{key}": entry["source"]
        for section, table in machine.items() if isinstance(table, dict)
        for key, entry in table.items() if isinstance(entry, dict) and "source" in entry
    }
    assert len(sources) >= 10
    missing = [key for key, source in sources.items() if "docs/hardware.md#" not in source]
    assert not missing, f"machine numbers whose source names no docs/hardware.md section: {missing}"


@pytest.mark.parametrize("text, cited", [
    ("see docs/hardware.md#moving-data.", ("docs/hardware.md", "#moving-data")),
    ("(runtime_sim/perf/tcp_cost.py)", ("runtime_sim/perf/tcp_cost.py", None)),
    ("`README.md#layout`", ("README.md", "#layout")),
    ("furiosa-opt-examples/src/pe_count.rs", None),
    ("https://github.com/furiosa-ai/furiosa-opt/blob/x/docs/src/intro.md", None),
])
def test_path_citation_pattern(text: str, cited: tuple[str, str | None] | None) -> None:
    match = PATH_CITATION.search(text)
    assert (match and (match.group(1), match.group(2))) == (cited or None)


def test_a_missing_file_and_a_missing_section_are_reported() -> None:
    assert broken(REPO / "docs" / "no_such_file.md", None) == "no such file"
    assert broken(REPO / "docs/hardware.md", "no-such-section") is not None
    assert broken(REPO / "docs/hardware.md", "moving-data") is None
    assert github_anchor("PEs, clusters and slices") == "pes-clusters-and-slices"
    assert github_anchor("Not public: the assumptions") == "not-public-the-assumptions"
    assert resolves("runtime_sim.semantics.tolerance.ULPS")
    assert not resolves("passes.lowering.lower_math.NO_SUCH_NAME")
