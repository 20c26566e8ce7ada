"""The Hugging Face adapter: causal LMs as layer specs (specs.py: hf_layer_specs and the loss), over
the structure read from a meta copy of the model (model.py) and the pipeline layers (layers.py); a
built module read back under Hugging Face's names (export.py), where their weights come from
(weights.py) and whether a checkpoint fits its config (match.py), their tensor-parallel plan
(tensor.py), generation from the training weights (generate.py). transformers is an optional extra.

`pipezero.pipe.hf` was one module before it was this folder: its names are here as they were,
whatever specs.py's `__all__` lists.
"""

from pipezero.pipe.hf import specs as _specs
from pipezero.pipe.hf.specs import *  # noqa: F401,F403 - the old module's names

__all__ = list(_specs.__all__)
