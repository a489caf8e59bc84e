"""docs/reference.md is the project's own record of the published facts it checks against: every
"docs/reference.md section N" cited in the sources, tests and docs names a section that exists there, and no file
cites the internal notes file that users do not have."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "docs" / "reference.md"
# The old name, spelled so that this file does not cite it itself.
OLD_NAME = re.compile(r"\b" + "REFER" + r"ENCE\b")
# "docs/reference.md section 4", "``docs/reference.md`` section 2", "sections 2 and 3", a citation split over two
# string literals or comment lines ("... docs/reference.md "\n    "section 4 ...").
CITE = re.compile(r"docs/reference\.md[\s`\"'#*]*sections?\s+(\d+(?:(?:\s*,\s*|\s+and\s+|\s*/\s*)\d+)*)")
SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yaml", ".yml"}


def _scanned_files() -> list[Path]:
    files = [ROOT / name for name in ("README.md", "BENCHMARKS.md", "pyproject.toml", "Makefile")]
    for top in ("src", "tests", "docs", "benchmarks"):
        files += [p for p in (ROOT / top).rglob("*") if p.suffix in SUFFIXES and p.is_file()]
    return [p for p in files if p.is_file() and not any(part.endswith(".egg-info") or part == "__pycache__"
                                                        for part in p.parts)]


def _headings() -> set[int]:
    return {int(m.group(1)) for m in re.finditer(r"^## (\d+)\. \S", REF.read_text(), flags=re.M)}


def _citations() -> dict[int, list[str]]:
    cited: dict[int, list[str]] = {}
    for path in _scanned_files():
        for m in CITE.finditer(path.read_text(errors="replace")):
            for n in re.findall(r"\d+", m.group(1)):
                cited.setdefault(int(n), []).append(str(path.relative_to(ROOT)))
    return cited


def test_sections_are_numbered_in_order():
    headings = [int(n) for n in re.findall(r"^## (\d+)\. ", REF.read_text(), flags=re.M)]
    assert headings == list(range(1, len(headings) + 1)), headings


def test_every_cited_section_exists():
    cited = _citations()
    assert cited, "no citation of docs/reference.md found: the scan is broken"
    # the facts the code relies on: architecture, FLOPs, records, hardware, recipe, checkpoint layout
    assert {2, 3, 4, 5, 6, 7} <= set(cited), sorted(cited)
    missing = {n: files for n, files in cited.items() if n not in _headings()}
    assert not missing, f"cited sections missing from docs/reference.md: {missing}"


def test_citation_pattern_reads_the_forms_in_use():
    text = ('see ``docs/reference.md`` section 2; docs/reference.md sections 2 and 3; (docs/reference.md section 5; '
            'a published plan of docs/reference.md "\n                   "section 4')
    assert [m.group(1) for m in CITE.finditer(text)] == ["2", "2 and 3", "5", "4"]


def test_no_file_cites_the_old_notes():
    offenders = []
    for path in _scanned_files():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OLD_NAME.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not offenders, "cite docs/reference.md instead:\n" + "\n".join(offenders)


def test_every_section_names_a_source():
    text = REF.read_text()
    parts = re.split(r"^## \d+\. .*$", text, flags=re.M)[1:]
    assert len(parts) == len(_headings())
    for n, body in enumerate(parts, 1):
        assert re.search(r"[Ss]ource|arXiv|README|datasheet|\.py|\.md|[Cc]hecked here|[Mm]easured here", body), n
