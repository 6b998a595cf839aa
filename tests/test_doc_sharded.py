"""The pages that quote the sharded-model records (the Sharded models page, and the Multi-node page on the two-level
exchange's memory): each figure is a sentence generated from the record that holds it."""

from __future__ import annotations

from pathlib import Path

from benchmarks import sharded_links, sharded_memory, sharded_study

ROOT = Path(__file__).resolve().parents[1]


def _page(name: str = "sharded.md") -> str:
    return " ".join((ROOT / "docs" / name).read_text().split())


def test_the_page_quotes_the_memory_record() -> None:
    assert sharded_memory.sentence() in _page()
    assert "`sharded_memory.json`" in _page()


def test_the_page_quotes_the_links_record() -> None:
    assert sharded_links.sentence() in _page()
    assert "`sharded_links.json`" in _page()


def test_the_page_quotes_the_study_record() -> None:
    assert sharded_study.sentence() in _page()
    assert "`sharded_ptb.json`" in _page()


def test_the_multi_node_page_quotes_the_two_level_exchange_s_memory_from_the_record() -> None:
    assert sharded_memory.two_level_sentence() in _page("multi-node.md")
    assert "`sharded_memory.json`" in _page("multi-node.md")


def test_the_readme_s_sections_point_to_the_page() -> None:
    """The feature list, "Which algorithm?" and "Across nodes" each link the Sharded models page."""
    readme = (ROOT / "README.md").read_text()
    intro, rest = readme.split("\n## Install", 1)
    sections = {title: body for title, body in (part.split("\n", 1) for part in rest.split("\n## ")[1:])}
    for text in (intro, sections["Which algorithm?"], sections["Across nodes"]):
        assert "(docs/sharded.md)" in text
