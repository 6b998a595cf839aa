"""Pure tensor math for gradient selection: no torch.distributed, no Lightning."""

from lightning_dgc.tensor_ops.selection.sampled import SelectionWorkspace, sampled_topk
from lightning_dgc.tensor_ops.selection.topk import topk_among, topk_indices

__all__ = ["SelectionWorkspace", "sampled_topk", "topk_among", "topk_indices"]
