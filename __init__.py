"""pipezero: a pipeline-parallel-first, modular training toolkit for PyTorch."""

__version__ = "0.1.0"
