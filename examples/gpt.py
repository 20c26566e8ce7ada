"""The small GPT of the examples, as layer specs: it lives in the package, pipezero/train/gpt/model.py.

`from gpt import ...` (examples/ on sys.path) and `from examples.gpt import ...` are that module itself.
"""

import sys

from pipezero.train.gpt import model as _model

sys.modules[__name__] = _model
