"""Pure tensor math for gradient selection: no torch.distributed, no Lightning."""

from lightning_dgc.compression.dgc import SelectionWorkspace, sampled_topk
from lightning_dgc.compression.topk import topk_among, topk_indices

__all__ = ["SelectionWorkspace", "sampled_topk", "topk_among", "topk_indices"]
