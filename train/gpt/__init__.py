"""The GPT that the main job (`pipezero train`), the planner and the examples use: the model as layer
specs (model.py), generation with a KV cache (generate.py), the main job (job.py).

The job is imported on demand (`from pipezero.train.gpt.job import main`), not here: it imports
the rest of train/, which the planner does not need.
"""

from pipezero.train.gpt.model import (GPT, GPTConfig, flops_per_token, gpt_layers, gpt_loss, gpt_specs,
                                      gpt_tensor_plan)

__all__ = ["GPT", "GPTConfig", "flops_per_token", "gpt_layers", "gpt_loss", "gpt_specs", "gpt_tensor_plan"]
