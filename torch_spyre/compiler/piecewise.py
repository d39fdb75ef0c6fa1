"""One compile per distinct piece of a graph: Dynamo's graph cut at its opaque ops.

A model's forward traced by Dynamo is one FX graph holding every layer.
Compiled whole, Inductor lowers, schedules and plans every layer again,
although a decoder's layers are the same graph over other weights: compile
time grows with the depth.  The graph's opaque ops (vLLM's attention custom
ops: no kernel program lowers them, and Inductor emits each as a fallback
kernel, a fusion barrier, anyway) cut it into pieces: the embedding and the
first layer up to its attention; then, per layer, the attention's output
through the MLP to the next layer's query, key and value; then the tail.
The middle pieces of identical layers are identical graphs.

``compile_piecewise`` splits the graph at those ops (``torch.fx``'s
``split_module``), runs the split graph once on the example inputs' fake
tensors to learn each piece's inputs, and compiles each piece with Inductor
once per **distinct piece**: the key is the piece's graph structure (ops,
targets, constants, which value feeds which) and its inputs' shapes, strides
and dtypes, never names.  An identical piece reuses the first one's
compiled code with its own inputs (its layer's weights).  The cut ops run as
they are.  What the cut gives up: fusion across an opaque op (Inductor does
none) and buffer reuse across pieces.  Pieces with graph attributes
(``get_attr``: a constant Dynamo lifted) are compiled on their own.

Measured in ``benchmarks/startup.py``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch._guards import detect_fake_mode
from torch.fx.passes.split_module import split_module

from torch_spyre.sim import card

#: compiled pieces of this process: key -> compiled callable
_PIECES: dict[str, Callable] = {}


class Stats:
    """What one ``compile_piecewise`` call did."""

    def __init__(self) -> None:
        self.pieces = 0  # pieces compiled or reused
        self.compiled = 0  # handed to Inductor
        self.reused = 0  # an identical piece's code

    def as_dict(self) -> dict[str, int]:
        return {"pieces": self.pieces, "compiled": self.compiled, "reused": self.reused}


def _meta(a) -> str:
    if isinstance(a, torch.Tensor):
        return f"T{tuple(a.shape)}{tuple(a.stride())}{a.dtype}{a.device}{a.storage_offset()}"
    return f"{type(a).__name__}:{a!r}"


def piece_key(gm: torch.fx.GraphModule, args, salt: str = "") -> str | None:
    """The structural key of a piece and its inputs (None: not shareable)."""
    index: dict[torch.fx.Node, int] = {}

    def ref(a):
        if isinstance(a, torch.fx.Node):
            return ("%", index[a])
        if isinstance(a, list | tuple):
            return (type(a).__name__, tuple(ref(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, ref(v)) for k, v in a.items()))
        if isinstance(a, torch.Tensor):  # a tensor constant in the code: not shared
            raise ValueError
        return ("c", repr(a))

    parts = []
    try:
        for i, n in enumerate(gm.graph.nodes):
            if n.op in ("get_attr", "call_module"):
                return None
            index[n] = i
            target = "" if n.op == "placeholder" else str(n.target)
            parts.append((n.op, target, ref(n.args), ref(n.kwargs)))
    except ValueError:
        return None
    text = repr((salt, parts, [_meta(a) for a in args]))
    return hashlib.sha256(text.encode()).hexdigest()


def compile_piecewise(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    is_cut: Callable[[torch.fx.Node], bool],
    compile_piece: Callable[[torch.fx.GraphModule, list], Callable],
    salt: str = "",
    stats: Stats | None = None,
    rerun: bool = False,
) -> Callable:
    """``gm`` compiled piece by piece (module doc); ``compile_piece(piece,
    example inputs)`` compiles one piece (Inductor's ``compile_fx``).

    Each piece's inputs are the fake values Dynamo recorded on the graph's
    nodes (``split_module`` copies them onto the pieces' placeholders); when
    one is missing (a graph not traced by Dynamo), or with ``rerun=True``,
    the split graph is run once on fake tensors instead (docs/compiler.md,
    "The artifact cache": a warm vLLM start of SmolLM2 spent ~30% less in
    its warm-up without that run)."""
    stats = stats if stats is not None else Stats()
    cuts = [n for n in gm.graph.nodes if n.op == "call_function" and is_cut(n)]
    if not cuts:
        stats.pieces, stats.compiled = 1, 1
        return compile_piece(gm, example_inputs)
    share_lookups(gm)
    ids = parts(gm, is_cut)
    cut_parts = {ids[n] for n in cuts}
    split = split_module(gm, None, lambda n: ids[n], keep_original_order=True)
    pieces = {
        name
        for name, _ in split.named_children()
        if name.startswith("submod_") and int(name.removeprefix("submod_")) not in cut_parts
    }

    fake_mode = detect_fake_mode(example_inputs) or torch._subclasses.FakeTensorMode(
        allow_non_fake_inputs=True
    )

    found: list[tuple[str, torch.fx.GraphModule, tuple]] = []

    class _Inputs(torch.fx.Interpreter):
        """Runs the split graph on fake tensors: each piece's inputs."""

        def call_module(self, target, args, kwargs):
            if target in pieces:
                found.append((target, self.fetch_attr(target), args))
            return super().call_module(target, args, kwargs)

    recorded = None if rerun else _recorded_inputs(split, pieces)
    if recorded is not None and any(symbolic(a) for _, _, args in recorded for a in args):
        # traced with a dynamic dim: each distinct piece compiled per shape
        # on its first call (``Sized``), the split made once for every shape
        for target, sub, args in recorded:
            key = piece_key(sub, args, salt)
            sized = _PIECES.get(key) if key is not None else None
            if not isinstance(sized, Sized):
                sized = Sized(sub, args, compile_piece, stats)
                if key is not None:
                    _PIECES[key] = sized
            _place(split, target, _SizedCall(sized, stats))
        split.meta["spyre_per_size"] = True
        return split
    if recorded is not None:
        found = recorded
    else:
        fakes = [
            fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) and not _is_fake(a) else a
            for a in example_inputs
        ]
        with fake_mode:
            _Inputs(split).run(*fakes)
    # compiled outside the fake mode: a constant a graph pass makes (RoPE's
    # permutation matrix, a lane table) must be a real tensor, or AOTAutograd's
    # cache stores it as a meta tensor (a warm start then handed it to a card
    # program: "not a spyre tensor")
    for target, sub, args in found:
        stats.pieces += 1
        key = piece_key(sub, args, salt)
        fn = _PIECES.get(key) if key is not None else None
        if fn is None:
            stats.compiled += 1
            fn = compile_piece(sub, list(args))
            if key is not None:
                _PIECES[key] = fn
        else:
            stats.reused += 1
        _place(split, target, fn)
    return split


def parts(gm: torch.fx.GraphModule, is_cut: Callable[[torch.fx.Node], bool]) -> dict:
    """The part of the split each node falls in (``split_module``'s partition):
    the nodes between two cuts share one, each cut op is one of its own; the
    graph's inputs and output are in none."""
    part, ids = 0, {}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "call_function" and is_cut(n):
            ids[n] = part + 1
            part += 2
        else:
            ids[n] = part
    return ids


def _place(split: torch.fx.GraphModule, target: str, fn: Callable) -> None:
    """The parent's code calls ``self.<target>(...)``: ``fn`` in the piece's
    place (not a module: set past nn.Module's ``__setattr__``)."""
    del split._modules[target]
    split.__dict__[target] = fn


class Sized:
    """A distinct piece of a graph traced with a dynamic dim (a vLLM token
    count), compiled for each concrete shape on its first call with it, as
    vLLM's own piecewise backend compiles per size: the programs are planned
    for static shapes, as if the shape had been traced alone.  Identical
    pieces (a decoder's layers) share one."""

    def __init__(self, sub: torch.fx.GraphModule, recorded: tuple, compile_piece, stats) -> None:
        self.sub, self.compile_piece, self.stats = sub, compile_piece, stats
        #: the inputs whose shape is symbolic: their shapes and strides key a compile
        self.dynamic = [i for i, a in enumerate(recorded) if symbolic(a)]
        self.compiled: dict[tuple, Callable] = {}

    def key(self, args: tuple) -> tuple:
        return tuple(
            (tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a
            for a in (args[i] for i in self.dynamic)
        )

    def get(self, key: tuple, args: tuple) -> Callable:
        fn = self.compiled.get(key)
        if fn is None:
            self.stats.compiled += 1
            fn = self.compiled[key] = compile_outside(self.compile_piece, self.sub, list(args))
        else:
            self.stats.reused += 1
        return fn


class _SizedCall:
    """One piece's place in the split graph: its shared ``Sized`` compile for
    the call's shapes (counted once per shape, as a piece compiled or reused)."""

    def __init__(self, sized: Sized, stats: Stats) -> None:
        self.sized, self.stats = sized, stats
        self.seen: dict[tuple, Callable] = {}

    def __call__(self, *args):
        key = self.sized.key(args)
        fn = self.seen.get(key)
        if fn is None:
            self.stats.pieces += 1
            fn = self.seen[key] = self.sized.get(key, args)
        return fn(*args)


def compile_outside(compile_fn, gm: torch.fx.GraphModule, args: list) -> Callable:
    """``compile_fn(gm, args)`` at run time, outside Dynamo's compile: with
    the metrics context Inductor's caches expect, and a tracing context of
    its own (a symbolic trace's fake mode must not reach a concrete compile).
    The tensors are handed over as fake tensors of static shapes: AOTAutograd
    would fakify real ones with a symbol for every dim (2x the compile time
    of a static trace, every shape then specialized again by guards)."""
    from torch._dynamo.utils import dynamo_timed, get_metrics_context
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # a fresh tracing context of static shapes, as Dynamo gives a static
    # trace: AOTAutograd's cache keys on its shape env (without one it
    # bypasses the cache, and a warm start would compile every piece again)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = torch._guards.TracingContext(mode)
    # a top-level compile event: AOTAutograd's cache records a hit on it;
    # the card work of compiling is not the caller's (sim/card.py ``compiling``)
    with (
        card.compiling(),
        torch._guards.tracing(context),
        get_metrics_context(),
        dynamo_timed("spyre_compile_per_shape", log_pt2_compile_event=True),
    ):
        fake = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
                for a in args]  # fmt: skip
        return compile_fn(gm, fake)


def fresh(gm: torch.fx.GraphModule, args: list | None = None) -> torch.fx.GraphModule:
    """A copy of ``gm``'s graph over the same attributes, for Inductor to
    compile: it edits the graph it compiles (a single output becomes a tuple,
    its pre-grad passes rewrite nodes), and the next shape of a graph traced
    with a dynamic dim must compile the graph as traced.  With ``args``, the
    integer inputs (the symbols Dynamo lifted: a token count) are
    specialized to their values: each placeholder stays, its uses take the
    value, so the copy is the graph a static trace of that shape gives."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    if args is not None:
        places = [n for n in graph.nodes if n.op == "placeholder"]
        for node, value in zip(places, args, strict=True):
            if isinstance(value, int) and not isinstance(value, bool):
                node.replace_all_uses_with(value)  # type: ignore[arg-type]
    return torch.fx.GraphModule(gm, graph)


#: pure ops a graph repeats per layer on the same operands: table lookups and
#: the views and casts of their indices
_PURE_FUNCTIONS = (
    torch.nn.functional.embedding,
    torch.index_select,
    torch.flatten,
    torch.reshape,
    torch.ops.aten.embedding.default,
    torch.ops.aten.index_select.default,
)
_PURE_METHODS = ("flatten", "view", "reshape", "long", "int", "to", "contiguous", "unsqueeze")


def _writes(n: torch.fx.Node) -> bool:
    """Whether ``n`` may write one of its operands (an in-place method or op)."""
    if n.op == "call_method":
        return str(n.target).endswith("_")
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable) or getattr(
        n.target, "__name__", ""
    ).endswith("_")


def share_lookups(gm: torch.fx.GraphModule) -> None:
    """One lookup per distinct (table, indices) before the cut.  Every layer
    gathers the same rotary cos/sin rows (one shared table) by its own
    ``positions.flatten()``; the whole graph's pass merges the lookups after
    lowering (``passes._dedupe_lookups``), which a piece cannot do across
    pieces.  Merged here (common subexpressions of pure lookups and of the
    views of their indices), the first piece looks the rows up and the others
    take them as an input: measured on an 8-layer model, 68 lookups in 4 steps
    became the whole graph's 12, and the modelled time its own."""
    first: dict[tuple, torch.fx.Node] = {}
    for n in list(gm.graph.nodes):
        pure = (n.op == "call_function" and n.target in _PURE_FUNCTIONS) or (
            n.op == "call_method" and n.target in _PURE_METHODS
        )
        if not pure or any(_writes(u) for u in n.users):
            continue
        try:
            key = (n.op, n.target, tuple(n.args), tuple(sorted(n.kwargs.items())))
            kept = first.setdefault(key, n)
        except TypeError:  # an unhashable argument: left alone
            continue
        if kept is not n:
            n.replace_all_uses_with(kept)
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def _recorded_inputs(
    split: torch.fx.GraphModule, pieces: set[str]
) -> list[tuple[str, torch.fx.GraphModule, tuple]] | None:
    """(name, piece, inputs) of every piece in run order, the inputs being the
    values Dynamo recorded (``example_value``); None when one is missing."""
    found = []
    for n in split.graph.nodes:
        if n.op != "call_module" or n.target not in pieces:
            continue
        sub = split.get_submodule(n.target)
        values = []
        for p in sub.graph.nodes:
            if p.op != "placeholder":
                continue
            v = p.meta.get("example_value")
            if v is None or (isinstance(v, torch.Tensor) and not _is_fake(v)):
                return None
            values.append(v)
        found.append((n.target, sub, tuple(values)))
    return found


def symbolic(v) -> bool:
    """A value of a graph Dynamo traced with a dynamic dim: its pieces are
    compiled for the call's concrete shapes (``vllm_plugin/compile.PerBucket``)."""
    if isinstance(v, torch.SymInt):
        return True
    return isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.FakeTensor)


def clear() -> None:
    """Forget the compiled pieces (a new hardware config or planning options)."""
    _PIECES.clear()


__all__ = [
    "Sized",
    "Stats",
    "clear",
    "compile_outside",
    "compile_piecewise",
    "fresh",
    "parts",
    "piece_key",
    "share_lookups",
    "symbolic",
]
