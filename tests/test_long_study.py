"""The long CIFAR-10 study's runner: which runs it holds, how a stopped run resumes, what data it accepts, and the
record a resumed run writes. (The study itself runs for hours and is not part of the suite.)"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import common, long_study, parity
from lightning_dgc_recipes.vision import CIFAR10_MEAN, CIFAR10_STD, CIFAR10DataModule, augment_batch

TASK = parity.TASKS["cifar10_full"]


def test_every_run_of_the_study_is_ordered_once() -> None:
    planned = {(s.name, seed, algo) for s in long_study.STUDIES for seed, algo in s.runs}
    assert sorted(planned) == sorted(long_study.ORDER) and len(set(long_study.ORDER)) == len(long_study.ORDER)
    assert long_study.ORDER[:2] == (("parity_full_cifar2", 42, "ddp"), ("parity_full_cifar2", 42, "dgc_1pct_int8"))
    for s in long_study.STUDIES:
        args = s.arguments(s.seeds, s.algos)
        assert args[args.index("--tasks") + 1] == "cifar10_full" and "--reuse" in args
        assert all(algo in parity.ALGO_SPECS for algo in s.algos)


def test_the_long_protocol_is_the_recipe_at_20_epochs_with_its_drops_at_60_and_80_percent(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(parity, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(parity, "data_folder", lambda task, root: root / task.data_subdir)
    argv, record = parity.command(TASK, "ddp", tmp_path, 20, None, tmp_path, name="t", seed=42)
    text = " ".join(argv)
    assert "--trainer.max_epochs 20" in text and "--model.milestones [12, 16]" in text
    assert "--trainer.val_check_interval 0.5" in text and "--trainer.enable_checkpointing true" in text
    assert parity.schedule_steps(TASK, *TASK.full) == 7820  # 391 steps an epoch at the global batch of 128
    assert record.name == "cifar10_full_ddp_s42.json"
    generated = (parity.CONFIG_DIR / "t" / "cifar10_full_ddp_s42.yaml").read_text()
    assert "ModelCheckpoint" in generated and "save_on_train_epoch_end: true" in generated
    assert str(parity.checkpoint_dir("t", "cifar10_full_ddp_s42")) in generated


def test_the_runs_checkpoint_callback_writes_last_ckpt_at_each_epoch_end(tmp_path) -> None:
    """The ModelCheckpoint a resumable run gets, built from its YAML and run by a real ``Trainer``: after each epoch
    one ``last.ckpt`` (what :func:`parity.resume_arguments` resumes from), and nothing else."""
    import yaml
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    callbacks = yaml.safe_load(parity.callbacks_yaml("ddp", tmp_path / "r.json", 2, tmp_path / "ckpt"))
    (spec,) = [c for c in callbacks["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
    trainer = Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[ModelCheckpoint(**spec["init_args"])])  # fmt: skip
    trainer.fit(BoringModel())
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 4


def test_a_stopped_run_resumes_from_its_checkpoint_and_another_command_starts_afresh(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(parity, "CACHE", tmp_path)
    record = tmp_path / "runs" / "cifar10_full_ddp_s42.json"
    record.parent.mkdir()
    record.write_text(json.dumps({"finished": False, "history": [{"step": 195}]}))
    folder = parity.checkpoint_dir("study", record.stem)
    assert parity.resume_arguments(TASK, "study", record, "key-1") == []  # nothing to resume: a fresh start
    assert not record.exists() and (folder / "key").read_text() == "key-1"
    record.write_text("{}")  # the run writes its record and its epoch-end checkpoint, then stops
    (folder / "last.ckpt").write_bytes(b"checkpoint")
    assert parity.resume_arguments(TASK, "study", record, "key-1") == ["--ckpt_path", str(folder / "last.ckpt")]
    assert record.exists()  # a resumed run keeps its partial record (the recorder resumes it)
    assert parity.resume_arguments(TASK, "study", record, "key-2") == []  # another command: afresh
    assert not (folder / "last.ckpt").exists() and not record.exists()
    assert parity.resume_arguments(parity.TASKS["cifar10"], "study", record, "key-1") == []  # not resumable


def test_a_data_root_without_the_full_set_is_an_error_that_names_what_is_missing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(parity, "CACHE", tmp_path / "cache")
    small = replace(TASK, required_files=(("cifar-10-batches-py/data_batch_1", 100), ("cifar-10-batches-py/test_batch", 100)))
    folder = tmp_path / "data" / "cifar10-full" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    (folder / "data_batch_1").write_bytes(b"x" * 10)  # a subset's file of the same name
    with pytest.raises(SystemExit, match=r"data_batch_1 \(10 bytes; the full set's has at least 100\); .*test_batch \(missing\)"):
        parity.data_folder(small, tmp_path / "data")
    (folder / "data_batch_1").write_bytes(b"x" * 100)
    (folder / "test_batch").write_bytes(b"x" * 100)
    assert parity.data_folder(small, tmp_path / "data") == folder.parent


def test_the_shared_builder_writes_the_set_into_the_cache_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(parity, "CACHE", tmp_path / "cache")
    small = replace(TASK, required_files=(("cifar-10-batches-py/test_batch", 4),))
    shared = tmp_path / "shared" / "cifar10-full"
    shared.mkdir(parents=True)
    (shared / "build.py").write_text(
        "import sys, pathlib\nout = pathlib.Path(sys.argv[1]) / 'cifar-10-batches-py'\nout.mkdir(parents=True)\n"
        "(out / 'test_batch').write_bytes(b'full')\nwith open(out.parent / 'builds', 'a') as f:\n    f.write('x')\n"
    )
    assert parity.data_folder(small, tmp_path / "shared") == tmp_path / "cache" / "cifar10-full"
    assert parity.data_folder(small, tmp_path / "shared") == tmp_path / "cache" / "cifar10-full"
    assert (tmp_path / "cache" / "cifar10-full" / "builds").read_text() == "x"  # built once, then kept


def test_a_resumed_recorder_writes_the_record_of_an_uninterrupted_run(tmp_path) -> None:
    first = common.RunRecorder(str(tmp_path / "a.json"))
    first.history = [{"step": 391, "val_acc": 0.5}]
    first.train_loss_epochs = [{"epoch": 0, "train_loss": 1.5}]
    first.totals.update(steps=391, bytes_sent=1000, dense_bytes=59000)
    first.densities, first._last_step, first._step_times = [0.0625, 0.01], (391, None), [0.1, 0.2]
    first.rank_selection_ms = [[12.5, 14.0]]
    state = torch.load(_saved(first.state_dict(), tmp_path), weights_only=True)  # through a checkpoint
    second = common.RunRecorder(str(tmp_path / "b.json"))
    second.load_state_dict(state)
    for field in ("history", "train_loss_epochs", "totals", "densities", "_last_step", "_step_times",
                  "rank_selection_ms"):
        assert getattr(second, field) == getattr(first, field), field
    assert second._resumed_wall[0] >= 0 and second._resumed_wall[1] >= 0


def _saved(state: dict, tmp_path: Path) -> Path:
    path = tmp_path / "state.pt"
    torch.save(state, path)
    return path


def test_batch_augmentation_draws_by_the_batch_s_place_in_the_run(monkeypatch) -> None:
    """``augment="batch"``: the same seed, position and rank draw the same crops and flips (so a resumed run
    draws what the uninterrupted one did); another position or rank draws others; evaluation is not augmented."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "42")
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    labels = torch.arange(8)

    def run(position: int, rank: int, training: bool = True) -> torch.Tensor:
        data = CIFAR10DataModule(augment="batch")
        progress = SimpleNamespace(total=SimpleNamespace(ready=position))
        data.trainer = SimpleNamespace(training=training, global_rank=rank,
                                       fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))  # type: ignore[assignment]  # fmt: skip
        out, same_labels = data.on_after_batch_transfer((images, labels), 0)
        assert torch.equal(same_labels, labels) and out.dtype == torch.float32
        return out

    assert torch.equal(run(5, 0), run(5, 0))
    assert not torch.equal(run(5, 0), run(6, 0)) and not torch.equal(run(5, 0), run(5, 1))
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (CIFAR10_MEAN, CIFAR10_STD))
    assert torch.allclose(run(5, 0, training=False), (images.float() / 255 - mean) / std)  # normalised only
    # one crop and flip per image: the same as cropping a padded image by hand
    g = torch.Generator().manual_seed(7)
    out = augment_batch(images.float(), g)
    g = torch.Generator().manual_seed(7)
    offsets, flips = torch.randint(0, 9, (8, 2), generator=g), torch.rand(8, generator=g) < 0.5
    padded = torch.nn.functional.pad(images.float(), (4, 4, 4, 4))
    for i, ((top, left), flip) in enumerate(zip(offsets.tolist(), flips.tolist(), strict=True)):
        crop = padded[i, :, top : top + 32, left : left + 32]
        assert torch.equal(out[i], crop.flip(-1) if flip else crop)



def _finished_run(path: Path, accs: list[float], steps: int, ratio: float | None = None, **fields) -> None:
    """A finished run's record, one evaluation a step in ``accs``; ``fields`` are more of the record's keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    run = {"finished": True, "global_step": steps, "history": [{"step": i, "val_acc": a} for i, a in enumerate(accs)]}
    if ratio is not None:
        run["compression"] = {"compression_ratio": ratio}
    path.write_text(json.dumps({**run, **fields}))


def test_a_study_s_report_lists_its_planned_runs_not_every_seed_with_every_algorithm(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(parity, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(parity, "data_folder", lambda task, root: root / task.data_subdir)
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")  # the report (the run configs: the ignored folder)
    study = long_study.Study("t_planned", 2, 20, ((42, "ddp"), (42, "deft"), (43, "ddp")))
    long_study.report(study, str(tmp_path))
    record = json.loads((tmp_path / "results" / "t_planned.json").read_text())
    assert sorted((r["seed"], r["algo"]) for r in record["runs"]) == [(42, "ddp"), (42, "deft"), (43, "ddp")]
    assert all(r["pending"] for r in record["runs"])  # nothing trained: each planned run is pending


def test_the_length_figure_pairs_ddp_and_dgc_at_each_length_where_both_finished(tmp_path) -> None:
    dgc = long_study.RECOMMENDED
    _finished_run(tmp_path / "parity_full_length_e3" / "cifar10_full_ddp_s42.json", [0.5, 0.70, 0.72], 1173)
    _finished_run(tmp_path / "parity_full_length_e3" / f"cifar10_full_{dgc}_s42.json", [0.4, 0.66, 0.68], 1173, 50.0)
    _finished_run(tmp_path / "parity_full_length_e5" / "cifar10_full_ddp_s42.json", [0.8, 0.8], 1955)  # DGC missing
    _finished_run(tmp_path / "parity_full_cifar2" / "cifar10_full_ddp_s43.json", [0.8, 0.8], 7820)  # another seed
    (row,) = long_study.length_summary(tmp_path)
    assert (row["epochs"], row["steps"], row["seed"]) == (3, 1173, 42)
    assert row["ddp"] == pytest.approx(0.71) and row[dgc] == pytest.approx(0.67)  # the last two evaluations
    assert row["difference"] == pytest.approx(-0.04) and row["compression"] == 50.0


def test_the_precision_sentence_waits_for_both_finished_ddp_runs_of_seed_42(tmp_path) -> None:
    folder = tmp_path / "parity_full_cifar2"
    _finished_run(folder / "cifar10_full_ddp_s42.json", [0.8, 0.842, 0.846], 7820)
    assert long_study.precision_sentence(tmp_path) is None  # fp32 not run yet
    (folder / "cifar10_full_ddp_fp32_s42.json").write_text(json.dumps({"finished": False, "history": []}))
    assert long_study.precision_sentence(tmp_path) is None  # stopped part-way: not quoted
    _finished_run(folder / "cifar10_full_ddp_fp32_s42.json", [0.8, 0.840, 0.842], 7820)
    assert long_study.precision_sentence(tmp_path) == (
        "DDP, seed 42: 84.40% under bf16 autocast, 84.10% in fp32 (+0.30 points)"
    )


def test_the_input_pipeline_variants_change_only_the_augmentation_and_the_loader_workers() -> None:
    from benchmarks import input_pipeline

    base = list(TASK.overrides)
    for variant, (augment, workers) in input_pipeline.VARIANTS.items():
        got = list(input_pipeline.overrides(variant))
        assert got[got.index("--data.augment") + 1] == augment and got[got.index("--data.num_workers") + 1] == str(workers)
        assert got[-2:] == ["--trainer.limit_val_batches", "0"]
        changed = [i for i, (a, b) in enumerate(zip(base, got[: len(base)], strict=True)) if a != b]
        assert all(base[i - 1] in ("--data.augment", "--data.num_workers") for i in changed)
    rows = input_pipeline.summary({"batch": [0.2, 0.22, 0.21], "workers": [0.3], "inline": []})
    assert rows["batch"] == {"step_s": 0.21, "ratio_to_batch": 1.0}
    assert rows["workers"]["ratio_to_batch"] == pytest.approx(0.3 / 0.21) and rows["inline"]["step_s"] is None


def test_the_lean_sentence_says_whether_each_target_was_met() -> None:
    def sentence(gaps: list[float], fewer: float) -> str:
        n = len(gaps)
        row = {"algo": "dgc_lean", "metric": 0.84, "seeds": [42, 43, 44][:n], "paired_seeds": n, "compression": fewer,
               "difference": sum(gaps) / n / 100, "difference_std": 0.001}  # fmt: skip
        return long_study.lean_sentence({"summary": [row]})

    assert long_study.lean_sentence({"summary": []}) is None
    assert "(target within 0.3 points over 3 seeds: 2 more seeds to run)" in sentence([-0.4], 250)
    assert "missed: more than 0.5 points on the first seed" in sentence([-0.6], 250)
    assert "3 seeds: met)" in sentence([-0.5, 0.1, 0.1], 250) and "(target at least 200x: met)" in sentence([0.0], 250)
    assert "3 seeds: missed)" in sentence([-0.5, -0.3, -0.3], 250)
    assert "(target at least 200x: missed)" in sentence([0.0], 150)


def test_a_gap_at_the_tolerance_s_edge_is_within_it_at_the_logged_metric_s_resolution() -> None:
    """50 images of 10,000 behind, as float32 logs it, is within 0.5 points; one image more is not."""
    assert parity.within_tolerance(0.0050000250, 0.005)
    assert not parity.within_tolerance(0.0051, 0.005)
    assert parity.within_tolerance(-0.01, 0.005)  # ahead of DDP


def _eight_worker_run(runs_dir: Path, algo: str, early: float, late: float, link_bytes: float, drop: float = 0.002,
                      seed: int = 42, density: float = 0.001) -> None:
    """A finished 20-step run at 8 workers, one evaluation a step (the learning rate drops at step 12): ``early``
    before the drop, ``late`` after it, ``drop`` lower over the last two."""
    accs = [early] * 12 + [late] * 6 + [late - drop] * 2
    _finished_run(runs_dir / "parity_full_cifar8" / f"cifar10_full_{algo}_s{seed}.json", accs, 20,
                  compression={"link_bytes": link_bytes}, densities=[0.25, density])


def test_the_deft_cause_sentence_names_the_changes_that_close_at_least_half_of_its_late_gap(tmp_path) -> None:
    """From the first learning-rate step (epoch 12 of 20) on, DEFT is 0.65 points below DDP on average, the
    norm-proportional k 0.75, DEFT as published 0.55 and selectors="all" 0.30: only the last closes half.
    Evaluations before the step do not count; the last two are the study's metric."""
    run = functools.partial(_eight_worker_run, tmp_path)
    summary = {"summary": [{"algo": "ddp", "link_kb_per_step": 100.0}, {"algo": "deft", "seeds": [42]}]}  # 100 kB a step
    run("ddp", 0.5, 0.842, 0.0, drop=0.0)
    run("deft", 0.6, 0.836, 2e5)
    run("deft_norm_k", 0.4, 0.835, 2e5)
    run("deft_paper", 0.4, 0.837, 1e4)
    assert long_study.deft_cause_sentence(summary, tmp_path) is None  # selectors="all" not finished
    run("deft_all_selectors", 0.3, 0.8395, 1e5)
    sentence, closes = long_study.deft_cause_sentence(summary, tmp_path)
    assert closes == ["deft_all_selectors"]
    assert "is, in points, -0.65 (-0.80 over the last two; 10.0x fewer link bytes) for `algo/deft`, -0.75" in sentence
    assert "-0.30 (-0.45 over the last two; 20.0x fewer link bytes) with every rank selecting" in sentence
    assert "-0.55 (-0.70 over the last two; 200.0x fewer link bytes) as published throughout (`deft_paper`" in sentence
    assert sentence.endswith('; `selectors="all"` closes at least half of `algo/deft`\'s gap there')
    run("deft_all_selectors", 0.3, 0.838, 1e5)  # 0.4 points below: not half
    assert long_study.deft_cause_sentence(summary, tmp_path) == (sentence.replace("-0.30 (-0.45", "-0.45 (-0.60").replace(
        '`selectors="all"` closes', "none closes"), [])
    run("ddp", 0.5, 0.842, 0.0, drop=0.0, seed=43)  # a second seed of algo/deft: 0.2 below on average, not 0.65
    run("deft", 0.6, 0.84, 2e5, drop=0.0, seed=43)
    summary["summary"][1]["seeds"] = [42, 43]
    sentence, _ = long_study.deft_cause_sentence(summary, tmp_path)
    assert sentence.endswith("gap there (over seeds 42, 43, `algo/deft`'s varies by 0.32, a standard deviation)")


def test_the_deft_density_sentence_says_whether_dgc_at_deft_s_density_closes_half_of_its_late_gap(tmp_path) -> None:
    """DEFT is 0.65 points below DDP on average from the learning rate's first step on; DGC at the same density
    0.30 below closes half of that, 0.45 below does not, above DDP closes all of it; DGC at another density is no
    control."""
    run = functools.partial(_eight_worker_run, tmp_path)
    summary = {"summary": [{"algo": "ddp", "link_kb_per_step": 100.0}, {"algo": "deft", "seeds": [42]}]}
    run("ddp", 0.5, 0.842, 0.0, drop=0.0)
    run("deft", 0.6, 0.836, 2e5)
    assert long_study.deft_density_sentence(summary, tmp_path) is None  # DGC not finished
    run("dgc", 0.3, 0.8395, 4e4)
    assert long_study.deft_density_sentence(summary, tmp_path) == (
        "DGC at the same density, 0.001, with its paper's warm-up (`algo/dgc_warmup`), on seed 42: -0.30 (-0.45 over"
        " the last two; 50.0x fewer link bytes); it closes at least half of `algo/deft`'s gap there", True)
    run("dgc", 0.3, 0.838, 4e4)
    sentence, closes = long_study.deft_density_sentence(summary, tmp_path)
    assert not closes and sentence.endswith("-0.45 (-0.60 over the last two; 50.0x fewer link bytes); it does not close"
                                            " at least half of `algo/deft`'s gap there")
    run("dgc", 0.3, 0.846, 4e4)  # above DDP: all of DEFT's gap closed, and more
    assert long_study.deft_density_sentence(summary, tmp_path)[1]
    run("dgc", 0.3, 0.838, 4e4, density=0.01)
    with pytest.raises(ValueError, match="density 0.01, algo/deft at 0.001: not a control"):
        long_study.deft_density_sentence(summary, tmp_path)
