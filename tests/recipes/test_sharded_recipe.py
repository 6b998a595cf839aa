"""The PTB transformer recipe sharded across nodes through the CLI: two ``torchrun`` agents of 2 processes each on
this machine, ``--config ptb_transformer_cpu --config algo/dgc_hsdp --trainer.num_nodes 2``, on generated PTB files."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port
from tests.lightning.run import _environment, outputs_of_passed, run_together
from tests.recipes.fake_datasets import TINY_OVERRIDES

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_transformer_recipe_trains_sharded_across_two_nodes_and_checkpoints(ptb_root: Path, tmp_path: Path) -> None:
    """4 steps of FSDP2 inside each node and the recommended DGC across the two, then a checkpoint: the
    ``torch.distributed.checkpoint`` folder with every process's exchange state in it."""
    port = free_port()
    cli = [
        "-m", "lightning_dgc_recipes", "fit", "--config", "ptb_transformer_cpu", "--config", "algo/dgc_hsdp",
        *TINY_OVERRIDES["ptb_transformer_cpu"], f"--data.root={ptb_root}", "--trainer.num_nodes=2",
        "--trainer.max_steps=4", "--trainer.limit_val_batches=1", f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]  # fmt: skip
    commands = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank",
         str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), *cli]
        for node in range(2)
    ]  # fmt: skip
    env = _environment() | {"OMP_NUM_THREADS": "1"}
    outputs = outputs_of_passed(run_together(commands, [env, env], REPO_ROOT, timeout=400))
    assert "HSDPCompressionStrategy: 2 node(s) x 2 process(es)" in outputs[0]
    (checkpoint,) = tmp_path.rglob("*.ckpt")
    assert checkpoint.is_dir() and (checkpoint / ".metadata").is_file()
    files = sorted(p.name for p in (checkpoint / "lightning_dgc.exchange").iterdir())
    assert [f[:10] for f in files] == [f"rank-0000{r}" for r in range(4)]
    meta = torch.load(checkpoint / "meta.pt", weights_only=True)
    assert meta["global_step"] == 4 and meta["lightning_dgc"]["topology"] == {
        "hierarchical": False, "sharded": True, "nodes": 2, "per_node": 2,
    }  # fmt: skip
