"""What the LoRA parity tests share: a base and peft's starting adapters on disk, peft's training run.

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


def peft_train(model, batches, lr: float) -> tuple[list[float], dict]:
    """AdamW over peft's adapters, one step per (ids, targets) in `batches`: the losses, and the adapters
    after (by name without peft's base_model.model. prefix)."""
    from pipezero.pipe.hf import causal_lm_loss

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for ids, targets in batches:
        loss = causal_lm_loss(model(ids).logits, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    adapters = {k.removeprefix("base_model.model."): v.clone()
                for k, v in peft.get_peft_model_state_dict(model).items()}
    return losses, adapters
