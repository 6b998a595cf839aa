"""The README, the docs site and the benchmarks README, checked against the code.

Every Python block compiles (the ones marked ``<!-- docs-test: run -->``, and the README's quickstart,
also run); every command line shown for the package's CLI is parsed with ``--print_config`` and every
benchmark or demo command with ``--help`` (each option it shows must be one the script has); the
README and the benchmarks README keep their size limits; no page names a path of the machine it was
written on; the README's links point at files that exist; the README's accuracy rows quote the figures of
the records in ``benchmarks/results``.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.parity import mean_std_text
from lightning_dgc_recipes.__main__ import main as cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")]
)
# the generated per-run tables quote the commands of past runs (with placeholders), not commands to type
GENERATED = {ROOT / "docs" / "benchmarks" / "results.md"}
RUN_MARK = "<!-- docs-test: run -->"
FENCE = re.compile(r"(<!-- docs-test: run -->\n)?```(\w*)\n(.*?)```", re.S)
#: Absolute paths of a particular machine (a user's paths are written relative, e.g. ./data).
MACHINE_PATH = re.compile(r"(?<![\w.<>~])/(?:work|root|home|tmp|mnt|scratch|opt|usr)/")


def blocks(path: Path, language: str) -> list[tuple[bool, str]]:
    return [(bool(mark), code) for mark, lang, code in FENCE.findall(path.read_text()) if lang == language]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def commands(path: Path) -> list[list[str]]:
    """The command lines of the bash blocks, continuation lines joined, comments dropped and a block's
    variables (``P="python -m ..."``, then ``$P --name ...``) expanded."""
    found = []
    for _, code in blocks(path, "bash"):
        variables: dict[str, str] = {}
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if not line or line.startswith(("#", "export ")):
                continue
            words = shlex.split(line.split(" > ")[0])
            assignment = re.fullmatch(r"([A-Za-z_]\w*)=(.*)", words[0], re.DOTALL)
            if len(words) == 1 and assignment:
                variables[assignment[1]] = assignment[2]
                continue
            found.append([w for word in words for w in _expand(word, variables)])
    return found


def _expand(word: str, variables: dict[str, str]) -> list[str]:
    """An unquoted ``$NAME`` word split into the words of its value, as the shell does."""
    name = word[1:] if word.startswith("$") else None
    return shlex.split(variables[name]) if name in variables else [word]


def test_size_limits() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024
    assert len((ROOT / "benchmarks" / "README.md").read_bytes()) <= 10 * 1024


@pytest.mark.parametrize("path", PAGES, ids=rel)
def test_no_machine_paths(path: Path) -> None:
    hits = [line for line in path.read_text().splitlines() if MACHINE_PATH.search(line)]
    assert not hits, f"{rel(path)} names paths of a particular machine: {hits[:3]}"


def test_generated_tables_have_no_machine_paths() -> None:
    for path in GENERATED:
        hits = [line for line in path.read_text().splitlines() if MACHINE_PATH.search(line)]
        assert not hits, hits[:3]


def test_readme_links_point_at_files() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert targets and not missing, missing


#: The README's accuracy rows: the text that starts the row, its records (``benchmarks/results/<name>.json``)
#: and the algorithm of each column (DGC, DEFT, PowerSGD; several where a cell quotes two).
ACCURACY_ROWS = [
    ("CIFAR-10 subset top-1", "parity_seeds_cifar8", [["dgc"], ["deft"], ["powersgd"]]),
    ("the same, 2 workers", "parity_seeds_cifar2", [["dgc"], ["deft"], ["powersgd"]]),
    ("PTB LSTM, SGD", "parity_seeds_ptb2", [["dgc"], ["deft"], ["powersgd"]]),
    ("the same, 8 workers (DDP 139", "parity_seeds_ptb8", [["dgc"], ["deft"], ["powersgd"]]),
    ("PTB transformer", "parity_seeds_xfmr2", [["dgc", "dgc_density_0.01"], [], ["powersgd"]]),
    ("the same, 8 workers (DDP 157", "parity_seeds_xfmr8", [["dgc_density_0.01"], [], ["powersgd"]]),
]


def _study(name: str) -> tuple[dict[str, dict], bool]:
    """A seeded study's summary by algorithm, and whether its metric is a percentage (accuracy)."""
    records = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
    (task,) = records["tasks"].values()
    return {s["algo"]: s for s in records["summary"]}, not task["relative"]


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip("|").split("|")]


def _metric_text(s: dict, percent: bool, digits: int = 2) -> str:
    """An algorithm's mean ± std as the pages write it: accuracy in percent, perplexity as is."""
    return mean_std_text(s["metric"], s["metric_std"], percent, digits) + ("%" if percent else "")


def _difference_text(s: dict, percent: bool, digits: int = 2) -> str:
    """Its paired difference to DDP: in points for accuracy, relative (%) for perplexity."""
    return mean_std_text(s["difference"], s["difference_std"], True, digits, sign=True) + (
        " pp" if percent else "%"
    )


@pytest.mark.parametrize("row", ACCURACY_ROWS, ids=lambda row: row[1])
def test_readme_accuracy_rows_quote_the_records(row: tuple[str, str, list[list[str]]]) -> None:
    """A record rebuilt with more seeds changes its figures; the README's row must follow."""
    start, name, columns = row
    lines = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| {start}")]
    assert len(lines) == 1, f"README: no single row starting {start!r}"
    cells = _cells(lines[0])
    quotes_kb = "kB" in lines[0]
    summary, percent = _study(name)
    # accuracy and its differences with 2 decimals, perplexity and its relative differences with 1
    digits = 2 if percent else 1
    ddp = summary["ddp"]
    expected = [(0, _metric_text(ddp, percent, digits))]
    if quotes_kb:
        expected.append((0, f"{ddp['link_kb_per_step']:,.0f}"))
    for column, algos in enumerate(columns, start=1):
        for algo in algos:
            s = summary[algo]
            expected.append((column, _difference_text(s, percent, digits)))
            if quotes_kb:
                expected.append((column, f"{s['link_kb_per_step']:,.0f} kB"))
    missing = [(cells[column], text) for column, text in expected if text not in cells[column]]
    assert not missing, f"README row {start!r} does not quote {name}.json: (cell, expected) {missing}"
    counts = {len(s["seeds"]) for s in summary.values()}
    wrong = [said for said in re.findall(r"\d+ seeds?", cells[0]) if int(said.split()[0]) not in counts]
    assert not wrong, f"README row {start!r} says {wrong}; {name}.json has {sorted(counts)} seeds per algo"


# the algorithm guide's table: one column per algorithm (a study's DEFT variants are on deft.md)
INDEX_COLUMNS = {"ddp": 1, "dgc": 2, "dgc_density_0.01": 2, "deft": 3, "powersgd": 4}


@pytest.mark.parametrize("name", [row[1] for row in ACCURACY_ROWS])
def test_algorithm_index_accuracy_rows_quote_the_records(name: str) -> None:
    """docs/algorithms/index.md quotes each study to 2 decimals, as the results page does: every
    algorithm's mean ± std and its paired difference to DDP."""
    page = ROOT / "docs" / "algorithms" / "index.md"
    lines = [line for line in page.read_text().splitlines() if f"(`{name}.json`)" in line]
    assert len(lines) == 1, f"{rel(page)}: no single row naming {name}.json"
    cells = _cells(lines[0])
    summary, percent = _study(name)
    expected = []
    for algo, s in summary.items():
        if algo not in INDEX_COLUMNS:
            continue
        expected.append((INDEX_COLUMNS[algo], _metric_text(s, percent)))
        if "difference" in s:
            expected.append((INDEX_COLUMNS[algo], f"({_difference_text(s, percent)}"))
    missing = [(cells[column], text) for column, text in expected if text not in cells[column]]
    assert not missing, f"{rel(page)} row of {name}.json does not quote it: (cell, expected) {missing}"


@pytest.mark.parametrize("path", PAGES, ids=rel)
def test_python_blocks_compile(path: Path) -> None:
    for i, (_, code) in enumerate(blocks(path, "python")):
        compile(code, f"{rel(path)} (python block {i})", "exec")


@pytest.mark.parametrize(
    "path_and_index",
    [(path, i) for path in PAGES for i, (run, _) in enumerate(blocks(path, "python")) if run],
    ids=lambda pi: f"{rel(pi[0])}-{pi[1]}",
)
def test_marked_python_blocks_run(path_and_index: tuple[Path, int], tmp_path: Path) -> None:
    path, index = path_and_index
    code = blocks(path, "python")[index][1]
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**_env(), "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    """Two CPU processes train under DGC for two epochs, from a file, as a user would run it."""
    code = next(code for _, code in blocks(ROOT / "README.md", "python") if "trainer.fit" in code)
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**_env(), "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "lightning_logs").is_dir()


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def _cli_commands() -> list[tuple[str, list[str]]]:
    """(page, arguments after the program) of every command of the package's CLI shown."""
    found = []
    for path in PAGES:
        for argv in commands(path):
            if "-m" in argv and argv[argv.index("-m") + 1] == "lightning_dgc_recipes":  # python -m lightning_dgc_recipes, torchrun -m lightning_dgc_recipes
                found.append((rel(path), argv[argv.index("-m") + 2 :]))
            elif "lightning-dgc" in argv:
                found.append((rel(path), argv[argv.index("lightning-dgc") + 1 :]))
    return found


def _module_commands() -> list[tuple[str, str, list[str]]]:
    """(page, module, arguments) of every ``python -m benchmarks.*`` / ``lightning_dgc_recipes.demo`` command shown."""
    found = []
    for path in PAGES:
        for argv in commands(path):
            if "-m" in argv:
                module = argv[argv.index("-m") + 1]
                if module.startswith("benchmarks.") or module == "lightning_dgc_recipes.demo":
                    found.append((rel(path), module, argv[argv.index("-m") + 2 :]))
    return found


def test_the_pages_show_commands() -> None:
    assert len(_cli_commands()) >= 5 and len(_module_commands()) >= 5


@pytest.mark.parametrize("page_and_args", _cli_commands(), ids=lambda c: f"{c[0]}: {' '.join(c[1])[:60]}")
def test_cli_commands_parse(page_and_args: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    page, args = page_and_args
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lightning-dgc"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli([*[a for a in args if a != "--print_config"], "--print_config"])
    assert exit_info.value.code == 0, f"{page}: {' '.join(args)}"
    assert "trainer:" in out.getvalue()


@pytest.mark.parametrize(
    "page_module_args", _module_commands(), ids=lambda c: f"{c[0]}: {c[1]} {' '.join(c[2])[:50]}"
)
def test_module_commands_take_their_options(
    page_module_args: tuple[str, str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    page, module, args = page_module_args
    monkeypatch.chdir(ROOT)
    main = importlib.import_module(module).main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([*args, "--help"])
    assert exit_info.value.code == 0
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in out.getvalue()]
    assert not unknown, f"{page}: python -m {module} has no option(s) {unknown}"
