"""Checkpoints and exports: the crash-safe files (files.py: safetensors per rank + a manifest), each
rank's random streams (rng.py), nested state without pickle (flatten.py), training state by global parameter name onto any grid (state.py,
what it needs of the parts: state_parts.py, tensor-parallel slices: tensor_state.py), typed saveable
things (saveable.py), LoRA adapters only (lora_state.py), Hugging Face / peft exports
(hf_export.py, lora_export.py), which checkpoint a job resumes (resume.py), and DeepSpeed's own
checkpoints resumed on any grid (deepspeed_files.py reads them, from_deepspeed.py maps their names onto
the parts).

`pipezero.train.checkpoint` was one module (now files.py) before it was this folder: its names are
here as they were, whatever files.py's `__all__` lists.
"""

from pipezero.train.checkpoint import files as _files
from pipezero.train.checkpoint.files import *  # noqa: F401,F403 - the old module's names
from pipezero.train.checkpoint.rng import rng_state, set_rng_state

__all__ = [*_files.__all__, "rng_state", "set_rng_state"]
