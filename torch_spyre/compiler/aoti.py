"""AOTInductor for spyre: ``aoti_compile_and_package`` writes the planned programs to a .pt2.

AOTInductor lowers an exported program with Inductor in "AOT mode" and asks
the device's C++ wrapper codegen (``register_backend_for_device``'s
``cpp_wrapper_codegen``) for one C++ source, which it compiles into the
package's model library next to the weights.  AOTInductor's stock C++ model
runtime knows only the CPU, CUDA, XPU and MPS devices (its
``parse_device_str``), and a spyre graph is kernel programs that the card's
Python launcher runs.  So the spyre wrapper that fills that slot is
``SpyreAotWrapperCodegen``: the Python wrapper the JIT path writes (every
planned program as the JSON of its IR, the launch sequence, buffer frees)
generated exactly as ``torch.compile`` would, then embedded in a C++
translation unit as two string constants:

* ``torch_spyre_aoti_module``: the wrapper module;
* ``torch_spyre_aoti_meta``: JSON with the call spec (the exported
  program's input and output trees), where each weight lies in the library's
  constants blob (AOTInductor serialises every constant's storage there,
  ``_binary_constants_bin_start``), the hardware fields the programs were
  planned for, and the torch_spyre version.

``aoti_load_package`` then finds the spyre runner AOTInductor's runner
registry holds for the device key ``spyre`` (``csrc/aoti.cpp``), which loads
the package through ``torch_spyre.runtime.aoti``: no Dynamo, no Inductor
lowering, no planning.  See docs/compiler.md, "Ahead-of-time packages".
"""

from __future__ import annotations

import json

import sympy
import torch
from torch._inductor import config
from torch._inductor.utils import ValueWithLineMap
from torch._inductor.virtualized import V

from torch_spyre.compiler import lowering
from torch_spyre.compiler.scheduling import SpyreWrapperCodegen
from torch_spyre.runtime.aoti import FORMAT, PLANNED_FOR  # what the loader reads

#: the raw-string delimiter of the embedded sources (C++ allows up to 16 chars)
DELIM = "TORCH_SPYRE"
#: exported from the model library whatever -fvisibility it is built with
VISIBLE = '__attribute__((visibility("default")))'


def constants_table(graph) -> tuple[list[dict], int]:
    """Where each weight lies in AOTInductor's constants blob, and the blob's size.

    ``AotCodeCompiler`` writes the storage of every constant that is not
    folded, in ``graph.constants`` order, each starting on an
    ``ALIGN_BYTES`` boundary (``codecache.AotCodeCompiler.compile``,
    "aoti_serialize_constants"); the offsets here follow the same rule, and
    the loader checks the blob against the size.
    """
    from torch._inductor.codecache import ALIGN_BYTES

    table, offset = [], 0
    for name in graph.constants:
        if name in graph.folded_constants:
            continue
        t = graph.get_original_value_of_constant(name)
        nbytes = 0 if t.numel() == 0 else t.untyped_storage().nbytes()
        table.append(
            {
                "name": name,
                "fqn": graph.allocated_constant_name.get(name, name),
                "dtype": str(t.dtype).removeprefix("torch."),
                "size": list(t.size()),
                "stride": list(t.stride()),
                "storage_offset": t.storage_offset(),
                "nbytes": nbytes,
                "offset": offset,
                "device": t.device.type,
            }
        )
        offset += (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
    return table, offset


def _check_packaging() -> None:
    aot = config.aot_inductor
    if not aot.package_constants_in_so or aot.package_constants_on_disk_format:
        raise lowering.Unsupported(
            "spyre AOTInductor packages keep the weights in the model library: "
            "leave aot_inductor.package_constants_in_so=True and "
            "package_constants_on_disk_format unset"
        )
    if aot.use_runtime_constant_folding:
        raise lowering.Unsupported(
            "spyre AOTInductor packages do not fold constants at run time: "
            "leave aot_inductor.use_runtime_constant_folding=False"
        )


def _check_static(graph) -> None:
    """Kernel programs are planned for static shapes, and a package cannot
    recompile: an exported dynamic dim is refused, naming it."""
    for name, value in graph.graph_inputs.items():
        size = value.get_size() if hasattr(value, "get_size") else ()
        dynamic = [str(s) for s in size if getattr(s, "free_symbols", None)]
        if dynamic or isinstance(value, sympy.Expr):
            raise lowering.Unsupported(
                f"spyre AOTInductor: input {name} has a dynamic size "
                f"({', '.join(dynamic) or value}); kernel programs are planned for static "
                "shapes and a package cannot recompile: export without dynamic_shapes "
                "(one package per shape, e.g. per token bucket)"
            )


def _raw(text: str) -> str:
    if f'){DELIM}"' in text:
        raise lowering.Unsupported(f"spyre AOTInductor: the wrapper holds ')' + {DELIM!r}")
    return f'R"{DELIM}({text}){DELIM}"'


def cpp_source(module: str, meta: dict) -> str:
    """The C++ translation unit the model library is built from."""
    return "\n".join(
        [
            "// torch_spyre AOTInductor model: the spyre wrapper module (planned kernel",
            "// programs and their launch sequence) and its metadata; the weights are",
            "// AOTInductor's constants blob.  Loaded by torch_spyre.runtime.aoti.",
            f'extern "C" {VISIBLE} const char torch_spyre_aoti_module[] = {_raw(module)};',
            f'extern "C" {VISIBLE} const char torch_spyre_aoti_meta[] = {_raw(json.dumps(meta))};',
            "",
        ]
    )


class SpyreAotWrapperCodegen(SpyreWrapperCodegen):
    """The spyre wrapper in AOTInductor's C++ wrapper slot (see the module doc).

    The graph is lowered in AOT mode; while this wrapper is generated the
    graph reads as a JIT graph (``cpp_wrapper`` and ``aot_mode`` off), so the
    code is the very module ``torch.compile`` would run, and both flags are
    back on before AOTInductor compiles and packages it."""

    def __init__(self) -> None:
        if not V.graph.aot_mode:
            raise lowering.Unsupported(
                "spyre compiles to a Python wrapper that calls the card's launcher: "
                "torch._inductor.config.cpp_wrapper=True is only used for AOTInductor "
                "packages (aoti_compile_and_package); leave it off for torch.compile"
            )
        super().__init__()
        _check_packaging()
        _check_static(V.graph)
        # AOTInductor precompiles the device's stock C++ runtime header
        # (torch/csrc/inductor/aoti_include/<device>.h) before building the
        # wrapper; torch ships none for spyre, and our translation unit
        # includes nothing.  The knob is not per device and no hook runs
        # after the build to restore it: a process that packages a spyre
        # model builds later AOTInductor packages without precompiled
        # headers (slower builds, the same libraries).
        config.aot_inductor.precompile_headers = False
        self._graph = V.graph
        self._flags = (self._graph.cpp_wrapper, self._graph.aot_mode)
        self._graph.cpp_wrapper = False
        self._graph.aot_mode = False

    @staticmethod
    def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
        if is_subgraph:
            return SpyreWrapperCodegen.create(
                is_subgraph, subgraph_name, parent_wrapper, partition_signatures
            )
        return SpyreAotWrapperCodegen()

    def generate(self, is_inference):
        from torch_spyre import _version
        from torch_spyre.runtime import cards

        try:
            # AOT mode stores Triton cubins: the JIT wrapper saves none
            with config.patch({"triton.store_cubin": False}):
                module, _ = super().generate(is_inference)
        finally:
            self._graph.cpp_wrapper, self._graph.aot_mode = self._flags
        device = next((d for d in self._graph.device_idxs), 0)
        hw = cards.config(device)
        table, blob_bytes = constants_table(self._graph)
        meta = {
            "format": FORMAT,
            "torch_spyre": _version.__version__,
            "torch": torch.__version__,
            "in_spec": config.aot_inductor.serialized_in_spec,
            "out_spec": config.aot_inductor.serialized_out_spec,
            "inputs": list(self._graph.graph_inputs),
            "input_shapes": [
                [int(d) for d in v.get_size()] for v in self._graph.graph_inputs.values()
            ],
            "input_dtypes": [
                str(v.get_dtype()).removeprefix("torch.") for v in self._graph.graph_inputs.values()
            ],
            "constants": table,
            "constants_bytes": blob_bytes,
            "planned_for": {f: getattr(hw, f) for f in PLANNED_FOR},
        }
        return ValueWithLineMap(cpp_source(module.value, meta), []), ValueWithLineMap("", [])


__all__ = ["SpyreAotWrapperCodegen", "constants_table", "cpp_source"]
