"""A callback that a CLI run in a subprocess adds (``--trainer.callbacks+=tests.recipes.ddp_probe.DDPWrapperProbe``)
to report how the strategy wrapped the model: it writes ``{LIGHTNING_DGC_DDP_PROBE}.rank{r}.json`` per rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

#: The environment variable that holds the output prefix.
ENV = "LIGHTNING_DGC_DDP_PROBE"


class DDPWrapperProbe(Callback):
    """Writes the DDP wrapper's ``gradient_as_bucket_view`` and the strategy's class at the start of ``fit``."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        assert isinstance(model, DistributedDataParallel), type(model)
        record = {"strategy": type(trainer.strategy).__name__, "gradient_as_bucket_view": model.gradient_as_bucket_view}
        Path(f"{os.environ[ENV]}.rank{trainer.global_rank}.json").write_text(json.dumps(record))


def read(prefix: Path, world_size: int = 2) -> list[dict]:
    """The records of every rank."""
    return [json.loads(Path(f"{prefix}.rank{rank}.json").read_text()) for rank in range(world_size)]
