"""Accuracy parity on real data: the recipes under ``ddp``, ``dgc`` (with SparsityWarmup), ``deft`` and ``powersgd``.

    .venv/bin/python -m benchmarks.parity --quick          # a few minutes: small budgets, indicative only
    .venv/bin/python -m benchmarks.parity --full           # the CPU configs' own schedules (hours)
    .venv/bin/python -m benchmarks.parity --tasks ptb --algos ddp,dgc --data-root ./data

Each run is the recipes' Lightning CLI in a subprocess, two processes on the CPU (the CPU configs'
``devices: 2``; ``--devices N`` runs N, with the per-process batch divided so that the global batch,
and so the optimizer steps, stay the config's; ``--threads T`` compute threads each), same seed (the
configs' ``seed_everything: 42``) and same budget for every algorithm::

    python -m lightning_dgc_recipes fit --config configs/<task>_cpu.yaml --config configs/algo/<algo>.yaml \\
        --config <generated callbacks.yaml> --data.root <data> --trainer.max_epochs E \\
        --trainer.limit_train_batches N ...

The generated config (saved under ``benchmarks/results/parity_configs/``) replaces the algorithm
YAML's callback list with the same callbacks plus :class:`benchmarks.common.RunRecorder`, which
writes the validation metrics and the run's total exchanged bytes to JSON. For ``dgc`` it holds
the paper's warm-up (densities 0.25, 0.0625, 0.015625, 0.004, then 0.001): per epoch, as in
``configs/algo/dgc_warmup.yaml``, when the run has at least 8 epochs, otherwise over the first 20% of
the optimizer steps, each stage for 5% (``SparsityWarmup(run_fraction=0.2)``: a short run would
otherwise never leave the warm-up); ``dgc_short_warmup`` is the latter whatever the run's length.
``deft`` is ``configs/algo/deft.yaml`` as shipped: DGC's momentum correction and the same warm-up.
``powersgd`` is ``configs/algo/powersgd.yaml`` (rank 2, plain all-reduce for the first 10 steps).
``--algos`` also takes ``deft_paper``: DEFT as published (error feedback with the optimizer's
momentum, no warm-up, k by fragment norm, a union of k values, the int32/fp32 all-reduces), and the
ablations of :data:`DEFT_ABLATIONS` (``deft.yaml`` with one part switched) and the remedies tried for its
8-worker gap (``deft_all_selectors``, ``deft_link``, ``deft_all_selectors_link``). ``deft.yaml`` shares k by fragment size since the 8-worker ablation
(``deft_uniform_k`` then; ``deft_norm_k`` is the published allocation) and fills DGC's link bytes
(``budget: dgc_link``) since the remedies: the 8-worker ``deft`` row of ``parity_8workers`` ran before
that, and ``deft_link`` is ``deft.yaml`` as shipped (at 2 workers the budget is k, so 2-worker runs
are unchanged).

Tasks (data from ``--data-root``, default ``../shared/data`` relative to the repository):

* ``cifar10``: ResNet-20 on the CIFAR-10 subset (10,000 training images, 2,000 test images); top-1
  on the test batch; target |dgc - ddp| and |deft - ddp| <= 0.5 percentage points.
* ``ptb``: the CPU-sized PTB LSTM (2 x 200); validation perplexity; target within 2 % of ddp. Every
  algorithm clips the averaged update at the config's 0.25 (the DGC paper's local clipping instead,
  ``local_clip_norm 0.25`` with ``gradient_clip_val`` off, was tried for dgc over the 4 epochs:
  136.13, +3.69 %, against +2.06 % with the config's clipping).
* ``ptb_transformer``: the CPU-sized decoder-only transformer with AdamW (warm-up and cosine decay),
  bf16 autocast; validation perplexity; target within 3 % of ddp. ``dgc`` there is plain error feedback
  (``DGCStrategy``'s default ``momentum=0``, what Adam-family optimizers need) with the warm-up.
* ``digits``: the CPU-sized DeepSpeech on spoken digits (``train-digits`` / ``test-digits``); CER
  (and WER); target within 1 percentage point of ddp. The learning rate is 3e-3 for every
  algorithm (the config's 3e-4 is LibriSpeech's, for far longer runs).

Quick mode trains each run for 60-170 optimizer steps (2-10% of the CPU configs' schedules): the
figures show the methods side by side on real data, early in training, where sparse updates still
lag dense ones; they say little about final accuracy. Runs are deterministic (same seed, same
result when repeated); ``--full`` (or ``--epochs``/``--batches``) trains longer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks import bf16_cpu, common
from lightning_dgc.algorithms.base import ring_allreduce_volume

CONFIG_DIR = common.RESULTS / "parity_configs"
CONFIG_DEVICES = 2  # the CPU configs' ``trainer.devices``
ALGOS = ("ddp", "dgc", "deft", "powersgd")
#: the ``light_warmup`` schedule: the paper's warm-up without its first stage (0.25), each later stage twice as long
LIGHT_WARMUP = (0.0625, 0.0625, 0.015625, 0.015625)
#: the ``lean_warmup`` schedule (``algo/dgc_lean``): the paper's warm-up without its first stage, one epoch a stage
LEAN_WARMUP = (0.0625, 0.015625, 0.004)
#: DGC at density 0.01 with int8 values, the transformer's (AdamW's) variants' CLI arguments
DENSITY_0_01_INT8 = ("--trainer.strategy.init_args.density", "0.01", "--trainer.strategy.init_args.value_dtype", "int8")
#: momentum factor masking off (a coordinate keeps its momentum when it is sent)
NO_MASKING = ("--trainer.strategy.init_args.momentum_masking", "false")
#: name -> (algorithm YAML, extra CLI arguments, the density schedule: ``True`` the warm-up,
#: ``"short_warmup"`` its four stages over the first 20% of the run whatever its length, ``"light_warmup"``
#: ``LIGHT_WARMUP`` over that 20%,
#: ``"regimes"`` CriticalRegimes alone, ``"regimes+warmup"`` both, ``False`` none); variants for
#: ``--algos`` outside the default set follow the four.
ALGO_SPECS: dict[str, tuple[str, tuple[str, ...], bool | str]] = {
    "ddp": ("configs/algo/ddp.yaml", (), False),
    "dgc": ("configs/algo/dgc_warmup.yaml", (), True),
    "deft": ("configs/algo/deft.yaml", (), True),
    "powersgd": ("configs/algo/powersgd.yaml", (), False),
    "deft_paper": (
        "configs/algo/deft.yaml",
        ("--trainer.strategy.init_args.momentum_correction", "false", "--trainer.strategy.init_args.k_allocation",
         "norm", "--trainer.strategy.init_args.budget", "k", "--trainer.strategy.init_args.wire", "allreduce"),
        False,
    ),
    # the critical-regime schedule: configs/algo/dgc_regimes.yaml as shipped (with the paper's warm-up), and
    # CriticalRegimes alone (the warm-up left out)
    "dgc_regimes_warmup": ("configs/algo/dgc_regimes.yaml", (), "regimes+warmup"),
    "dgc_regimes": ("configs/algo/dgc_regimes.yaml", (), "regimes"),
    # the paper's warm-up in a fifth of the run (each stage 5%), not four epochs: fewer bytes over a short run
    "dgc_short_warmup": ("configs/algo/dgc_warmup.yaml", (), "short_warmup"),
    # the shipped regimes recipe with its values sent in fp16 or int8 (4 or 3.125 bytes a value with its index, not 6)
    "dgc_regimes_fp16": (
        "configs/algo/dgc_regimes.yaml",
        ("--trainer.strategy.init_args.value_dtype", "fp16"),
        "regimes+warmup",
    ),
    "dgc_regimes_int8": (
        "configs/algo/dgc_regimes.yaml",
        ("--trainer.strategy.init_args.value_dtype", "int8"),
        "regimes+warmup",
    ),
    "deft_regimes": ("configs/algo/deft.yaml", (), "regimes"),
    # AdamW: the regimes over a target of 0.005 (0.05 in the start window)
    "dgc_regimes_0.005": ("configs/algo/dgc_regimes.yaml", ("--trainer.strategy.init_args.density", "0.005"), "regimes"),
    # DGC with density="auto": the link decides (the warm-up's densities are a floor under it)
    "dgc_auto": ("configs/algo/dgc_warmup.yaml", ("--trainer.strategy.init_args.density", "auto"), True),
    # DGC ten times denser: how much of the transformer's (AdamW's) gap the density explains
    "dgc_density_0.01": (
        "configs/algo/dgc_warmup.yaml",
        ("--trainer.strategy.init_args.density", "0.01"),
        True,
    ),
    # the same with its values sent in int8 (3.125 bytes a value with its index, not 6)
    "dgc_density_0.01_int8": (
        "configs/algo/dgc_warmup.yaml",
        DENSITY_0_01_INT8,
        True,
    ),
    # the same without the warm-up (AdamW's second moment left to settle under the target density), and with a
    # lighter one: the paper's stages from its second (0.0625, 0.0156), each twice as long, over the same 20%;
    # the latter is what configs/algo/dgc_adamw.yaml ships (a test compares them)
    "dgc_density_0.01_int8_no_warmup": (
        "configs/algo/dgc_warmup.yaml",
        DENSITY_0_01_INT8,
        False,
    ),
    "dgc_density_0.01_int8_light_warmup": (
        "configs/algo/dgc_warmup.yaml",
        DENSITY_0_01_INT8,
        "light_warmup",
    ),
    # the same without momentum factor masking: a coordinate keeps its momentum when it is sent, as under DDP
    # (with masking, a coordinate sent every k steps moves (k - m (1 - m^k) / (1 - m)) / k of DDP's steady step:
    # 10% at k = 1, 26% at k = 5, 91% at k = 100, for m = 0.9)
    "dgc_density_0.01_int8_light_warmup_no_masking": (
        "configs/algo/dgc_warmup.yaml",
        (*DENSITY_0_01_INT8, *NO_MASKING),
        "light_warmup",
    ),
    # the same as top-k with error feedback: no momentum correction, SGD's momentum and weight decay applied by the
    # optimizer to the averaged sparse update (GRACE's "top-k with EF", ahead of DGC on short CIFAR schedules)
    "dgc_density_0.01_int8_light_warmup_ef": (
        "configs/algo/dgc_warmup.yaml",
        (*DENSITY_0_01_INT8, "--trainer.strategy.init_args.momentum_correction", "false"),
        "light_warmup",
    ),
    # the light warm-up with CriticalRegimes (its defaults: 10x denser in the first tenth of the run and a tenth
    # after each drop of the learning rate)
    "dgc_density_0.01_int8_light_warmup_regimes": (
        "configs/algo/dgc_warmup.yaml",
        DENSITY_0_01_INT8,
        "regimes+light_warmup",
    ),
    # DGC at the density density="auto" chose on the 20 Mbit/s link (1/16), with the paper's warm-up as its floor,
    # and the same without momentum factor masking (whose damping of often-sent coordinates grows with the density)
    "dgc_density_0.0625": ("configs/algo/dgc_warmup.yaml", ("--trainer.strategy.init_args.density", "0.0625"), True),
    "dgc_density_0.0625_no_masking": (
        "configs/algo/dgc_warmup.yaml",
        ("--trainer.strategy.init_args.density", "0.0625", *NO_MASKING),
        True,
    ),
    # nearly dense (a quarter of each tensor a step, no warm-up, no masking): DGC's sparse path where its delays are
    # short, against DDP's
    "dgc_density_0.25_no_masking": (
        "configs/algo/dgc.yaml",
        ("--trainer.strategy.init_args.density", "0.25", *NO_MASKING),
        False,
    ),
    # local steps: an outer exchange every 10 optimizer steps, dense or DGC's top-k at density 0.01
    "diloco": ("configs/algo/diloco.yaml", (), False),
    "diloco_dgc": ("configs/algo/diloco_dgc.yaml", (), False),
    # the same with an outer step every 50 optimizer steps
    "diloco_h50": ("configs/algo/diloco.yaml", ("--trainer.strategy.init_args.sync_every", "50"), False),
    "diloco_dgc_h50": ("configs/algo/diloco_dgc.yaml", ("--trainer.strategy.init_args.sync_every", "50"), False),
    # local SGD: the same rounds with the outer step a plain average (outer lr 1, no momentum), which tells the
    # local steps' cost from the outer optimizer's
    "diloco_local_sgd": (
        "configs/algo/diloco.yaml",
        ("--trainer.strategy.init_args.outer_lr", "1.0", "--trainer.strategy.init_args.outer_momentum", "0.0",
         "--trainer.strategy.init_args.outer_nesterov", "false"),
        False,
    ),
    # Streaming DiLoCo: the same rounds in 5 staggered fragments, each exchange behind one inner step; and the
    # fragments alone (no overlap), which tells the fragments' effect from the overlap's
    "diloco_streaming": ("configs/algo/diloco_streaming.yaml", (), False),
    "diloco_fragments": ("configs/algo/diloco_streaming.yaml", ("--trainer.strategy.init_args.overlap_steps", "0"), False),
    # the overlap and its mix alone: one fragment, the whole model's exchange behind one inner step
    "diloco_overlap": ("configs/algo/diloco_streaming.yaml", ("--trainer.strategy.init_args.fragments", "1"), False),
    # the streamed recipe with another mix of the late global weights into the local ones: 0 replaces the local
    # weights (the inner steps taken meanwhile are lost), 0.75 keeps more of them
    "diloco_streaming_mix0": ("configs/algo/diloco_streaming.yaml", ("--trainer.strategy.init_args.mixing", "0.0"), False),
    "diloco_streaming_mix0.75": (
        "configs/algo/diloco_streaming.yaml", ("--trainer.strategy.init_args.mixing", "0.75"), False
    ),
    # DGC's top-k with error feedback on the optimizer's update (each rank's own step), not the gradient
    "dgc_updates": ("configs/algo/dgc_updates.yaml", (), False),
    # the recommended DGC as shipped: density 0.01, int8 values, the light warm-up
    "dgc_1pct_int8": ("configs/algo/dgc_1pct_int8.yaml", (), "light_warmup"),
    # DGC light in bytes: 0.001, int8, every tensor compressed, the paper's warm-up without its first stage
    "dgc_lean": ("configs/algo/dgc_lean.yaml", (), "lean_warmup"),
    # algo/dgc_lean with one lever taken back, to tell which one costs its accuracy: fp32 values, not int8; and the
    # 1-D and small tensors averaged dense again, as the paper's DGC does
    "dgc_lean_fp32": (
        "configs/algo/dgc_lean.yaml", ("--trainer.strategy.init_args.value_dtype", "fp32"), "lean_warmup"
    ),
    "dgc_lean_vectors_dense": (
        "configs/algo/dgc_lean.yaml",
        ("--trainer.strategy.init_args.compress_vectors", "false", "--trainer.strategy.init_args.min_compress_numel",
         "1024"),
        "lean_warmup",
    ),
    # algo/dgc_lean with its small tensors compressed at density 1/8 (small_density), not 0.001 nor dense
    "dgc_lean_small": ("configs/algo/dgc_lean_small.yaml", (), "lean_warmup"),
    # ... and without momentum factor masking: whether clearing a sent value's momentum, every few steps on a
    # small tensor, is what its compression costs
    "dgc_lean_small_nomask": (
        "configs/algo/dgc_lean_small.yaml", ("--trainer.strategy.init_args.momentum_masking", "false"), "lean_warmup"
    ),
    # algo/dgc_lean with its small tensors sent whole every 8 steps from their residual (small_every): each value at
    # most 7 steps late, none cleared from the momentum, for fewer bytes than at density 1/8
    "dgc_lean_every": ("configs/algo/dgc_lean_every.yaml", (), "lean_warmup"),
    # DDP in fp32, for a bf16 task: what bf16 autocast costs DDP's accuracy
    "ddp_fp32": ("configs/algo/ddp.yaml", ("--trainer.precision", "32-true"), False),
    # DDP with 5x the recipe's weight decay (5e-4, common for short CIFAR schedules): tuning the schedule for DDP
    "ddp_wd5e-4": ("configs/algo/ddp.yaml", ("--model.weight_decay", "0.0005"), False),
}
#: DEFT's ablations: the shipped DEFT with one part switched (see ``DEFTConfig``), for ``--algos``.
DEFT_ABLATIONS: dict[str, tuple[tuple[str, ...], bool]] = {
    "deft_uniform_k": (("--trainer.strategy.init_args.k_allocation", "size"), True),
    "deft_norm_k": (("--trainer.strategy.init_args.k_allocation", "norm"), True),
    "deft_whole_layers": (("--trainer.strategy.init_args.fragmenting", "false"), True),
    "deft_fixed_owners": (("--trainer.strategy.init_args.rotation", "false"), True),
    "deft_owner_values": (("--trainer.strategy.init_args.union_values", "owner"), True),
    "deft_no_warmup": ((), False),
    "deft_no_momentum_correction": (("--trainer.strategy.init_args.momentum_correction", "false"), True),
    # not parts of the published method: the remedies tried for its 8-worker gap
    "deft_all_selectors": (("--trainer.strategy.init_args.selectors", "all"), True),
    "deft_link": (("--trainer.strategy.init_args.budget", "dgc_link"), True),
    "deft_all_selectors_link": (
        ("--trainer.strategy.init_args.selectors", "all", "--trainer.strategy.init_args.budget", "dgc_link"),
        True,
    ),
}
ALGO_SPECS.update({name: ("configs/algo/deft.yaml", *spec) for name, spec in DEFT_ABLATIONS.items()})
#: What each ablation changes against the full method (for the ablation table).
ABLATION_TEXT = {
    "deft_uniform_k": "k in proportion to fragment size, not norm",
    "deft_norm_k": "k in proportion to fragment norm (as published)",
    "deft_whole_layers": "no fragmenting: whole layers",
    "deft_fixed_owners": "no LPT rotation: fixed owners",
    "deft_owner_values": "only the owner sends and clears the union",
    "deft_no_warmup": "no density warm-up",
    "deft_no_momentum_correction": "error feedback only (optimizer momentum)",
    "deft_all_selectors": "every rank selects k/N in every fragment (not only owners)",
    "deft_link": "union fills DGC's link bytes (budget dgc_link, as deft.yaml ships)",
    "deft_all_selectors_link": "both of the above",
}


@dataclass(frozen=True)
class Task:
    name: str
    what: str
    config: str
    data_subdir: str
    metric: str  # key in trainer.callback_metrics
    metric_label: str
    higher_is_better: bool
    tolerance: float  # absolute (fraction) or relative, see `relative`
    relative: bool
    quick: tuple[int, int]  # (epochs, train batches per epoch)
    full: tuple[int, int | None]  # (epochs, train batches per epoch; None = all)
    batch_size: int = 64  # per process in the config, at the config's 2 processes
    extra_metrics: tuple[str, ...] = ()
    overrides: tuple[str, ...] = field(default_factory=tuple)
    #: the config's learning-rate milestones as fractions of its epochs: a run of another length gets
    #: them at the same fractions (``--model.milestones``), so it ends annealed as the config's does
    milestone_fractions: tuple[float, ...] = ()
    #: the config's own ``max_epochs`` when the task's full budget is another length (milestones are moved then)
    config_epochs: int | None = None
    #: a run saves a checkpoint at every epoch end and, started again, resumes from it (see :func:`run_one`)
    resumable: bool = False
    #: the data files the task needs under its data folder, and the fewest bytes each has (a smaller set's
    #: files of the same names are refused by name)
    required_files: tuple[tuple[str, int], ...] = ()


TASKS: dict[str, Task] = {
    "cifar10": Task(
        name="cifar10",
        what="ResNet-20, CIFAR-10 subset (10k train / 2k test), batch 2 x 64",
        config="configs/cifar10_resnet20_cpu.yaml",
        data_subdir="cifar10-subset",
        metric="val_acc",
        metric_label="top-1",
        higher_is_better=True,
        tolerance=0.005,
        relative=False,
        quick=(1, 60),
        full=(10, None),
        overrides=("--data.download", "false"),
        milestone_fractions=(0.6, 0.8),
    ),
    "ptb": Task(
        name="ptb",
        what="PTB LSTM 2 x 200, tied (configs/ptb_lstm_cpu.yaml), batch 2 x 20, BPTT 35",
        config="configs/ptb_lstm_cpu.yaml",
        data_subdir="ptb",
        metric="val_ppl",
        metric_label="perplexity",
        higher_is_better=False,
        tolerance=0.02,
        relative=True,
        quick=(1, 60),
        full=(4, None),
        batch_size=20,
        overrides=("--data.download", "false"),
    ),
    "ptb_transformer": Task(
        name="ptb_transformer",
        what="PTB decoder-only transformer, 2 blocks x 128, AdamW, warm-up + cosine"
        " (configs/ptb_transformer_cpu.yaml), batch 2 x 20, BPTT 35, bf16 autocast",
        config="configs/ptb_transformer_cpu.yaml",
        data_subdir="ptb",
        metric="val_ppl",
        metric_label="perplexity",
        higher_is_better=False,
        tolerance=0.03,
        relative=True,
        quick=(1, 60),
        full=(6, None),
        batch_size=20,
        # bf16 autocast where the accelerator has it: this benchmark's CPUs do (avx512_bf16), 2x faster;
        # without bf16 instructions its matrix products run as fp32 GEMMs (see `emulates_bf16`)
        overrides=("--data.download", "false", "--trainer.precision", "bf16-mixed"),
    ),
    "digits": Task(
        name="digits",
        what="DeepSpeech 2 x 128 bi-GRU, spoken digits (2,700 train / 300 test), batch 2 x 8",
        config="configs/librispeech_deepspeech_cpu.yaml",
        data_subdir="librispeech-digits",
        metric="val_cer",
        metric_label="CER",
        higher_is_better=False,
        tolerance=0.01,
        relative=False,
        quick=(1, None),
        full=(10, None),
        batch_size=8,
        extra_metrics=("val_wer",),
        overrides=(
            "--data.train_subset",
            "train-digits",
            "--data.val_subset",
            "test-digits",
            "--data.test_subset",
            "test-digits",
            "--data.download",
            "false",
            "--model.lr",
            "0.003",
        ),  # fmt: skip
    ),
}


# the long protocol: the CIFAR recipe on all of CIFAR-10 for 20 epochs (7,820 optimizer steps at the global batch of
# 128), the learning rate / 10 at 60% and 80% of the run as the config has it, bf16 autocast (the CPUs' avx512_bf16:
# 1.7x), the augmentation on each batch (one gather, seeded per batch: exact on resume), and the 10,000 test images
# evaluated every half epoch; run only when named (``--tasks cifar10_full``, ``benchmarks.long_study``)
TASKS["cifar10_full"] = replace(
    TASKS["cifar10"],
    name="cifar10_full",
    what="ResNet-20, CIFAR-10 (50k train / 10k test), batch 2 x 64, 20 epochs (7,820 steps), bf16 autocast,"
    " evaluated every half epoch",
    data_subdir="cifar10-full",
    full=(20, None),
    overrides=("--data.download", "false", "--trainer.precision", "bf16-mixed", "--trainer.val_check_interval",
               "0.5", "--data.augment", "batch", "--data.num_workers", "0"),  # fmt: skip
    config_epochs=10,
    resumable=True,
    required_files=(*((f"cifar-10-batches-py/data_batch_{i}", 10_000 * 3072) for i in range(1, 6)),
                    ("cifar-10-batches-py/test_batch", 10_000 * 3072), ("cifar-10-batches-py/batches.meta", 1)),
)  # fmt: skip

def callbacks_yaml(algo: str, record_path: Path, epochs: int, checkpoints: Path | None = None) -> str:
    """The run's ``trainer.callbacks`` (the algorithm YAML's, plus the recorder, plus with ``checkpoints`` a
    ``ModelCheckpoint`` that keeps the last epoch end's checkpoint there), as YAML text."""
    lines = ["trainer:", "  callbacks:"]
    schedule = ALGO_SPECS[algo][2]
    # the schedule's parts: "regimes+light_warmup" -> {"regimes", "light_warmup"}, True (the paper's warm-up) -> {"True"}
    parts = set(str(schedule).split("+")) if schedule else set()
    if "regimes" in parts:
        lines.append("    - class_path: lightning_dgc.CriticalRegimes")
    if parts - {"regimes"}:  # a warm-up: the paper's ("True", "warmup"), "short_warmup", "light_warmup" or "lean_warmup"
        lines.append("    - class_path: lightning_dgc.SparsityWarmup")
        settings = []
        if epochs < 8 or parts & {"short_warmup", "light_warmup"}:  # its stages over the first part of the run
            settings.append(f"        run_fraction: {0.15 if 'lean_warmup' in parts else 0.2}")
        if "light_warmup" in parts:
            settings.append(f"        densities: {list(LIGHT_WARMUP)}")
        if "lean_warmup" in parts:  # per epoch, as the paper's (its three later stages: 15% of a 20-epoch run)
            settings.append(f"        densities: {list(LEAN_WARMUP)}")
        if settings:
            lines += ["      init_args:", *settings]
    if not algo.startswith("ddp") and algo != "native_hsdp":  # (plain DDP and HSDP have no compression statistics)
        lines.append("    - class_path: lightning_dgc.CompressionMonitor")
    lines += [
        "    - class_path: benchmarks.common.RunRecorder",
        "      init_args:",
        f"        path: {json.dumps(str(record_path))}",
    ]
    if checkpoints is not None:
        # at epoch ends only: there a resume replays the data exactly (the sampler's order is a function of seed and
        # epoch), where a checkpoint after a mid-epoch evaluation would start that epoch's batches again. One file,
        # last.ckpt, replaced at each epoch end (no monitor: the newest is the one kept); not ``save_last`` with
        # ``save_top_k: 0``, which saves nothing since Lightning 2.6
        lines += [
            "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint",
            "      init_args:",
            f"        dirpath: {json.dumps(str(checkpoints))}",
            "        filename: last",
            "        save_top_k: 1",
            "        save_on_train_epoch_end: true",
        ]
    return "\n".join(lines) + "\n"


def algo_config(algo: str) -> str:
    return ALGO_SPECS[algo][0]


def steps_per_epoch_estimate(task: Task, batches: int | None) -> int | None:
    if batches is not None:
        return batches
    return {"cifar10": 79, "cifar10_full": 391, "ptb": 634, "ptb_transformer": 634, "digits": 170}.get(task.name)


RUNS_DIR = common.RESULTS / "parity_runs"
#: where a resumable task's data is built and its runs' checkpoints are kept (outside the checkout, so that a
#: stopped study resumes in a fresh clone on the same machine)
CACHE = Path(os.environ.get("LIGHTNING_DGC_CACHE", Path.home() / ".cache" / "lightning-dgc"))


def missing_files(task: Task, folder: Path) -> list[str]:
    """The task's required data files that ``folder`` lacks or holds too small, each with why."""
    out = []
    for name, least in task.required_files:
        path = folder / name
        if not path.is_file():
            out.append(f"{name} (missing)")
        elif path.stat().st_size < least:
            out.append(f"{name} ({path.stat().st_size:,} bytes; the full set's has at least {least:,})")
    return out


def data_folder(task: Task, data_root: Path) -> Path:
    """The folder ``task``'s runs read: ``<data_root>/<data_subdir>``; for a task with required files that the
    folder does not hold but whose ``build.py`` is there (``../shared/data/cifar10-full``), the set that
    ``build.py`` writes into :data:`CACHE` (once). Anything else is an error that names what is missing."""
    folder = data_root / task.data_subdir
    if not missing_files(task, folder):
        return folder
    builder = folder / "build.py"
    if builder.is_file():
        built = CACHE / task.data_subdir
        if missing_files(task, built):
            subprocess.run([sys.executable, str(builder), str(built)], check=True)
        folder = built
    missing = missing_files(task, folder)
    if missing:
        raise SystemExit(
            f"{task.name}: {folder} does not hold the full data set: {'; '.join(missing)}. Pass --data-root a folder"
            f" whose {task.data_subdir}/ holds all of CIFAR-10 in its original layout (cifar-10-batches-py/), or"
            f" the shared data's {task.data_subdir}/ with its build.py and archive."
        )
    return folder


def checkpoint_dir(name: str, run_name: str) -> Path:
    """Where a resumable run keeps its last epoch end's checkpoint."""
    return CACHE / "parity" / name / run_name


def per_process_batch(task: Task, devices: int) -> int:
    """The batch per process at ``devices`` processes that keeps the config's global batch (its
    per-process batch times its 2 processes), so that runs at any N take the same optimizer steps."""
    total = task.batch_size * CONFIG_DEVICES
    if total % devices:
        raise SystemExit(f"--devices {devices} does not divide {task.name}'s global batch of {total}")
    return total // devices


def command(
    task: Task,
    algo: str,
    data_root: Path,
    epochs: int,
    batches: int | None,
    workdir: Path,
    name: str = "parity",
    devices: int = CONFIG_DEVICES,
    seed: int | None = None,
) -> tuple[list[str], Path]:
    """(argv, record path) of one run; writes the run's generated config under ``parity_configs/<name>/``.

    ``seed``: ``--seed_everything`` (``None``: the config's 42); each seed has its own record."""
    run_name = f"{task.name}_{algo}" + ("" if seed is None else f"_s{seed}")
    record = RUNS_DIR / name / f"{run_name}.json"
    (CONFIG_DIR / name).mkdir(parents=True, exist_ok=True)
    generated = CONFIG_DIR / name / f"{run_name}.yaml"
    budget = f"{epochs} epoch(s) x {batches or 'all'} batches"
    checkpoints = checkpoint_dir(name, run_name) if task.resumable else None
    generated.write_text(
        f"# Generated by benchmarks/parity.py for {task.name} / {algo} ({budget}): the callbacks of\n"
        f"# {algo_config(algo)} plus benchmarks.common.RunRecorder (run metrics to JSON).\n"
        + callbacks_yaml(algo, record.relative_to(common.REPO), epochs, checkpoints)
    )
    argv = [
        common.python(), "-m", "lightning_dgc_recipes", "fit",
        "--config", task.config, "--config", algo_config(algo), "--config", str(generated.relative_to(common.REPO)),
        "--data.root", str(data_folder(task, data_root)), *task.overrides, *ALGO_SPECS[algo][1],
        "--trainer.max_epochs", str(epochs),
        "--trainer.devices", str(devices), "--data.batch_size", str(per_process_batch(task, devices)),
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_checkpointing", str(task.resumable).lower(),
        "--trainer.default_root_dir", str(workdir / "root"),
        "--trainer.logger.init_args.save_dir", str(workdir / "logs"),
        "--trainer.logger.init_args.version", run_name,
    ]  # fmt: skip
    if seed is not None:
        argv += ["--seed_everything", str(seed)]
    if task.milestone_fractions and epochs != (task.config_epochs or task.full[0]):
        argv += ["--model.milestones", json.dumps(milestones(task, epochs))]
    if batches is not None:  # per process: at N processes each sees 1/N of the data
        argv += ["--trainer.limit_train_batches", str(batches)]
    return argv, record


def milestones(task: Task, epochs: int) -> list[int]:
    """The config's learning-rate milestones moved to the same fractions of a run of ``epochs``."""
    return sorted({max(1, min(epochs - 1, round(f * epochs))) for f in task.milestone_fractions})


def display_command(argv: list[str], workdir: Path) -> str:
    """The command as a user would type it (``python`` for the interpreter, ``<tmp>`` for the scratch folder)."""
    out = []
    for arg in argv:
        if arg == common.python():
            arg = "python"
        elif arg.startswith(str(workdir)):
            arg = "<tmp>" + arg[len(str(workdir)) :]
        out.append(arg)
    return " ".join(out)


def run_key(argv: list[str], workdir: Path) -> str:
    """What makes two runs the same run, for ``--reuse``: the command (its scratch folder aside) and
    the content of every ``--config`` file it reads (an edited setting is a different run; an edited
    comment or layout is not: the files are compared as parsed YAML). A ``ModelCheckpoint`` is left out: where and
    how a run keeps its epoch-end checkpoint does not change what it computes."""
    digest = hashlib.sha256(display_command(argv, workdir).encode())
    for flag, value in zip(argv[:-1], argv[1:], strict=True):
        if flag == "--config":
            content = without_checkpointing(yaml.safe_load((common.REPO / value).read_text()))
            digest.update(json.dumps(content, sort_keys=True).encode())
    return digest.hexdigest()


def without_checkpointing(content: Any) -> Any:
    """A parsed config without its ``ModelCheckpoint`` callbacks (see :func:`run_key`)."""
    callbacks = content.get("trainer", {}).get("callbacks") if isinstance(content, dict) else None
    if isinstance(callbacks, list):
        content["trainer"]["callbacks"] = [
            c for c in callbacks if not (isinstance(c, dict) and str(c.get("class_path", "")).endswith(".ModelCheckpoint"))
        ]
    return content


def run_one(task: Task, algo: str, data_root: Path, epochs: int, batches: int | None, workdir: Path,
            timeout_s: float, name: str = "parity", devices: int = CONFIG_DEVICES,
            threads: int = 1, reuse: bool = False, seed: int | None = None,
            report_only: bool = False) -> dict[str, Any]:  # fmt: skip
    argv, record = command(task, algo, data_root, epochs, batches, workdir, name, devices, seed)
    log = workdir / f"{record.stem}.log"
    key, key_file = run_key(argv, workdir), record.with_suffix(".key")
    earlier = json.loads(record.read_text()) if (reuse or report_only) and record.exists() else {}
    # reuse only a finished run of the same command and the same config files' contents
    reused = bool(earlier.get("finished")) and key_file.exists() and key_file.read_text() == key
    if reused:
        code, wall = 0, earlier.get("train_wall_s")
    elif report_only:
        return {"task": task.name, "algo": algo, "seed": seed, "devices": devices, "epochs": epochs,
                "command": display_command(argv, workdir), "exit_code": None, "wall_s": None,
                "reused": False, "pending": True}  # fmt: skip
    else:
        if not task.resumable:  # (a resumable run drops its record only when it starts afresh)
            record.unlink(missing_ok=True)
        key_file.unlink(missing_ok=True)
        code, wall = common.run_command([*argv, *resume_arguments(task, name, record, key)], run_env(task, threads),
                                        log, timeout_s)  # fmt: skip
        if code == 0 and record.exists() and json.loads(record.read_text()).get("finished"):
            key_file.write_text(key)
            if task.resumable:  # a finished run's checkpoint is not needed again
                shutil.rmtree(checkpoint_dir(name, record.stem), ignore_errors=True)
    out: dict[str, Any] = {
        "task": task.name,
        "algo": algo,
        "seed": seed,
        "devices": devices,
        "batch_per_process": per_process_batch(task, devices),
        "epochs": epochs,
        "limit_train_batches": batches,
        "command": display_command(argv, workdir),
        "exit_code": code,
        "wall_s": wall,
        "reused": bool(reused),
    }
    if record.exists():
        rec = earlier if reused else json.loads(record.read_text())
        final = rec.get("final", {})
        out.update(
            metric=final.get(task.metric),
            extra={m: final.get(m) for m in task.extra_metrics},
            val_loss=final.get("val_loss"),
            global_step=rec.get("global_step"),
            train_wall_s=rec.get("train_wall_s"),
            compression_ratio=(rec.get("compression") or {}).get("compression_ratio"),
            bytes_sent=(rec.get("compression") or {}).get("bytes_sent"),
            link_bytes=link_bytes(algo, devices, rec.get("compression") or {}),
            dense_bytes=(rec.get("compression") or {}).get("dense_bytes"),
            densities=rec.get("densities"),
            history=rec.get("history"),
            train_loss_epochs=rec.get("train_loss_epochs"),
            params=rec.get("params"),
            finished=rec.get("finished"),
            bf16_matmuls_as_fp32=rec.get("bf16_matmuls_as_fp32"),  # set where bf16_cpu computed them
        )
        out.update(protocol_values(task, out))
    if code != 0 or not record.exists():
        out["error"] = common.tail(log, 30)
    return out


def resume_arguments(task: Task, name: str, record: Path, key: str) -> list[str]:
    """``["--ckpt_path", <last.ckpt>]`` where a resumable run of this very command (``key``) stopped after an epoch
    end, else ``[]``; a run that starts afresh first drops its partial record and any checkpoint of another command.
    The run's :class:`benchmarks.common.RunRecorder` resumes its record from the checkpoint, so a resumed run's
    record is the record of an uninterrupted one."""
    if not task.resumable:
        return []
    folder = checkpoint_dir(name, record.stem)
    last, key_file = folder / "last.ckpt", folder / "key"
    if last.exists() and key_file.is_file() and key_file.read_text() == key:
        return ["--ckpt_path", str(last)]
    shutil.rmtree(folder, ignore_errors=True)
    record.unlink(missing_ok=True)
    folder.mkdir(parents=True)
    key_file.write_text(key)
    return []


def protocol_values(task: Task, run: dict[str, Any]) -> dict[str, Any]:
    """A run's figures for the seed protocol: the metric averaged over its last two evaluations (one
    evaluation on a small test set moves by points from epoch to epoch), their difference (how settled
    the run is), and the training loss averaged over the last epoch (every batch, every rank)."""
    evals = [h[task.metric] for h in run.get("history") or [] if task.metric in h]
    losses = [e["train_loss"] for e in run.get("train_loss_epochs") or []]
    return {
        "metric_last2": sum(evals[-2:]) / len(evals[-2:]) if evals else None,
        "last2_spread": abs(evals[-1] - evals[-2]) if len(evals) >= 2 else None,
        "train_loss_last_epoch": losses[-1] if losses else None,
        "link_kb_per_step": link_kb_per_step(run),
    }


def emulates_bf16(task: Task) -> bool:
    """Whether ``task``'s runs compute their bf16 matrix products as fp32 GEMMs (:mod:`benchmarks.bf16_cpu`).

    Only a bf16 task on a CPU that lacks bf16 instructions (avx512_bf16 or AMX): PyTorch's own bf16
    products are a scalar fallback there (the transformer at 8 processes on 2 cores took 2.85 s per step
    on an AVX2-only AMD EPYC against 0.17 s with avx512_bf16). The rounding is a bf16 GEMM's, so such a
    run has the settings of the records made with bf16 instructions and joins them.
    """
    return "bf16-mixed" in task.overrides and bf16_cpu.has_bf16_instructions() is False


def run_env(task: Task, threads: int) -> dict[str, str]:
    """The environment of ``task``'s training processes."""
    return common.worker_env(threads, **({bf16_cpu.ENV: "1"} if emulates_bf16(task) else {}))


#: slack in a comparison with a tolerance: the metrics are logged in float32 (a gap of exactly 50 of 10,000 images
#: reads 0.0050000250), far below the resolution of any test set here (one image of 10,000 is 1e-4)
FLOAT32_SLACK = 1e-6


def within_tolerance(worse: float, tolerance: float) -> bool:
    """Whether a gap (positive: worse than DDP) is at most ``tolerance``, at the logged metric's resolution."""
    return worse <= tolerance + FLOAT32_SLACK


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (``None`` for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def summarize(task: Task, runs: list[dict[str, Any]], devices: int) -> list[dict[str, Any]]:
    """Per algorithm, over its seeds: mean +- std of the metric (last two evaluations) and of the last
    epoch's training loss; for a compressed algorithm, its difference to ddp paired by seed (same seed,
    same initialization and data order) with the spread of those differences, and the target's verdict
    on the mean difference."""
    done = [r for r in runs if r["task"] == task.name and r.get("metric_last2") is not None]
    ddp = {r["seed"]: r for r in done if r["algo"] == "ddp"}
    out = []
    for algo in dict.fromkeys(r["algo"] for r in done):
        rs = [r for r in done if r["algo"] == algo]
        row: dict[str, Any] = {"task": task.name, "algo": algo, "devices": devices,
                               "seeds": [r["seed"] for r in rs]}  # fmt: skip
        row["metric"], row["metric_std"] = mean_std([r["metric_last2"] for r in rs])
        losses = [r["train_loss_last_epoch"] for r in rs if r.get("train_loss_last_epoch") is not None]
        row["train_loss"], row["train_loss_std"] = mean_std(losses) if losses else (None, None)
        spreads = [r["last2_spread"] for r in rs if r.get("last2_spread") is not None]
        row["last2_spread_max"] = max(spreads) if spreads else None
        link = [r["link_kb_per_step"] for r in rs if r.get("link_kb_per_step") is not None]
        if algo == "ddp" and rs[0].get("params"):  # ring all-reduce of every fp32 gradient
            link = [ring_allreduce_volume(4 * rs[0]["params"], devices) / 1e3]
        row["link_kb_per_step"] = sum(link) / len(link) if link else None
        out.append(row)
    ddp_link = next((row["link_kb_per_step"] for row in out if row["algo"] == "ddp"), None)
    for row in out:
        algo, rs = row["algo"], [r for r in done if r["algo"] == row["algo"]]
        if ddp_link and row["link_kb_per_step"]:
            # DDP's link bytes over the algorithm's, every step of the run counted (warm-up included)
            row["compression"] = round(ddp_link / row["link_kb_per_step"], 2)
        paired = [(r, ddp[r["seed"]]) for r in rs if r["seed"] in ddp]
        if algo != "ddp" and paired:
            diffs = [
                (r["metric_last2"] / b["metric_last2"] - 1) if task.relative else r["metric_last2"] - b["metric_last2"]
                for r, b in paired
            ]  # fmt: skip
            row["difference"], row["difference_std"] = mean_std(diffs)
            worse = -row["difference"] if task.higher_is_better else row["difference"]
            row["met"] = within_tolerance(worse, task.tolerance)
            row["paired_seeds"] = len(paired)
    return out


def mean_std_text(
    value: float | None, std: float | None, percent: bool, digits: int = 2, sign: bool = False
) -> str | None:
    """``value ± std`` (``value`` alone without a spread), times 100 when ``percent``; ``sign`` writes a
    leading ``+`` on positive values, as a difference is written."""
    if value is None:
        return None
    scale = 100 if percent else 1
    text = f"{value * scale:{'+' if sign else ''}.{digits}f}"
    return text + (f" ± {std * scale:.{digits}f}" if std is not None else "")


def summary_rows(result: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for row in result.get("summary", []):
        task = TASKS[row["task"]]
        percent = not task.relative
        if "difference" in row:
            diff = mean_std_text(row["difference"], row.get("difference_std"), True, sign=True)
            diff = f"{diff} {'pp' if percent else '%'}"
        else:
            diff = ""
        rows.append(
            [row["task"], row["devices"], row["algo"], len(row["seeds"]),
             mean_std_text(row["metric"], row["metric_std"], percent) + ("%" if percent else ""),
             diff, mean_std_text(row["train_loss"], row["train_loss_std"], False, 3),
             row.get("link_kb_per_step") and round(row["link_kb_per_step"], 1),
             row.get("compression") and f"{row['compression']:.1f}x",
             "" if "met" not in row else row["met"]]
        )  # fmt: skip
    return rows


def schedule_steps(task: Task, epochs: int, batches: int | None) -> int:
    return epochs * (steps_per_epoch_estimate(task, batches) or 0)


def compare(task: Task, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each compressed run against ddp: the difference and whether it is within the tolerance."""
    bases = {r.get("seed"): r for r in runs if r["algo"] == "ddp" and r.get("metric") is not None}
    out = []
    for r in runs:
        base = bases.get(r.get("seed"))
        if r["algo"] == "ddp" or base is None or r.get("metric") is None:
            continue
        if task.relative:
            diff = r["metric"] / base["metric"] - 1
        else:
            diff = r["metric"] - base["metric"]
        worse = -diff if task.higher_is_better else diff  # > 0: worse than ddp
        out.append(
            {
                "task": task.name,
                "algo": r["algo"],
                "seed": r.get("seed"),
                "metric": task.metric_label,
                "ddp": base["metric"],
                "value": r["metric"],
                "difference": diff,
                "worse_by": worse,
                "tolerance": task.tolerance,
                "relative": task.relative,
                "met": within_tolerance(worse, task.tolerance),
                "steps": r.get("global_step"),
                "full_schedule_steps": schedule_steps(task, *task.full),
                "warmup_densities": r.get("densities"),
            }
        )
    return out


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The parity targets, one per task and compressed algorithm (over seeds: on the mean of the
    paired differences)."""
    out = []
    if result.get("summary"):
        for row in result["summary"]:
            if "met" not in row:
                continue
            task = TASKS[row["task"]]
            target = f"{task.tolerance:.0%}" if task.relative else f"{task.tolerance * 100:g} pp"
            better = "higher" if task.higher_is_better else "lower"
            out.append(
                {
                    "target": f"{row['task']}, {row['devices']} workers: {row['algo']} {task.metric_label}"
                    f" ({better} is better) within {target} of ddp, mean of {row['paired_seeds']}"
                    f" seed{'s' * (row['paired_seeds'] != 1)}",
                    "value": summary_rows({"summary": [row]})[0][5],
                    "met": row["met"],
                    "note": "",
                }
            )
        return out
    for c in result.get("comparisons", []):
        if c["algo"] in DEFT_ABLATIONS:  # (in the ablation table)
            continue
        if c["relative"]:
            target = f"{c['tolerance']:.0%}"
            value = f"{c['value']:.2f} vs {c['ddp']:.2f} ({c['difference']:+.2%})"
        else:
            target = f"{c['tolerance'] * 100:g} pp"
            value = f"{c['value']:.2%} vs {c['ddp']:.2%} ({c['difference'] * 100:+.2f} pp)"
        better = "higher" if TASKS[c["task"]].higher_is_better else "lower"
        out.append(
            {
                "target": f"{c['task']}: {c['algo']} {c['metric']} ({better} is better) within {target} of ddp",
                "value": value,
                "met": c["met"],
                "note": _note(c, result.get("quick", True)),
            }
        )
    return out


def _note(c: dict[str, Any], quick: bool) -> str:
    steps, full = c.get("steps"), c.get("full_schedule_steps")
    budget = f"{steps} optimizer steps"
    if full:
        budget += f", {steps / full:.0%} of the CPU config's schedule ({full} steps)"
    if c["met"]:
        return f"after {budget}"
    text = f"after {budget}: early in training, where sparse updates lag dense ones"
    if c["algo"] == "deft_paper":
        text += " (DEFT as published: no warm-up, error feedback with the optimizer's momentum, k by norm, budget k, the all-reduce wire)"
    if quick:
        text += "; this budget cannot settle parity: train longer (`--full`)"
    return text


def _metric_text(task: Task | None, value: float | None) -> Any:
    if value is None:
        return None
    if task is not None and not task.relative:
        return f"{value * 100:.2f}%"
    return value


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    rows = []
    for r in result.get("runs", []):
        task = TASKS.get(r["task"])
        extra = r.get("extra") or {}
        rows.append(
            [
                r["task"], r["algo"] + ("" if r.get("seed") is None else f" s{r['seed']}"),
                task.metric_label if task else "", _metric_text(task, r.get("metric")),
                ", ".join(f"{k.removeprefix('val_')} {_metric_text(task, v)}" for k, v in extra.items() if v is not None),
                r.get("global_step"), r.get("compression_ratio"), link_kb_per_step(r), r.get("wall_s"),
                "pending" if r.get("pending") else "ok" if r.get("exit_code") == 0 else f"failed ({r.get('exit_code')})",
            ]
        )  # fmt: skip
    budget = result.get("budget") or ("quick" if result.get("quick") else "full")
    out = []
    if result.get("summary"):
        out.append(
            (
                f"Mean ± std over seeds {result.get('seeds')}: metric averaged over the last two evaluations,"
                " difference to ddp paired by seed, training loss of the last epoch",
                ["task", "workers", "algo", "seeds", "metric", "vs ddp", "train loss", "link kB/step", "vs ddp bytes", "met"],
                summary_rows(result),
            )
        )
    out += [
        (
            f"Accuracy parity on real data ({budget} budget), {result.get('devices', CONFIG_DEVICES)} workers",
            [
                "task",
                "algo",
                "metric",
                "value",
                "also",
                "steps",
                "compression ratio",
                "link kB/step",
                "wall s",
                "run",
            ],
            rows,
        )
    ]
    ablation = ablation_rows(result)
    if ablation:
        out.append(
            (
                f"DEFT ablations and remedies, {result.get('devices', CONFIG_DEVICES)} workers: one part switched at a time",
                [
                    "task",
                    "variant",
                    "what changes",
                    "value",
                    "vs deft",
                    "vs ddp",
                    "compression ratio",
                    "link kB/step",
                ],
                ablation,
            )
        )
    tgt = [[t["target"], t["value"], t["met"]] for t in targets(result)]
    if tgt:
        out.append(("Parity targets", ["target", "measured", "met"], tgt))
    skipped = result.get("skipped_tasks") or []
    if skipped:
        out.append(
            (
                "Tasks skipped (time budget)",
                ["task", "reason"],
                [[t, "would not fit before the deadline"] for t in skipped],
            )
        )
    return out


def link_bytes(algo: str, devices: int, compression: dict[str, Any]) -> float | None:
    """The run's ``link_bytes``; for a DEFT run recorded before that statistic existed, derived from
    ``bytes_sent``: all of DEFT's collectives are ring all-reduces, ``2 (N-1)/N`` of what each rank sends."""
    if compression.get("link_bytes") is not None:
        return compression["link_bytes"]
    if algo.startswith("deft") and compression.get("bytes_sent") is not None:
        return ring_allreduce_volume(compression["bytes_sent"], devices)
    return None


def link_kb_per_step(run: dict[str, Any]) -> float | None:
    """kB each worker's link carried per optimizer step, averaged over the run (``WireCost.link_bytes``:
    ring collectives); ``None`` for runs recorded before the statistic existed, and for ddp (which
    does not record it: its ring all-reduce carries ``2 (N-1)/N`` times the dense bytes)."""
    link, steps = run.get("link_bytes"), run.get("global_step")
    return round(link / steps / 1e3, 1) if link and steps else None


def _difference(task: Task, run: dict[str, Any], base: dict[str, Any] | None) -> str | None:
    if base is None:
        return None
    d = run["metric"] / base["metric"] - 1 if task.relative else run["metric"] - base["metric"]
    return f"{d:+.2%}" if task.relative else f"{d * 100:+.2f} pp"


def ablation_rows(result: dict[str, Any]) -> list[list[Any]]:
    """The full DEFT and each ablation of one run set, with its difference to deft and to ddp on the same seed (the
    variant named with its seed where the run set has several)."""
    rows = []
    runs = [r for r in result.get("runs", []) if r.get("metric") is not None]
    for task_name in dict.fromkeys(r["task"] for r in runs):
        task = TASKS[task_name]
        ours = [r for r in runs if r["task"] == task_name]
        several = len({r.get("seed") for r in ours}) > 1
        for seed in dict.fromkeys(r.get("seed") for r in ours if r["algo"] in DEFT_ABLATIONS):
            by_algo = {r["algo"]: r for r in ours if r.get("seed") == seed}
            for algo in (a for a in ("deft", *DEFT_ABLATIONS) if a in by_algo):
                r = by_algo[algo]
                rows.append(
                    [task_name, f"{algo} s{seed}" if several else algo,
                     ABLATION_TEXT.get(algo, "configs/algo/deft.yaml as run"), _metric_text(task, r["metric"]),
                     "" if algo == "deft" else _difference(task, r, by_algo.get("deft")),
                     _difference(task, r, by_algo.get("ddp")), r.get("compression_ratio"), link_kb_per_step(r)]
                )  # fmt: skip
    return rows


def show(result: dict[str, Any]) -> None:
    for title, columns, rows in tables(result):
        common.print_table(title, columns, rows)


def plot(result: dict[str, Any], name: str = "parity") -> None:
    """Per task: the metric against optimizer steps (bars of the final value when there is one point)."""
    plt = common.pyplot()
    runs = [r for r in result.get("runs", []) if r.get("history")]
    if plt is None or not runs:
        return
    tasks = list(dict.fromkeys(r["task"] for r in runs))
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.4), squeeze=False)
    for ax, task_name in zip(axes[0], tasks, strict=True):
        task = TASKS[task_name]
        task_runs = [r for r in runs if r["task"] == task_name]
        if all(len(r["history"]) == 1 for r in task_runs):
            values = [r["history"][0].get(task.metric, float("nan")) for r in task_runs]
            bars = ax.bar(
                [r["algo"] for r in task_runs], values, color=["C0", "C1", "C2", "C3"][: len(task_runs)]
            )
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
            ax.set_xlabel(f"after {task_runs[0]['history'][0]['step']} optimizer steps")
        else:
            # one colour per algorithm, one line per seed, labelled once
            colours = {algo: f"C{i}" for i, algo in enumerate(dict.fromkeys(r["algo"] for r in task_runs))}
            labelled: set[str] = set()
            for r in task_runs:
                points = [(h["step"], h[task.metric]) for h in r["history"] if task.metric in h]
                if points:
                    label = None if r["algo"] in labelled else r["algo"]
                    labelled.add(r["algo"])
                    ax.plot(*zip(*points, strict=True), marker="o", markersize=3, color=colours[r["algo"]],
                            alpha=0.8, label=label)  # fmt: skip
            ax.set_xlabel("optimizer step")
            ax.legend(fontsize=8)
        better = "higher" if task.higher_is_better else "lower"
        ax.set_title(f"{task_name}: {task.metric_label} ({better} is better)")
    common.save_figure(fig, f"{name}.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parity", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small budgets (default)")
    mode.add_argument("--full", action="store_true", help="the CPU configs' own schedules (hours)")
    parser.add_argument("--data-root", type=Path, default=common.REPO.parent / "shared" / "data")
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=[n for n, t in TASKS.items() if not t.resumable],
                        help="default: every task but the long protocol (cifar10_full)")  # fmt: skip
    parser.add_argument(
        "--algos", type=lambda s: s.split(","), default=list(ALGOS), help=f"of {', '.join(ALGO_SPECS)}"
    )
    parser.add_argument("--epochs", type=int, default=None, help="override the mode's epochs")
    parser.add_argument(
        "--batches", type=int, default=None, help="override the train batches per epoch (0: all)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per run (default: 600 for the quick budget, else 36000)",
    )
    parser.add_argument("--name", default="parity",
                        help="result name: writes results/<name>.json and .png (default parity)")  # fmt: skip
    parser.add_argument("--devices", type=int, default=CONFIG_DEVICES,
                        help="processes per run (default 2, the configs'); the per-process batch is scaled so that"
                        " the global batch stays the config's")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="compute threads per process (default 1)")
    parser.add_argument("--reuse", action="store_true",
                        help="take a run's finished record from an earlier run of the same --name instead of"
                        " training again (its wall time is the recorded training time)")  # fmt: skip
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: build the report from the finished records of earlier runs of the"
                        " same --name (a run without one is listed as pending)")  # fmt: skip
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="run every configuration once per seed (e.g. 42,43,44) and report mean ± std;"
                        " default: the configs' seed only")  # fmt: skip
    parser.add_argument("--pairs", type=lambda s: {(int(x.split(":")[0]), x.split(":")[1]) for x in s.split(",")},
                        default=None, help="only these SEED:ALGO runs of --seeds x --algos (e.g. 42:ddp,42:deft,43:ddp):"
                        " a study that runs some algorithms on fewer seeds")  # fmt: skip
    parser.add_argument("--deadline", type=float, default=None,
                        help="Unix time by which to finish: a task whose runs would not fit is skipped")  # fmt: skip
    args = parser.parse_args(argv)
    quick = not args.full
    # 600 s only for the quick budget itself: a run of chosen --epochs/--batches may take far longer
    timeout = args.timeout or (600 if quick and args.epochs is None and args.batches is None else 36000)
    con = common.console()
    if not args.data_root.is_dir():
        reason = f"data root {args.data_root} not found (pass --data-root)"
        con.print(f"[yellow]parity skipped: {reason}[/yellow]")
        common.write_json(f"{args.name}.json", {"skipped": reason, "runs": []})
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="dgc_parity_"))
    runs: list[dict[str, Any]] = []
    comparisons: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    skipped: list[str] = []
    t0 = time.perf_counter()
    try:
        for name in args.tasks:
            task = TASKS[name]
            epochs, batches = task.quick if quick else task.full
            epochs = args.epochs or epochs
            batches = (args.batches or None) if args.batches is not None else batches  # 0: every batch
            task_runs = []
            if not args.report_only and emulates_bf16(task):
                con.print(
                    f"[yellow]{name}: this CPU has no bf16 instructions (avx512_bf16 or AMX), so its bf16 matrix"
                    " products run as fp32 GEMMs of the bf16 operands (benchmarks.bf16_cpu): a bf16 GEMM's"
                    " rounding, far faster than PyTorch's fallback here[/yellow]"
                )
            if args.deadline is not None:
                # a task is run whole or not at all (a ddp run alone compares with nothing)
                estimate = max([r["wall_s"] for r in runs] or [90.0]) * len(args.algos)
                if time.time() + estimate > args.deadline:
                    con.print(
                        f"[yellow]{name}: skipped, {estimate:.0f} s of runs would pass the deadline[/yellow]"
                    )
                    skipped.append(name)
                    continue
            for seed in args.seeds or [None]:  # seed by seed: a stopped study has whole seeds
                for algo in (a for a in args.algos if args.pairs is None or (seed, a) in args.pairs):
                    con.print(f"[bold]{name}[/bold] / {algo}{'' if seed is None else f' / seed {seed}'}:"
                              f" {args.devices} processes, {epochs} epoch(s) x {batches or 'all'} batches ...")  # fmt: skip
                    run = run_one(task, algo, args.data_root.resolve(), epochs, batches, workdir, timeout,
                                  args.name, args.devices, args.threads, args.reuse, seed, args.report_only)  # fmt: skip
                    if run.get("pending"):
                        con.print("  no finished record yet")
                    elif "error" in run:
                        con.print(f"[red]failed[/red]:\n{run['error']}")
                    else:
                        con.print(
                            f"  {task.metric_label} {_metric_text(task, run.get('metric'))},"
                            f" {run['wall_s']:.0f} s{' (reused)' if run['reused'] else ''}"
                        )
                    task_runs.append(run)
            runs += task_runs
            comparisons += compare(task, task_runs)
            if args.seeds:
                summary += summarize(task, task_runs, args.devices)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "quick": quick and args.epochs is None and args.batches is None,
        "budget": "full"
        if args.full
        else ("quick" if args.epochs is None and args.batches is None else "custom"),
        "data_root": str(args.data_root),
        "tasks": {
            n: {
                "what": TASKS[n].what,
                "metric": TASKS[n].metric,
                "tolerance": TASKS[n].tolerance,
                "relative": TASKS[n].relative,
            }
            for n in args.tasks
        },  # fmt: skip
        "seeds": args.seeds,
        "epochs": args.epochs,
        "summary": summary,
        "runs": runs,
        "comparisons": comparisons,
        "skipped_tasks": skipped,
        "wall_s": time.perf_counter() - t0,
        "devices": args.devices,
        "threads_per_process": args.threads,
    }
    show(result)
    common.write_json(f"{args.name}.json", result)
    plot(result, args.name)
    return 1 if any("error" in r for r in runs if not r.get("pending")) else 0


if __name__ == "__main__":
    sys.exit(main())
