"""The small GPT of the examples, as layer specs: it lives in the package, pipezero/train/gpt/model.py.

Kept so that `from gpt import ...` (examples/ on sys.path) and `from examples.gpt import ...`
go on working; everything here is the package's.
"""

from pipezero.train.gpt.model import *  # noqa: F401,F403
from pipezero.train.gpt.model import __all__  # noqa: F401
