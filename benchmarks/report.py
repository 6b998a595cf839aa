"""Write the docs page ``docs/benchmarks/results.md`` from every result file under ``benchmarks/results/``.

    python -m benchmarks.report

(``benchmarks/README.md`` is written by hand: methods, headline plots and the limits of each figure.)
The page holds, for every ``benchmarks/results/*.json`` present: how to reproduce it, its tables
(the latest run's), the targets it states with the measured figure and met / not met, and its
plots (``<name>*.png``). Slow links, overhead and parity are rendered by their modules' ``tables``
functions; any other result file (selection, traffic, scaling, ...) by the module's own
``tables(result)`` when it has one (a list of ``(title, columns, rows)``), otherwise generically
(its lists of records and records of records as tables, its scalars as a key / value table).
Nothing is measured here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import common

PAGE = common.REPO / "docs" / "benchmarks" / "results.md"
#: Absolute paths of the machine a result was measured on (data roots, interpreters, temporary folders):
#: never written to the page. A data root becomes ``<data>/...``, any other path ``<path>``.
_MACHINE_PATH = re.compile(r"(?<![\w.<>])/(?:work|tmp|root|home|usr|opt|mnt|data|scratch)(?:/[^\s`'\"|),\]]*)?")


def headline_plots() -> list[str]:
    """The figures benchmarks/README.md and the docs pages show or link: ``results/<name>.png`` on the benchmark
    pages, ``benchmarks/results/<name>.png`` (after any ``../``) on the others, which resolve to the same copies."""
    docs = PAGE.parent.parent
    pages = [common.RESULTS.parent / "README.md", *sorted(docs.rglob("*.md"))]
    link = re.compile(r"\]\((?:\.\./)*(?:benchmarks/)?results/([\w.-]+\.png)\)")
    links = [name for page in pages for name in link.findall(page.read_text())]
    return list(dict.fromkeys(links))


def copy_headline_plots(page: Path) -> None:
    """Copy the figures of :func:`headline_plots` that exist into ``results/`` beside ``page``, so that the
    relative image links of the README (which the docs site includes) and of the benchmark pages work there."""
    target = page.parent / "results"
    for name in headline_plots():
        source = common.RESULTS / name
        if source.exists():
            target.mkdir(parents=True, exist_ok=True)
            (target / name).write_bytes(source.read_bytes())


def scrub_paths(text: str) -> str:
    """``text`` with the absolute paths of the measuring machine replaced by placeholders."""

    def placeholder(match: re.Match[str]) -> str:
        path = match.group(0)
        if "/data/" in path:
            return "<data>/" + path.split("/data/", 1)[1]
        return "<path>"

    return _MACHINE_PATH.sub(placeholder, text)
MAX_ROWS = 40
MAX_COLUMNS = 16

#: Result files written by this package's own scripts, in report order: module and how to reproduce.
OWN: dict[str, tuple[str, str]] = {
    "slow_links": ("benchmarks.slow_links", "sudo .venv/bin/python -m benchmarks.slow_links [--quick]"),
    "overhead": ("benchmarks.overhead", ".venv/bin/python -m benchmarks.overhead [--quick]"),
    "parity": (
        "benchmarks.parity",
        ".venv/bin/python -m benchmarks.parity [--quick | --full] [--data-root DIR]",
    ),
    "time_to_accuracy": (
        "benchmarks.time_to_accuracy",
        "sudo .venv/bin/python -m benchmarks.time_to_accuracy [--quick] [--rates 10mbit,1gbit,none]",
    ),
}
#: Other result files: (file name prefix, module that writes them), first match wins.
OTHERS: tuple[tuple[str, str], ...] = (
    ("selection", "benchmarks.selection"),
    ("traffic", "benchmarks.traffic"),
    ("scaling_", "benchmarks.scaling_model"),
    ("profile_", "benchmarks.scaling_model"),
    ("gradient_sizes", "benchmarks.scaling_model"),
    ("shapes", "benchmarks.shapes"),
    ("tensorboard_", "benchmarks.tensorboard_figure"),
    ("buildup", "benchmarks.buildup"),
    ("gpu_check", "benchmarks.gpu_check"),
    ("two_level_links", "benchmarks.two_level_links"),
)
SECTION_TITLES = {
    "slow_links": "Slow links, end to end (1 Gbit/s and 100 Mbit/s)",
    "overhead": "Overhead of the exchange, and the compression ratio",
    "parity": "Accuracy parity on real data",
    "time_to_accuracy": "Time to accuracy on shaped links",
    "run_all": "Last `run_all`",
}


# -- markdown ---------------------------------------------------------------------------------------
def rst_to_md(text: str) -> str:
    """Docstring markup to Markdown: ``:role:`x``` and ````x```` become ```x```."""
    text = re.sub(r":(?:mod|class|func|data|meth|attr):`~?([^`]+)`", r"`\1`", text)
    text = re.sub(r"::\n", ":\n", text)  # RST literal-block marker; the indented block stays a code block
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _cell(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        if len(value) > 8 or any(isinstance(v, (dict, list)) for v in value):
            return f"[{len(value)} values]"
        return ", ".join(common.fmt(v) for v in value)
    if isinstance(value, dict):
        return f"{{{len(value)} entries}}"
    return common.fmt(value).replace("|", "\\|").replace("\n", " ")


def md_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], max_rows: int = MAX_ROWS) -> str:
    if not rows:
        return "_(no rows)_\n"
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows[:max_rows]:
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    if len(rows) > max_rows:
        lines.append(f"\n_First {max_rows} of {len(rows)} rows; all of them are in the JSON file._")
    return "\n".join(lines) + "\n"


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _records_table(records: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    columns: list[str] = []
    for record in records:
        for key, value in record.items():
            if key not in columns and (_is_scalar(value) or (isinstance(value, list) and len(value) <= 8)):
                columns.append(key)
    columns = columns[:MAX_COLUMNS]
    return columns, [[r.get(c) for c in columns] for r in records]


def generic_markdown(data: Any, title: str = "", depth: int = 0) -> str:
    """A readable rendering of any JSON result: records as tables, scalars as key / value pairs."""
    out: list[str] = []
    heading = "#" * min(6, 4 + depth)
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        columns, rows = _records_table(data)
        if title:
            out.append(f"{heading} {title}\n")
        out.append(md_table(columns, rows))
        return "\n".join(out)
    if not isinstance(data, dict):
        return ""
    scalars = [
        (k, v)
        for k, v in data.items()
        if _is_scalar(v)
        or (isinstance(v, list) and v and len(v) <= 8 and all(_is_scalar(x) and len(str(x)) <= 40 for x in v))
    ]
    texts = [
        (k, v)
        for k, v in data.items()
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v) and len(v) > 0
    ]
    if title and (scalars or depth < 2):
        out.append(f"{heading} {title}\n")
    if scalars:
        out.append(md_table(["key", "value"], [[k, v] for k, v in scalars]))
    for key, lines in texts:
        if len(lines) > 8 or any(len(x) > 40 for x in lines):
            out.append(f"**{key}**:\n\n" + "\n".join(f"- {x}" for x in lines) + "\n")
    if depth >= 3:
        return "\n".join(out)
    for key, value in data.items():
        if key == "environment":
            continue
        if isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            out.append(generic_markdown(value, key, depth + 1))
        elif isinstance(value, dict) and value and all(isinstance(x, dict) for x in value.values()):
            # a record of records: one row per entry, then one table per nested record field
            records = [
                {"": name, **{k: v for k, v in rec.items() if not isinstance(v, dict)}}
                for name, rec in value.items()
            ]
            columns, rows = _records_table(records)
            out.append(f"{'#' * min(6, 5 + depth)} {key}\n")
            if len(columns) > 1:
                out.append(md_table(columns, rows))
            nested = {k for rec in value.values() for k, v in rec.items() if isinstance(v, dict)}
            for field in sorted(nested):
                subrecords = [
                    {"": name, **(rec.get(field) or {})}
                    for name, rec in value.items()
                    if isinstance(rec.get(field), dict)
                ]
                if all(all(_is_scalar(v) for v in r.values()) for r in subrecords):
                    sub_columns, sub_rows = _records_table(subrecords)
                    out.append(f"_{key} / {field}_\n\n" + md_table(sub_columns, sub_rows))
        elif isinstance(value, dict) and value:
            out.append(generic_markdown(value, key, depth + 1))
    return "\n".join(x for x in out if x)


def generic_targets(data: Any, source: str) -> list[dict[str, Any]]:
    """Targets stated in another benchmark's JSON: dicts with ``met`` next to a target/limit description."""
    found: list[dict[str, Any]] = []

    def visit(node: Any, key: str, depth: int) -> None:
        if depth > 2:
            return
        if isinstance(node, dict):
            if "met" in node and isinstance(node["met"], bool):
                name = node.get("target") if isinstance(node.get("target"), str) else node.get("name") or key
                value_key = next((k for k in ("value", "best_ratio", "ratio", "measured") if k in node), None)
                value = node.get(value_key) if value_key else None
                if value_key not in (None, "value") and name == key:
                    name = f"{key}: {value_key}"
                bound = node.get("limit")
                op = node.get("op", "")
                text = common.fmt(value) if not isinstance(value, str) else value
                if bound is not None:
                    text += f" (target {op} {common.fmt(bound)})".replace("  ", " ")
                why = node.get("why") or node.get("note") or ""
                why = "; ".join(why) if isinstance(why, list) else str(why)
                found.append(
                    {"source": source, "target": str(name), "value": text, "met": node["met"], "note": why}
                )
                return
            for k, v in node.items():
                if k != "environment":
                    visit(v, k, depth + 1)
        elif isinstance(node, list):
            for item in node:
                visit(item, key, depth + 1)

    visit(data, source, 0)
    return found


# -- sections ---------------------------------------------------------------------------------------
def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return {"unreadable": f"{path.name}: {error}"}


def _module(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except Exception:  # a broken or missing script must not break the report of the others
        return None


def _tables_md(tables: list[tuple[str, list[str], list[list[Any]]]]) -> str:
    return "\n".join(f"**{title}**\n\n{md_table(columns, rows)}" for title, columns, rows in tables)


def _images(stem: str) -> str:
    pngs = sorted(p for p in common.RESULTS.glob(f"{stem}*.png"))
    return "Plots: " + ", ".join(f"`benchmarks/results/{p.name}`" for p in pngs) + "\n" if pngs else ""


def _environment(data: Any) -> str:
    env = data.get("environment") if isinstance(data, dict) else None
    if not env:
        return ""
    load = env.get("load_average")
    load_text = f", load average {', '.join(f'{x:.1f}' for x in load)}" if load else ""
    return (
        f"_Measured {env.get('date')} on {env.get('cpu_count')} CPU cores{load_text}; torch {env.get('torch')},"
        f" Lightning {env.get('lightning')}, commit {env.get('git_commit') or '?'}._\n"
    )


def own_key(stem: str) -> str | None:
    """The benchmark of this package that wrote ``<stem>.json`` (``parity_long``: parity with ``--name``)."""
    return next((key for key in OWN if stem == key or stem.startswith(key + "_")), None)


def own_section(key: str, data: dict[str, Any], stem: str) -> tuple[str, list[dict[str, Any]]]:
    module_name, command = OWN[key]
    module = _module(module_name)
    argv = (data.get("environment") or {}).get("argv") or []
    title = SECTION_TITLES[key] + (f" (`{stem}`)" if stem != key else "")
    parts = [f"## {title}\n", f"`{command}` writes `results/{stem}.json`.\n"]
    if argv:
        args = argv[1:]
        if args and args[0] == module_name:  # started by run_all: python -c <runner> <module> <args>
            args = args[1:]
        last = " ".join([f"python -m {module_name}", *args]).strip()
        parts.append(f"These figures: `{last}`{' (quick mode)' if data.get('quick') else ''}.\n")
    doc = (module.__doc__ or "").split("\n\n") if module else []
    if len(doc) > 2:
        parts.append(
            rst_to_md("\n\n".join(p for p in doc[2:] if not p.lstrip().startswith((".venv", "sudo")))) + "\n"
        )
    parts.append(_environment(data))
    if data.get("skipped"):
        parts.append(f"**Skipped:** {data['skipped']}\n")
    found: list[dict[str, Any]] = []
    if module is not None and not data.get("skipped"):
        parts.append(_tables_md(module.tables(data)))
        found = [{"source": stem, **t} for t in module.targets(data)]
        for error in data.get("errors", []) or []:
            parts.append(f"**Error:**\n\n```\n{error[-2000:]}\n```\n")
    if key == "parity":
        parts.append(_parity_commands(data))
    parts.append(_images(stem))
    return "\n".join(p for p in parts if p), found


def _parity_commands(data: dict[str, Any]) -> str:
    runs = data.get("runs", [])
    if not runs:
        return ""
    lines = "\n".join(r.get("command", "") for r in runs)
    return (
        f"<details><summary>The {len(runs)} commands of this run</summary>\n\n```\n{lines}\n```\n</details>\n"
    )


def other_section(path: Path, data: Any) -> tuple[str, list[dict[str, Any]]]:
    module_name = next((m for prefix, m in OTHERS if path.stem.startswith(prefix)), None)
    module = _module(module_name) if module_name else None
    command = data.get("command") if isinstance(data, dict) and isinstance(data.get("command"), str) else None
    command = command or (f"python -m {module_name}" if module_name else "")
    parts = [f"## `{path.name}`\n"]
    if module is not None and module.__doc__:
        parts.append(rst_to_md(module.__doc__.strip().split("\n\n")[0]) + "\n")
    if command:
        parts.append(f"Reproduce: `{command}`\n")
    parts.append(_environment(data))
    tables: Callable[[Any], Any] | None = getattr(module, "tables", None) if module else None
    rendered = ""
    if callable(tables):
        try:
            rendered = _tables_md(tables(data))
        except Exception:
            rendered = ""
    parts.append(rendered or generic_markdown(data))
    parts.append(_images(path.stem))
    return "\n".join(p for p in parts if p), generic_targets(data, path.stem)


def run_all_section() -> str:
    path = common.RESULTS / "run_all.json"
    if not path.exists():
        return ""
    data = _load(path)
    rows = [
        [b["name"], b.get("status"), b.get("wall_s"), " ".join(b.get("argv", []))]
        for b in data.get("benchmarks", [])
    ]
    mode = "quick" if data.get("quick") else "full"
    total = data.get("wall_s")
    head = f"`python -m benchmarks.run_all{' --quick' if data.get('quick') else ''}` ({mode}): {common.fmt(total)} s in total"
    if total is not None:
        head += f" ({total / 60:.1f} min)"
    return f"## {SECTION_TITLES['run_all']}\n\n{head}.\n\n{_environment(data)}\n" + md_table(
        ["benchmark", "status", "wall s", "arguments"], rows
    )


def build() -> str:
    results = sorted(common.RESULTS.glob("*.json")) if common.RESULTS.is_dir() else []
    sections: list[str] = []
    all_targets: list[dict[str, Any]] = []
    own = sorted(
        (p for p in results if own_key(p.stem)),
        key=lambda p: (list(OWN).index(own_key(p.stem) or ""), p.stem),
    )
    for path in own:
        text, found = own_section(own_key(path.stem) or "", _load(path), path.stem)
        sections.append(text)
        all_targets += found
    for path in results:
        if path.stem == "run_all" or own_key(path.stem):
            continue
        text, found = other_section(path, _load(path))
        sections.append(text)
        all_targets += found
    header = [
        "# Per-run tables",
        "",
        "_Generated by `python -m benchmarks.report` from `benchmarks/results/*.json`; do not edit by hand._",
        "",
        "Every table of every result file, as its run left it. [Benchmarks](index.md) explains the methods,",
        "shows the headline figures and says what each can and cannot show. Reproduce everything with",
        "`python -m benchmarks.run_all --quick` or `python -m benchmarks.run_all` (the full parity schedules take",
        "hours); every script also runs alone: `python -m benchmarks.<name> --help`.",
        "",
    ]
    run_all = run_all_section()
    del all_targets  # the scripts' own targets stay in their JSON; the page shows what was measured
    return scrub_paths("\n".join(header + ([run_all] if run_all else []) + sections) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    text = build()
    args.out.write_text(text)
    copy_headline_plots(args.out)
    common.console().print(f"[green]wrote[/green] {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
