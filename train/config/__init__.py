"""ds_config.json -> the validated parts of a training job: the top level (parse.py, keys.py), the batch
arithmetic (batch.py), Hugging Face's "auto" values (auto.py), the compile, optimizer and scheduler
sections (compile.py, optim.py). Each package's own section is read by that package.

`pipezero.train.config` was one module before it was this folder: its names are here as they were,
whatever parse.py's `__all__` lists.
"""

from pipezero.train.config import parse as _parse
from pipezero.train.config.parse import *  # noqa: F401,F403 - the old module's names

__all__ = list(_parse.__all__)
