"""Process-group plumbing shared by the parallel ops (``torch.distributed`` only)."""
