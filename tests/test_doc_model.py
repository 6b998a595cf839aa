"""The performance model's figures on every page that quotes them: each table and sentence is rendered by
``benchmarks.model_figures`` from the record that holds it, and the claims around them follow from the same records."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import model_figures as figures

ROOT = Path(__file__).resolve().parents[1]
PERF = "docs/performance-model.md"
MULTI_NODE = "docs/multi-node.md"
GUIDE = "docs/algorithms/index.md"
#: The model's target on the measured links: every predicted step within this fraction of the measured one.
TARGET = 0.25


def _page(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def _quotes(path: str, text: str) -> None:
    assert " ".join(text.split()) in _page(path), f"{path} does not quote the record: {text!r}"


def test_the_model_meets_its_target_on_every_configuration_measured() -> None:
    """Flat and two-level, every algorithm, every shaped rate and round trip: a prediction beside every measured step
    (DiLoCo's step is measured only), each within the target."""
    expected = {"ddp", "dgc", "dgc_node", "deft", "deft_node", "powersgd", "powersgd_node"}
    for record, shaped in ((figures._links(None), {(100.0, 0.0), (1000.0, 0.0)}),
                           (figures._latency(None), {(100.0, 0.0), (100.0, 20.0), (100.0, 80.0)})):  # fmt: skip
        links = {(e["rate_mbit"], e["rtt_ms"]): e for e in record["links"] if e["rate_mbit"] is not None}
        assert set(links) == shaped
        for entry in links.values():
            assert {n for n, row in entry["rows"].items() if row.get("predicted_ms") is not None} == expected
        error, name, entry = figures.largest_error(record)
        assert abs(error) <= TARGET, (name, entry["rate_mbit"], entry["rtt_ms"], error)


def test_the_performance_page_quotes_the_measured_links() -> None:
    links, latency = figures._links(None), figures._latency(None)
    for text in (figures.prediction_table(links), figures.terms_table(links), figures.latency_table(latency)):
        assert text in (ROOT / PERF).read_text(), text.splitlines()[0]
    for text in (figures.settings(links), figures.largest_error_text(links), figures.link_share(links),
                 figures.message_step(latency), figures.round_trip_sentence(latency), figures.rerun_spread(links, latency),
                 figures.largest_error_text(latency, delayed=True)):  # fmt: skip
        _quotes(PERF, text)
    assert "(algorithms/index.md#links-of-long-round-trips)" in _page(PERF)
    assert "## Links of long round trips" in (ROOT / GUIDE).read_text()


@pytest.mark.parametrize("path", ["README.md", PERF, MULTI_NODE, GUIDE])
def test_every_page_quoting_a_cluster_speedup_says_its_inputs_and_how_close_the_model_came(path: str) -> None:
    _quotes(path, figures.inputs_label())
    _quotes(path, figures.agreement())
    _quotes(path, "#where-the-inputs-come-from")
    assert "65.3" not in _page(path) and "no committed profile" not in _page(path)


def test_the_gpu_page_says_how_close_the_model_came() -> None:
    _quotes("docs/gpus.md", figures.agreement())


def test_the_cluster_prediction_s_times_are_the_gpu_profile_s() -> None:
    """The record was made from the committed H100 profile as measured: no time set on the command line."""
    profile = figures.record(figures.SCALING)["profile"]
    h100 = figures.record("profile_resnet50_h100")
    assert "H100" in h100["device"] and h100["world_size"] == 1
    for key in ("compute_s", "selection_s", "backward_s", "batch_size", "device", "buckets"):
        assert profile[key] == h100[key], key
    assert not any("set to" in note for note in profile["notes"])
    _quotes(PERF, figures.assumptions())


def test_the_multi_node_page_and_the_benchmarks_readme_quote_the_bytes() -> None:
    assert figures.bytes_table() in (ROOT / MULTI_NODE).read_text()
    _quotes(MULTI_NODE, figures.measured_agreement())
    _quotes("benchmarks/README.md", figures.bytes_sentence())


def test_the_guide_s_advice_for_long_round_trips_follows_the_record() -> None:
    """At 80 ms: the guide recommends exactly what was faster than DDP, names the rest as slower, puts DiLoCo where its
    figure does (the fastest), and says what the shipped configurations issue and what ``density="auto"`` prices."""
    latency = figures._latency(None)
    speed = figures.against_ddp(latency)
    assert {n for n, s in speed.items() if s >= 1} == {"dgc_node", "diloco"}
    assert max(speed, key=speed.__getitem__) == "diloco"
    text = _page(GUIDE)
    section = text[text.index("## Links of long round trips") : text.index("## 2 nodes x 8 GPUs")]
    assert "- **DGC in two levels**" in section and "- **DiLoCo**" in section
    assert "- **Not** flat DGC, DEFT or PowerSGD, nor DEFT or PowerSGD in two levels: slower than DDP" in section
    for text in (figures.round_trip_sentence(latency), figures.settings(latency), figures.shipped_collectives(latency),
                 figures.auto_sentence(latency)):  # fmt: skip
        assert " ".join(text.split()) in section, text


def test_the_model_counts_the_collectives_the_profiler_counted() -> None:
    """The model's collectives per flat step (each bucket's messages and the settings check) are those the benchmark's
    profiler counted; the shipped configurations issue about as many (the guide's claim)."""
    latency = figures._latency(None)
    reference = figures.link(latency, None)
    for name in figures.SHIPPED:
        measured = figures.collectives_per_step(figures.measured_config(name, latency))
        assert measured == figures.collectives(reference, name), name
        assert abs(figures.collectives_per_step(figures.shipped_config(figures.SHIPPED[name])) - measured) <= 2, name


def test_auto_density_prices_the_round_trip() -> None:
    """On the 80 ms link the price holds the round trips: at least the settings check's three message steps (an
    all-gather over 4 workers), which no byte count explains at that density."""
    choice = figures.auto_choice()
    assert choice.density < 1 and choice.predicted_s < choice.dense_s
    entry = figures.link(figures._latency(None), 100.0, 80.0)
    message_step = entry["shared"]["latency_s"]["across"]["all_reduce"] / 2
    assert choice.predicted_s > 3 * message_step  # at least the settings check's three steps over 4 workers
