"""``python tp_worker.py MODEL_DIR TP EAGER PROMPTS_JSON OUT``: greedy tokens of
vLLM at tensor parallel TP on spyre (run in a fresh process: the card count is
fixed when torch_spyre loads), written to the file OUT as JSON (not printed:
the engine's worker processes share stdout, and a line of theirs could land
on the result's line)."""

from __future__ import annotations

import json
import sys

from vllm import LLM, SamplingParams

path, tp, eager, prompts, out = (
    sys.argv[1],
    int(sys.argv[2]),
    sys.argv[3] == "1",
    json.loads(sys.argv[4]),
    sys.argv[5],
)
llm = LLM(
    model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4,
    kv_cache_memory_bytes=8 << 20, seed=0, tensor_parallel_size=tp, enforce_eager=eager,
)  # fmt: skip
outs = llm.generate(
    [{"prompt_token_ids": p} for p in prompts],
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    use_tqdm=False,
)
with open(out, "w") as f:
    json.dump([list(o.outputs[0].token_ids) for o in outs], f)
llm.llm_engine.engine_core.shutdown()
