"""The README, the docs site and the benchmarks README, checked against the code.

Every Python block compiles (the ones marked ``<!-- docs-test: run -->``, and the README's quickstart,
also run); every command line shown for the package's CLI is parsed with ``--print_config`` and every
benchmark or demo command with ``--help`` (each option it shows must be one the script has); the
README and the benchmarks README keep their size limits; no page names a path of the machine it was
written on; the README's links point at files that exist (its tables: ``test_readme.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
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


#: The seeded studies the algorithm guide quotes, one row each.
SEEDED_STUDIES = ["parity_full_cifar2", "parity_full_cifar8", "parity_seeds_cifar8", "parity_seeds_cifar2", "parity_seeds_ptb2", "parity_seeds_ptb8",
                  "parity_seeds_xfmr2", "parity_seeds_xfmr8"]  # fmt: skip


def _study(name: str) -> tuple[dict[str, dict], bool]:
    """A seeded study's summary by algorithm, and whether its metric is a percentage (accuracy)."""
    records = json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())
    (task,) = records["tasks"].values()
    return {s["algo"]: s for s in records["summary"]}, not task["relative"]


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip("|").split("|")]


def _row(page: str, start: str) -> list[str]:
    """The cells of the one table row of ``page`` whose first cell starts with ``start``."""
    lines = [line for line in (ROOT / page).read_text().splitlines() if line.startswith(f"| {start}")]
    assert len(lines) == 1, f"{page}: no single row starting {start!r}"
    return _cells(lines[0])


def _metric_text(s: dict, percent: bool, digits: int = 2) -> str:
    """An algorithm's mean ± std as the pages write it: accuracy in percent, perplexity as is."""
    return mean_std_text(s["metric"], s["metric_std"], percent, digits) + ("%" if percent else "")


def _difference_text(s: dict, percent: bool, digits: int = 2) -> str:
    """Its paired difference to DDP: in points for accuracy, relative (%) for perplexity."""
    return mean_std_text(s["difference"], s["difference_std"], True, digits, sign=True) + (
        " pp" if percent else "%"
    )


# the algorithm guide's table: one column per algorithm (a study's DEFT variants are on deft.md)
INDEX_COLUMNS = {"ddp": 1, "dgc": 2, "dgc_density_0.01": 2, "dgc_regimes_warmup": 2, "dgc_regimes": 2,
                 "dgc_regimes_0.005": 2, "dgc_short_warmup": 2, "dgc_regimes_int8": 2, "dgc_regimes_fp16": 2,
                 "dgc_density_0.01_int8": 2, "dgc_density_0.01_int8_light_warmup": 2,
                 "dgc_density_0.01_int8_no_warmup": 2, "dgc_1pct_int8": 2, "deft": 3, "powersgd": 4, "diloco": 5, "diloco_dgc": 5,
                 "diloco_streaming": 5}  # fmt: skip


@pytest.mark.parametrize("name", SEEDED_STUDIES)
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


def test_the_benchmarks_readmes_study_commands_rebuild_the_committed_records() -> None:
    """Each ``$P --name <study> ...`` line of ``benchmarks/README.md`` (with its shell variables expanded) names the
    algorithms, task and workers that the study's committed record was last rebuilt with."""
    block = (ROOT / "benchmarks" / "README.md").read_text().split('P="python -m benchmarks.parity')[1].split("```")[0]
    variables = dict(re.findall(r"\b(\w)=(\S+)", block.splitlines()[1]))
    lines = [shlex.split(line) for line in block.splitlines() if line.startswith("$P ")]
    assert len(lines) >= 6
    for words in lines:
        name, algos = words[words.index("--name") + 1], words[words.index("--algos") + 1]
        for key, value in variables.items():
            algos = algos.replace(f"${{{key}}}", value).replace(f"${key}", value)
        argv = _record(name)["environment"]["argv"]
        for option in ("--tasks", "--devices"):
            assert words[words.index(option) + 1] == argv[argv.index(option) + 1], (name, option)
        assert set(algos.split(",")) == set(argv[argv.index("--algos") + 1].split(",")), name


#: The DGC page's measured schedules: the text that starts a row, and its algorithm in the 2- and 8-worker
#: CIFAR studies (``None``: not measured there).
DGC_SCHEDULE_ROWS = [
    ("`algo/dgc_warmup`", "dgc", "dgc"),
    ("`algo/dgc_regimes`", "dgc_regimes_warmup", "dgc_regimes_warmup"),
    ("the warm-up in the first 20% of the run", "dgc_short_warmup", "dgc_short_warmup"),
    ("fp16 values", "dgc_regimes_fp16", None),
    ("int8 values", "dgc_regimes_int8", "dgc_regimes_int8"),
    ("`CriticalRegimes()` alone, density 0.001", "dgc_regimes", None),
    ("`algo/dgc_1pct_int8`", "dgc_density_0.01_int8_light_warmup", "dgc_density_0.01_int8_light_warmup"),
    ("the same without momentum factor masking", "dgc_density_0.01_int8_light_warmup_no_masking",
     "dgc_density_0.01_int8_light_warmup_no_masking"),
    ("the same as top-k with error feedback", "dgc_density_0.01_int8_light_warmup_ef", None),
    ("the same with `CriticalRegimes()`", "dgc_density_0.01_int8_light_warmup_regimes", None),
    ("density 0.0625 (what", "dgc_density_0.0625", None),
    ("density 0.0625 without momentum factor masking", "dgc_density_0.0625_no_masking", None),
    ("density 0.25, no masking", "dgc_density_0.25_no_masking", None),
]


@pytest.mark.parametrize("row", DGC_SCHEDULE_ROWS, ids=lambda row: row[1])
def test_the_dgc_pages_schedules_quote_the_cifar_records(row: tuple[str, str, str | None]) -> None:
    """Each schedule's paired difference, link kB per step and compression, as the records have them."""
    start, *algos = row
    cells = _row("docs/algorithms/dgc.md", start)
    for column, (name, algo) in enumerate(zip(("parity_seeds_cifar2", "parity_seeds_cifar8"), algos, strict=True), 1):
        if algo is None:
            assert cells[column] == "not measured"
            continue
        s = _study(name)[0][algo]
        quoted = f"{_difference_text(s, True)}; {s['link_kb_per_step']:,.0f} kB ({s['compression']:.1f}x)"
        assert cells[column].startswith(quoted), f"dgc.md {start!r}, {name}: {cells[column]!r}, want {quoted!r}"
        assert cells[column].endswith("1 seed") == (len(s["seeds"]) == 1)


def test_the_pages_that_say_density_is_not_the_lever_quote_the_cifar_record() -> None:
    """The DGC page's and the ``density="auto"`` page's figures for density 0.0625 (with and without momentum
    factor masking) beside density 0.01 and 0.001, and for 0.25, from ``parity_seeds_cifar2.json``."""
    summary = _study("parity_seeds_cifar2")[0]

    def below(algo: str) -> str:  # "-1.66 ± 0.86 pp" -> "1.66 ± 0.86"
        return _difference_text(summary[algo], True).lstrip("-").removesuffix(" pp")

    def mean(algo: str) -> str:
        return f"{100 * summary[algo]['difference']:.2f}"

    dgc = _text("docs/algorithms/dgc.md")
    assert (
        f"ended {below('dgc_density_0.0625')} points below DDP, and {below('dgc_density_0.0625_no_masking')} without"
        f" momentum factor masking" in dgc
    )
    assert f"density 0.01 ({mean('dgc_density_0.01_int8_light_warmup')}) and 0.001 ({mean('dgc')})" in dgc
    assert f"it ended {below('dgc_density_0.25_no_masking')} points below, as close as the seeds can tell" in dgc
    auto = _text("docs/auto-density.md")
    assert (
        f"ended {below('dgc_density_0.0625')} points below DDP, and `algo/dgc_1pct_int8` at 0.01"
        f" {mean('dgc_density_0.01_int8_light_warmup').lstrip('-')}" in auto
    )


#: The recipes page's AdamW table: the text that starts a row and its algorithm in ``parity_seeds_xfmr2.json``.
RECIPES_XFMR_ROWS = [
    ("DDP", "ddp"),
    ("`algo/dgc_warmup` (density 0.001)", "dgc"),
    ("`algo/dgc_warmup`, `--trainer.strategy.init_args.density 0.01`", "dgc_density_0.01"),
    ("`algo/dgc_warmup`, `--trainer.strategy.init_args.density 0.01 --trainer.strategy.init_args.value_dtype int8`",
     "dgc_density_0.01_int8"),
    ("`algo/dgc_1pct_int8` (density 0.01, int8 values, the lighter warm-up)", "dgc_density_0.01_int8_light_warmup"),
    ("the same without a warm-up (1 seed)", "dgc_density_0.01_int8_no_warmup"),
    ("`algo/powersgd` (rank 2)", "powersgd"),
]  # fmt: skip


@pytest.mark.parametrize("row", RECIPES_XFMR_ROWS, ids=lambda row: row[1])
def test_the_recipes_adamw_table_quotes_its_record(row: tuple[str, str]) -> None:
    """Perplexity (mean ± std) and the paired difference to DDP, as ``parity_seeds_xfmr2.json`` has them."""
    start, algo = row
    cells = _row("docs/recipes.md", start)
    s = _study("parity_seeds_xfmr2")[0][algo]
    assert cells[1] == _metric_text(s, False), f"recipes.md {algo}: {cells[1]!r}"
    if algo != "ddp":
        assert cells[2] == _difference_text(s, False), f"recipes.md {algo}: {cells[2]!r}"


@pytest.mark.parametrize("page", ["docs/recipes.md", "docs/algorithms/dgc.md"])
def test_the_adamw_recipes_text_quotes_its_record(page: str) -> None:
    """The text that recommends ``algo/dgc_adamw`` quotes the record: its compression and difference to DDP,
    and those of the same recipe without a warm-up."""
    text = _text(page)
    summary = _study("parity_seeds_xfmr2")[0]
    for algo in ("dgc_density_0.01_int8_light_warmup", "dgc_density_0.01_int8_no_warmup"):
        s = summary[algo]
        difference = _difference_text(s, False).lstrip("+-")
        assert f"{s['compression']:.1f}x" in text and difference in text, f"{page}: {algo} {difference}"


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


# -- one source per figure: the memory, traffic and slow-link figures of every page, against their records


def _record(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())


def _text(page: str) -> str:
    """A page's text with its lines joined, so that a figure may be quoted across a line break."""
    return " ".join((ROOT / page).read_text().split())


def _kb(nbytes: float) -> str:
    return f"{nbytes / 1e3:,.0f} kB"


def _signed(value: float, digits: int) -> str:
    """A difference as the pages write it: ``+1.09``, ``-0.05``, and ``0`` where it rounds to nothing."""
    text = f"{value:+.{digits}f}"
    return "0" if float(text) == 0 else text


def _memory() -> tuple[dict[str, dict], dict[str, dict]]:
    """``checkpoint_memory.json``: rank 0's and rank 1's run of each strategy."""
    runs = _record("checkpoint_memory")["runs"]
    return {s: r[0] for s, r in runs.items()}, {s: r[1] for s, r in runs.items()}


MEMORY_ALGOS = ("dgc", "deft", "powersgd")


def test_migrating_page_memory_figures_quote_the_record() -> None:
    rank0, _ = _memory()
    text = _text("docs/migrating-from-ddp.md")
    peaks = ", ".join(_signed(rank0[a]["over"]["peak - ddp"], 2) for a in MEMORY_ALGOS[:2])
    ends = ", ".join(_signed(rank0[a]["over"]["training - ddp"], 2) for a in MEMORY_ALGOS[:2])
    third = MEMORY_ALGOS[2]
    assert f"{peaks} and {_signed(rank0[third]['over']['peak - ddp'], 2)} model sizes at the training peak" in text
    assert f"{ends} and {_signed(rank0[third]['over']['training - ddp'], 2)} at the end of a step" in text


def test_benchmarks_readme_memory_line_quotes_the_record() -> None:
    rank0, _ = _memory()
    text = _text("benchmarks/README.md")
    peak = {a: _signed(rank0[a]["over"]["peak - ddp"], 1) for a in MEMORY_ALGOS}
    end = {a: _signed(rank0[a]["over"]["training - ddp"], 1) for a in MEMORY_ALGOS}
    assert (
        f"training peaks at {peak['dgc']} model sizes over DDP + SGD momentum under DGC, {peak['deft']} under DEFT"
        f" and {peak['powersgd']} under PowerSGD ({end['dgc']}, {end['deft']} and {end['powersgd']} at the end"
        in text
    )


def _shows(cell: str, value: float) -> bool:
    """Whether ``cell``'s number is ``value`` rounded to the digits the cell shows."""
    number = re.match(r"[+-]?\d+(?:\.\d+)?", cell.replace(",", ""))
    assert number, f"no number in {cell!r}"
    digits = len(number[0].split(".")[1]) if "." in number[0] else 0
    return abs(float(number[0]) - value) <= 0.5 * 10**-digits + 1e-12


#: The DiLoCo page's measured rows: the first cell of a row -> the parity variant it quotes.
DILOCO_ROWS = {"DDP": "ddp", "`algo/diloco` (H = 10, dense)": "diloco", "`algo/diloco_dgc` (H = 10, DGC at 0.01)":
               "diloco_dgc", "H = 50, dense": "diloco_h50", "H = 50, DGC at 0.01": "diloco_dgc_h50",
               "local SGD (H = 10, outer lr 1, no momentum)": "diloco_local_sgd",
               "`algo/diloco_streaming` (H = 10, 5 fragments, overlap 1)": "diloco_streaming",
               "5 fragments, no overlap": "diloco_fragments", "1 fragment, overlap 1": "diloco_overlap",
               "`algo/diloco_streaming` with mixing 0 (the late global weights replace the local ones)":
               "diloco_streaming_mix0", "`algo/diloco_streaming` with mixing 0.75": "diloco_streaming_mix0.75"}  # fmt: skip


def test_the_diloco_pages_longer_rounds_sentence_quotes_the_transformer_record() -> None:
    """H = 50 against H = 10 on the 8-worker transformer, dense and with DGC's top-k outer step, and streaming
    against DiLoCo there (3 seeds each)."""
    summary, _ = _study("parity_seeds_xfmr8")

    def gap(algo: str, digits: int) -> str:
        return _difference_text(summary[algo], False, digits)

    assert len(summary["diloco_h50"]["seeds"]) == len(summary["diloco_dgc_h50"]["seeds"]) == 3
    assert (
        f"cost the transformer more ({gap('diloco_h50', 1)} against {gap('diloco', 1)}; with DGC's"
        f" top-k outer step {gap('diloco_dgc_h50', 0)} against {gap('diloco_dgc', 0)})"
        in _text("docs/diloco.md")
    )
    streaming, diloco = (f"{100 * summary[a]['difference']:+.0f}%" for a in ("diloco_streaming", "diloco"))
    assert len(summary["diloco_streaming"]["seeds"]) == 3
    assert f"on the transformer {streaming} against {diloco} (3 seeds)" in _text("docs/diloco.md")


def test_diloco_page_measured_tables_quote_the_records() -> None:
    """Each subsection of the DiLoCo page's *Measured* names its record; every row of its table quotes the record's
    summary: the metric (last two evaluations, seeds' mean ± std), the paired difference to DDP and the link kB
    per step over the run with DDP's bytes over the algorithm's."""
    measured = (ROOT / "docs" / "diloco.md").read_text().split("## Measured")[1].split("\n## ")[0]
    sections = measured.split("\n### ")[1:]
    assert len(sections) >= 3
    for section in sections:
        (name,) = set(re.findall(r"`(parity_seeds_\w+)\.json`", section))
        summary, percent = _study(name)
        rows = [_cells(line) for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
        quoted = [cells for cells in rows if cells[0] in DILOCO_ROWS]
        assert len(quoted) == len(rows) - 1, f"{name}: rows the test does not know: {rows}"
        for cells in quoted:
            s = summary[DILOCO_ROWS[cells[0]]]
            assert cells[1] == _metric_text(s, percent), (name, cells)
            assert cells[-1].startswith(f"{s['link_kb_per_step']:,.0f}"), (name, cells)
            if s["algo"] != "ddp":
                assert cells[2] == _difference_text(s, percent), (name, cells)
                assert f"({s['compression']:.1f}x fewer)" in cells[-1], (name, cells)


def test_diloco_page_mixing_text_quotes_the_record() -> None:
    summary = _study("parity_seeds_cifar2")[0]
    text = _text("docs/diloco.md")
    for algo in ("diloco_streaming_mix0", "diloco_streaming_mix0.75"):
        lost = _difference_text(summary[algo], True).lstrip("-").removesuffix(" pp")
        assert f"lost {lost}" in text, algo


def test_diloco_page_streaming_wall_clock_quotes_the_record() -> None:
    runs = {r["method"]: r for r in _record("time_to_accuracy_streaming")["runs"]}
    streamed, plain = runs["streaming"], runs["diloco"]
    expected = (
        f"took {streamed['launch_to_exit_s']:.0f} s from launch to exit against plain DiLoCo's"
        f" {plain['launch_to_exit_s']:.0f} s, with a median step of {streamed['median_step_s'] * 1e3:.0f} ms against"
        f" {plain['median_step_s'] * 1e3:.0f} ms"
    )
    assert expected in _text("docs/diloco.md")


def test_diloco_page_memory_figures_quote_the_record() -> None:
    """The DiLoCo page's memory figures: rank 0's excess over ``strategy="ddp"``, with and without ``offload``."""
    runs = _record("diloco_memory")["runs"]
    text = _text("docs/diloco.md")
    plain, offload = runs["diloco"][0]["over"], runs["diloco_offload"][0]["over"]
    end, peak = _signed(plain["training - ddp"], 2), _signed(plain["peak - ddp"], 2)
    assert f"{end} model sizes of resident memory at the end of a step" in text and f"{peak} at the training peak" in text
    assert f"({_signed(offload['training - ddp'], 2)} and {_signed(offload['peak - ddp'], 2)})" in text
    sizes = {s: (r[0]["checkpoint_bytes"] / r[0]["model_bytes"], r[0]["rank_file_bytes"]) for s, r in runs.items()}
    (file, rank_file), (ddp_file, _) = sizes["diloco"], sizes["ddp"]
    model = runs["diloco"][0]["model_bytes"]
    assert f"the checkpoint is {file:.1f} model sizes" in text and f"DDP's: {ddp_file:.1f}) and each rank's file" in text
    assert f"each rank's file {rank_file / model:.1f} (its local" in text


def test_checkpoints_memory_table_quotes_the_record() -> None:
    rank0, _ = _memory()
    rows = {
        "ddp": "| DDP + SGD momentum |",
        "ddp_bucket_view": "| DDP, `gradient_as_bucket_view=True` |",
        "dgc": "| DGC |",
        "dgc_batched": "| DGC, batched selection",
        "deft": "| DEFT |",
        "powersgd": "| PowerSGD (rank 2) |",
    }
    lines = (ROOT / "docs" / "checkpoints.md").read_text().splitlines()
    for strategy, start in rows.items():
        (line,) = [x for x in lines if x.startswith(start) and "model size" not in x and "velocity" not in x]
        cells = _cells(line)[1:]
        r0, over = rank0[strategy], rank0[strategy]["over"]
        checks = [
            (cells[0], over["peak - ddp"], r0["training_peak_model_sizes"]),
            (cells[1], over["step peak - ddp"], r0["last_step_peak_model_sizes"]),
            (cells[2], over["training - ddp"], r0["training_model_sizes"]),
            (cells[3], over["training - ddp view"], r0["training_model_sizes"]),
        ]
        for cell, difference, absolute in checks:
            assert _shows(cell, difference), f"checkpoints.md {strategy}: {cell!r} against {difference:.4f}"
            if "(" in cell:  # the baseline: 0 (its own size)
                assert _shows(cell.split("(")[1], absolute), f"checkpoints.md {strategy}: {cell!r}"
    batched = rank0["dgc_batched"]["over"]["step peak - ddp"]
    assert f"{_signed(batched, 2)} in a later step of this MLP" in _text("docs/checkpoints.md"), batched


def test_checkpoint_sizes_table_quotes_the_record_and_meets_its_targets() -> None:
    """``checkpoint_files.json``: rank 0's file within 5% of DDP's at every world size, each rank file at most
    its own buffers plus a few kB, rank 0's peak during the save at most model + optimizer + 10%; the table in
    docs/checkpoints.md quotes every row."""
    rows = _record("checkpoint_files")["rows"]
    ddp = {r["world_size"]: r for r in rows if r["strategy"] == "ddp"}
    buffers = {"dgc": 2, "deft": 1, "powersgd": 1}
    text = _text("docs/checkpoints.md")
    for row in rows:
        n, name, model = row["world_size"], row["strategy"], row["model_bytes"]
        if name in buffers:
            assert row["checkpoint_bytes"] <= 1.05 * ddp[n]["checkpoint_bytes"], row
            assert all(b <= buffers[name] * model + 64e3 for b in row["rank_file_bytes"]), row
            assert row["save_peak_model_sizes"] <= 2.2, row  # model + SGD momentum + 10%
        files = f"{max(row['rank_file_bytes']) / 1e6:.1f} MB" if row["rank_file_bytes"][0] else "none"
        cells = (f"| {n} | {name} | {row['checkpoint_bytes'] / 1e6:.1f} MB | {files} | {row['save_seconds']:.2f} s |"
                 f" {row['save_peak_model_sizes']:.2f} |")  # fmt: skip
        assert cells in text, f"docs/checkpoints.md lacks the row {cells!r}"


def test_resume_without_memory_table_quotes_the_record() -> None:
    """``resume_without_memory.json``: the three runs' top-1 (mean of the last two evaluations)."""
    runs = _record("resume_without_memory")["runs"]
    text = _text("docs/checkpoints.md")
    for label, name in (("not interrupted", "straight"), ("resumed with the exchange memory", "with_memory"),
                        ("resumed without it", "without_memory")):  # fmt: skip
        cells = f"| {label} | {100 * runs[name]['metric']:.2f}% |"
        assert cells in text, f"docs/checkpoints.md lacks the row {cells!r}"


def _traffic() -> dict[str, dict]:
    """ResNet-50's rows of ``traffic.json`` by name: dgc, dgc_fp16, dgc_int8, deft, deft_fp16, powersgd_1, _2, _4
    (density 0.001)."""
    rows = {}
    for row in _record("traffic")["rows"]:
        if row["model"] != "resnet50" or row["density"] not in (None, 0.001):
            continue
        if row["algorithm"] == "powersgd":
            rows[f"powersgd_{row['rank']}"] = row
        else:
            rows[row["algorithm"] + ("" if row["value_dtype"] == "fp32" else f"_{row['value_dtype']}")] = row
    return rows


def _ratio(row: dict) -> str:
    return f"{row['dense_bytes'] / row['bytes_sent']:.0f}x"


def _buffers(row: dict) -> str:
    """The ratio counting the buffers DDP broadcasts in every step under every method."""
    return f"{row['ratio_with_buffers']:.0f}x with DDP's buffers"


TRAFFIC_PAGES = ["benchmarks/README.md", "docs/algorithms/index.md", "docs/algorithms/powersgd.md"]


@pytest.mark.parametrize("page", TRAFFIC_PAGES)
def test_traffic_figures_quote_the_record(page: str) -> None:
    """ResNet-50's bytes per step (``python -m benchmarks.traffic --quick``) wherever a page quotes them."""
    t = _traffic()
    text = _text(page)
    dgc, deft, fp16, int8 = t["dgc"], t["deft"], t["dgc_fp16"], t["dgc_int8"]
    ranks = [t[f"powersgd_{r}"] for r in (1, 2, 4)]
    expected = {
        "benchmarks/README.md": [
            f"ResNet-50 sends {dgc['dense_bytes'] / 1e6:.1f} MB under DDP, {_kb(dgc['bytes_sent'])} under DGC"
            f" ({_ratio(dgc)} less, {_buffers(dgc)}; {_kb(fp16['bytes_sent'])} with fp16 values, {_kb(int8['bytes_sent'])} with int8),"
            f" {_kb(deft['bytes_sent'])} under DEFT,"
            f" {_kb(ranks[0]['bytes_sent'])} to {_kb(ranks[2]['bytes_sent'])} under PowerSGD",
            f"{dgc['dense_exchange_bytes'] / dgc['bytes_sent']:.0%} of DGC's bytes are the 1-D tensors",
        ],
        "docs/algorithms/index.md": [
            f"| {dgc['dense_bytes'] / 1e6:.1f} MB | {_kb(dgc['bytes_sent'])} ({_ratio(dgc)} less; {_buffers(dgc)});"
            f" {_kb(fp16['bytes_sent'])} with fp16 values, {_kb(int8['bytes_sent'])} with int8 ({_ratio(int8)}) |"
            f" {_kb(deft['bytes_sent'])} ({_ratio(deft)}) |"
            f" rank 1: {_kb(ranks[0]['bytes_sent'])} ({_ratio(ranks[0])}); rank 2: {_kb(ranks[1]['bytes_sent'])};"
            f" rank 4: {_kb(ranks[2]['bytes_sent'])} |",
        ],
        "docs/algorithms/powersgd.md": [
            f"| rank 1: {_kb(ranks[0]['bytes_sent'])} ({_ratio(ranks[0])} less than DDP);"
            f" rank 2: {_kb(ranks[1]['bytes_sent'])} ({_ratio(ranks[1])}); rank 4: {_kb(ranks[2]['bytes_sent'])}"
            f" ({_ratio(ranks[2])}) | {_kb(dgc['bytes_sent'])} ({_ratio(dgc)}; {_buffers(dgc)}), {_kb(fp16['bytes_sent'])} with fp16"
            f" values ({_ratio(fp16)}) | {_kb(deft['bytes_sent'])} ({_ratio(deft)}) |",
        ],
    }[page]
    missing = [e for e in expected if e not in text]
    assert not missing, f"{page} does not quote traffic.json: {missing}"
    # the ratios count the gradients only: each page says so where it quotes them
    buffers = f"{dgc['buffer_broadcast_bytes'] / 1e3:.0f} kB"
    assert "gradient bytes" in text and (page.endswith("README.md") or buffers in text), page


def _slow(name: str = "slow_links") -> dict[tuple[str, int, str], dict]:
    return {(r["model"], r["bandwidth_mbit"], r["strategy"]): r for r in _record(name)["runs"]}


def _s(run: dict) -> str:
    return f"{run['step_time_s']:.3f} s"


def test_slow_links_table_quotes_the_record() -> None:
    """The benchmarks page's step-time table: ResNet-110 on 2 workers at 100 Mbit/s (``benchmarks.slow_links``)."""
    record = _record("slow_links")
    runs = _slow()
    lines = (ROOT / "benchmarks" / "README.md").read_text().splitlines()
    ddp = runs[("resnet110", 100, "ddp")]
    for strategy in ("ddp", "powersgd", "dgc", "deft"):
        run = runs[("resnet110", 100, strategy)]
        (line,) = [x for x in lines if x.startswith(f"| `{strategy}`")]
        cells = _cells(line)
        sent = run["bytes_sent_per_step"]
        assert cells[1] == (f"{sent / 1e6:.2f} MB" if sent >= 1e6 else _kb(sent)), (strategy, cells[1])
        assert cells[2] == _s(run), (strategy, cells[2])
        assert cells[3] == f"{ddp['step_time_s'] / run['step_time_s']:.1f}x", (strategy, cells[3])
    settings = record["settings"]
    header = _text("benchmarks/README.md")
    assert f"ResNet-110, batch {ddp['batch_size']} per worker" in header
    assert f"one run of {settings['timed_steps']} timed steps" in header and settings["rounds"] == 1


def test_the_time_to_accuracy_page_quotes_the_interleaved_step_times() -> None:
    """The 1 Gbit/s step ratios of ``slow_links_recipe.json`` and the CPU ratios of ``overhead_recipe_dense.json``."""
    page = _text("docs/benchmarks/time-to-accuracy.md")
    steps = {r["strategy"]: r["step_time_s"] for r in _record("slow_links_recipe")["runs"] if r["bandwidth_mbit"] == 1000}
    ratio = {name: f"{t / steps['ddp']:.2f}x" for name, t in steps.items()}
    assert (
        f"DGC at {ratio['dgc']} DDP's step, DGC at density 1 at {ratio['dgc_dense']}, `density=\"auto\"` at"
        f" {ratio['dgc_auto']} and PowerSGD at {ratio['powersgd']}" in page
    )
    cpu = _record("overhead_recipe_dense")["summary"]["cpu"]["ratio_to_ddp"]
    assert (
        f"DGC at density 1 takes {cpu['dgc_dense']['of_medians']:.2f}x DDP's step and `density=\"auto\"`"
        f" {cpu['dgc_auto']['of_medians']:.2f}x" in page
    )


def test_the_time_to_accuracy_page_quotes_the_record() -> None:
    from benchmarks.time_to_accuracy import markdown_levels, markdown_table, markdown_time_split

    record = _record("time_to_accuracy")
    page = (ROOT / "docs" / "benchmarks" / "time-to-accuracy.md").read_text()
    for table in (markdown_table(record), markdown_levels(record), markdown_time_split(record)):
        assert "\n".join(table) in page, table[0]
    report = {(r["link"], r["method"]): r for r in record["report"]}
    auto, ddp = report["1gbit", "auto"], report["1gbit", "ddp"]
    assert (
        f"in {auto['time_to_target_s']:.0f} s against DDP's {ddp['time_to_target_s']:.0f} s (mean of {auto['seeds']}"
        f" seeds; its median step {auto['median_step_s'] * 1e3:.0f} ms against {ddp['median_step_s'] * 1e3:.0f})"
    ) in _text("docs/benchmarks/time-to-accuracy.md")
    step = {(r["link"], r["method"]): r["median_step_s"] for r in record["runs"] if r["seed"] == 42}
    ratio = step["1gbit", "dgc"] / step["1gbit", "ddp"]
    assert f"DGC's steps took {ratio:.2f}x DDP's at 1 Gbit/s" in _text("docs/migrating-from-ddp.md"), ratio


def test_the_time_to_accuracy_page_quotes_the_adamw_recipes_bytes_and_cpu_step() -> None:
    """``algo/dgc_adamw``'s bytes against the regime recipe's (the 2-worker CIFAR study) and its interleaved CPU
    step against DDP's (``overhead_recipe_int8.json``)."""
    summary = _study("parity_seeds_cifar2")[0]
    fewer = summary["dgc_regimes_warmup"]["link_kb_per_step"] / summary["dgc_density_0.01_int8_light_warmup"][
        "link_kb_per_step"]
    cpu = _record("overhead_recipe_int8")["summary"]["cpu"]["ratio_to_ddp"]["dgc_0.01_int8"]["of_medians"]
    text = _text("docs/benchmarks/time-to-accuracy.md")
    assert f"sends {fewer:.1f}x fewer bytes than the regime recipe" in text, fewer
    assert f"its CPU step is {cpu:.2f}x DDP's (`overhead_recipe_int8.json`)" in text, cpu
    from benchmarks.time_to_accuracy import time_to

    record = _record("time_to_accuracy")
    target = next(r["target"] for r in record["report"] if r["method"] == "ddp")
    runs = [r for r in record["runs"] if (r["method"], r["link"]) == ("dgc_adamw", "20mbit")]
    times = [time_to(r["history"], "val_acc", target, True) for r in runs]
    (reached,) = [t for t in times if t is not None]
    best = sorted(max(h["val_acc"] for h in r["history"] if "val_acc" in h) for r, t in zip(runs, times, strict=True) if t is None)
    assert len(runs) == 3 and f"One seed of three reached the target (in {reached:.0f} s at 20 Mbit/s" in text, times
    assert f"the others' best were {100 * best[0]:.1f}% and {100 * best[1]:.1f}%" in text, best


def test_the_time_to_accuracy_page_quotes_the_slow_links_gaps_and_steps() -> None:
    """At 20 Mbit/s: the density ``auto`` chose on every seed, the bytes, the accuracy gaps and the step times."""
    record = _record("time_to_accuracy")
    report = {(r["link"], r["method"]): r for r in record["report"]}
    runs = [r for r in record["runs"] if r["link"] == "20mbit"]
    chosen = {r["auto"]["auto_density"] for r in runs if r["method"] == "auto"}
    assert chosen == {1 / 16}, chosen
    ratio = {m: {r["compression"]["compression_ratio"] for r in runs if r["method"] == m} for m in ("auto", "dgc")}
    assert all(len(v) == 1 for v in ratio.values()), ratio
    ddp, auto, dgc = (report["20mbit", m] for m in ("ddp", "auto", "dgc"))
    step = {m: f"{report['20mbit', m]['median_step_s'] * 1e3:.0f}" for m in ("ddp", "auto", "dgc")}
    text = _text("docs/benchmarks/time-to-accuracy.md")
    for expected in (
        f"chose 1/16 on every seed ({ratio['auto'].pop():.1f}x fewer bytes than DDP over the run) and ended"
        f" {(ddp['final'] - auto['final']) * 100:.1f} points below DDP (mean of {auto['seeds']} seeds)",
        f"`algo/dgc_regimes` ({ratio['dgc'].pop():.1f}x fewer bytes) {(ddp['final'] - dgc['final']) * 100:.1f}"
        " points below",
        f"({step['auto']} and {step['dgc']} ms against {report['none', 'ddp']['median_step_s'] * 1e3:.0f}; DDP"
        f" {step['ddp']} ms)",
    ):
        assert expected in text, expected


def test_the_time_to_accuracy_pages_drift_figure_is_the_rerun_against_the_record() -> None:
    """The limit that seconds compare within one record only: DDP's median step in the rerun and in the record."""

    def ddp_step_ms(name: str) -> float:
        run = next(r for r in _record(name)["runs"] if (r["method"], r["link"], r["seed"]) == ("ddp", "1gbit", 43))
        return 1000 * run["median_step_s"]

    first, second, record = (ddp_step_ms(n) for n in ("tta_drift_check", "tta_drift_probe", "time_to_accuracy"))
    assert (
        f"stepped in {first:.0f} ms (`tta_drift_check.json`) and {second:.0f} ms (`tta_drift_probe.json`) against the"
        f" record's {record:.0f} ms ({first / record:.2f}x and {second / record:.2f}x)"
        in _text("docs/benchmarks/time-to-accuracy.md")
    )


def test_the_time_to_accuracy_page_quotes_the_ptb_record() -> None:
    from benchmarks.time_to_accuracy import markdown_table, markdown_time_split

    record = _record("time_to_accuracy_ptb")
    text = _text("docs/benchmarks/time-to-accuracy.md")
    for table in (markdown_table(record, "ptb"), markdown_time_split(record)):
        assert "\n".join(table) in (ROOT / "docs" / "benchmarks" / "time-to-accuracy.md").read_text(), table[0]
    report = {(r["link"], r["method"]): r for r in record["report"]}
    runs = {(r["link"], r["method"]): r for r in record["runs"]}
    split = {(w["link"], w["method"]): w for w in record["time_split"]}
    ddp, auto, dgc, bound = report["200mbit", "ddp"], report["200mbit", "auto"], report["200mbit", "dgc"], report["none", "ddp"]
    adamw = report["200mbit", "dgc_adamw"]
    ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
    for expected in (
        f"reaches the target {ddp['time_to_target_s'] / auto['time_to_target_s']:.2f}x sooner than DDP**"
        f" ({auto['time_to_target_s']:.0f} s against {ddp['time_to_target_s']:.0f} s)",
        f"(final perplexity {auto['final']:.1f} against {ddp['final']:.1f})",
        f"chose 1/{1 / runs['200mbit', 'auto']['auto']['auto_density']:.0f}"
        f" ({runs['200mbit', 'auto']['compression']['compression_ratio']:.1f}x fewer bytes",
        f"{auto['time_to_target_s'] / bound['time_to_target_s']:.2f}x the compute-only bound"
        f" ({bound['time_to_target_s']:.0f} s): of its {ms(auto['median_step_s'])} ms step,"
        f" {ms(split['200mbit', 'auto']['selection_s'])} ms are its selection",
        f"and {ms(split['200mbit', 'auto']['rest_s'])} ms the exchange and the waits, against"
        f" {ms(bound['median_step_s'])} ms of compute",
        f"({runs['200mbit', 'dgc']['compression']['compression_ratio']:.1f}x fewer bytes) steps in"
        f" {ms(dgc['median_step_s'])} ms but ends at {dgc['final']:.1f}, {dgc['final'] - dgc['target']:.1f} above",
        f"reaches it {ddp['time_to_target_s'] / adamw['time_to_target_s']:.2f}x sooner than DDP**"
        f" ({adamw['time_to_target_s']:.0f} s against {ddp['time_to_target_s']:.0f} s) on"
        f" {runs['200mbit', 'dgc_adamw']['compression']['compression_ratio']:.1f}x fewer bytes, and ends at DDP's"
        f" perplexity ({adamw['final']:.1f} against {ddp['final']:.1f}):"
        f" {adamw['time_to_target_s'] / bound['time_to_target_s']:.2f}x the compute-only bound, with a"
        f" {ms(adamw['median_step_s'])} ms step of which {ms(split['200mbit', 'dgc_adamw']['selection_s'])} ms",
    ):
        assert expected in text, expected
    assert dgc["time_to_target_s"] is None
    sooner = ddp["time_to_target_s"] / adamw["time_to_target_s"]
    assert f"reached DDP's perplexity {sooner:.2f}x sooner than DDP (one seed" in _text("docs/recipes.md")


def test_the_time_to_accuracy_page_quotes_the_ptb_record_of_deft_powersgd_and_diloco() -> None:
    """Measured on another day with DDP again beside them: the tables, and the figures the pages draw from them."""
    from benchmarks.time_to_accuracy import markdown_table, markdown_time_split

    record = _record("time_to_accuracy_ptb_peers")
    page = (ROOT / "docs" / "benchmarks" / "time-to-accuracy.md").read_text()
    for table in (markdown_table(record, "ptb"), markdown_time_split(record)):
        assert "\n".join(table) in page, table[0]
    report = {(r["link"], r["method"]): r for r in record["report"]}
    ratio = {r["method"]: r["compression"]["compression_ratio"] for r in record["runs"] if r["compression"]}
    selection = {w["method"]: w["selection_s"] for w in record["time_split"]}
    bound = report["none", "ddp"]
    ddp, deft, powersgd, diloco = (report["200mbit", m] for m in ("ddp", "deft", "powersgd", "diloco"))
    earlier = next(r for r in _record("time_to_accuracy_ptb")["report"] if (r["link"], r["method"]) == ("none", "ddp"))
    ms = lambda x: f"{x * 1e3:.0f}"  # noqa: E731
    sooner = ddp["time_to_target_s"] / deft["time_to_target_s"]
    of_bound = deft["time_to_target_s"] / bound["time_to_target_s"]
    above = 100 * (powersgd["final"] / ddp["final"] - 1)
    expected = {
        "docs/benchmarks/time-to-accuracy.md": [
            f"(DDP's compute-only step {ms(bound['median_step_s'])} ms against {ms(earlier['median_step_s'])} above)",
            f"the target is this DDP's final perplexity, {ddp['final']:.1f}, plus 2%",
            f"reaches the target {sooner:.2f}x sooner than DDP** ({deft['time_to_target_s']:.0f} s against"
            f" {ddp['time_to_target_s']:.0f} s) on {ratio['deft']:.1f}x fewer bytes, ending at {deft['final']:.1f} against"
            f" DDP's {ddp['final']:.1f}: {of_bound:.2f}x the compute-only bound ({bound['time_to_target_s']:.0f} s). Of its"
            f" {ms(deft['median_step_s'])} ms step, {ms(selection['deft'])} ms are its selection",
            f"(rank 2; {ratio['powersgd']:.1f}x fewer bytes) steps in {ms(powersgd['median_step_s'])} ms but ends at"
            f" {powersgd['final']:.1f}, {above:.1f}% above DDP's",
            f"{ratio['diloco']:.1f}x fewer bytes) steps in {ms(diloco['median_step_s'])} ms and ends at {diloco['final']:.1f}"
            f" (best {diloco['best']:.1f}): not reached",
        ],
        "docs/algorithms/deft.md": [
            f"DDP's perplexity + 2% {sooner:.2f}x sooner than DDP, at {of_bound:.2f}x the compute-only bound"
        ],
        "docs/algorithms/powersgd.md": [f"over a 200 Mbit/s link it ended {above:.1f}% above"],
        "docs/diloco.md": [
            f"stepped in {ms(diloco['median_step_s'])} ms against DDP's {ms(ddp['median_step_s'])} ms but ended at a"
            f" perplexity of {diloco['final']:.1f} against DDP's {ddp['final']:.1f}"
        ],
    }
    for page_name, quotes in expected.items():
        missing = [q for q in quotes if q not in _text(page_name)]
        assert not missing, (page_name, missing)
    assert powersgd["time_to_target_s"] is None and diloco["time_to_target_s"] is None


@pytest.mark.parametrize("page", ["benchmarks/README.md", "docs/algorithms/index.md", "docs/algorithms/powersgd.md"])
def test_slow_link_step_times_quote_the_record(page: str) -> None:
    runs = _slow()
    r = {(m, b, s): _s(run) for (m, b, s), run in runs.items()}
    text = _text(page)
    expected = {
        "benchmarks/README.md": [
            f"LSTM took {r['lstm', 100, 'ddp']}, {r['lstm', 100, 'powersgd']}, {r['lstm', 100, 'dgc']} and"
            f" {r['lstm', 100, 'deft']}",
            f"DGC's {runs['resnet110', 100, 'dgc']['efficiency']:.0%} efficiency",
        ],
        "docs/algorithms/index.md": [
            f"a step took {r['resnet110', 100, 'ddp']} under DDP, {r['resnet110', 100, 'dgc']} under DGC,"
            f" {r['resnet110', 100, 'powersgd']} under PowerSGD (rank 2) and {r['resnet110', 100, 'deft']} under DEFT",
        ],
        "docs/algorithms/powersgd.md": [
            f"| {r['resnet110', 100, 'powersgd']} | {r['resnet110', 100, 'dgc']} | {r['resnet110', 100, 'deft']} |",
            f"| ResNet-110 step at 1 Gbit/s | {r['resnet110', 1000, 'powersgd']} | {r['resnet110', 1000, 'dgc']} |"
            f" {r['resnet110', 1000, 'deft']} |",
            f"| PTB LSTM step at 100 Mbit/s | {r['lstm', 100, 'powersgd']} | {r['lstm', 100, 'dgc']} |"
            f" {r['lstm', 100, 'deft']} |",
        ],
    }[page]
    missing = [e for e in expected if e not in text]
    assert not missing, f"{page} does not quote slow_links.json: {missing}"


@pytest.mark.parametrize("page", ["benchmarks/README.md", "docs/algorithms/deft.md"])
def test_selector_step_times_quote_the_record(page: str) -> None:
    runs = _slow("slow_links_selectors")
    dgc, deft = _s(runs["resnet110", 100, "dgc"]), _s(runs["resnet110", 100, "deft"])
    text = _text(page)
    expected = (
        f"`algo/deft` took {deft}, DGC {dgc}" if page == "benchmarks/README.md" else f"{dgc} under dgc and {deft} under `algo/deft`"
    )
    assert expected in text, f"{page} does not quote slow_links_selectors.json: {expected!r}"


def test_monitoring_residual_norm_figures_quote_the_record() -> None:
    """docs/monitoring.md describes the figure's residual norm: the last steps at the final density."""
    record = _record("tensorboard_compression")["scalars"]
    density = record["compression/density"]
    final = density[-1]["value"]
    first_step = next(p["step"] for p in density if p["value"] == final)
    norm = {p["step"]: p["value"] for p in record["compression/residual_norm"]}
    last_step = max(norm)
    text = _text("docs/monitoring.md")
    ratio = record["compression/ratio"][-1]["value"]
    assert f"to {ratio:.0f}x at density {final:g}" in text
    assert f"through the run's last {last_step - first_step} steps at {final:g}" in text
    assert f"(from {norm[first_step]:.0f} to {norm[last_step]:.0f})" in text
    assert f"ends {last_step - first_step} steps into the roughly {1 / final:,.0f}" in text
    # the healthy shape the page describes: still rising at the end, within 1/density steps of the change
    assert norm[last_step] > norm[first_step] and last_step - first_step < 1 / final
    assert f"still rises {last_step - first_step} steps into {final:g}" in _text("benchmarks/README.md")


# -- the API reference and the extending page


def _reference_entries() -> list[str]:
    return re.findall(r"^::: ([\w.]+)$", (ROOT / "docs" / "reference.md").read_text(), re.M)


def test_every_reference_entry_is_importable_from_where_the_reference_says() -> None:
    """The reference says every class and function is importable from ``lightning_dgc``, the kit a module."""
    import lightning_dgc

    wrong = []
    for path in _reference_entries():
        module_name, _, name = path.rpartition(".")
        try:
            importlib.import_module(path)  # a module entry (the kit)
            continue
        except ModuleNotFoundError:
            pass
        defined = getattr(importlib.import_module(module_name), name)
        if getattr(lightning_dgc, name, None) is not defined or name not in lightning_dgc.__all__:
            wrong.append(path)
    assert len(_reference_entries()) > 20 and not wrong, f"not importable from lightning_dgc: {wrong}"
    assert lightning_dgc.check_algorithm is importlib.import_module("lightning_dgc.kit").check_algorithm


def test_the_extending_examples_use_documented_names_only() -> None:
    """Every name the extending page's examples import from the package is in the reference."""
    documented = {path.rpartition(".")[2] for path in _reference_entries()}
    for path in _reference_entries():  # a module entry (the kit) documents its __all__
        if importlib.util.find_spec(path.rpartition(".")[0]).submodule_search_locations:  # a package's child
            with contextlib.suppress(ModuleNotFoundError):
                documented |= set(importlib.import_module(path).__all__)
    imported: set[str] = set()
    for _, code in blocks(ROOT / "docs" / "extending.md", "python"):
        for module, grouped, single in re.findall(
            r"^from (lightning_dgc[\w.]*) import (?:\(([^)]*)\)|([^(\n]+)$)", code, re.M
        ):
            names = grouped or single
            assert module in ("lightning_dgc", "lightning_dgc.kit"), f"extending.md imports from {module}"
            imported |= {n.strip() for n in names.split(",") if n.strip()}
    assert {"BucketWork", "Message", "register", "TensorSpec"} <= imported
    assert imported <= documented, f"used by docs/extending.md, missing from the reference: {imported - documented}"


def test_the_random_k_example_is_the_tested_file() -> None:
    """docs/extending.md says its random-k block is tests/extending/randomk.py, tested there."""
    block = next(code for _, code in blocks(ROOT / "docs" / "extending.md", "python") if "class RandomK(" in code)
    source = (ROOT / "tests" / "extending" / "randomk.py").read_text()
    assert source.split("from __future__ import annotations\n\n", 1)[1] == block


# -- launch examples and configs


def test_slurm_script_sends_the_requeue_signal() -> None:
    (script,) = [code for _, code in blocks(ROOT / "docs" / "multi-node.md", "bash") if "#SBATCH" in code]
    assert "#SBATCH --signal=SIGUSR1@90" in script


@pytest.mark.parametrize("page", ["docs/multi-node.md", "docs/fabric-and-restarts.md"])
def test_torchrun_examples_can_restart_and_resume(page: str) -> None:
    """A torchrun example restarts lost workers with a fresh store; a CLI one resumes from a fixed folder."""
    examples = [code for _, code in blocks(ROOT / page, "bash") if "torchrun" in code]
    assert examples
    for code in examples:
        assert "--max-restarts" in code and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in code, f"{page}: {code}"
    cli = [code for code in examples if "fit --config" in code]
    assert cli, f"{page}: no command-line example of a restartable run"
    for code in cli:
        assert "--ckpt_path last" in code and "--trainer.callbacks.dirpath" in code and "save_last true" in code


CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_task_config_headers_warm_dgc_up(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each task config's first line, the command that launches it, runs DGC with the warm-up the docs
    call necessary, and parses."""
    args = shlex.split(path.read_text().splitlines()[0].lstrip("# "))
    assert args[:3] == ["python", "-m", "lightning_dgc_recipes"]
    assert "configs/algo/dgc.yaml" not in args and "configs/algo/dgc_warmup.yaml" in args
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["lightning-dgc"])
    with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exit_info:
        cli([*args[3:], "--print_config"])
    assert exit_info.value.code == 0


def test_getting_started_lists_every_built_in_config() -> None:
    text = _text("docs/getting-started.md").split("Built-in names:")[1].split("See [Recipes")[0]
    listed = set(re.findall(r"`([\w/]+)`", text))
    shipped = {p.stem for p in CONFIGS} | {f"algo/{p.stem}" for p in (ROOT / "configs" / "algo").glob("*.yaml")}
    assert listed == shipped, f"listed but not shipped: {listed - shipped}; shipped but not listed: {shipped - listed}"


# -- records


RECORDS = sorted((ROOT / "benchmarks" / "results").rglob("*.json"))


def test_no_record_names_a_path_of_the_machine_it_was_measured_on() -> None:
    hits = {
        rel(path): match[0]
        for path in RECORDS
        if (match := MACHINE_PATH.search(path.read_text()))
    }
    assert len(RECORDS) > 20 and not hits, f"records with machine paths (common.scrub): {hits}"


def test_records_are_scrubbed_when_written(tmp_path: Path) -> None:
    """``common.write_json`` writes a record's paths relative to the checkout or as placeholders."""
    import tempfile

    from benchmarks import common

    record = {
        "argv": [str(common.REPO / "benchmarks" / "parity.py"), "--data-root", "/work/shared/data"],
        "command": f"{sys.executable} -m lightning_dgc_recipes fit --data.root /home/me/data/ptb --trainer.default_root_dir"
        f" {tempfile.gettempdir()}/run7/root",
        "nested": [{"data_root": Path("/mnt/x/data")}, {"where": "/opt/cache/x", "ratio": "(N-1)/N x 4 r"}],
    }
    assert common.scrub(record) == {
        "argv": ["benchmarks/parity.py", "--data-root", "<data>"],
        "command": "python -m lightning_dgc_recipes fit --data.root <data>/ptb --trainer.default_root_dir <tmp>/run7/root",
        "nested": [{"data_root": "<data>"}, {"where": "<path>", "ratio": "(N-1)/N x 4 r"}],
    }


def _step_costs() -> dict[str, str]:
    """``overhead_recipe.json`` as the pages quote it: CPU-clock medians over DDP's (``1.03x``), the monitor's
    and the trim-every-step's additions to DGC's step in percent."""
    cpu = _record("overhead_recipe")["summary"]["cpu"]
    ratio, step = cpu["ratio_to_ddp"], cpu["step_s"]
    out = {c: f"{ratio[c]['of_medians']:.2f}x" for c in ("dgc", "deft", "powersgd")}
    out["monitor"] = f"{(step['dgc_monitor'] / step['dgc'] - 1) * 100:+.0f}%"
    out["trim"] = f"{(step['dgc_trim_every_step'] / step['dgc'] - 1) * 100:+.0f}%"
    return out


def test_step_cost_figures_quote_the_overhead_record() -> None:
    costs = _step_costs()
    migrating = _text("docs/migrating-from-ddp.md")
    assert f"{costs['dgc']} DDP's CPU time per step under DGC, {costs['deft']} under DEFT and {costs['powersgd']}" \
        " under PowerSGD" in migrating, costs
    assert f"`CompressionMonitor` {costs['monitor']} on DGC's step" in _text("docs/monitoring.md"), costs
    assert f"a step of the CIFAR-10 CPU recipe's ResNet-20 {costs['trim']} of CPU time" in _text(
        "docs/checkpoints.md"
    ), costs


# -- the GPU records (python -m benchmarks.gpu_check, benchmarks.selection --device cuda)
def _cuda_peaks() -> dict[tuple[str, int], float]:
    """``gpu_check.json``'s CUDA training peak over DDP's, per strategy and rank (model sizes)."""
    part = _record("gpu_check")["parts"]["checkpoint_memory"]
    assert part["status"] == "ok", part
    return {(c["strategy"], c["rank"]): c["cuda peak - ddp"] for c in part["result"]["cuda_columns"]}


def test_gpu_memory_figures_quote_the_record() -> None:
    peaks, ddp = _cuda_peaks(), _record("gpu_check")["parts"]["checkpoint_memory"]["result"]["cuda_columns"][0]
    checkpoints, diloco = _text("docs/checkpoints.md"), _text("docs/diloco.md")
    assert f"over DDP's {ddp['cuda peak']:.2f} model sizes: DGC {_signed(peaks['dgc', 0], 2)}," in checkpoints
    assert f"DEFT {_signed(peaks['deft', 0], 2)} (rank 1: {_signed(peaks['deft', 1], 2)})" in checkpoints
    assert f"PowerSGD {_signed(peaks['powersgd', 0], 2)}." in checkpoints
    assert f"is {_signed(peaks['diloco', 0], 2)} model sizes over DDP's without `offload`" in diloco
    assert f"and {_signed(peaks['diloco_offload', 0], 2)} with it" in diloco


def test_gpu_profile_and_selection_figures_quote_the_records() -> None:
    profile = _record("profile_resnet50_h100")
    assert "H100" in profile["device"] and profile["batch_size"] == 32 and profile["value_dtype"] == "fp32"
    text = _text("docs/performance-model.md")
    assert f"measured {profile['compute_s'] * 1e3:.1f} ms of compute and {profile['selection_s'] * 1e3:.1f} ms" in text
    selection = _record("selection_cuda")
    assert selection["config"]["device"] == "cuda"
    ms = selection["models"]["resnet50"]["median_ms"]
    dgc = _text("docs/algorithms/dgc.md")
    assert f"take {ms['dgc_batched']:.2f} ms per step batched, against {ms['dgc']:.2f} ms tensor by tensor" in dgc
    assert f"and {ms['exact']:.2f} ms for exact `torch.topk` per tensor" in dgc
    assert f"reading the buckets once takes {ms['floor_bucket']:.2f} ms" in dgc


def test_the_benchmark_pages_figures_are_the_records_figures() -> None:
    """The docs site shows the figures that benchmarks/README.md and the benchmark pages link, copied by
    ``benchmarks.report`` from ``benchmarks/results/``: every one is listed and its copy is current."""
    from benchmarks.report import headline_plots

    linked = headline_plots()
    assert {"time_to_accuracy.png", "time_to_accuracy_ptb_peers.png"} <= set(linked)
    copy, record = ROOT / "docs" / "benchmarks" / "results", ROOT / "benchmarks" / "results"
    stale = [n for n in linked if (copy / n).read_bytes() != (record / n).read_bytes()]
    assert not stale, f"run python -m benchmarks.report: {stale}"
