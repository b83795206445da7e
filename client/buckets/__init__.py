"""Tensors into buckets: the plan, the packing, the read order, the plan cache."""
