"""`tcpc run --html PAGE` (tcpc/html_page.py): one self-contained page of a run. Its structure,
read back with html.parser, agrees with what the same run writes elsewhere: every source line
with the figures of --report-json's `lines` (the critical path summing to the total), the IR of
each step as --dump-ir writes it, a rect per event of --trace; a run of more slices than the
page draws is drawn in intervals by its stated rule; a mesh run shows its slowest chip; and a
real browser (Debian's Chromium, when installed) opens it without an error. The page's text is
pinned by the golden file tests/filecheck/pipeline/html.moe."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tcpc.html_page import TIMELINE_RECTS, timeline
from tcpc.pipelines import FULL_PIPELINE, pipeline_spec
from support import failure, tcpc_main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TOY = EXAMPLES / "toy.moe"
FIXED = pipeline_spec(FULL_PIPELINE, topk_strategy="rank", expert_order="block")
"""The full pipeline with its autos given: the test is the page, not the choices."""
SECTIONS = ["run", "source", "passes", "report", "timeline"]
VOID = {"meta", "br", "hr", "img", "input", "link", "area", "base", "col", "embed", "source", "track", "wbr"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def all(self, tag: str | None = None, **attrs: str) -> list[Node]:
        """Every node below this one (itself included) of `tag` whose attributes hold `attrs`'
        values (`class_` matches one of the classes)."""
        found = []
        stack = [self]
        while stack:
            node = stack.pop()
            stack.extend(reversed(node.children))
            if tag is not None and node.tag != tag:
                continue
            if all(v in node.attrs.get(k.rstrip("_"), "").split() if k == "class_" else node.attrs.get(k) == v
                   for k, v in attrs.items()):
                found.append(node)
        return found

    def one(self, tag: str | None = None, **attrs: str) -> Node:
        found = self.all(tag, **attrs)
        assert len(found) == 1, (tag, attrs, len(found))
        return found[0]

    @property
    def content(self) -> str:
        """All the text inside, in document order."""
        return "".join(self.text_parts())

    def text_parts(self) -> list[str]:
        parts = list(self.text)
        for child in self.children:
            parts += child.text_parts()
        return parts


class TreeBuilder(HTMLParser):
    """A document as a tree of Nodes (text kept in order only within leaf-level runs, which is
    all these tests read: a cell's, a <pre>'s, a <title>'s)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].text.append(data)


def parse(text: str) -> Node:
    builder = TreeBuilder()
    builder.feed(text)
    builder.close()
    return builder.root


def cell(row: Node, kind: str) -> int:
    return int(row.one("td", class_=kind).content.replace(",", "") or 0)


def check_self_contained(page: Node) -> None:
    """Nothing the page would fetch: no src, no link to anything but its own sections, no URL."""
    for node in page.all():
        assert "src" not in node.attrs and node.tag not in ("link", "iframe", "object", "embed", "img"), node.tag
        assert node.attrs.get("href", "#").startswith("#"), node.attrs
        assert not any("://" in v for v in node.attrs.values()), node.attrs


def test_the_page_agrees_with_the_report_the_dump_and_the_trace(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The toy, cost-only: the sections in order; every line of the program, the costed ones
    with --report-json's figures, the critical path summing to the total; each step's IR as
    --dump-ir writes it, unchanged steps marked and without a copy; the report's tables but
    the line table (the source is that one); one rect per --trace slice, its tooltip the op."""
    page, report, trace, dump = (tmp_path / n for n in ("p.html", "r.json", "t.json", "dump"))
    code, out, err = tcpc_main(capsys, "run", TOY, "--cost-only", "-p", FIXED, "--html", page, "--report-json", report,
                               "--trace", trace, "--dump-ir", dump)
    assert code == 0, err
    assert f"wrote {page}\n" in out
    doc = parse(page.read_text())
    data = json.loads(report.read_text())
    total = data["total_cycles"]
    check_self_contained(doc)
    assert [s.attrs["id"] for s in doc.all("section")] == SECTIONS
    assert doc.one("html").attrs["data-status"] == "static"  # the script sets it when it runs

    facts = {row.one("th").content: row.one("td").content for row in doc.one("section", id="run").all("tr")}
    assert facts["cycles"].startswith(f"{total:,} = ") and facts["machine"] == data["machine"]
    assert facts["routing %routing"].startswith("balanced") and "not computed (cost-only)" in facts["out0"]

    source = doc.one("section", id="source")
    rows = source.all("tr", class_="line")
    assert [r.one("td", class_="code").content for r in rows] == TOY.read_text().splitlines()
    assert [r.one("td", class_="n").content for r in rows] == [str(n) for n in range(1, len(rows) + 1)]
    costed = {int(r.one("td", class_="n").content): r for r in rows if "costed" in r.attrs["class"].split()}
    lines = {line["line"]: line for line in data["lines"]}
    assert set(costed) == set(lines)
    for n, row in costed.items():
        assert [cell(row, k) for k in ("commands", "busy", "critical", "bytes", "flops")] == \
            [lines[n][k] for k in ("commands", "busy_cycles", "critical_cycles", "bytes", "flops")]
    assert sum(cell(r, "critical") for r in source.all("tr", class_="costed")) == total
    assert source.one("tr", class_="total").all("td")[2].content == f"{total:,}"

    steps = doc.one("section", id="passes").all(class_="step")
    files = sorted(dump.iterdir())
    assert [s.one(class_="pass").content for s in steps] == ["input", "pin-routing", *FULL_PIPELINE]
    assert [f.name for f in files] == [f"{int(s.attrs['id'].split('-')[1]):02d}-{s.one(class_='pass').content}.mlir"
                                       for s in steps]
    previous = ""
    for step, file in zip(steps, files):
        text = file.read_text()
        if "unchanged" in step.attrs["class"].split():
            assert text == previous and not step.all("pre"), file.name
        else:
            assert step.tag == "details" and step.one("pre").content == text != previous, file.name
        previous = text
    assert "unchanged" in steps[FULL_PIPELINE.index("schedule-shared") + 2].attrs["class"]  # the toy has no shared expert

    tables = doc.one("section", id="report").one("pre").content
    assert "phase     commands" in tables and "critical path (*" in tables and "line commands" not in tables

    slices = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    rects = doc.one("section", id="timeline").all("rect")
    assert len(slices) < TIMELINE_RECTS
    assert sorted(r.one("title").content.split("\n")[0] for r in rects) == sorted(e["name"] for e in slices)
    located = [r for r in rects if "data-locs" in r.attrs]
    assert located and all(t.startswith("0:") for r in located for t in r.attrs["data-locs"].split())
    assert any(len(r.all("title")) == 1 and "made by lower-dispatch" in r.one("title").content for r in rects)


def test_a_mesh_page_shows_the_slowest_chip_and_every_chips_tracks(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The slowest chip's lines sum to the mesh's total; the IR is a chip's passes, shard-experts
    first; the timeline has a process per chip."""
    page, report = tmp_path / "p.html", tmp_path / "r.json"
    code, _, err = tcpc_main(capsys, "run", TOY, "--mesh", "ep=2", "--html", page, "--report-json", report)
    assert code == 0, err
    doc, data = parse(page.read_text()), json.loads(report.read_text())
    slowest = max(range(len(data["chips"])), key=lambda c: data["chips"][c]["total_cycles"])
    source = doc.one("section", id="source")
    assert f"chip {slowest}'s, the slowest of the 2" in source.content
    assert sum(cell(r, "critical") for r in source.all("tr", class_="costed")) == data["total_cycles"]
    names = [s.one(class_="pass").content for s in doc.one("section", id="passes").all(class_="step")]
    assert names[:3] == ["input", "shard-experts", "lower-topk"]
    processes = [t.content for t in doc.one("section", id="timeline").all("text", class_="process")]
    assert processes == ["chip 0", "chip 1"]
    assert "out0" in doc.one("section", id="run").content


def test_a_run_of_many_slices_is_drawn_in_intervals_by_its_stated_rule() -> None:
    """3,200 slices over three tracks: each track in TIMELINE_RECTS // 3 intervals, a rect for
    each with work (the third track's second half has none), a fully busy one opaque."""
    events: list[dict[str, object]] = [{"ph": "M", "pid": 1, "tid": 0, "name": "process_name", "args": {"name": "p"}}]
    for tid, count in ((1, 1300), (2, 1300), (3, 600)):
        events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": f"unit {tid}"}})
        events += [{"ph": "X", "pid": 1, "tid": tid, "name": f"op{i}", "ts": float(i), "dur": 1.0,
                    "args": {"key": i, "phase": "experts", "location": "f.moe:3:1"}} for i in range(count)]
    drawn = parse(timeline({"traceEvents": events, "otherData": {"total_cycles": 1_300_000, "clock_hz": 1e9}},
                           {1: {0}}, {"f.moe": 0}))
    bins = TIMELINE_RECTS // 3
    assert f"This run has 3,200 slices, more than the {TIMELINE_RECTS:,} rects the page draws" in drawn.content
    assert f"cut into {bins:,} equal intervals of 1,300 cycles" in drawn.content
    groups = [g for g in drawn.all("g") if g.attrs.get("transform", "").startswith("translate")]
    assert [len(g.all("rect")) for g in groups] == [bins, bins, math.ceil(600 / (1300 / bins))]
    assert {r.attrs["fill-opacity"] for g in groups[:2] for r in g.all("rect")} == {"1.00"}
    first = groups[0].all("rect")[0]
    assert "cp" in first.attrs["class"].split() and first.attrs["data-locs"] == "0:3"
    assert "cp" not in groups[0].all("rect")[1].attrs["class"].split()
    assert "2 command(s), busy 100%" in first.one("title").content


@pytest.mark.parametrize("argv, status, message", [
    (("--cost-only", "--html", "{tmp}/no/such/p.html"), 1,
     "tcpc: error: --html {tmp}/no/such/p.html: no such file or directory ({tmp}/no/such does not exist)"),
    (("--cost-only", "--html", "{tmp}"), 1, "tcpc: error: --html {tmp}: is a directory; name a file"),
    (("--cost-only", "--html", "/dev/full"), 1, "tcpc: error: cannot write /dev/full: no space left on device"),
    (("--cost-only", "--html", "{tmp}/p", "--trace", "{tmp}/p"), 2, "tcpc: error: --trace and --html both name {tmp}/p"),
    (("--reference", "--html", "{tmp}/p"), 2, "tcpc: error: --html needs a simulation; --reference runs the IR "
                                               "without one"),
    (("-p", "lower-topk", "--html", "{tmp}/p"), 1, "tcpc: error: cannot simulate ops that have no cost model; lower "
                                                     "them first: moe.combine"),
], ids=["missing-directory", "directory", "full-device", "same-as-trace", "reference", "partial-pipeline"])
def test_a_page_that_cannot_be_written_or_has_no_run_is_one_error(argv: tuple[str, ...], status: int, message: str,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Refused with one line, before the run where the path is the mistake; nothing written."""
    err = failure(capsys, "run", TOY, *(a.format(tmp=tmp_path) for a in argv), status=status)
    assert err.startswith(message.format(tmp=tmp_path)) and err.count("\n") == 1, err
    assert not (tmp_path / "p").exists()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
"""Headless, and no connection of its own: the page must need none."""


def browser_dom(page: Path, profile: Path) -> Node:
    """The page's DOM after it loaded in Chromium (its scripts run)."""
    result = subprocess.run([str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "<html" in result.stdout, result.stderr[-2000:]
    return parse(result.stdout)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium to open the page in (Debian: apt-get install chromium)")
def test_the_page_opens_in_a_browser_without_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Its script ran to the end and recorded no error; its sections rendered. A page with a
    failing script and a missing image shows both in #page-errors (the check can fail)."""
    page = tmp_path / "p.html"
    code, _, err = tcpc_main(capsys, "run", TOY, "--cost-only", "-p", FIXED, "--html", page)
    assert code == 0, err
    dom = browser_dom(page, tmp_path / "profile")
    assert dom.one("html").attrs["data-status"] == "loaded"
    assert dom.one("ul", id="page-errors").all("li") == []
    assert [s.attrs["id"] for s in dom.all("section")] == SECTIONS
    assert dom.one("section", id="timeline").all("rect") and dom.one("section", id="passes").all("details")

    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text().replace("<section id=\"run\">",
                                               '<img src="missing.png"><script>no_such_function();</script>'
                                               '<section id="run">'))
    dom = browser_dom(broken, tmp_path / "profile2")
    assert dom.one("html").attrs["data-status"] == "errors"
    errors = [li.content for li in dom.one("ul", id="page-errors").all("li")]
    assert any("no_such_function" in e for e in errors) and any("missing.png" in e for e in errors), errors
