"""Model-based speculative drafters on the card (draft model, EAGLE, EAGLE-3).

vLLM's ``SpecDecodeBaseProposer`` (``DraftModelProposer``, ``EagleProposer``)
is created by the runner (``GPUModelRunner.__init__``) and loads its model in
``CPUModelRunner.load_model`` on the host, with the spyre layers (layers.py).
Here that model goes to the card the way the target does: rotary tables as
buffers, every weight and buffer in device memory (an EAGLE head's shared
embedding and LM head are the target's modules, already there), and its
forward wrapped to move the step's host ids, positions (and EAGLE's
hidden-state buffer) to the card. Its attention layers are ordinary vLLM ``Attention``
layers: their paged KV tensors are allocated on the card with the target's
(``SpyreModelRunner.initialize_kv_cache_tensors``: the draft layers are in
vLLM's KV cache config) and run the spyre attention backend, whose metadata
builder vLLM's proposer calls for each draft pass.

The drafter's forward runs eagerly on the card (spyre kernels, no graph):
vLLM calls ``proposer.model(...)`` directly, at the step's own token count.
The drafter's bookkeeping (its input buffers, slot mappings, the draft
token ids) stays on the host with vLLM's, prepared by draft_kernels.py.
EAGLE heads take the target's hidden states: vLLM copies them into the
proposer's host buffer and the wrapped forward moves them back (a round trip of
[tokens, hidden] per draft pass). EAGLE-3 heads also take some target layers'
outputs: the compiled target forward returns them (compile.py, vLLM's
``aux_hidden_state_layers``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")

SPYRE = torch.device("spyre")


def model_of(runner: Any) -> torch.nn.Module | None:
    """The runner's drafter model (None for n-gram or no speculation)."""
    model = getattr(getattr(runner, "drafter", None), "model", None)
    return model if isinstance(model, torch.nn.Module) else None


def to_card(model: torch.nn.Module) -> None:
    """Move a loaded drafter model to the card and feed it card inputs."""
    from torch_spyre.vllm_plugin.layers import SpyreRotary
    from torch_spyre.vllm_plugin.model_runner import SpyreModelRunner, _inputs_to_card

    for m in model.modules():
        if isinstance(m, SpyreRotary):
            m.spyre_prepare()  # cos/sin tables as buffers, moved below
    before = torch.spyre.memory_allocated()
    t0 = time.perf_counter()
    model.to(SPYRE)
    SpyreModelRunner._check_on_card(model)
    # Not a forward pre-hook (as for the target): vLLM's @support_torch_compile
    # models (e.g. DeepSeekMTP) replace __call__ and call self.forward
    # directly, skipping nn.Module hooks; every path calls .forward.
    model.forward = _card_inputs(model.forward, _inputs_to_card)
    logger.info(
        "spyre: drafter %s moved to the card: %.1f MiB of weights in device memory (%.1f s); "
        "it runs eagerly on the card",
        type(model).__name__,
        (torch.spyre.memory_allocated() - before) / 2**20,
        time.perf_counter() - t0,
    )


def _card_inputs(forward: Callable, to_card: Callable) -> Callable:
    """``forward`` with its host tensor arguments moved to the card first."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = to_card(None, args, kwargs)
        return forward(*args, **kwargs)

    return run
