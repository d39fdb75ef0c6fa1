"""deploy/entrypoint.sh turns its two calling conventions (ours: MODEL first;
llm-d's modelservice chart: ``--model MODEL ... --tensor-parallel-size N``)
into one ``vllm serve`` command line and environment.  A stand-in for the
Python interpreter records what would be exec'd (the real server run is
tests/vllm/test_deploy_entrypoint.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "deploy" / "entrypoint.sh"
SEEN = ("TORCH_SPYRE_NUM_CARDS", "TORCH_SPYRE_VLLM_WARMUP", "TORCH_SPYRE_VLLM_METRICS_PORT",
        "HF_HUB_OFFLINE")  # fmt: skip


@pytest.fixture
def run(tmp_path):
    record = tmp_path / "record.py"
    record.write_text(
        "import json, os, sys\n"
        f"seen = {list(SEEN)!r}\n"
        "print(json.dumps({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) for k in seen}}))\n"
    )
    fake = tmp_path / "python"
    # `-c CODE` (the offline: lookup) runs for real; `-m vllm...` prints its argv
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\n'
        f'exec {sys.executable} {record} "$@"\n'
    )
    fake.chmod(0o755)

    def call(*args: str, **env: str) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if k not in SEEN and not k.startswith("SPYRE_")}
        return subprocess.run(
            ["bash", str(ENTRY), *args], capture_output=True, text=True, timeout=120,
            env={**base, "SPYRE_PYTHON": str(fake), "PYTHONPATH": str(ROOT), **env},
        )  # fmt: skip

    def served(*args: str, **env: str) -> dict:
        r = call(*args, **env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    call.served = served
    return call


def _flag(argv: list[str], name: str) -> str:
    """The value vLLM's argparse keeps: the last one given."""
    return [argv[i + 1] for i, a in enumerate(argv) if a == name][-1]


def test_model_first_with_defaults(run):
    out = run.served("/models/m", "--dtype", "float16")
    argv = out["argv"]
    assert argv[:4] == ["-m", "vllm.entrypoints.cli.main", "serve", "/models/m"]
    assert _flag(argv, "--port") == "8000" and _flag(argv, "--host") == "0.0.0.0"
    assert _flag(argv, "--served-model-name") == "/models/m"
    assert _flag(argv, "--dtype") == "float16"
    assert out["env"] == {"TORCH_SPYRE_NUM_CARDS": None, "TORCH_SPYRE_VLLM_WARMUP": "all",
                          "TORCH_SPYRE_VLLM_METRICS_PORT": "9100", "HF_HUB_OFFLINE": "1"}  # fmt: skip


def test_the_modelservice_charts_arguments(run):
    """imageDefault: the chart passes --model, --port, --tensor-parallel-size
    and --served-model-name, then our args; the TP size gives the cards."""
    out = run.served(
        "--model", "/models/smollm2", "--port", "8000", "--tensor-parallel-size", "4",
        "--served-model-name", "smollm2", "--dtype", "float16",
    )  # fmt: skip
    argv = out["argv"]
    assert argv[3] == "/models/smollm2" and "--model" not in argv
    assert _flag(argv, "--served-model-name") == "smollm2"
    assert _flag(argv, "--tensor-parallel-size") == "4"
    assert out["env"]["TORCH_SPYRE_NUM_CARDS"] == "4"


def test_user_arguments_win_and_env_settings_pass(run):
    out = run.served(
        "/m", "--port", "9000", SPYRE_TENSOR_PARALLEL="2", TORCH_SPYRE_VLLM_WARMUP="16,64",
        SPYRE_SERVED_MODEL_NAME="tiny",
    )  # fmt: skip
    argv = out["argv"]
    assert _flag(argv, "--port") == "9000"
    assert _flag(argv, "--served-model-name") == "tiny"
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert out["env"]["TORCH_SPYRE_NUM_CARDS"] == "2"
    assert out["env"]["TORCH_SPYRE_VLLM_WARMUP"] == "16,64"


def test_no_model_is_an_error_that_says_so(run):
    r = run("--dtype", "float16")
    assert r.returncode == 2 and "name the model" in r.stderr


def test_offline_names_resolve_to_their_folder(run):
    from torch_spyre.models.offline import folder

    try:
        path = str(folder("smollm2"))
    except ModuleNotFoundError as e:
        pytest.skip(f"the offline SmolLM2 is not installed: {e}")
    out = run.served("offline:smollm2")
    assert out["argv"][3] == path
    assert _flag(out["argv"], "--served-model-name") == "smollm2"
