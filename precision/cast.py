"""Cast a model's parameters to its training dtype, leaving its buffers in the dtype they were made in.

`module.to(torch.bfloat16)` casts buffers too. A Hugging Face model's rotary frequencies
(`inv_freq`) are such a buffer, made in fp32 on purpose: rounded to bf16 they are off by up to
0.4%, so the angle of position p is off by up to 0.004 p radians (0.9 rad at 2,048, 3.6 at
8,192) and a pretrained checkpoint sees other positions than it was trained on.
transformers' `from_pretrained(dtype=torch.bfloat16)` and DeepSpeed 0.19.8's engine (unless
ds_config's data_types.buffer_dtype says otherwise) cast the parameters only; so does this.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["cast_parameters"]


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """module.to(dtype) for its floating parameters only; every buffer keeps its dtype. Returns module."""
    kept = [(m, name, buf) for m in module.modules() for name, buf in m.named_buffers(recurse=False)
            if buf.is_floating_point()]
    module.to(dtype)
    for m, name, buf in kept:  # the buffer objects themselves: .to() made cast copies, never in place
        setattr(m, name, buf)
    return module
