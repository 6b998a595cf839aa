"""Paper experiments for lightning-dgc: LightningModules and LightningDataModules per task.

Run them with the CLI, stacking a task YAML and an algorithm YAML::

    python -m recipes fit --config configs/cifar10_resnet20.yaml --config configs/algo/dgc.yaml

Modules: :mod:`recipes.vision` (CIFAR-10 / ImageNet ResNets), :mod:`recipes.language` (PTB LSTM),
:mod:`recipes.transformer` (PTB decoder-only transformer with AdamW),
:mod:`recipes.speech` (LibriSpeech DeepSpeech-style CTC). Submodules are imported lazily so that
``import recipes`` stays cheap and the speech recipe's optional dependencies are only needed by it.
"""
