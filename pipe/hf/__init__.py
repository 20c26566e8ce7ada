"""The Hugging Face adapter: causal LMs as layer specs (specs.py), where their weights come from
(weights.py) and whether a checkpoint fits its config (match.py), their tensor-parallel plan
(tensor.py), generation from the training weights (generate.py). transformers is an optional extra.

`pipezero.pipe.hf` was one module before it was this folder: its names are here as they were.
"""

from pipezero.pipe.hf.specs import (TIED_KEY, HFDecoderLayer, HFFinalNorm, HFHead, HFHeadBias, HFPositions,
                                    HFTokenEmbedding, causal_lm_loss, hf_config, hf_layer_specs, hf_shapes,
                                    hf_state_dict, hf_tensor_plan)

__all__ = ["HFDecoderLayer", "HFFinalNorm", "HFHead", "HFHeadBias", "HFPositions", "HFTokenEmbedding", "TIED_KEY",
           "causal_lm_loss", "hf_config", "hf_layer_specs", "hf_shapes", "hf_state_dict", "hf_tensor_plan"]
