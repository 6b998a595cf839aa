"""lightning-dgc: Deep Gradient Compression and DEFT as PyTorch Lightning strategies.

Importing the package registers the strategy names ``"dgc"`` and ``"dgc_spawn"`` with Lightning, so
``Trainer(strategy="dgc")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dgc.hook import dgc_hook
from lightning_dgc.state import DGCConfig, DGCState
from lightning_dgc.strategy import DGCStrategy

__version__ = "0.1.0"

__all__ = ["DGCConfig", "DGCState", "DGCStrategy", "dgc_hook", "__version__"]

DGCStrategy.register_strategies(StrategyRegistry)
