"""The kernel library: every builder of kernel programs, and the one search.

Eager ops (``ops``) and the compiler (``compiler``) both get their programs
here.  A builder is a function of shapes, dtypes and choices returning an
``ir.Program``; a builder with choices (core splits, tiles, buffering) has a
``best_*`` form that finds its plan with ``search.search`` (build, validate,
cost with the timing model, keep the fastest).  Where things are:

==================  ==========================================================
``search``          the one search: candidates, validation, cost, cache
``plan``            the split, tiles and loop order of any step list (the
                    compiler's fused groups; eager programs, ``replan``)
``rewrites``        step-list rewrites before planning (streamed rows, online
                    softmax, several passes over a row)
``options``         planning options (naive baselines, core and LX limits)
``basic``           elementwise, matmul, GEMV, softmax and norms over rows,
                    the ring all-reduce: fixed recipes
``eager``           the eager layer's recipes: broadcasting pointwise ops of
                    mixed dtypes, reductions along a dim, matmuls over named
                    dims, softmax and layer norm over any dim
``quant``           quantise / dequantise with a scale
``flash``           flash attention (dense and paged KV)
``swiglu``          the fused SwiGLU MLP
``moe``             mixture-of-experts experts as one grouped program
``lora``            multi-LoRA shrink/expand of a batch's adapters (SGMV), one
                    grouped program per projection
``ssd``             Mamba-2 scans (chunked and single step), the gated norm
``ssm``             the causal depthwise conv1d
``recurrent``       RNN/LSTM/GRU: the input projection, one timestep
``splits``          core counts for a dim of whole sticks
==================  ==========================================================

A new kernel family is a new module here (its builder, and its ``best_*``
through ``search``); the eager op that runs it lives in ``ops`` and the
compiler pattern that emits it in ``compiler``.
"""

from torch_spyre.kernels.basic import (
    best_matmul,
    broadcast_index,
    default_matmul_split,
    default_matmul_tiles,
    elementwise,
    fit_tiles,
    gemv,
    layernorm,
    matmul,
    ring_allreduce,
    rmsnorm,
    softmax,
)
from torch_spyre.kernels.flash import PagedKV, best_flash_attention, flash_attention
from torch_spyre.kernels.moe import grouped_matmul, grouped_swiglu
from torch_spyre.kernels.search import Unsupported
from torch_spyre.kernels.ssd import rmsnorm_gated, ssd_chunk_scan, ssm_step
from torch_spyre.kernels.ssm import depthwise_conv1d
from torch_spyre.kernels.swiglu import best_swiglu_mlp, swiglu_mlp

__all__ = [
    "PagedKV",
    "Unsupported",
    "best_flash_attention",
    "best_matmul",
    "best_swiglu_mlp",
    "broadcast_index",
    "default_matmul_split",
    "default_matmul_tiles",
    "depthwise_conv1d",
    "elementwise",
    "fit_tiles",
    "flash_attention",
    "gemv",
    "grouped_matmul",
    "grouped_swiglu",
    "layernorm",
    "matmul",
    "ring_allreduce",
    "rmsnorm",
    "rmsnorm_gated",
    "softmax",
    "ssd_chunk_scan",
    "ssm_step",
    "swiglu_mlp",
]
