"""Claims around the docs' figures, checked against their records: not only the number, but what the sentence
says of it ("less than half", "the fewest", "without a GPU")."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_docs import GENERATED, PAGES, ROOT, _cells, _record, _text


def _summary(record: str) -> dict[str, dict]:
    return {row["algo"]: row for row in _record(record)["summary"]}


def test_the_short_warm_up_sentence_gives_its_share_of_the_bytes() -> None:
    parts = []
    for workers, record in ((8, "parity_seeds_cifar8"), (2, "parity_seeds_cifar2")):
        rows = _summary(record)
        short, paper = rows["dgc_short_warmup"], rows["dgc"]
        share = short["link_kb_per_step"] / paper["link_kb_per_step"]
        parts.append((workers, share, short, paper))
    (_, share8, short8, paper8), (_, share2, short2, paper2) = parts
    assert share8 < 0.5 < share2  # under half at 8 workers only
    sentence = (
        f"send {share8:.0%} of its bytes at 8 workers ({short8['link_kb_per_step']:.0f} against "
        f"{paper8['link_kb_per_step']:.0f} kB a step; {short8['compression']:.1f}x fewer than DDP) and {share2:.0%} at 2"
        f" ({short2['link_kb_per_step']:.0f} against {paper2['link_kb_per_step']:.0f} kB; {short2['compression']:.1f}x)"
    )
    assert sentence in _text("docs/algorithms/dgc.md")


def test_the_checkpoint_manifest_sentence_gives_its_bytes() -> None:
    rows = _record("checkpoint_files")["rows"]
    ddp = {r["world_size"]: r["checkpoint_bytes"] for r in rows if r["strategy"] == "ddp"}
    extra = {}
    for r in rows:
        if r["strategy"] != "ddp":
            extra.setdefault(r["world_size"], []).append(r["checkpoint_bytes"] - ddp[r["world_size"]])
    text = " ".join(_text("docs/checkpoints.md").split())
    want = (f"{min(extra[2]):,} to {max(extra[2]):,} bytes more than DDP's at 2 ranks,"
            f" {min(extra[8]):,} to {max(extra[8]):,} at 8.")  # fmt: skip
    assert want in text and "under 1 kB" not in text


def test_the_powersgd_page_does_not_call_it_the_fewest_bytes_with_adamw() -> None:
    rows = _summary("parity_seeds_xfmr2")
    powersgd, dgc = rows["powersgd"], rows["dgc_density_0.01_int8_light_warmup"]
    assert dgc["compression"] > powersgd["compression"]  # DGC's recommended setting sends fewer
    # "matches": the two differences to DDP are within the sum of their seed spreads
    assert abs(powersgd["difference"] - dgc["difference"]) < powersgd["difference_std"] + dgc["difference_std"]
    text = " ".join(_text("docs/algorithms/powersgd.md").split())
    assert "fewest bytes" not in text
    assert (f"{-100 * powersgd['difference']:.1f}% below DDP's perplexity on {powersgd['compression']:.0f}x fewer link"
            f" bytes; `algo/dgc_1pct_int8` was {-100 * dgc['difference']:.1f}% below on {dgc['compression']:.1f}x fewer") in text


def test_the_benchmarks_page_points_every_gpu_figure_to_a_record() -> None:
    text = _text("benchmarks/README.md")
    assert "without a GPU" not in text and "(GPU: below)" not in text
    for name in re.findall(r"GPU: `([\w.]+)`", text):
        assert (ROOT / "benchmarks" / "results" / name).is_file(), name


def test_the_readme_demo_paragraph_quotes_no_unrecorded_figure() -> None:
    text = _text("README.md")
    demo = text[text.index("python -m lightning_dgc_recipes.demo") : text.index("## Which algorithm?")]
    assert "%" not in demo and not re.search(r"\d+x fewer", demo)


def long_protocol_sentence() -> str:
    """The DGC page's sentence on the long protocol's 2-worker pairs, from ``parity_full_cifar2.json``."""
    record = _record("parity_full_cifar2")
    rows = {row["algo"]: row for row in record["summary"]}
    ddp, dgc = rows["ddp"], rows["dgc_1pct_int8"]
    top1 = lambda r: f"{100 * r['metric']:.2f}" + (f" ± {100 * r['metric_std']:.2f}%" if len(r["seeds"]) > 1 else "%")  # noqa: E731
    n = dgc["paired_seeds"]
    error = f"; standard error {100 * dgc['difference_std'] / n**0.5:.2f}" if n > 1 else ""  # in words: "±" is the std
    final = {(r["algo"], r["seed"]): r["metric_last2"] for r in record["runs"] if r.get("finished")}
    per_seed = ", ".join(f"{100 * (final['dgc_1pct_int8', s] - final['ddp', s]):+.2f}" for s in dgc["seeds"])
    seeds = "seed" if n == 1 else "seeds"
    return (f"{n} {seeds} ({', '.join(map(str, dgc['seeds']))}): DDP {top1(ddp)}, `algo/dgc_1pct_int8` {top1(dgc)}, a"
            f" gap of {100 * dgc['difference']:+.2f} points (paired by seed{error}; per seed {per_seed}) on"
            f" {dgc['compression']:.1f}x fewer link bytes over the run")  # fmt: skip


def eight_worker_sentence() -> str:
    """The DGC page's sentence on the long protocol at 8 workers, from ``parity_full_cifar8.json``."""
    rows = {row["algo"]: row for row in _record("parity_full_cifar8")["summary"]}
    dgc = rows["dgc_1pct_int8"]
    ddp = dgc["metric"] - dgc["difference"]  # DDP on the same seeds (the gap is paired by seed)
    n = dgc["paired_seeds"]
    if n == 1:
        seeds = f"seed {dgc['seeds'][0]}"
        figures = f"{100 * dgc['metric']:.2f}%, a gap of {100 * dgc['difference']:+.2f} points"
    else:
        seeds = f"seeds {', '.join(map(str, dgc['seeds']))}"
        figures = (f"{100 * dgc['metric']:.2f} ± {100 * dgc['metric_std']:.2f}%, a gap of {100 * dgc['difference']:+.2f}"
                   f" ± {100 * dgc['difference_std']:.2f} points (paired by seed, ± the standard deviation)")  # fmt: skip
    return (f"At 8 workers of 16 images (`parity_full_cifar8.json`, {seeds}): DDP {100 * ddp:.2f}%,"
            f" `algo/dgc_1pct_int8` {figures} on {dgc['compression']:.1f}x fewer link bytes over the run")  # fmt: skip


def paper_density_sentence() -> str:
    """The DGC page's sentence on ``algo/dgc`` (the paper's density and warm-up) on the long protocol, from
    ``parity_full_cifar2.json`` and seed 42's run record: the share of the run's bytes its warm-up sent."""
    row = {r["algo"]: r for r in _record("parity_full_cifar2")["summary"]}["dgc"]
    from benchmarks import long_study

    run = _record("parity_runs/parity_full_cifar2/cifar10_full_dgc_s42")
    # the warm-up's 4 epochs of 20; at 2 workers DDP's link carries the dense bytes
    share, after = long_study.warmup_split(run, run["compression"]["dense_bytes"] / run["global_step"])
    n = row["paired_seeds"]
    if n > 1:
        seeds = f"seeds {', '.join(map(str, row['seeds']))}"
        figures = (f"{100 * row['metric']:.2f} ± {100 * row['metric_std']:.2f}%, a gap of {100 * row['difference']:+.2f}"
                   f" points (paired by seed; standard error {100 * row['difference_std'] / n**0.5:.2f})")  # fmt: skip
    else:
        seeds, figures = f"seed {row['seeds'][0]}", f"{100 * row['metric']:.2f}%, a gap of {100 * row['difference']:+.2f} points"
    share = f"{100 * share:.0f}% of them" + (" (seed 42)" if n > 1 else "")
    return (f"DGC at the paper's density, `algo/dgc` (0.001 after the paper's warm-up over the first 4 of the 20 epochs;"
            f" {seeds}): {figures}, on {row['compression']:.1f}x fewer link bytes over the run, {share}"
            f" sent by the warm-up's end; after it, {after:.1f}x fewer a step")  # fmt: skip


def test_the_dgc_page_quotes_the_paper_s_density_on_the_long_protocol() -> None:
    assert paper_density_sentence() in " ".join(_text("docs/algorithms/dgc.md").split())


def test_the_dgc_page_s_comparison_of_the_paper_s_density_with_the_recommended_one_holds() -> None:
    """"It ends closer to DDP than the recommended configuration and reaches DDP's final less 0.5 points on every
    seed, on about twice its bytes": the study's rows and the composed record."""
    rows = {r["algo"]: r for r in _record("parity_full_cifar2")["summary"]}
    paper, recommended = rows["dgc"], rows["dgc_1pct_int8"]
    assert "On this protocol it ends closer to DDP than the recommended `algo/dgc_1pct_int8` and reaches DDP's final" in (
        " ".join(_text("docs/algorithms/dgc.md").split()))
    assert paper["difference"] > recommended["difference"]
    composed = [r for r in _record("composed_time")["long"] if r["method"] == "dgc_warmup"]
    assert composed and all(r["reached"] == len(r["seeds"]) == len(paper["seeds"]) for r in composed)
    assert 1.75 <= recommended["compression"] / paper["compression"] <= 2.25  # "about twice"


def test_the_dgc_page_quotes_the_lean_configuration_s_accuracy_and_bytes() -> None:
    from benchmarks import long_study

    sentence = long_study.lean_sentence(_record("parity_full_cifar2"))
    assert sentence is not None, "algo/dgc_lean has a finished run of the long protocol"
    assert sentence in " ".join(_text("docs/algorithms/dgc.md").split()), sentence


def test_the_deft_page_quotes_the_long_protocol_at_eight_workers() -> None:
    from benchmarks import long_study

    sentence = long_study.deft_eight_sentence(_record("parity_full_cifar8"))
    assert sentence is not None, "algo/deft has a finished run at 8 workers"
    text = " ".join(_text("docs/algorithms/deft.md").split())
    assert sentence in text, sentence
    left = 3 - len(_summary("parity_full_cifar8")["deft"]["seeds"])  # the protocol: three seeds
    note = {0: "", 1: " One more seed is to run.", 2: " Two more seeds are to run."}[left]
    assert f"{sentence}.{note}" in text and (left > 0) == ("more seed" in text)


def test_the_deft_page_says_where_its_eight_worker_gap_lies_from_the_runs_evaluations() -> None:
    from benchmarks import long_study

    sentence = long_study.deft_decay_sentence(_record("parity_full_cifar8"))
    assert sentence is not None, "algo/deft, DDP and the recommended DGC have finished seed 42 at 8 workers"
    assert f"{sentence}." in " ".join(_text("docs/algorithms/deft.md").split()), sentence
    below, count = (int(w) for w in sentence.split("to the end ")[1].split(" evaluations")[0].split(" of their "))
    assert below == count, "the page says the gap is set once the learning rate is low: every evaluation below"


def _deft_page_quoting(found: tuple | None, missing: str) -> tuple[str, object]:
    """The DEFT page's text (whitespace folded), once it is checked to quote a generated ``(sentence, verdict)``,
    and that verdict; ``missing`` says which runs a ``None`` waits for."""
    assert found is not None, missing
    sentence, verdict = found
    text = " ".join(_text("docs/algorithms/deft.md").split())
    assert f"{sentence}." in text, sentence
    return text, verdict


def test_the_deft_page_says_which_change_closes_its_eight_worker_gap() -> None:
    from benchmarks import long_study

    text, closes = _deft_page_quoting(long_study.deft_cause_sentence(_record("parity_full_cifar8")),
                                      "DDP, algo/deft and each change have finished seed 42 at 8 workers")
    assert closes == [], "the page concludes that no variant closes the gap"
    assert "So the gap is neither the shipped k by fragment size" in text and "nor DEFT's owner-only selection" in text
    runs, late = long_study.late_gaps(42, ("deft", *long_study.DEFT_CAUSES))
    mean = {algo: figures[0] for algo, figures in long_study.late_figures(_record("parity_full_cifar8"), runs, late).items()}
    assert "DEFT as published, without them, ends more than three times as far from DDP" in text
    assert mean["deft_paper"] < 3 * mean["deft"] < 0, "the shipped additions narrow the gap"
    assert "DEFT as published has both and clears 20x (above), but ends furthest from DDP of the runs above" in text
    assert min(mean, key=mean.get) == "deft_paper" and _summary("parity_full_cifar8")["deft_paper"]["compression"] >= 20


def test_the_deft_page_says_whether_dgc_at_its_density_shows_the_gap() -> None:
    from benchmarks import long_study

    text, closes = _deft_page_quoting(long_study.deft_density_sentence(_record("parity_full_cifar8")),
                                      "DDP, algo/deft and DGC at 0.001 have finished seed 42 at 8 workers")
    assert closes, "the page concludes that the gap is DEFT's own, not that of a selection at 0.1%"
    assert "So the gap is DEFT's own at this scale, not that of a selection at 0.1%: DGC at the same density ends above DDP." in text
    assert _summary("parity_full_cifar8")["dgc"]["difference"] > 0


def test_the_dgc_page_quotes_the_long_protocol_at_eight_workers() -> None:
    assert eight_worker_sentence() in " ".join(_text("docs/algorithms/dgc.md").split())


def test_the_dgc_page_says_what_bf16_autocast_gave_ddp_against_fp32() -> None:
    from benchmarks import long_study

    precision = long_study.precision_sentence()
    if precision is None:
        pytest.skip("no finished fp32 DDP run of the long protocol")
    assert f"bf16 did not cost DDP accuracy: {precision};" in " ".join(_text("docs/algorithms/dgc.md").split())


def test_the_dgc_page_quotes_the_long_protocol_s_pairs() -> None:
    rows = _summary("parity_full_cifar2")
    ddp = rows["ddp"]
    text = _text("docs/algorithms/dgc.md")
    want = long_protocol_sentence()
    assert want in text, want
    from benchmarks import long_study

    assert long_study.length_sentence(_record(long_study.LENGTH_RECORD)["rows"]) in " ".join(text.split())
    tuned = _summary("parity_full_tuning")["ddp_wd5e-4"]
    assert tuned["metric"] < ddp["metric"]  # the recipe's weight decay stays
    assert f"a weight decay of 5e-4 instead of its 1e-4 gave DDP {100 * tuned['metric']:.2f}%" in text


def test_the_recipes_page_quotes_the_input_pipeline_record() -> None:
    summary = _record("input_pipeline")["summary"]
    text = " ".join(_text("docs/recipes.md").split())
    want = (f"took {1e3 * summary['batch']['step_s']:.1f} ms augmenting per batch, {summary['workers']['ratio_to_batch']:.2f}x"
            f" that per image in 2 loader workers per rank and {summary['inline']['ratio_to_batch']:.2f}x per image in"
            " the training process")  # fmt: skip
    assert want in text, want


def long_sentence(algo: str) -> str:
    """A peer's page's sentence on the long protocol (``parity_full_cifar2.json``, one seed): DEFT's, PowerSGD's."""
    row = {r["algo"]: r for r in _record("parity_full_cifar2")["summary"]}[algo]
    return (f"On all of CIFAR-10 at 7,820 steps (2 workers, `parity_full_cifar2.json`, seed {row['seeds'][0]}), `algo/{algo}`"
            f" ends at {100 * row['metric']:.2f}%, {100 * row['difference']:+.2f} points against DDP, on"
            f" {row['compression']:.1f}x fewer link bytes over the run")  # fmt: skip


@pytest.mark.parametrize("algo", ["deft", "powersgd"])
def test_the_peers_pages_quote_the_long_protocol_where_it_ran(algo: str) -> None:
    if algo not in {r["algo"] for r in _record("parity_full_cifar2")["summary"]}:
        pytest.skip(f"no finished {algo} run of the long protocol")
    assert long_sentence(algo) in " ".join(_text(f"docs/algorithms/{algo}.md").split())


def test_the_powersgd_page_s_long_protocol_comparison_holds_for_the_records() -> None:
    """"None of its evaluations reaches DDP's final less 0.5 points"; the recommended DGC ends closer on fewer bytes,
    DEFT closer on slightly more (at most 1.5x PowerSGD's)."""
    rows = {r["algo"]: r for r in _record("parity_full_cifar2")["summary"]}
    if "powersgd" not in rows:
        pytest.skip("no finished PowerSGD run of the long protocol")
    text = " ".join(_text("docs/algorithms/powersgd.md").split())
    assert "None of its evaluations reaches DDP's final less 0.5 points" in text
    composed = [r for r in _record("composed_time")["long"] if r["method"] == "powersgd"]
    assert composed and all(r["reached"] == 0 for r in composed)
    power, dgc, deft = rows["powersgd"], rows["dgc_1pct_int8"], rows["deft"]
    assert ("the same protocol the recommended DGC (`algo/dgc_1pct_int8`) ends closer to DDP on fewer bytes, and DEFT"
            " closer on slightly more") in text  # fmt: skip
    assert dgc["difference"] > power["difference"] and dgc["compression"] > power["compression"]
    assert deft["difference"] > power["difference"] and 1 < power["compression"] / deft["compression"] <= 1.5


# -- words read with their numbers: "flat in N", "recommended", "±" ------------------------------------------------
#: the pages a user reads (the generated per-run tables quote records, not claims)
CLAIM_PAGES = [p for p in PAGES if p not in GENERATED and p.name != "CHANGELOG.md"]


def _pieces(page: Path, leave_out: str = "") -> list[str]:
    """A page's sentences and table cells, each a claim read on its own: a table cell with its row's label, prose
    split at a full stop followed by a space; ``leave_out``: a generated sentence checked on its own."""
    pieces = []
    for block in re.split(r"\n\s*\n", page.read_text()):
        if block.lstrip().startswith("|"):  # each cell's sentences, with its column's and its row's labels
            rows = [_cells(line) for line in block.splitlines() if line.startswith("|") and not line.startswith("| ---")]
            pieces += [f"{rows[0][i + 1]} | {row[0]} | {sentence}" for row in rows[1:] for i, cell in enumerate(row[1:])
                       for sentence in re.split(r"(?<=\.)\s+(?=[A-Z`*(\[])", cell)]  # fmt: skip
        else:
            prose = " ".join(block.split())
            pieces += re.split(r"(?<=\.)\s+(?=[A-Z`*(\[])", prose.replace(leave_out, "") if leave_out else prose)
    return pieces


def _readme_which_rows() -> dict[str, list[str]]:
    from tests.test_readme import _which_rows

    return _which_rows()


def test_the_readme_s_bytes_against_n_are_the_records_words() -> None:
    """"flat in N" / "grow with N" per column: a method is flat where its link bytes grow from 2 to 8 workers as
    DDP's ring all-reduce's do (the CIFAR-10 subset studies), and the shipped `algo/deft` does not."""
    from benchmarks import doc_claims

    growth = doc_claims.growth()
    assert growth["DDP"]["words"] == doc_claims.FLAT  # the yardstick is flat by definition
    assert growth["DEFT"]["words"] == doc_claims.GROWS and growth["DEFT"]["growth"] > 3  # 131 -> 422 kB
    rows = _readme_which_rows()
    (label,) = [label for label in rows if label.startswith("link bytes as workers grow")]
    assert rows[label] == [growth[column]["words"] for column in ("DGC", "DEFT", "PowerSGD", "DiLoCo")], rows[label]
    (label,) = [label for label in rows if label.startswith("pick it when")]
    deft = rows[label][1]
    assert "flat" not in deft or growth["DEFT"]["words"] == doc_claims.FLAT, deft
    assert doc_claims.growth_sentence() in _text("docs/algorithms/index.md")
    assert "docs/algorithms/index.md#link-bytes-as-workers-grow" in _text("README.md")


@pytest.mark.parametrize("page", CLAIM_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_calls_the_shipped_deft_flat_in_n(page: Path) -> None:
    """DEFT's bytes are flat in N only with ``budget="k"`` (as published); a sentence or cell that says "flat in N"
    of DEFT names that budget."""
    from benchmarks.doc_claims import growth_sentence

    # the generated sentence says what "flat in N" means, and is checked against the records above
    wrong = [p for p in _pieces(page, growth_sentence()) if re.search(r"flat in N", p, re.I) and re.search(r"\bDEFT\b|algo/deft", p, re.I)
             and not re.search(r"budget[`\s=:\"]*k\b|budget `k`", p)]  # fmt: skip
    assert not wrong, wrong


def _recommended_names(piece: str) -> list[str]:
    """The configuration each "recommended" of a sentence names: the ``algo/...`` nearest to the word."""
    names = [(m.start(), m.group(1)) for m in re.finditer(r"algo/(\w+)", piece)]
    out = []
    for word in re.finditer(r"recommended", piece, re.I):
        of_dgc = piece[word.end() :].lstrip().startswith("DGC")  # "the recommended DGC": a DGC configuration's name
        near = [n for n in names if n[1].startswith("dgc")] if of_dgc else names
        if near:
            out.append(min(near, key=lambda n: abs(n[0] - word.start()))[1])
        elif of_dgc or re.search(r"\bDGC\b", piece):
            out.append("")  # "the recommended DGC" without its name
    return out


@pytest.mark.parametrize("page", CLAIM_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_recommended_dgc_names_the_one_configuration(page: Path) -> None:
    from benchmarks.doc_claims import RECOMMENDED_DGC

    names = [name for piece in _pieces(page) for name in _recommended_names(piece)]
    wrong = [n for n in names if f"algo/{n}" != RECOMMENDED_DGC and (n == "" or n.startswith("dgc"))]
    assert not wrong, f"{page.name} calls another DGC (or an unnamed one) recommended: {wrong}"


def test_the_readme_s_config_row_is_the_recommended_dgc() -> None:
    from benchmarks.doc_claims import RECOMMENDED_DGC

    assert _readme_which_rows()["config"][0] == f"`{RECOMMENDED_DGC}`"
    assert "# The recommended DGC" in (ROOT / "configs" / f"{RECOMMENDED_DGC}.yaml").read_text()
    assert _recommended_names("the recommended DGC (`algo/dgc_regimes`)") == ["dgc_regimes"]  # the rule catches it
    assert _recommended_names("`algo/deft` ends there (the recommended DGC there, 3 seeds)") == [""]


STD = re.compile(r"standard deviation|\bstd\b")


def _tables_with_plus_minus(page: Path) -> list[tuple[str, str, str]]:
    """Each table of ``page`` that holds a "±": the paragraph before it, the table, the paragraph after it."""
    blocks = re.split(r"\n\s*\n", page.read_text())
    found = []
    for i, block in enumerate(blocks):
        if block.lstrip().startswith("|") and "±" in block:
            before = blocks[i - 1] if i and not blocks[i - 1].lstrip().startswith("#") else ""
            after = blocks[i + 1] if i + 1 < len(blocks) else ""
            found.append((before, block, after))
    return found


@pytest.mark.parametrize("page", CLAIM_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_says_its_plus_minus_is_the_standard_deviation(page: Path) -> None:
    """One statistic per table, said in its caption (the paragraph before or after it): "±" is the standard
    deviation over seeds everywhere; a standard error is written out in words, never after a "±"."""
    for before, table, after in _tables_with_plus_minus(page):
        before, after = (" ".join(text.split()) for text in (before, after))
        assert STD.search(before) or STD.search(after), f"{page.name}: which statistic is this table's ±?\n{table[:200]}"
    assert not re.search(r"±\s*(?:its|the)\s+standard error", " ".join(page.read_text().split()))


def test_the_readme_headline_gives_one_statistic() -> None:
    from benchmarks import composed

    table = composed.markdown_headline(_record("parity_full_cifar2"), _record("composed_time"))
    row = next(line for line in table if line.startswith("| `algo/dgc_1pct_int8`"))
    dgc = _summary("parity_full_cifar2")["dgc_1pct_int8"]
    assert f"{100 * dgc['difference']:+.2f} ± {100 * dgc['difference_std']:.2f} pp" in row  # the std, as top-1's
    (before, _, _) = [t for t in _tables_with_plus_minus(ROOT / "README.md") if "| method | top-1 |" in t[1]][0]
    assert "standard error" not in before and STD.search(" ".join(before.split()))


def test_a_time_ratio_in_a_cell_says_whether_it_is_a_speed_or_a_time() -> None:
    """"Nx DDP's" reads both ways; a cell says "DDP's speed" (DDP's time over the method's) or "DDP's time"."""
    for page in CLAIM_PAGES:
        cells = [c for line in page.read_text().splitlines() if line.startswith("|") for c in _cells(line)]
        bare = [c for c in cells if re.search(r"\d x DDP's(?! (?:speed|time|step))".replace(" x", "x"), c)]
        assert not bare, (page.name, bare)


def test_the_auto_cell_at_1_gbit_says_it_is_ddp_s_curve() -> None:
    from benchmarks import composed

    (auto,) = [r for r in _record("composed_time")["long"] if (r["link"], r["method"]) == ("1gbit", "auto")]
    assert auto["curve"] == "ddp"  # it chose dense: DDP's run, priced at auto's step
    (row,) = [line for line in _text("README.md").split(" | `density=\"auto\"` |")[1:2]]
    assert "DDP's curve at auto's step: it chose dense" in row
    assert composed._minutes(auto).endswith("DDP's curve at auto's step: it chose dense)")


def test_the_memory_figures_say_they_are_the_cpu_path_s() -> None:
    from benchmarks import doc_claims

    peaks = doc_claims.gpu_memory_peaks()
    cpu = {s: r[0]["over"]["peak - ddp"] for s, r in _record("checkpoint_memory")["runs"].items()}
    assert peaks["dgc"] > cpu["dgc"] and peaks["deft"] > cpu["deft"]  # "larger"
    rows = _readme_which_rows()
    assert [label for label in rows if label.startswith("memory per rank")] == [
        "memory per rank over DDP, training peak, CPU"]  # fmt: skip
    assert f"Memory: {doc_claims.gpu_memory_note(every=False)}" in _text("README.md")
    assert f"These figures are {doc_claims.gpu_memory_note()}" in _text("docs/migrating-from-ddp.md")


def test_the_guide_s_step_times_are_labelled_a_quick_run_and_say_what_a_longer_one_found() -> None:
    quick, full = _record("slow_links"), _record("slow_links_selectors")
    q = {r["strategy"]: r["step_time_s"] for r in quick["runs"] if (r["model"], r["bandwidth_mbit"]) == ("resnet110", 100)}
    f = {r["strategy"]: r["step_time_s"] for r in full["runs"] if (r["model"], r["bandwidth_mbit"]) == ("resnet110", 100)}
    assert quick["quick"] and quick["settings"]["rounds"] == 1 and not full["quick"]
    text = _text("docs/algorithms/index.md")
    assert f"a quick run of {quick['settings']['timed_steps']} timed steps, one round (`slow_links.json`)" in text
    reversed_ = (q["dgc"] < q["deft"]) != (f["dgc"] < f["deft"])
    said = (f"A longer run of DGC and DEFT alone, {full['settings']['rounds']} interleaved rounds of"
            f" {full['settings']['timed_steps']} steps (`slow_links_selectors.json`), reverses their order:"
            f" {f['dgc']:.3f} s under DGC, {f['deft']:.3f} s under `algo/deft`")  # fmt: skip
    assert reversed_ and said in text
    assert "a quick run of 5 timed steps" in _text("docs/algorithms/powersgd.md")


def test_the_length_figure_names_whose_it_is() -> None:
    from benchmarks import long_study
    from benchmarks.doc_claims import RECOMMENDED_DGC

    rows = _record(long_study.LENGTH_RECORD)["rows"]
    assert rows and all(long_study.RECOMMENDED in r for r in rows)
    sentence = long_study.length_sentence(rows)
    assert sentence.startswith(f"`{RECOMMENDED_DGC}` less DDP")
    for page in ("README.md", "docs/algorithms/dgc.md"):
        assert sentence in _text(page), page


def test_the_paper_s_ratios_stand_in_one_table_that_other_pages_link_to() -> None:
    from benchmarks import doc_claims

    text = (ROOT / "docs" / "algorithms" / "dgc.md").read_text()
    assert "\n".join(doc_claims.paper_table()) in text and "\n".join(doc_claims.paper_why()) in text
    paper = [f"{ratio}x" for ratio in doc_claims.PAPER.values()]
    for page in CLAIM_PAGES:
        if page.name != "dgc.md":
            assert not [r for r in paper if re.search(rf"(?<![\d,.]){re.escape(r)}", page.read_text())], page.name
    for page, link in (("README.md", "docs/algorithms/dgc.md#compression-against-the-papers"),):
        assert link in _text(page)


def test_the_deft_page_s_bytes_at_2_and_8_workers_are_the_guide_s() -> None:
    """The figures of the guide's generated sentence stand on the DEFT page too: 131 kB a step at 2 workers
    ("twice DGC's"), 422 at 8 (its table)."""
    from benchmarks import doc_claims

    deft, dgc = doc_claims.growth()["DEFT"], _summary("parity_seeds_cifar2")["dgc"]
    text = _text("docs/algorithms/deft.md")
    assert f"its link carried twice DGC's bytes averaged over the run ({deft['kb_2']:.0f} against" \
        f" {dgc['link_kb_per_step']:.0f} kB per step)" in text
    assert 1.75 <= deft["kb_2"] / dgc["link_kb_per_step"] <= 2.25  # "twice"
    (row,) = [line for line in (ROOT / "docs/algorithms/deft.md").read_text().splitlines()
              if line.startswith("| deft (`algo/deft`: budget `dgc_link`, compact wire) |")]  # fmt: skip
    assert _cells(row)[-1] == f"{deft['kb_8']:,.0f}"


def test_the_readme_gives_algo_deft_dgc_s_optimizer_rules_where_it_corrects_momentum() -> None:
    """`algo/deft` turns momentum correction on (SGD's momentum taken over): its optimizer cell is not "any"."""
    from tests.test_readme import _init_args

    corrects = _init_args("deft")["momentum_correction"]
    (label,) = [label for label in _readme_which_rows() if label.startswith("optimizer")]
    cell = _readme_which_rows()[label][1]
    assert (cell == "as DGC (momentum correction on)") == corrects and (cell == "any") == (not corrects), cell
    assert "`DEFTStrategy(momentum_correction=True)`, as the shipped `algo/deft` sets it" in _text("docs/algorithms/deft.md")


def test_the_2_by_8_answer_says_which_settings_the_model_priced() -> None:
    """The answer names the recommended configurations; the model's record priced others (its profile's density and
    values, DEFT's defaults: as published), and the page says so."""
    from lightning_dgc.algorithms.deft_config import DEFTConfig

    profile = _record("two_level/scaling_resnet50")["profile"]
    assert "deft" not in profile["configs"] and DEFTConfig().budget == "k"  # DEFT as published
    assert profile["configs"]["dgc"]["density"] == profile["density"] and profile["configs"]["dgc"]["value_dtype"] == "fp32"
    text = _text("docs/algorithms/index.md")
    assert (f"The model prices DGC at density {profile['density']:g} with {profile['value_dtype']} values and DEFT as"
            f" published (density {profile['density']:g}, budget `k`: flat in N), the record's profile") in text


def test_the_dgc_page_gives_the_levers_bytes_over_a_run() -> None:
    """The lever table comes from ``run_bytes.json``; the lean configuration is the one above 200x at 2 workers."""
    from benchmarks import run_bytes

    assert run_bytes.table() in (ROOT / "docs/algorithms/dgc.md").read_text()
    rows = {r["lever"]: r["2_workers"]["ratio"] for r in _record("run_bytes")["rows"]}
    text = " ".join(_text("docs/algorithms/dgc.md").split())
    lean = next(ratio for lever, ratio in rows.items() if lever.endswith("(algo/dgc_lean)"))
    assert lean >= 200 and "one epoch each): over 200x over a run at 2 workers" in text
    ceiling = next(ratio for lever, ratio in rows.items() if "the dense small tensors' ceiling" in lever)
    assert ceiling < 200 and "even without a warm-up they hold a run below 200x" in text
    small = next(ratio for lever, ratio in rows.items() if lever.endswith("(algo/dgc_lean_small)"))
    assert small >= 200 and "`algo/dgc_lean_small` compresses them at density 1/8" in text
    assert "which the table counts above 200x over a run" in text
    every = next(ratio for lever, ratio in rows.items() if lever.endswith("(algo/dgc_lean_every)"))
    assert every >= 200 and every > small and "the small tensors cost fewer bytes than at density 1/8" in text


def test_the_deft_page_counts_what_holds_its_bytes_at_8_workers() -> None:
    """The DEFT table comes from ``run_bytes.json``; its check row gives the trained runs' ratios within 0.1, each
    change alone clears the target, and the ablations' accuracy costs are ``parity_8workers.json``'s."""
    from benchmarks import long_study, run_bytes

    text = " ".join(_text("docs/algorithms/deft.md").split())
    assert " ".join(run_bytes.table(rows="deft_rows", workers=8).split()) in text
    rows = {r["lever"]: r for r in _record("run_bytes")["deft_rows"]}
    shipped = next(r for lever, r in rows.items() if lever.startswith("algo/deft (check"))
    for workers, record in ((2, "parity_full_cifar2"), (8, "parity_full_cifar8")):
        trained = _summary(record)["deft"]["compression"]
        assert abs(shipped[f"{workers}_workers"]["ratio"] - trained) < 0.1, (workers, trained)
        assert f"{trained:.1f}x at {workers}" in shipped["lever"]
    target = long_study.DEFT_EIGHT_TARGETS["fewer_bytes"]
    assert shipped["8_workers"]["ratio"] < target
    no_warmup = rows["algo/deft without its warm-up"]["8_workers"]["ratio"]
    budget_k = rows["algo/deft with budget k (as published)"]["8_workers"]["ratio"]
    assert min(no_warmup, budget_k) >= target and f"Either change alone clears {target:g}x at 8 workers" in text
    assert (f"without the warm-up `algo/deft` sends {no_warmup:.1f}x fewer bytes than DDP, with `budget=\"k\"` (as"
            f" published: the union holds k values whatever the number of workers) {budget_k:.1f}x") in text
    ablation = {run["algo"]: run["metric"] for run in _record("parity_8workers")["runs"]}
    link, no_warm = ablation["deft_link"] - ablation["deft"], ablation["deft"] - ablation["deft_no_warmup"]
    assert link > 0 and no_warm > 0
    assert f"budget k ended {100 * link:.2f} points under `dgc_link`, no warm-up {100 * no_warm:.2f} under the warm-up" in text


def test_the_guide_s_eight_worker_long_protocol_row_gives_each_run_s_seeds_and_bytes() -> None:
    """The algorithm guide's row of ``parity_full_cifar8.json`` (its accuracy cells: ``test_docs``) names how many
    seeds each figure averages and each compressed run's ratio of link bytes."""
    (row,) = [line for line in _text("docs/algorithms/index.md").splitlines() if "(`parity_full_cifar8.json`)" in line]
    summary = _summary("parity_full_cifar8")
    count = lambda s: f"({len(s['seeds'])} seed{'s' if len(s['seeds']) > 1 else ''})"  # noqa: E731
    assert f"% {count(summary['ddp'])} |" in row
    for algo in ("dgc_1pct_int8", "deft"):
        s = summary[algo]
        assert f"`algo/{algo}` {count(s)}: " in row and f"; {s['compression']:.1f}x fewer link bytes" in row, algo
    for algo, words in (("deft_paper", "as published (`deft_paper`"), ("dgc", "at DEFT's density 0.001 (`algo/dgc_warmup`")):
        s = summary[algo]  # DEFT as published beside the shipped algo/deft, DGC at DEFT's density beside the recommended
        assert (f"{words}, {len(s['seeds'])} seed): {100 * s['metric']:.2f}% ({100 * s['difference']:+.2f} pp;"
                f" {s['compression']:.1f}x fewer link bytes)") in row, algo


def test_the_dgc_page_quotes_the_small_tensors_candidate_from_its_runs() -> None:
    from benchmarks import long_study

    sentence = long_study.lean_sentence(_record("parity_full_cifar2"), "dgc_lean_small")
    text = " ".join(_text("docs/algorithms/dgc.md").split())
    if sentence is None:
        assert "its run on the long protocol is in the study's plan" in text
    else:
        assert sentence in text, sentence
        gap = {algo: _summary("parity_full_cifar2")[algo]["difference"]
               for algo in ("dgc_lean", "dgc_lean_vectors_dense", "dgc_lean_small")}  # fmt: skip
        most = gap["dgc_lean_vectors_dense"] - gap["dgc_lean_small"] > (gap["dgc_lean_vectors_dense"] - gap["dgc_lean"]) / 2
        assert most == ("Compressed even at 1/8, the small tensors still cost most of the points" in text)


def test_the_dgc_page_quotes_the_small_tensors_sent_every_8_steps_from_their_runs() -> None:
    from benchmarks import long_study

    sentence = long_study.lean_sentence(_record("parity_full_cifar2"), "dgc_lean_every")
    text = " ".join(_text("docs/algorithms/dgc.md").split())
    assert sentence is not None and sentence in text, sentence
    gap = {algo: _summary("parity_full_cifar2")[algo]["difference"] for algo in ("dgc_lean_every", "dgc_lean_small")}
    assert gap["dgc_lean_every"] < 2 * gap["dgc_lean_small"] and "tensors cost far more points than compressed at 1/8" in text
    run = json.loads((ROOT / "benchmarks/results/parity_runs/parity_full_cifar2/cifar10_full_dgc_lean_every_s42.json").read_text())
    first = [h["val_acc"] for h in run["history"] if "val_acc" in h and h["step"] <= 600]
    assert max(first) < 0.12 and "its first epoch stayed near chance (10-11% for 600 steps)" in text
    from lightning_dgc.algorithms.dgc_config import DGCConfig

    doc = " ".join((DGCConfig.__doc__ or "").split())  # the API reference quotes both gaps, rounded
    assert (f"every 8 steps lost {-100 * gap['dgc_lean_every']:.0f} points where compressing them at 1/8 lost"
            f" {-100 * gap['dgc_lean_small']:.1f}") in doc  # fmt: skip


def test_the_dgc_page_says_masking_is_a_small_part_of_what_the_compressed_small_tensors_cost() -> None:
    """The masking diagnostic's sentence comes from its record; "a small part" holds only if taking masking back moves
    the gap by less than one evaluation's standard error (0.37 points, the page's) and leaves it outside 0.5 points."""
    from benchmarks import long_study

    sentence = long_study.lean_diagnostics_sentence(_record("parity_full_cifar2"), long_study.SMALL_DIAGNOSTICS, "On the same seed")
    text = " ".join(_text("docs/algorithms/dgc.md").split())
    assert sentence is not None and sentence in text, sentence
    gap = {algo: 100 * _summary("parity_full_cifar2")[algo]["difference"] for algo in ("dgc_lean_small", "dgc_lean_small_nomask")}
    assert 0 <= gap["dgc_lean_small_nomask"] - gap["dgc_lean_small"] < 0.37 and gap["dgc_lean_small_nomask"] < -0.5
    assert "momentum factor masking is a small part of that cost, less than one evaluation's standard error" in text
    assert "standard error of about 0.37 points" in text


def test_the_dgc_page_concludes_from_every_way_of_sending_the_small_tensors() -> None:
    """"None of the ways ... at DDP's accuracy": every light configuration that compresses, delays or masks the small
    tensors ends more than 0.5 points below DDP, and the one that keeps DDP's accuracy is under 200x."""
    summary = _summary("parity_full_cifar2")
    light = ("dgc_lean", "dgc_lean_small", "dgc_lean_small_nomask", "dgc_lean_every")
    assert all(100 * summary[algo]["difference"] < -0.5 for algo in light)
    assert summary["dgc_lean_vectors_dense"]["compression"] < 200
    assert "none of the ways of sending them measured here sends 200x fewer bytes over a run at DDP's accuracy" in " ".join(
        _text("docs/algorithms/dgc.md").split())
    assert "no DGC configuration measured sends 200x fewer bytes over a run at DDP's accuracy" in _text("docs/algorithms/index.md")


def test_the_dgc_page_says_which_lever_costs_the_lean_configuration_its_accuracy() -> None:
    """The diagnostics' sentence comes from their records; the page's conclusion holds only if taking the small
    tensors' compression back (alone) closes the gap to within the target, and taking int8 back does not."""
    from benchmarks import long_study, parity

    sentence = long_study.lean_diagnostics_sentence(_record("parity_full_cifar2"))
    assert sentence is not None and sentence in " ".join(_text("docs/algorithms/dgc.md").split()), sentence
    gaps = {algo: -_summary("parity_full_cifar2")[algo]["difference"] for algo in long_study.LEAN_DIAGNOSTICS}
    assert parity.within_tolerance(gaps["dgc_lean_vectors_dense"], long_study.LEAN_TARGETS["within_points"] / 100)
    assert not parity.within_tolerance(gaps["dgc_lean_fp32"], long_study.LEAN_TARGETS["more_seeds_within"] / 100)
    assert "So compressing the small tensors costs the accuracy" in _text("docs/algorithms/dgc.md")


@pytest.mark.parametrize("config", ["dgc_lean", "dgc_lean_small", "dgc_lean_every"])
def test_the_light_configs_headers_quote_their_bytes_from_run_bytes(config: str) -> None:
    """Each light DGC config's header gives its step and run ratios at 2 workers as ``run_bytes.json`` counts them."""
    row = next(r for r in _record("run_bytes")["rows"] if r["lever"].endswith(f"(algo/{config})"))
    two = row["2_workers"]
    lines = (ROOT / "configs" / "algo" / f"{config}.yaml").read_text().splitlines()
    header = " ".join(" ".join(line.lstrip("#") for line in lines if line.startswith("#")).split())
    assert (f"a step after the warm-up sends {two['final_step_ratio']:,.0f}x fewer bytes than DDP, and a 20-epoch run"
            f" {two['ratio']:.0f}x fewer, warm-up included") in header  # fmt: skip
