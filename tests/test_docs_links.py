"""The README's and docs/'s links and test names point at something: a relative link names a file
of the checkout and, with ``#anchor``, a heading of it (GitHub's slugs); a test named in the text
(``test_...``) is defined under tests/. Pure text: no network, no kvtier import."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
TEST_NAME = re.compile(r"\btest_[A-Za-z0-9_]+\b")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped (letters, digits,
    ``-`` and ``_`` kept), each space a hyphen."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path`` (repeats get GitHub's ``-1``, ``-2`` suffixes)."""
    seen: Counter[str] = Counter()
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(1))
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of each relative Markdown link outside code blocks."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out += [(number, target) for target in LINK.findall(line)
                    if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, mailto:, ...
    return out


def test_relative_links_name_existing_files_and_headings():
    broken = []
    for doc in DOCS:
        for number, target in links(doc):
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            where = f"{doc.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_tests_named_in_the_docs_exist():
    defined = set()
    for source in (ROOT / "tests").rglob("*.py"):
        defined |= set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", source.read_text(), re.MULTILINE))
        defined |= {path.stem for path in [source] if path.stem.startswith("test_")}
    missing = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for name in TEST_NAME.findall(line):
                if name not in defined and not line[line.index(name) + len(name):].startswith("*"):
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "\n".join(missing)


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The slug rule on this repository's kinds of headings, and a broken anchor found."""
    assert slug("Node service lookups — `python benchmarks/bench_node.py`") == \
        "node-service-lookups--python-benchmarksbench_nodepy"
    assert slug("vLLM's own offloading: `kvtier_disk`, `kvtier_s3` and `kvtier_node`") == \
        "vllms-own-offloading-kvtier_disk-kvtier_s3-and-kvtier_node"
    doc = tmp_path / "a.md"
    doc.write_text("# Title\n## Part\n## Part\n```\n# not a heading\n```\n[x](a.md#part-1) [y](a.md#nope) [z](b.md)\n")
    assert anchors(doc) == {"title", "part", "part-1"}
    assert links(doc) == [(7, "a.md#part-1"), (7, "a.md#nope"), (7, "b.md")]
