"""Runs a spyre AOTInductor package: the model ``csrc/aoti.cpp``'s runner calls.

``torch._inductor.aoti_load_package`` extracts the package and asks
AOTInductor's runner registry for the runner of its device key; ours
constructs ``AotModel`` with the model library's path.  The library holds
(``compiler/aoti.py``) the spyre wrapper module, its metadata and
AOTInductor's constants blob.  Loading puts the weights on the card once
and executes the wrapper module; a call then runs its planned kernel
programs through the one launcher, exactly as ``torch.compile``'s code
would.  Nothing is traced, lowered or planned.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import pathlib
import types
import warnings
from typing import Any

import torch

from torch_spyre.runtime import cards

#: the package format compiler/aoti.py writes and this module reads
FORMAT = 1
#: hardware fields a planned program depends on (core splits, LX tiles, sticks)
PLANNED_FOR = ("cores", "lx_bytes", "stick_bytes")


class AotPackageError(Exception):
    """A spyre AOTInductor package that cannot run here (and why).

    Not a RuntimeError: ``torch.export.pt2_archive.load_pt2`` takes any
    RuntimeError for an outdated archive and loads the package a second
    time, warning about the wrong cause."""


def _string(lib: ctypes.CDLL, name: str) -> str:
    try:
        return ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(lib, name))).decode()
    except ValueError:
        raise AotPackageError(
            f"{lib._name}: no {name}: not a model library written by torch_spyre's "
            "AOTInductor backend; compile it again with torch._inductor.aoti_compile_and_package"
        ) from None


def _device(device_str: str) -> torch.device:
    kind, _, index = device_str.partition(":")
    if kind != "spyre":
        raise AotPackageError(f"the spyre AOTInductor runner got device {device_str!r}")
    i = int(index) if index and int(index) >= 0 else torch.spyre.current_device()
    if i >= torch.spyre.device_count():
        raise AotPackageError(
            f"the package is loaded on spyre:{i}, but this process has "
            f"{torch.spyre.device_count()} card(s) (TORCH_SPYRE_NUM_CARDS)"
        )
    return torch.device("spyre", i)


def _check_meta(meta: dict, path: str, device: torch.device) -> None:
    if meta.get("format") != FORMAT:
        raise AotPackageError(
            f"{path}: spyre package format {meta.get('format')}, this torch_spyre reads "
            f"{FORMAT}: compile the model again with this version"
        )
    hw = cards.config(device.index)
    differ = {
        f: (meta["planned_for"].get(f), getattr(hw, f))
        for f in PLANNED_FOR
        if meta["planned_for"].get(f) != getattr(hw, f)
    }
    if differ:
        what = ", ".join(f"{f} {a} (package) vs {b} (card)" for f, (a, b) in differ.items())
        raise AotPackageError(
            f"{path}: its programs were planned for another card ({what}); compile the "
            "model again for this hardware config"
        )


def _blob(lib: ctypes.CDLL, so_path: str, total: int) -> tuple[Any, int]:
    """AOTInductor's constants blob: (a buffer holding it, where it starts).

    AOTInductor links the blob into the model library
    (``_binary_constants_bin_start``).  Past 2 GB of weights, or with
    ``aot_inductor.force_mmap_weights``, it appends the blob to the library
    file instead (page-aligned, then an 8-byte magic number) and maps it at
    run time (``AotCodeCompiler.compile``); it is read from there."""
    try:
        start = ctypes.addressof(ctypes.c_char.in_dll(lib, "_binary_constants_bin_start"))
        end = ctypes.addressof(ctypes.c_char.in_dll(lib, "_binary_constants_bin_end"))
    except ValueError:
        start = end = 0
    if end - start >= total:
        return (ctypes.c_ubyte * total).from_address(start), 0
    begin = os.path.getsize(so_path) - 8 - total
    if begin < 0:
        raise AotPackageError(
            f"{so_path}: the package's weights ({total} bytes) are neither in the model "
            "library nor appended to it: the package is corrupt or from another AOTInductor"
        )
    with open(so_path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), begin


def _constants(
    lib: ctypes.CDLL, so_path: str, meta: dict, device: torch.device
) -> dict[str, torch.Tensor]:
    """The weights, from AOTInductor's constants blob, on the card."""
    table = meta["constants"]
    if not table:
        return {}
    blob, base = _blob(lib, so_path, meta["constants_bytes"])
    out = {}
    with warnings.catch_warnings():
        # a read-only map: every tensor made here is copied before it is used
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for c in table:
            dtype = getattr(torch, c["dtype"])
            if c["nbytes"] == 0:
                host = torch.empty_strided(c["size"], c["stride"], dtype=dtype)
            else:
                raw = torch.frombuffer(blob, dtype=torch.uint8, count=c["nbytes"],
                                       offset=base + c["offset"])  # fmt: skip
                host = raw.view(dtype).as_strided(c["size"], c["stride"], c["storage_offset"])
            if c["device"] != "spyre":
                out[c["name"]] = host.clone()
                continue
            t = torch.empty_strided(c["size"], c["stride"], dtype=dtype, device=device)
            out[c["name"]] = t.copy_(host)
    if isinstance(blob, mmap.mmap):
        blob.close()
    return out


class AotModel:
    """One loaded spyre package model: ``run(inputs) -> outputs``."""

    def __init__(self, so_path: str, device_str: str, model_dir: str) -> None:
        self.device = _device(device_str)
        lib = ctypes.CDLL(so_path)
        source = _string(lib, "torch_spyre_aoti_module")
        meta = json.loads(_string(lib, "torch_spyre_aoti_meta"))
        _check_meta(meta, so_path, self.device)
        self.meta = meta
        #: [in_spec, out_spec]: the exported program's pytree specs
        self.call_spec = [meta["in_spec"], meta["out_spec"]]
        path = pathlib.Path(model_dir) / "spyre_wrapper.py"
        try:  # tracebacks through the wrapper show its lines
            path.write_text(source)
        except OSError:
            path = pathlib.Path(f"<spyre aoti {so_path}>")
        module = types.ModuleType("torch_spyre_aoti_model")
        module.__file__ = str(path)
        with torch.spyre.device(self.device.index):
            module.__dict__.update(_constants(lib, so_path, meta, self.device))
            exec(compile(source, str(path), "exec"), module.__dict__)
        self.module = module
        self._call = module.call

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        names = self.meta["inputs"]
        if len(inputs) != len(names):
            raise AotPackageError(
                f"the package's model takes {len(names)} tensor input(s), got {len(inputs)}"
            )
        shapes, dtypes = self.meta["input_shapes"], self.meta["input_dtypes"]
        for name, t, shape, dtype in zip(names, inputs, shapes, dtypes):
            if t.device != self.device:
                raise AotPackageError(
                    f"input {name} is on {t.device}; the package was loaded on "
                    f"{self.device}: move the inputs there (.to({str(self.device)!r}))"
                )
            if list(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
                raise AotPackageError(
                    f"input {name} is {tuple(t.shape)} {t.dtype}; the package was exported "
                    f"for {tuple(shape)} torch.{dtype} (its programs are planned for that "
                    "shape): export and package the model for this one"
                )
        with torch.spyre.device(self.device.index):
            outs = self._call(list(inputs))
        return list(outs)


def load(so_path: str, device_str: str, model_dir: str) -> Any:
    return AotModel(so_path, device_str, model_dir)


__all__ = ["AotModel", "AotPackageError", "load"]
