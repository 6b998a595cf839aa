"""Pure tensor math for gradient selection: no torch.distributed, no Lightning."""

from lightning_dgc.selection.sampled import SelectionWorkspace, sampled_topk
from lightning_dgc.selection.topk import topk_among, topk_indices

__all__ = ["SelectionWorkspace", "sampled_topk", "topk_among", "topk_indices"]
