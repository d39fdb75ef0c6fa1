"""Builds the thin C++ part of the device (torch_spyre._C) at install time.

The build is cached by the hash of its sources and the torch version
(~/.cache/torch_spyre, or TORCH_SPYRE_BUILD_CACHE): a fresh clone on a machine
that built the same sources before copies the library instead of compiling
for a minute.
"""

import hashlib
import os
import shutil
from pathlib import Path

# Building must not load an installed torch_spyre through torch's backend
# autoload (it may be an older or half-built checkout).
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

SOURCES = [
    "torch_spyre/csrc/spyre.cpp",
    "torch_spyre/csrc/warm.cpp",
    "torch_spyre/csrc/gemm.cpp",
    "torch_spyre/csrc/dl16.cpp",
]
COMPILE_ARGS = ["-O2", "-std=c++17", "-Wno-unused-parameter"]


def _cache_key() -> str:
    h = hashlib.sha256()
    for src in [*SOURCES, *sorted(str(p) for p in Path("torch_spyre/csrc").glob("*.h"))]:
        h.update(Path(src).read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(COMPILE_ARGS).encode())
    return h.hexdigest()[:20]


class CachedBuildExt(BuildExtension):
    def build_extension(self, ext):
        cache = Path(
            os.environ.get("TORCH_SPYRE_BUILD_CACHE", Path.home() / ".cache" / "torch_spyre")
        )
        target = Path(self.get_ext_fullpath(ext.name))
        cached = cache / f"{ext.name}-{_cache_key()}{target.suffix}"
        if cached.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(cached, target)
            print(f"torch_spyre: using cached build {cached}")
            return
        super().build_extension(ext)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            shutil.copy2(target, cached)
        except OSError as err:  # a read-only home must not fail the install
            print(f"torch_spyre: build not cached ({err})")


setup(
    ext_modules=[CppExtension("torch_spyre._C", SOURCES, extra_compile_args=COMPILE_ARGS)],
    cmdclass={"build_ext": CachedBuildExt.with_options(use_ninja=True)},
)
