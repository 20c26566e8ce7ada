"""Memory for long sequences: activation checkpointing per layer, full or selective (recompute), and the
host offload of the inputs it keeps (offload).

The public names are those modules' (`from pipezero.pipe.memory.recompute import RecomputeConfig`).
"""
