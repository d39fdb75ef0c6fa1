"""The model forward through the spyre torch.compile backend, one graph per token bucket.

vLLM compiles its models per batch shape (cudagraph capture sizes); the spyre
backend compiles statically (``dynamic=False``, docs/compiler.md). The plugin does
the same: the number of scheduled tokens of a step is padded up to a **bucket**
(default 16, 32, 64, ... doubling up to ``max_num_batched_tokens``, which is always
the last bucket), and the model forward for that bucket is compiled once with plain
``torch.compile`` (spyre tensors reach the spyre Inductor backend). So at most one
graph per bucket is ever compiled, whatever the decode/prefill mix.

* **Attention stays outside the kernel programs**: the platform reports
  ``opaque_attention_op()``, so vLLM's ``Attention`` layer calls its custom ops
  ``vllm::unified_kv_cache_update`` and ``vllm::unified_attention_with_output``
  (registered with fake implementations by vLLM). In the graph they are opaque
  nodes; Inductor emits them as fallback kernels that call the paged attention of
  attention.py (eager spyre kernels over the paged KV cache, per step metadata
  from vLLM's forward context). Everything else (embedding, norms, rotary, QKV /
  output / MLP projections, SiluAndMul, residuals, the final norm) is planned as
  spyre kernel programs.
* **The LM head** runs after the forward on the sampled rows only (vLLM's
  ``compute_logits``): compiled on its own, per bucket of rows (``CompiledHead``).
* **Padded tokens never reach real ones**: padded rows carry token id 0 at
  position 0; the attention backend writes only the step's real tokens into the
  KV cache (``slots`` has one entry per real token), attends with real queries
  only, and zeroes the padded rows of its output; every other layer is row-wise.
  The runner returns the real rows only.

* **Piece by piece** (``TORCH_SPYRE_VLLM_PIECEWISE``, on by default): each
  bucket's graph is cut at the attention ops and each distinct piece is
  compiled once (``compiler/piecewise.py``): a decoder's layers are one
  piece compiled once, not once per layer.  SmolLM2-135M (30 layers, buckets
  16 and 256, fp16): engine start 45.6 s cold as one graph, 19.0-21.9 s
  piece by piece (62 pieces, 6 compiled); warm 16.3 s and 17.4 s; the same
  tokens; 54.979 and 54.220 ms modelled for a 16-token answer.

* **Traced once** (``TORCH_SPYRE_VLLM_REGIONS``, on by default): Dynamo
  traces the forward once for every bucket, the token count marked dynamic
  (``maybe_mark_dynamic``: a model whose code branches on it is traced per
  bucket), and the decoder's repeated layers once (PyTorch's nested compile
  regions, ``compiler/regions.py``), as vLLM's own backend does on GPUs.  The
  traced graph is flattened and each bucket compiled for its static shapes
  on its first call (``PerBucket``; piece by piece: ``piecewise.Sized``), so
  the programs are those of a bucket traced alone.  Should the trace with
  regions fail, the forward is traced flat per bucket, with a warning.
  A 40-layer Granite-shaped model compiles in 1.29x the time of a 2-layer
  one, 3.09x traced flat (``benchmarks/startup.py``, docs/serving.md).

* **Saved trace** (``TORCH_SPYRE_PRECOMPILE``, on by default, with the
  artifact cache): the one trace is saved (``compiler/precompiled.py``:
  torch's ahead-of-time Dynamo compile; the graph with the fake values its
  pieces read, ``compiler/saved_graph.py``) and a later engine loads it
  instead of tracing: keyed by the module (class tree, parameter shapes),
  vLLM's hash of the engine's config and the versions, with the token count
  still a symbol, each bucket then compiled from the FX graph and kernel
  caches.  SmolLM2's warm-up in a warm ``vllm serve``: 2.9-3.8 s -> 1.7-2.0 s
  (the first bucket 2.6-3.1 s -> 1.0-1.2 s), the same tokens.

``TORCH_SPYRE_VLLM_COMPILE=0`` runs the same layers eagerly, op by op.
``TORCH_SPYRE_VLLM_BUCKETS=16,64,256`` sets the buckets (the largest scheduled
token count is always added).
"""

from __future__ import annotations

import contextvars
import pickle
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch._dynamo.aot_compile_types import SerializableCallable
from vllm.logger import init_logger

from torch_spyre import settings
from torch_spyre.compiler import piecewise, regions, saved_graph
from torch_spyre.compiler.precompiled import PrecompiledForward

logger = init_logger(f"vllm.{__name__}")  # vLLM configures the "vllm" tree

SPYRE = torch.device("spyre")
FIRST_BUCKET = 16


def enabled(pooling: bool = False) -> bool:
    """Compile the forward?  ``TORCH_SPYRE_VLLM_COMPILE``: on by default for
    generative models; pooling models (one prefill-only pass per request) run
    eagerly unless it is set to 1 (the compiler lacks the integer bit ops of
    vLLM's BERT token-type packing: docs/serving.md)."""
    on = settings.get().vllm_compile
    return (not pooling) if on is None else on


def buckets(max_tokens: int) -> list[int]:
    """Token-count buckets: the environment's list or 16, 32, ... below the max; the max."""
    sizes = list(settings.get().vllm_buckets or _doubling(max_tokens))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def bucket_for(n: int, sizes: list[int]) -> int:
    for b in sizes:
        if n <= b:
            return b
    raise ValueError(f"spyre: {n} scheduled tokens exceed the largest bucket {sizes[-1]}")


class CompiledForward:
    """The model's forward compiled per bucket; counts graphs, compile time, launches."""

    def __init__(
        self, model: torch.nn.Module, max_tokens: int, config_hash: str | None = None
    ) -> None:
        self.model = model
        #: vLLM's hash of the engine's config: with the module, it keys the saved trace
        self.config_hash = config_hash
        self.sizes = buckets(max_tokens)
        self.graphs = 0  # FX graphs handed to Inductor (spyre backend), one per bucket
        self.traces = 0  # Dynamo traces of the forward (one for every bucket: below)
        self.calls: Counter[int] = Counter()  # steps per bucket
        self.compile_s: dict[int, float] = {}  # first call per bucket (compile + run)
        self.cache: Counter[str] = Counter()  # AOTAutograd cache: hit / miss / bypass
        self.pieces = piecewise.Stats()  # pieces compiled / reused (piecewise.py)
        self._bucket: int | None = None
        # one graph per bucket; never fall back to eager silently.  Dynamo's
        # limit counts entries per code object, across every model of the
        # process whose forward is the same code (engines built one after
        # another: tests, notebooks, a llama then a mistral): room for 8 such
        # models; a recompiling bucket still shows in ``graphs``
        limit = 8 * (len(self.sizes) + 2)
        dynamo_config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name) and getattr(dynamo_config, name) < limit:
                setattr(dynamo_config, name, limit)
        # repeated layers traced once, the forward once for every bucket
        # (module doc, "Traced once"; TORCH_SPYRE_VLLM_REGIONS)
        self.regions = settings.get().vllm_regions
        self.marked = regions.mark_repeated(model) if self.regions else []
        self._fn: Callable = self._compiled()

    def _compiled(self) -> Callable:
        if self.regions:
            # one trace for every bucket, saved and loaded (module doc, "Saved trace")
            return PrecompiledForward(
                self.model,
                self._backend,
                fullgraph=True,
                salt=self.config_hash,
                dynamic=_token_dims,
            )
        return torch.compile(
            self.model.forward, backend=self._backend, dynamic=False, fullgraph=True
        )

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        # Inductor (which hands spyre tensors to the spyre scheduling/wrapper):
        # exactly what torch.compile's default backend does, plus a count; a
        # graph traced with a symbolic token count is compiled per bucket
        self.traces += 1
        regions.inline_subgraphs(gm)  # repeated layers traced once, planned flat
        sizes = _symbolic_inputs(example_inputs)
        if sizes is not None:
            return PerBucket(gm, sizes, self._compile_bucket)
        return self._compile_bucket(gm, example_inputs)

    def _compile_bucket(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return _compile_fx(gm, example_inputs, self.cache, self.pieces)

    def __call__(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if inputs_embeds is not None or intermediate_tensors is not None or kwargs:
            raise NotImplementedError(
                "spyre compiled forward: token ids and positions only "
                "(no inputs_embeds, pipeline stages or extra model inputs)"
            )
        return self._run(input_ids, positions, count=True)

    def warm_up(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Compile (and run) the bucket of these inputs; not counted as a step.
        The hidden states (without EAGLE-3's auxiliary ones)."""
        out = self._run(input_ids, positions, count=False)
        return out[0] if isinstance(out, tuple) else out

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, count: bool) -> torch.Tensor:
        n = input_ids.shape[0]
        b = bucket_for(n, self.sizes)
        ids = _pad(input_ids, b)
        pos = _pad(positions, b)
        first = b not in self.compile_s
        t0 = time.perf_counter()
        token = _LOADING.set(self)
        try:
            out = self._fn(input_ids=ids, positions=pos)
        except Exception as e:
            if not first:
                raise
            if self.regions:
                # the degrade path: the model as Dynamo traces it flat, per bucket
                logger.warning(
                    "spyre: tracing the forward with its repeated layers as one region "
                    "and a dynamic token count failed (%s: %s); tracing every layer "
                    "and bucket instead (TORCH_SPYRE_VLLM_REGIONS=0)",
                    type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "",
                )
                self.regions = False
                regions.unmark(self.model)
                self.marked = []
                self._fn = self._compiled()
                return self._run(input_ids, positions, count)
            raise RuntimeError(
                f"spyre: compiling the model forward for the {b}-token bucket failed "
                f"(TORCH_SPYRE_VLLM_COMPILE=0 runs the layers eagerly): {e}"
            ) from e
        finally:
            _LOADING.reset(token)
        if first:
            self.compile_s[b] = time.perf_counter() - t0
            logger.info(
                "spyre: compiled the forward for the %d-token bucket in %.1f s "
                "(%d graphs so far, buckets %s)",
                b,
                self.compile_s[b],
                self.graphs,
                self.sizes,
            )
        if count:
            self.calls[b] += 1
        return _real_rows(out, n)

    def summary(self) -> dict:
        return {
            "buckets": list(self.sizes),
            "graphs": self.graphs,
            "traces": self.traces,
            "regions": list(self.marked),
            "calls": dict(self.calls),
            "compile_s": dict(self.compile_s),
            "aot_cache": dict(self.cache),
            "pieces": self.pieces.as_dict(),
            # the saved trace: loaded, built, saved, calls it served, why not
            "saved_trace": self._fn.stats.as_dict()
            if isinstance(self._fn, PrecompiledForward)
            else None,
        }


def _token_dims(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    """The token count of a call, traced as a symbol: one Dynamo trace for
    every bucket (module doc, "Traced once").  Dynamo may still specialize
    it if the model's code branches on it, and then traces that bucket on
    its own; M-RoPE's [3, n] positions keep every bucket's trace static."""
    ids, pos = kwargs.get("input_ids"), kwargs.get("positions")
    if isinstance(ids, torch.Tensor) and isinstance(pos, torch.Tensor):
        if ids.dim() == 1 and pos.dim() == 1:
            return [(ids, 0), (pos, 0)]
    return []


#: the compiled forward a saved ``PerBucket`` being loaded belongs to
_LOADING: contextvars.ContextVar[CompiledForward | None] = contextvars.ContextVar(
    "spyre_vllm_loading", default=None
)


class PerBucket(SerializableCallable):
    """A graph Dynamo traced once with a symbolic token count, compiled for
    each concrete count on its first call with it (what vLLM's own piecewise
    backend does per compile size): the programs are planned for the bucket's
    static shapes, exactly as if Dynamo had traced that bucket alone.

    ``sizes``: the positions of the graph's integer inputs (Dynamo lifts each
    free symbol as one); their values key the compiled graphs.

    Saved with the trace (module doc, "Saved trace"): the graph and the fake
    values its pieces' inputs need, not the compiled buckets (those come
    from the FX graph and kernel caches on their first call)."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        sizes: list[int],
        compile_fn: Callable[[torch.fx.GraphModule, list], Callable],
    ) -> None:
        self.gm, self.sizes, self.compile_fn = gm, sizes, compile_fn
        self.compiled: dict[tuple[int, ...], Callable] = {}

    @classmethod
    def serialize_compile_artifacts(cls, fn: PerBucket) -> bytes:
        return pickle.dumps({"graph": saved_graph.dumps(fn.gm, _is_attention), "sizes": fn.sizes})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> PerBucket:
        owner = _LOADING.get()
        if owner is None:
            raise RuntimeError("spyre: a saved forward loads only through CompiledForward")
        saved = pickle.loads(data)
        return PerBucket(saved_graph.loads(saved["graph"]), saved["sizes"], owner._compile_bucket)

    def __call__(self, *args):
        if self.sizes:
            key = tuple(args[i] for i in self.sizes)
        else:  # a symbol Dynamo did not lift: the tensors' shapes
            key = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        fn = self.compiled.get(key)
        if fn is None:
            fn = self.compiled[key] = piecewise.compile_outside(
                self.compile_fn, self.gm, list(args)
            )
        return fn(*args)


def _symbolic_inputs(example_inputs) -> list[int] | None:
    """None for a static graph; else the positions of its symbolic integer
    inputs (a dim Dynamo traced as dynamic is one)."""
    if not any(piecewise.symbolic(a) for a in example_inputs):
        return None
    return [i for i, a in enumerate(example_inputs) if isinstance(a, torch.SymInt)]


def _real_rows(out, n: int):
    """The first ``n`` rows of the forward's output: the hidden states, or
    (hidden states, [auxiliary hidden states]) when an EAGLE-3 drafter asks
    the target for some layers' outputs too (vLLM's ``aux_hidden_state_layers``)."""
    if isinstance(out, tuple):
        hidden, aux = out
        return hidden[:n], [a[:n] for a in aux]
    return out[:n]


class CompiledHead:
    """The LM head (``F.linear`` of the sampled rows) compiled per row bucket.

    ``compute_logits`` runs after the forward on the rows that are sampled (one per
    scheduled request), so its row count is bucketed on its own: 16, 32, ... up to
    ``max_num_seqs``; the rows are zero-padded on the card and the real rows kept.
    """

    def __init__(self, max_rows: int) -> None:
        self.sizes = _doubling(max_rows)
        self.graphs = 0
        self.calls: Counter[int] = Counter()
        self.compile_s: dict[int, float] = {}
        self.cache: Counter[str] = Counter()
        self._fn: Callable = torch.compile(
            _linear, backend=self._backend, dynamic=False, fullgraph=True
        )

    def _backend(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        return _compile_fx(gm, example_inputs, self.cache)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        out = self._run(x, weight, bias)
        self.calls[bucket_for(x.shape[0], self.sizes)] += 1
        return out

    def _run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        n = x.shape[0]
        b = bucket_for(n, self.sizes)
        if n < b:
            x = torch.cat([x, x.new_zeros((b - n, *x.shape[1:]))])
        first = b not in self.compile_s
        t0 = time.perf_counter()
        out = self._fn(x, weight, bias)
        if first:
            self.compile_s[b] = time.perf_counter() - t0
        return out[:n]

    def summary(self) -> dict:
        return {
            "buckets": list(self.sizes),
            "graphs": self.graphs,
            "calls": dict(self.calls),
            "compile_s": dict(self.compile_s),
            "aot_cache": dict(self.cache),
        }


def _is_attention(node: torch.fx.Node) -> bool:
    """vLLM's attention ops, where a forward is cut into pieces."""
    ops = (
        torch.ops.vllm.unified_attention_with_output,
        torch.ops.vllm.unified_kv_cache_update,
        torch.ops.vllm.unified_mla_attention_with_output,  # latent attention (mla.py)
        torch.ops.vllm.unified_mla_kv_cache_update,
    )
    return node.target in ops or node.target in tuple(op.default for op in ops)


def _salt() -> str:
    """What else a compiled piece depends on: what the spyre graph pass's
    cache key holds (the compiler's version and the planning options)."""
    from torch_spyre.compiler.passes import SpyreGraphPass

    return SpyreGraphPass().uuid()


def _compile_fx(
    gm: torch.fx.GraphModule,
    example_inputs,
    cache: Counter[str],
    pieces: piecewise.Stats | None = None,
):
    """Inductor's ``compile_fx``, piece by piece between attention ops
    (``compiler/piecewise.py``; ``TORCH_SPYRE_VLLM_PIECEWISE``); ``cache``
    counts the AOTAutograd cache's verdicts (hit, miss, bypass: a warm start
    loads every graph whole, see ``torch_spyre.compiler.CACHEABLE_FACTORIES``)."""
    from torch._inductor.compile_fx import compile_fx

    def counted(graph: torch.fx.GraphModule, inputs) -> Callable:
        from torch._dynamo.utils import counters

        before = dict(counters["aot_autograd"])
        out = compile_fx(piecewise.fresh(graph, inputs) if per_size else graph, inputs)
        for verdict in ("hit", "miss", "bypass"):
            n = counters["aot_autograd"][f"autograd_cache_{verdict}"] - before.get(
                f"autograd_cache_{verdict}", 0
            )
            if n:
                cache[verdict] += n
        return out

    # a graph compiled once per shape (traced with a dynamic dim): Inductor
    # edits what it compiles, so each compile gets a copy
    per_size = any(piecewise.symbolic(a) for a in example_inputs) or any(
        piecewise.symbolic(n.meta.get("example_value"))
        for n in gm.graph.nodes
        if n.op == "placeholder"
    )
    if settings.get().vllm_piecewise and any(_is_attention(n) for n in gm.graph.nodes):
        split = gm.meta.get("spyre_split")
        if split is None:  # a split made for every shape is made once
            split = piecewise.compile_piecewise(
                gm, example_inputs, _is_attention, counted, salt=_salt(), stats=pieces
            )
            if split.meta.get("spyre_per_size"):
                gm.meta["spyre_split"] = split
        return split
    return counted(gm, example_inputs)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def _doubling(max_n: int) -> list[int]:
    sizes, b = [], FIRST_BUCKET
    while b < max_n:
        sizes.append(b)
        b *= 2
    return [*sizes, max_n]


def _pad(x: torch.Tensor, b: int) -> torch.Tensor:
    """Token ids / positions to the card, zero-padded to b rows (one copy)."""
    x = x.to("cpu") if x.device.type != "cpu" else x
    n = x.shape[0]
    if n < b:
        x = torch.cat([x, x.new_zeros((b - n, *x.shape[1:]))])
    return x.to(SPYRE)


def register_spyre_attention_ops() -> None:
    """vLLM registers its attention and MoE custom ops for the platform's dispatch
    key (CPU, as device_type is "cpu"); the same Python implementations serve
    spyre tensors (the MoE ones call the layer's quant method: vllm_plugin/moe.py)."""
    global _LIB
    if _LIB is not None:
        return
    from vllm.model_executor.layers.attention import attention as vllm_attention
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    lib = torch.library.Library("vllm", "IMPL")  # vLLM's own ops: one more kernel
    lib.impl("unified_kv_cache_update", vllm_attention.unified_kv_cache_update, "PrivateUse1")
    lib.impl(
        "unified_attention_with_output",
        vllm_attention.unified_attention_with_output,
        "PrivateUse1",
    )
    lib.impl(
        "unified_mla_kv_cache_update", mla_attention.unified_mla_kv_cache_update, "PrivateUse1"
    )
    lib.impl(
        "unified_mla_attention_with_output",
        mla_attention.unified_mla_attention_with_output,
        "PrivateUse1",
    )
    lib.impl("moe_forward", moe_runner._moe_forward, "PrivateUse1")
    lib.impl("moe_forward_shared", moe_runner._moe_forward_shared, "PrivateUse1")
    _LIB = lib


_LIB: torch.library.Library | None = None
