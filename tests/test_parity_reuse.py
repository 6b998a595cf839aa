"""``benchmarks.parity --reuse`` takes an earlier record only for the same run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from benchmarks import bf16_cpu, parity


def test_run_key_follows_settings_not_comments_or_the_scratch_folder(tmp_path: Path) -> None:
    config = tmp_path / "algo.yaml"
    config.write_text("trainer:\n  strategy: dgc\n")

    def argv(scratch: str, *extra: str) -> list[str]:
        return ["python", "-m", "lightning_dgc_recipes", "fit", "--config", str(config), "--trainer.default_root_dir",
                f"{scratch}/root", *extra]  # fmt: skip

    key = parity.run_key(argv("/tmp/a"), Path("/tmp/a"))
    assert parity.run_key(argv("/tmp/b"), Path("/tmp/b")) == key  # a new scratch folder: the same run
    assert parity.run_key(argv("/tmp/a", "--trainer.max_epochs", "2"), Path("/tmp/a")) != key
    config.write_text("# why dgc\ntrainer:\n  strategy:   dgc  # a comment\n")  # only comments and layout
    assert parity.run_key(argv("/tmp/a"), Path("/tmp/a")) == key
    config.write_text("trainer:\n  strategy: deft\n")  # a setting edited, the command unchanged
    assert parity.run_key(argv("/tmp/a"), Path("/tmp/a")) != key


def _run(algo: str, seed: int, evals: list[float], loss: float) -> dict:
    run = {"task": "cifar10", "algo": algo, "seed": seed, "history": [{"val_acc": v} for v in evals],
           "train_loss_epochs": [{"epoch": 0, "train_loss": 9.0}, {"epoch": 1, "train_loss": loss}]}  # fmt: skip
    run.update(parity.protocol_values(parity.TASKS["cifar10"], run))
    return run


def test_the_seed_protocol_averages_the_last_two_evaluations_and_pairs_differences_by_seed() -> None:
    runs = [
        _run("ddp", 42, [0.1, 0.60, 0.62], 1.0), _run("dgc", 42, [0.1, 0.58, 0.60], 1.1),
        _run("ddp", 43, [0.1, 0.50, 0.50], 1.2), _run("dgc", 43, [0.1, 0.50, 0.49], 1.3),
    ]  # fmt: skip
    assert runs[0]["metric_last2"] == pytest.approx(0.61)
    assert runs[0]["last2_spread"] == pytest.approx(0.02)
    assert runs[0]["train_loss_last_epoch"] == 1.0  # the last epoch's, not the first
    ddp, dgc = parity.summarize(parity.TASKS["cifar10"], runs, devices=8)
    assert ddp["metric"] == pytest.approx(0.555) and ddp["metric_std"] == pytest.approx(0.0777817, rel=1e-5)
    # paired by seed: -0.02 and -0.005, whatever the spread between the seeds themselves
    assert dgc["difference"] == pytest.approx(-0.0125) and dgc["difference_std"] == pytest.approx(0.0106066)
    assert dgc["met"] is False  # 1.25 pp worse than ddp, the tolerance is 0.5 pp
    assert dgc["train_loss"] == pytest.approx(1.2)


def test_the_ablation_table_compares_each_variant_with_deft_and_ddp_on_its_own_seed() -> None:
    """A study with several seeds of DDP and DEFT and an ablation on one seed: the ablation's differences are to
    that seed's runs, not to the last seed's."""
    runs = [{"task": "cifar10_full", "algo": a, "seed": s, "metric": m} for a, s, m in (
        ("ddp", 42, 0.842), ("deft", 42, 0.838), ("deft_norm_k", 42, 0.836), ("ddp", 44, 0.845), ("deft", 44, 0.835),
    )]  # fmt: skip
    rows = parity.ablation_rows({"runs": runs})
    assert [r[1] for r in rows] == ["deft s42", "deft_norm_k s42"]  # seed 44 has no ablation
    assert rows[1][4:6] == ["-0.20 pp", "-0.60 pp"]  # against deft s42 and ddp s42
    one_seed = parity.ablation_rows({"runs": [r for r in runs if r["seed"] == 42]})
    assert [r[1] for r in one_seed] == ["deft", "deft_norm_k"]  # a run set of one seed names no seed


def test_the_summary_table_writes_a_difference_s_sign_either_side_of_ddp() -> None:
    row = {"task": "cifar10_full", "devices": 8, "seeds": [42], "metric": 0.8457, "metric_std": None,
           "train_loss": 0.385, "train_loss_std": None, "link_kb_per_step": 166.2, "compression": 11.4, "met": True,
           "paired_seeds": 1}
    above, below = ({**row, "algo": "dgc", "difference": d, "difference_std": None} for d in (0.0039, -0.0196))
    assert [r[5] for r in parity.summary_rows({"summary": [above, below]})] == ["+0.39 pp", "-1.96 pp"]
    assert parity.targets({"summary": [above]})[0]["value"] == "+0.39 pp"


def test_a_run_of_another_length_gets_the_configs_milestones_at_the_same_fractions() -> None:
    task = parity.TASKS["cifar10"]  # the config: 10 epochs, milestones 6 and 8
    assert parity.milestones(task, 10) == [6, 8]
    assert parity.milestones(task, 12) == [7, 10]
    assert parity.milestones(task, 2) == [1]


def test_the_short_warmup_takes_a_fifth_of_any_run_and_the_paper_warmup_its_epochs() -> None:
    record = Path("record.json")
    assert "run_fraction: 0.2" in parity.callbacks_yaml("dgc_short_warmup", record, epochs=10)
    assert "run_fraction" not in parity.callbacks_yaml("dgc", record, epochs=10)  # per epoch: 4 of the 10
    assert "run_fraction: 0.2" in parity.callbacks_yaml("dgc", record, epochs=4)  # too short for 4 epochs


def test_the_adamw_variant_runs_what_the_shipped_adamw_config_sets() -> None:
    """``dgc_density_0.01_int8_light_warmup`` (measured on the transformer) is ``configs/algo/dgc_adamw.yaml``:
    the same strategy settings and the same warm-up."""
    shipped = yaml.safe_load((parity.common.REPO / "configs/algo/dgc_adamw.yaml").read_text())["trainer"]
    variant = "dgc_density_0.01_int8_light_warmup"
    config, args, _ = parity.ALGO_SPECS[variant]
    base = yaml.safe_load((parity.common.REPO / config).read_text())["trainer"]
    init_args = dict(base["strategy"]["init_args"])
    for flag, value in zip(args[::2], args[1::2], strict=True):
        init_args[flag.removeprefix("--trainer.strategy.init_args.")] = yaml.safe_load(value)
    assert shipped["strategy"] == {**base["strategy"], "init_args": init_args}
    callbacks = yaml.safe_load(parity.callbacks_yaml(variant, Path("record.json"), epochs=6))["trainer"]["callbacks"]
    assert callbacks[:2] == shipped["callbacks"]
    assert shipped["callbacks"][0]["init_args"]["densities"] == list(parity.LIGHT_WARMUP)


def test_a_bf16_task_on_a_cpu_without_bf16_instructions_runs_its_matmuls_in_fp32(monkeypatch) -> None:
    transformer, lstm = parity.TASKS["ptb_transformer"], parity.TASKS["ptb"]
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert parity.emulates_bf16(transformer) and parity.run_env(transformer, 1)[bf16_cpu.ENV] == "1"
    assert not parity.emulates_bf16(lstm) and bf16_cpu.ENV not in parity.run_env(lstm, 1)  # fp32 task
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert not parity.emulates_bf16(transformer) and bf16_cpu.ENV not in parity.run_env(transformer, 1)
