"""Builds the thin C++ part of the device at install time: two modules.

* ``torch_spyre._card`` (csrc/card/): the simulated card, its memory and
  modelled clock behind a C interface (card_api.h), and the loops the
  simulator computes with; it registers nothing with PyTorch;
* ``torch_spyre._C`` (csrc/*.cpp): the PyTorch integration (allocator, guard,
  hooks, generator, aten kernels, the warm launch path), which reaches the
  card through that interface.

Each build is cached by the hash of its sources and the torch version
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

CSRC = Path("torch_spyre/csrc")
SOURCES = {
    "torch_spyre._card": sorted(str(p) for p in (CSRC / "card").glob("*.cpp")),
    "torch_spyre._C": sorted(str(p) for p in CSRC.glob("*.cpp")),
}
HEADERS = sorted(str(p) for p in CSRC.rglob("*.h"))
# No -std flag: torch.utils.cpp_extension adds the standard the torch being
# built against needs (c++20 for both 2.13 and 2.14; 2.14's headers require it,
# so the fixed -std=c++17 this file used to pass broke the build on 2.14).
# tests/runtime/test_build_flags.py checks that none comes back.
COMPILE_ARGS = ["-O2", "-Wno-unused-parameter"]


def _cache_key(name: str) -> str:
    h = hashlib.sha256()
    for src in [*SOURCES[name], *HEADERS]:
        h.update(Path(src).read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(COMPILE_ARGS).encode())
    return h.hexdigest()[:20]


def _unity(name: str) -> list[str]:
    """One translation unit per module that includes its sources: the files
    stay one per integration point, but PyTorch's headers are parsed once per
    module, not once per file (14 files took minutes on a 2-core machine)."""
    out = Path("build") / "unity" / (name.replace(".", "_") + ".cpp")
    text = "".join(f'#include "{Path(src).resolve()}"\n' for src in SOURCES[name])
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists() or out.read_text() != text:
        out.write_text(text)
    return [str(out)]


class CachedBuildExt(BuildExtension):
    def build_extension(self, ext):
        cache = Path(
            os.environ.get("TORCH_SPYRE_BUILD_CACHE", Path.home() / ".cache" / "torch_spyre")
        )
        target = Path(self.get_ext_fullpath(ext.name))
        cached = cache / f"{ext.name}-{_cache_key(ext.name)}{target.suffix}"
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
    ext_modules=[
        CppExtension(name, _unity(name), extra_compile_args=COMPILE_ARGS) for name in SOURCES
    ],
    cmdclass={"build_ext": CachedBuildExt.with_options(use_ninja=True)},
)
