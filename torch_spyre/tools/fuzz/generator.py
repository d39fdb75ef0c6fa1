"""Random valid graphs: NNSmith-style forward insertion with type inference.

``generate(seed)`` starts from one or two float inputs and inserts ops of the
grammar (``ops.OPS``, weighted) one at a time: each op picks its operands
among the nodes so far (recent ones first, so chains form) or makes new
inputs whose shapes are tied to them (broadcast partners, weights, index
tensors within the indexed dim), and the node is kept only when it
type-checks (``Graph.add`` infers it).  Every graph is therefore valid by
construction; the outputs are the computed nodes nothing reads.

Shapes come from a pool that favours sizes which are not multiples of 64,
size-1 dims and small primes; a quarter of the float inputs are
non-contiguous views (transposed, strided, offset or expanded bases).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from torch_spyre.tools.fuzz.graph import Graph, Invalid, Node
from torch_spyre.tools.fuzz.ops import OPS

#: sizes of new dims (small ones more often)
DIM_POOL = (
    1,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    8,
    12,
    16,
    17,
    31,
    32,
    33,
    48,
    63,
    64,
    65,
    96,
    100,
    127,
    128,
    130,
)
LAYOUTS = ("transposed", "strided", "offset", "expanded")


@dataclass
class Config:
    """How large the graphs are."""

    min_ops: int = 1
    max_ops: int = 6
    #: elements of any one tensor
    max_numel: int = 4096
    #: largest dim size drawn
    max_dim: int = 130
    #: chance that a new float input is a non-contiguous view
    p_noncontiguous: float = 0.25
    #: ops left out (names of ops.OPS)
    exclude: tuple[str, ...] = ()
    #: chance that a graph starts with model-shaped motifs (``motifs.py``)
    motifs: float = 0.0


#: the grammar's later ops (``ops/routing.py``: top-k and sort, attention, row
#: writes, gathers and scatters at computed positions), which the CI seed set
#: leaves out so that its seeds keep their graphs
ROUTING_OPS = ("select", "attention", "write", "route")
CI = Config(exclude=ROUTING_OPS)
#: CI-sized graphs drawing the whole grammar
ROUTING = Config()
LONG = Config(min_ops=2, max_ops=12, max_numel=16384, max_dim=200)
#: an attention and/or MLP half of a decoder layer (what the fused programs
#: match, and their near misses), then a few ops of the whole grammar
BLOCKS = Config(min_ops=0, max_ops=2, max_numel=65536, max_dim=200, motifs=1.0)


class Builder:
    """The state ops sample against: the graph so far and the random source."""

    def __init__(self, rng: random.Random, config: Config) -> None:
        self.rng = rng
        self.config = config
        self.g = Graph()

    # ---- sizes and shapes -----------------------------------------------------------

    def size(self) -> int:
        return self.rng.choice([d for d in DIM_POOL if d <= self.config.max_dim])

    def shape(self, rank: int) -> list[int]:
        out = [self.size() for _ in range(rank)]
        while math.prod(out) > self.config.max_numel:
            i = max(range(rank), key=lambda j: out[j])
            out[i] = max(1, out[i] // 2)
        return out

    def broadcast_of(self, x: int) -> list:
        """A shape that broadcasts against node ``x``'s: its dims (tied to
        them), some set to 1, maybe without the leading ones."""
        rank = len(self.g.nodes[x].shape)
        out = [[x, d] if self.rng.random() > 0.25 else 1 for d in range(rank)]
        if rank > 1 and self.rng.random() < 0.3:
            out = out[self.rng.randint(1, rank - 1) :]
        return out

    # ---- picking nodes --------------------------------------------------------------

    def pick(self, pred=None, exclude: int | None = None) -> int | None:
        """A node satisfying ``pred``, recent nodes more likely."""
        cands = [
            i
            for i, n in enumerate(self.g.nodes)
            if i != exclude and n.numel <= self.config.max_numel and (pred is None or pred(n))
        ]
        if not cands:
            return None
        weights = [
            1.0 + 3.0 * (self.g.nodes[i].op != "input") + i / len(self.g.nodes) for i in cands
        ]
        return self.rng.choices(cands, weights)[0]

    def pick_float(self, pred=None, exclude: int | None = None) -> int | None:
        return self.pick(lambda n: n.is_float and (pred is None or pred(n)), exclude)

    # ---- new inputs -----------------------------------------------------------------

    def _input(self, attrs: dict) -> int:
        return self.g.add(Node("input", (), attrs))

    def new_float(
        self,
        shape: list,
        lo: float = -2.0,
        hi: float = 2.0,
        dtype: str = "float32",
        layout_ok: bool = True,
    ) -> int:
        attrs = {"kind": "float", "shape": shape, "lo": lo, "hi": hi, "dtype": dtype}
        rank = len(shape)
        if layout_ok and rank and self.rng.random() < self.config.p_noncontiguous:
            layout = self.rng.choice(LAYOUTS if rank >= 2 else LAYOUTS[1:])
            attrs["layout"] = layout
            if layout == "transposed":
                attrs["dims"] = (
                    sorted(self.rng.sample(range(rank), 2))
                    if self.rng.random() < 0.5
                    else [rank - 2, rank - 1]
                )
            else:
                attrs["dim"] = self.rng.randrange(rank)
        return self._input(attrs)

    def new_index(self, shape: list, high, unique: int | None = None) -> int:
        return self._input({"kind": "index", "shape": shape, "high": high, "unique": unique})

    def new_positions(self, shape: list, high, run: bool) -> int:
        """Distinct row positions below ``high`` (a 1-D index): consecutive
        from a random start when ``run`` (a prefill's cache rows), else any."""
        return self._input({"kind": "index", "shape": shape, "high": high, "unique": 0, "run": run})

    def new_mask(self, shape: list) -> int:
        return self._input({"kind": "mask", "shape": shape, "p": self.rng.choice([0.3, 0.5, 0.8])})


def _pick_op(b: Builder):
    names = [n for n in OPS if n not in b.config.exclude]
    return OPS[b.rng.choices(names, [OPS[n].weight for n in names])[0]]


def generate(seed: int, config: Config = CI) -> Graph:
    """A random valid graph; the same ``seed`` and ``config`` give the same graph."""
    rng = random.Random(seed)
    b = Builder(rng, config)
    b.g.seed = seed
    for _ in range(rng.choice([1, 1, 2])):
        rank = rng.choices([1, 2, 3, 4], [0.1, 0.35, 0.35, 0.2])[0]
        b.new_float(b.shape(rank))
    if config.motifs and rng.random() < config.motifs:
        from torch_spyre.tools.fuzz import motifs

        motifs.play(b)
    target = rng.randint(config.min_ops, config.max_ops)
    done = tries = 0
    while done < target and tries < 30 * target:
        tries += 1
        mark = len(b.g.nodes)
        try:
            sample = _pick_op(b).sample(b)
            if sample is None:
                del b.g.nodes[mark:]
                continue
            i = b.g.add(Node(*sample))
            if b.g.nodes[i].numel > config.max_numel:
                raise Invalid("too large")
        except Invalid:
            del b.g.nodes[mark:]
            continue
        done += 1
    users = b.g.users()
    outs = [i for i, n in enumerate(b.g.nodes) if n.op != "input" and not users[i]]
    if not outs:  # no op fitted: the identity of an input is still a graph
        b.g.add(Node("unary", (0,), {"f": "scale"}))
        outs = [len(b.g.nodes) - 1]
    b.g.outputs = outs
    return b.g


def merge(graphs: list[Graph], seed: int | None = None) -> tuple[Graph, list[tuple[int, int]]]:
    """One graph holding ``graphs`` side by side (compiled as one, so many
    small graphs share one compile), and each one's range of outputs."""
    out = Graph(seed=graphs[0].seed if seed is None else seed)
    spans = []
    for g in graphs:
        off = len(out.nodes)
        for n in g.nodes:
            m = Node(n.op, tuple(a + off for a in n.args), _shift_attrs(n, off))
            out.nodes.append(m)
        start = len(out.outputs)
        out.outputs += [o + off for o in g.outputs]
        spans.append((start, len(out.outputs)))
    out.infer()
    return out, spans


def _shift_attrs(n: Node, off: int) -> dict:
    import copy

    a = copy.deepcopy(n.attrs)
    if n.op == "input":
        a["shape"] = [e if isinstance(e, int) else [e[0] + off, e[1]] for e in a["shape"]]
        if a.get("high") is not None and not isinstance(a["high"], int):
            a["high"] = [a["high"][0] + off, a["high"][1]]
    return a


__all__ = ["BLOCKS", "CI", "LONG", "Builder", "Config", "generate", "merge"]
