"""lightning-dgc: Deep Gradient Compression and DEFT as PyTorch Lightning strategies.

Importing the package registers the strategy names ``"dgc"``, ``"dgc_spawn"``, ``"deft"`` and
``"deft_spawn"`` with Lightning, so ``Trainer(strategy="dgc")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dgc.callbacks import CompressionMonitor, SparsityWarmup, warmup_density
from lightning_dgc.comm import destroy_process_group
from lightning_dgc.hook import deft_hook, dgc_hook
from lightning_dgc.perfmodel import Network, Profile, predict
from lightning_dgc.profiler import ExchangeProfiler
from lightning_dgc.state import DGCConfig, DGCState
from lightning_dgc.strategy import DEFTStrategy, DGCStrategy

__version__ = "0.1.0"

__all__ = [
    "CompressionMonitor",
    "DEFTStrategy",
    "DGCConfig",
    "DGCState",
    "DGCStrategy",
    "ExchangeProfiler",
    "Network",
    "Profile",
    "SparsityWarmup",
    "__version__",
    "deft_hook",
    "destroy_process_group",
    "dgc_hook",
    "predict",
    "warmup_density",
]

DGCStrategy.register_strategies(StrategyRegistry)
DEFTStrategy.register_strategies(StrategyRegistry)
