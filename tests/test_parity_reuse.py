"""``benchmarks.parity --reuse`` takes an earlier record only for the same run."""

from __future__ import annotations

from pathlib import Path

from benchmarks import parity


def test_run_key_follows_the_command_and_the_config_texts_not_the_scratch_folder(tmp_path: Path) -> None:
    config = tmp_path / "algo.yaml"
    config.write_text("trainer:\n  strategy: dgc\n")

    def argv(scratch: str, *extra: str) -> list[str]:
        return ["python", "-m", "recipes", "fit", "--config", str(config), "--trainer.default_root_dir",
                f"{scratch}/root", *extra]  # fmt: skip

    key = parity.run_key(argv("/tmp/a"), Path("/tmp/a"))
    assert parity.run_key(argv("/tmp/b"), Path("/tmp/b")) == key  # a new scratch folder: the same run
    assert parity.run_key(argv("/tmp/a", "--trainer.max_epochs", "2"), Path("/tmp/a")) != key
    config.write_text("trainer:\n  strategy: deft\n")  # the YAML edited, the command unchanged
    assert parity.run_key(argv("/tmp/a"), Path("/tmp/a")) != key
