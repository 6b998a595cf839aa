"""The Sharded models page quotes its records: each figure is a sentence generated from the record that holds it."""

from __future__ import annotations

from pathlib import Path

from benchmarks import sharded_links, sharded_memory

ROOT = Path(__file__).resolve().parents[1]


def _page() -> str:
    return " ".join((ROOT / "docs" / "sharded.md").read_text().split())


def test_the_page_quotes_the_memory_record() -> None:
    assert sharded_memory.sentence() in _page()
    assert "`sharded_memory.json`" in _page()


def test_the_page_quotes_the_links_record() -> None:
    assert sharded_links.sentence() in _page()
    assert "`sharded_links.json`" in _page()
