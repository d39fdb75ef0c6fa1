"""A virtual environment with IBM's clients of torch-spyre, next to ours.

IBM's spyre-inference (its vLLM plugin) declares vllm>=0.27.1,<0.28 while our
own plugin is tested with vLLM 0.32.0 in the main environment, so the clients
get their own: vLLM 0.27.1 (built from its sdist as pure Python, like our
0.32.0), the pinned snapshots of spyre-inference (with its pytest plugin) and
hf-adapters from ../shared/clients/, and torch_spyre from this checkout
(editable, so the checkout under test is what runs).  Everything is fetched
through pip and the index it is configured with.

The venv is cached under ~/.cache/torch_spyre/clients (TORCH_SPYRE_CLIENTS_CACHE),
keyed by a hash of what goes into it; the vLLM wheel is cached with our
other wheels.  ``python scripts/ibm_clients.py`` prints the venv's path,
building it first if needed.  Used by tests/compat/test_ibm_clients.py.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.27.1"
TORCH = "torch==2.13.0"
SNAPSHOTS = {
    "spyre-inference": "spyre-inference-4744aed.tar.gz",
    "hf-adapters": "hf-adapters-8bf2b76.tar.gz",
}
# What the clients need at run time besides what their own metadata pulls in
# (their test tooling and the model conversion used to check them).
EXTRA = ["pytest", "pyyaml", "pytest-timeout", "pytest-asyncio", "gguf==0.19.0", "tqdm"]
# Build requirements of the vLLM sdist when built without isolation.
BUILD = ["setuptools>=77", "setuptools-rust", "setuptools-scm>=8", "wheel", "ninja", "packaging"]


def clients_dir(snapshot: str = SNAPSHOTS["spyre-inference"]) -> Path:
    """../shared/clients next to the checkout, as laid out for developers and
    CI: the folder that holds ``snapshot``."""
    env = os.environ.get("TORCH_SPYRE_IBM_CLIENTS")
    for cand in ([Path(env)] if env else []) + [
        ROOT.parent / "shared" / "clients",
        Path("/work/shared/clients"),
    ]:
        if (cand / snapshot).exists():
            return cand
    raise FileNotFoundError(
        f"IBM's client snapshots ({snapshot}, ...) are not in ../shared/clients; "
        "set TORCH_SPYRE_IBM_CLIENTS to the folder that holds them"
    )


def cache_root() -> Path:
    env = os.environ.get("TORCH_SPYRE_CLIENTS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "torch_spyre" / "clients"


def wheel_cache() -> Path:
    env = os.environ.get("TORCH_SPYRE_WHEEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "torch_spyre" / "wheels"


def key() -> str:
    """Hash of everything that goes into the venv (not torch_spyre: installed editable)."""
    h = hashlib.sha256()
    h.update(f"{sys.version_info[:2]}|{VLLM_VERSION}|{TORCH}|{EXTRA}|{BUILD}".encode())
    for name in sorted(SNAPSHOTS.values()):
        h.update((clients_dir() / name).read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()[:16]


def _pip(python: Path, *args: str, env: dict | None = None) -> None:
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    subprocess.run(cmd, check=True, env={**os.environ, **(env or {})})


def vllm_wheel(python: Path) -> Path:
    """vLLM 0.27.1 as a pure-Python wheel (VLLM_TARGET_DEVICE=empty), built once.

    The sdist is fetched with ``pip download``; VLLM_VERSION_OVERRIDE keeps the
    version vLLM's metadata reports equal to the file's, which pip checks (an
    empty-target build calls itself "0.27.1+empty").
    """
    cache = wheel_cache()
    wheel = cache / f"vllm-{VLLM_VERSION}+empty-cp311-cp311-linux_x86_64.whl"
    if wheel.exists():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "VLLM_TARGET_DEVICE": "empty"}
        subprocess.run(
            [str(python), "-m", "pip", "download", "-q", "--disable-pip-version-check",
             "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
             f"vllm=={VLLM_VERSION}", "-d", tmp],
            check=True, env={**env, "VLLM_VERSION_OVERRIDE": VLLM_VERSION},
        )  # fmt: skip
        sdist = Path(tmp) / f"vllm-{VLLM_VERSION}.tar.gz"
        print(f"building vllm {VLLM_VERSION} (VLLM_TARGET_DEVICE=empty), once", file=sys.stderr)
        subprocess.run(
            [str(python), "-m", "pip", "wheel", "-q", "--disable-pip-version-check",
             "--no-deps", "--no-build-isolation", str(sdist), "-w", tmp],
            check=True, env=env,
        )  # fmt: skip
        built = next(Path(tmp).glob("vllm-*.whl"))
        shutil.move(str(built), wheel)
    return wheel


def _extract(snapshot: str, into: Path) -> Path:
    with tarfile.open(clients_dir() / snapshot) as tar:
        top = tar.getnames()[0].split("/")[0]
        tar.extractall(into, filter="data")
    return into / top


def ensure_venv() -> Path:
    """The clients' venv (built if missing), with this checkout's torch_spyre in it."""
    venv = cache_root() / f"venv-{key()}"
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists():
        if venv.exists():
            shutil.rmtree(venv)
        cache_root().mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        _pip(python, TORCH, *BUILD)
        src = venv / "src"
        inference = _extract(SNAPSHOTS["spyre-inference"], src)
        adapters = _extract(SNAPSHOTS["hf-adapters"], src)
        # vLLM and the clients with their dependencies, torch held where it is
        constraints = venv / "constraints.txt"
        constraints.write_text(f"{TORCH}\n")
        _pip(python, "-c", str(constraints), str(vllm_wheel(python)), *EXTRA)
        _pip(python, "-c", str(constraints), str(adapters))
        # the snapshots have no git metadata for setuptools-scm; --no-deps: their
        # torch-spyre requirement is ours (installed below), the rest is above
        scm = {"SETUPTOOLS_SCM_PRETEND_VERSION": "0.0.1"}
        # editable, as their own uv workspace installs them (the test plugin reads
        # its YAML beside its module)
        for pkg in (inference, inference / "tests" / "plugin"):
            _pip(python, "--no-deps", "--no-build-isolation", "-e", str(pkg), env=scm)
        # vLLM's dependencies pull triton; nothing here runs it and vLLM would try
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "triton"], check=False)
        (venv / ".complete").write_text("ok\n")
        for stale in cache_root().glob("venv-*"):  # built from other inputs
            if stale != venv:
                shutil.rmtree(stale, ignore_errors=True)
    install_torch_spyre(python)
    return venv


def install_torch_spyre(python: Path) -> None:
    """This checkout's torch_spyre, editable (its C++ build is cached by hash)."""
    probe = subprocess.run(
        [str(python), "-c", "import torch_spyre, sys; print(torch_spyre.__file__)"],
        capture_output=True, text=True, cwd="/",
        env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONPATH": ""},
    )  # fmt: skip
    if probe.returncode == 0 and Path(probe.stdout.strip()).parent == ROOT / "torch_spyre":
        return
    _pip(
        python, "--no-deps", "--no-build-isolation", "-e", str(ROOT),
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )  # fmt: skip


def source(venv: Path, name: str) -> Path:
    """The extracted snapshot of client ``name`` inside the venv."""
    return next((venv / "src").glob(f"{name}*"))


if __name__ == "__main__":
    print(ensure_venv())
