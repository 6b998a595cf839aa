"""Paper experiments for lightning-dgc: LightningModules and LightningDataModules per task.

Run them with the CLI, stacking a task YAML and an algorithm YAML::

    python -m lightning_dgc_recipes fit --config configs/cifar10_resnet20.yaml --config configs/algo/dgc.yaml

Modules: :mod:`lightning_dgc_recipes.vision` (CIFAR-10 / ImageNet ResNets), :mod:`lightning_dgc_recipes.language` (PTB LSTM),
:mod:`lightning_dgc_recipes.transformer` (PTB decoder-only transformer with AdamW),
:mod:`lightning_dgc_recipes.speech` (LibriSpeech DeepSpeech-style CTC). Submodules are imported lazily so that
``import lightning_dgc_recipes`` stays cheap and the speech recipe's optional dependencies are only needed by it.
"""
