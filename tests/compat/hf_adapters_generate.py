"""Runs in the clients' venv: hf-adapters loads MODEL_DIR and generates greedily on
spyre; transformers generates the same on the CPU. Prints one JSON line."""

import json
import sys
import time

import torch
from hf_adapters import AutoSpyreModelForCausalLM
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(path: str, new_tokens: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = ["The capital of France is"]
    t0 = time.time()
    model = AutoSpyreModelForCausalLM.from_pretrained(path)
    spyre = model.generate(tokenizer, prompts, max_new_tokens=new_tokens, do_sample=False)
    t_spyre = time.time() - t0
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tokenizer(prompts, return_tensors="pt").input_ids
    out = ref_model.generate(
        ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens
    )
    cpu = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    print(
        json.dumps(
            {
                "device": str(next(model.parameters()).device),
                "spyre": spyre[0],
                "cpu": cpu[0],
                "spyre_s": round(t_spyre, 1),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
