"""Op coverage of spyre, measured with PyTorch's OpInfo database.

Every sample input of every OpInfo entry in the universe (below) is generated
on the CPU, copied to spyre (tensors, nested ones included; ``cpu`` devices
become ``spyre``), run there and on the CPU, and the results are compared.
Each op is then classified by how spyre served it (``dispatch_stats``):

* ``device kernel``: every sample passed, and no adapter or host fallback ran
  (kernel programs, or metadata-only ops such as views that move no data);
* ``adapter``: every sample passed, some went through an adapter, none through
  the host fallback;
* ``host fallback``: every sample passed, some ran on the host;
* ``fails``: some sample raised or gave a different result;
* ``crash``: the worker process died (signal, abort) or hung; that is a bug,
  since every failure must be a Python exception.

Run ``python -m torch_spyre.tools.opcheck --help``.  A full run rewrites
docs/op-coverage.md; a filtered run (``--ops``/``--quick``) writes only where
``--output`` says, so a partial table never replaces the full one.

The package, one module a step: ``samples`` (OpInfo samples and moving them to
the device), ``compare`` (a sample on spyre and on the CPU), ``results`` (an
op's outcome and its path), ``selection`` (the universe and --quick),
``runners`` (in process or in workers), ``report`` (docs/op-coverage.md) and
``cli``.
"""

from torch_spyre.tools.opcheck.cli import DEFAULT_OUTPUT, build_parser, main, parse_dtypes
from torch_spyre.tools.opcheck.compare import MAX_SAMPLE_ELEMENTS, TOLERANCES, run_op, run_sample
from torch_spyre.tools.opcheck.report import (
    Totals,
    failure_groups,
    format_table,
    render_markdown,
    totals,
)
from torch_spyre.tools.opcheck.results import (
    ADAPTER,
    CRASH,
    EXCLUDED,
    FAILS,
    FALLBACK,
    KERNEL,
    ORDER,
    PASSING,
    OpResult,
    SampleOutcome,
    classify,
)
from torch_spyre.tools.opcheck.runners import run_in_process, run_in_workers
from torch_spyre.tools.opcheck.samples import describe, sample_inputs
from torch_spyre.tools.opcheck.selection import (
    DEFAULT_DTYPES,
    EXCLUDED_FAMILIES,
    QUICK_MAX_SAMPLES,
    QUICK_OPS,
    VARIANTS,
    in_universe,
    load_op_db,
    op_key,
    select_ops,
)

__all__ = [
    "ADAPTER",
    "CRASH",
    "DEFAULT_DTYPES",
    "DEFAULT_OUTPUT",
    "EXCLUDED",
    "EXCLUDED_FAMILIES",
    "FAILS",
    "FALLBACK",
    "KERNEL",
    "MAX_SAMPLE_ELEMENTS",
    "ORDER",
    "PASSING",
    "QUICK_MAX_SAMPLES",
    "QUICK_OPS",
    "TOLERANCES",
    "VARIANTS",
    "OpResult",
    "SampleOutcome",
    "Totals",
    "build_parser",
    "classify",
    "describe",
    "failure_groups",
    "format_table",
    "in_universe",
    "load_op_db",
    "main",
    "op_key",
    "parse_dtypes",
    "render_markdown",
    "run_in_process",
    "run_in_workers",
    "run_op",
    "run_sample",
    "sample_inputs",
    "select_ops",
    "totals",
]
