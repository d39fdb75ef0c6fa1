"""Models with random weights from a public config: the shapes of real
checkpoints that do not ship offline (../shared/models.md), built fast.

``transformers``' own init runs a Python loop of per-module initialisers in
fp32 (tens of seconds and 2x the memory for a 1-2B model); here the model is
made on the meta device and its tensors filled in place, in the dtype asked
for, from one seeded generator: the same weights on every run.
"""

from __future__ import annotations

import torch
import transformers


def random_causal_lm(
    config: transformers.PretrainedConfig, dtype: torch.dtype = torch.float16, seed: int = 0
) -> torch.nn.Module:
    """A causal LM of ``config`` with N(0, initializer_range) weights on the host."""
    from accelerate import init_empty_weights

    # parameters on meta (no memory, no init); buffers (rotary tables) as usual
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    std = float(getattr(config, "initializer_range", 0.02))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                t = torch.empty(p.shape, dtype=p.dtype)
                full = f"{mod_name}.{name}"
                if name == "bias":
                    t.zero_()
                elif "norm" in full.lower() and p.dim() == 1:
                    t.fill_(1.0)
                else:
                    t.normal_(0.0, std, generator=gen)
                module._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()
