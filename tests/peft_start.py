"""The starting point the LoRA parity tests share: a base model and peft's adapters on disk.

`peft_start(base, config, root)` saves `base` under root/base, wraps it in peft's model with
`config`, makes every lora_B non-zero (peft starts them at zero, where B's gradient alone would
be tested) and saves that adapter under root/start; returns peft's model.
"""

import peft
import torch


def peft_start(base, config, root: str):
    base.save_pretrained(f"{root}/base")
    model = peft.get_peft_model(base, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(f"{root}/start")
    return model
