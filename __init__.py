"""pipezero: a pipeline-parallel-first, modular training toolkit for PyTorch."""

from pipezero import moved as _moved

__version__ = "0.1.0"

_moved.install()  # old module paths of moved files (pipezero.pipe.schedule.schedules, ...) import with a warning
