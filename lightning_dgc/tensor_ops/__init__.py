"""Pure tensor math: selection, the wire format, momentum, residual memory; no torch.distributed."""
