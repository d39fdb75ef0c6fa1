"""The stick layout of device tensors (../shared/hardware.md, "Layout rule").

A device tensor keeps its host (logical) sizes; in device memory it is stored
row-major as ``device_size``, whose last dimension is the position inside a
128-byte stick.  Every device dimension indexes exactly one host dimension
(``dim_map``); a host dimension split over several device dimensions is tiled,
the later device dimension being the inner one.  ``stride_map[d]`` is the
host-element stride (of the contiguous host tensor) of device dimension ``d``,
-1 for a synthetic size-1 dimension that indexes no host dimension.

This module is the contract between the runtime (copies), the kernel program
(stick loads/stores) and the simulator: it depends on torch only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

from torch_spyre import _card, settings

STICK_BYTES = 128


#: How device memory encodes fp16 and bf16 values (process-wide, fixed when
#: this module is imported: the ``fp16_format`` setting,
#: ``TORCH_SPYRE_FP16_FORMAT``): "ieee" keeps their own bits (bit-exact round
#: trips), "dl16" stores the card's DL16 format (torch_spyre.dl16: the range
#: of the real card, 9 fraction bits), as IBM's stack maps both to
#: SEN169_FP16.  docs/hardware-model.md says when which.
FP16_FORMAT = settings.get().fp16_format
_HALF = (torch.float16, torch.bfloat16)
#: the 8-bit floats device memory stores (quantised data: no arithmetic on them
#: outside the quantised kernels, torch_spyre/ops/quantized.py)
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)

#: ``copy(src, dst) -> bool``: a faster ``dst.copy_(src)`` for a permuted view of
#: device memory into a contiguous host tensor, or False where it does not
#: apply: the card module's (a stick at a time with the CPU's fp16 conversion
#: instructions, csrc/card/stick_copy.cpp).
fast_copy: Callable[[torch.Tensor, torch.Tensor], bool] | None = _card.stick_copy

#: Host dtypes that device memory stores, and how.  Every one is stored
#: exactly (no narrowing): fp16 (the card's compute type), bf16 and fp32 (used
#: by vector ops), the 8-bit floats of quantised weights and activations
#: (fp8 e4m3 and e5m2, IBM's SEN143_FP8 / SEN152_FP8, 128 per stick), the
#: integer types (int64 keeps its full range: 16 per stick), bool (one
#: byte each) and complex64 (interleaved fp32 (real, imaginary) pairs: 16 per
#: stick; ops on it are rewritten into fp32 ops on those pairs,
#: ops/complex_ops.py).  Kernels decide how they compute on them.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
)


class UnsupportedDtypeError(TypeError, RuntimeError):
    """A dtype spyre does not store: a TypeError (a wrong argument), and a
    RuntimeError as IBM's runtime raises for one (their tests catch that)."""


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise UnsupportedDtypeError(
            f"spyre does not store {dtype}; supported dtypes are {names}. "
            f"Cast first, e.g. tensor.to(torch.float32) or tensor.to(torch.float16)."
        )


def stick_elems(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in one 128-byte stick (64 fp16, 32 fp32, 128 int8)."""
    return STICK_BYTES // dtype.itemsize


#: IBM's constructor forms and names, supplied by ``torch_spyre.compat`` when
#: it installs IBM's API (docs/compat.md), so that this module knows nothing
#: of it: ``"fields"`` maps their constructor arguments onto ours,
#: ``"device_dtype"`` a dtype onto their ``DataFormats``.
FOREIGN: dict[str, Callable] = {}


@dataclass(frozen=True, init=False)
class SpyreTensorLayout:
    """``SpyreTensorLayout(host_size, device_size, dim_map, dtype)``.

    IBM's constructor forms are accepted too and mapped onto these fields by
    ``torch_spyre.compat`` (docs/compat.md): ``SpyreTensorLayout(size, dtype)``,
    ``SpyreTensorLayout(size, stride, dtype, dim_order)`` and
    ``SpyreTensorLayout(device_size=..., stride_map=..., device_dtype=...)``.
    """

    host_size: tuple[int, ...]
    device_size: tuple[int, ...]
    dim_map: tuple[int, ...]
    dtype: torch.dtype

    def __init__(self, *args, **kwargs) -> None:
        if len(args) == 4 and not kwargs and isinstance(args[3], torch.dtype):
            host_size, device_size, dim_map, dtype = args
        elif not args and kwargs.keys() == {"host_size", "device_size", "dim_map", "dtype"}:
            host_size, device_size, dim_map, dtype = (
                kwargs["host_size"],
                kwargs["device_size"],
                kwargs["dim_map"],
                kwargs["dtype"],
            )
        elif "fields" in FOREIGN:
            host_size, device_size, dim_map, dtype = FOREIGN["fields"](*args, **kwargs)
        else:
            raise TypeError(
                "SpyreTensorLayout(host_size, device_size, dim_map, dtype); IBM's forms "
                "need torch_spyre imported (torch_spyre.compat)"
            )
        object.__setattr__(self, "host_size", tuple(int(s) for s in host_size))
        object.__setattr__(self, "device_size", tuple(int(s) for s in device_size))
        object.__setattr__(self, "dim_map", tuple(int(d) for d in dim_map))
        object.__setattr__(self, "dtype", dtype)
        self.__post_init__()

    # ----------------------------------------------------------- construction
    @staticmethod
    def default(host_size: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> SpyreTensorLayout:
        """The runtime's default: stick dimension = last host dimension.

        [d0..dn-1] -> [d1, ..., d(n-2), ceil(dn-1/stick), d0, stick];
        1-D [d0] -> [ceil(d0/stick), stick]; a scalar is stored as [1, stick].
        """
        return _default_layout(tuple(int(s) for s in host_size), dtype)

    @staticmethod
    def with_stick_dim(
        host_size: tuple[int, ...] | torch.Size, dtype: torch.dtype, stick_dim: int
    ) -> SpyreTensorLayout:
        """Like the default, but with ``stick_dim`` as the stick dimension.

        The other host dimensions keep their order; the outermost one moves
        between the stick blocks and the stick, as in the default rule.
        """
        size = tuple(int(s) for s in host_size)
        n = len(size)
        if n == 0:
            return _default_layout(size, dtype)
        stick_dim %= n
        if stick_dim == n - 1:
            return _default_layout(size, dtype)
        se = stick_elems(dtype)
        others = [k for k in range(n) if k != stick_dim]
        outer, rest = others[0], others[1:]
        dims = rest + [stick_dim, outer, stick_dim]
        sizes = [size[k] for k in rest] + [ceil_div(size[stick_dim], se), size[outer], se]
        return SpyreTensorLayout(size, tuple(sizes), tuple(dims), dtype)

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        if len(self.device_size) != len(self.dim_map):
            raise ValueError("device_size and dim_map must have the same length")
        if self.device_size and self.device_size[-1] != stick_elems(self.dtype):
            raise ValueError(
                f"the last device dimension must be one stick ({stick_elems(self.dtype)} "
                f"elements of {self.dtype}), got {self.device_size[-1]}"
            )
        for k, h in enumerate(self.host_size):
            span = math.prod(s for s, d in zip(self.device_size, self.dim_map) if d == k)
            if span < h:
                raise ValueError(f"device dimensions for host dim {k} cover {span} < {h}")

    # ------------------------------------------------------------- properties
    @cached_property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def stick_elems(self) -> int:
        return stick_elems(self.dtype)

    @cached_property
    def stick_dim(self) -> int:
        """The host dimension whose elements are contiguous inside a stick."""
        return self.dim_map[-1]

    @cached_property
    def host_strides(self) -> tuple[int, ...]:
        strides, acc = [], 1
        for s in reversed(self.host_size):
            strides.append(acc)
            acc *= max(s, 1)
        return tuple(reversed(strides))

    @cached_property
    def units(self) -> tuple[int, ...]:
        """Host elements (along dim_map[d]) per step of device dimension d."""
        units = [0] * len(self.device_size)
        inner: dict[int, int] = {}
        for d in reversed(range(len(self.device_size))):
            k = self.dim_map[d]
            units[d] = inner.get(k, 1)
            inner[k] = units[d] * self.device_size[d]
        return tuple(units)

    @cached_property
    def stride_map(self) -> tuple[int, ...]:
        """Host-element stride of each device dim; -1 where it indexes nothing
        (a synthetic dim, or a host dim of size 1), as in IBM's stack."""
        last = len(self.device_size) - 1
        return tuple(
            (0 if n > 1 and d < last else -1)  # a synthetic dim > 1 repeats the data
            if k < 0
            else -1
            if self.host_size[k] == 1
            else self.host_strides[k] * u
            for d, (k, u, n) in enumerate(zip(self.dim_map, self.units, self.device_size))
        )

    def elems_per_stick(self) -> int:
        """IBM's spelling of :attr:`stick_elems`."""
        return self.stick_elems

    @property
    def device_dtype(self):
        """IBM's name for how device memory stores the elements (a ``DataFormats``;
        the torch dtype before ``torch_spyre.compat`` is installed)."""
        to_format = FOREIGN.get("device_dtype")
        return self.dtype if to_format is None else to_format(self.dtype)

    @cached_property
    def device_strides(self) -> tuple[int, ...]:
        """Element strides of the row-major device tensor."""
        strides, acc = [], 1
        for s in reversed(self.device_size):
            strides.append(acc)
            acc *= s
        return tuple(reversed(strides))

    @cached_property
    def numel(self) -> int:
        return math.prod(self.host_size)

    @cached_property
    def device_numel(self) -> int:
        return math.prod(self.device_size)

    @cached_property
    def nbytes(self) -> int:
        """Bytes of device memory: whole sticks, padding included."""
        return self.device_numel * self.itemsize

    @cached_property
    def num_sticks(self) -> int:
        return self.device_numel // self.stick_elems if self.device_size else 0

    def __repr__(self) -> str:
        # IBM's repr, character for character (their "stride_map =" included)
        return (
            f"SpyreTensorLayout(device_size={list(self.device_size)}, "
            f"stride_map ={list(self.stride_map)}, device_dtype={self.device_dtype})"
        )

    # ------------------------------------------------------------- conversion
    @cached_property
    def _plan(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """How a host tensor becomes the device tensor.

        Returns (padded host size, split sizes in host order, permutation from
        split order to device order, positions of synthetic device dims).
        """
        n = len(self.host_size)
        padded, split_sizes, order = [], [], []
        for k in range(n):
            ds = [d for d in range(len(self.device_size)) if self.dim_map[d] == k]
            padded.append(math.prod(self.device_size[d] for d in ds))
            split_sizes.extend(self.device_size[d] for d in ds)
            order.extend(ds)
        synthetic = tuple(d for d in range(len(self.device_size)) if self.dim_map[d] < 0)
        # split position of each device dim (synthetic ones are appended last)
        pos = {d: i for i, d in enumerate(order)}
        for j, d in enumerate(synthetic):
            pos[d] = len(order) + j
        perm = tuple(pos[d] for d in range(len(self.device_size)))
        return tuple(padded), tuple(split_sizes), perm, synthetic

    @cached_property
    def _repeats(self) -> bool:
        """True when a synthetic device dim of size > 1 repeats the data (IBM's
        stride 0): writes fill every copy, reads take the first."""
        dims = zip(self.dim_map[:-1], self.device_size[:-1])  # (a scalar's stick is its own)
        return any(k < 0 and n > 1 for k, n in dims)

    @cached_property
    def _scalar_as_vector(self) -> SpyreTensorLayout | None:
        # a scalar is stored exactly like a 1-element vector
        return _default_layout((1,), self.dtype) if not self.host_size else None

    @cached_property
    def _inverse_perm(self) -> tuple[int, ...]:
        perm = self._plan[2]
        inv = [0] * len(perm)
        for d, p in enumerate(perm):
            inv[p] = d
        return tuple(inv)

    @cached_property
    def padded(self) -> bool:
        """True when device memory holds padding (the stick dim is not whole sticks)."""
        return self._plan[0] != self.host_size

    @property
    def dl16(self) -> bool:
        """True when device memory holds this layout's values as DL16 bits."""
        return FP16_FORMAT == "dl16" and self.dtype in _HALF

    def values(self, raw: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Host values (``dtype``, default the layout's) of raw device elements."""
        if not self.dl16:
            return raw if dtype is None else raw.to(dtype)
        from torch_spyre import dl16

        return dl16.decode(raw.view(torch.int16)).to(dtype or self.dtype)

    def raw(self, values: torch.Tensor) -> torch.Tensor:
        """Raw device elements (``dtype``-typed) holding ``values``."""
        if not self.dl16:
            return values.to(self.dtype)
        from torch_spyre import dl16

        return dl16.encode(values).view(self.dtype)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Host values (``host_size``) -> a new row-major ``device_size`` tensor.

        Padding is zero.  Runs on whatever device ``host`` is on (CPU here).
        """
        if tuple(host.shape) != self.host_size:
            raise ValueError(f"expected host size {self.host_size}, got {tuple(host.shape)}")
        if self._scalar_as_vector is not None:
            return self._scalar_as_vector.to_device(host.reshape(1))
        padded, split_sizes, perm, synthetic = self._plan
        if self.dl16:  # encode first: DL16 values past fp16's range stay finite
            x = self.raw(host.to(torch.float32))
        else:
            x = host.to(self.dtype)
        if self.padded:
            out = torch.zeros(padded, dtype=self.dtype, device=host.device)
            out[tuple(slice(0, h) for h in self.host_size)] = x
            x = out
        x = x.reshape(split_sizes + (1,) * len(synthetic)).permute(perm)
        if self._repeats:
            x = x.expand(self.device_size)  # every copy of the data
        return x.contiguous()

    def store(self, device: torch.Tensor, host: torch.Tensor) -> None:
        """Write host values (``host_size``, any dtype: cast) into row-major device
        memory ``device`` (``device_numel`` elements of ``dtype``).

        Without padding this is one strided copy straight into device memory
        (the re-lay and the cast in one pass, no temporary).
        """
        if self._scalar_as_vector is not None or self.padded:
            device.view(self.device_size).copy_(self.to_device(host.reshape(self.host_size)))
            return
        _, split_sizes, _, synthetic = self._plan
        dst = device.view(self.device_size).permute(self._inverse_perm)
        src = host.reshape(split_sizes + (1,) * len(synthetic))
        dst.copy_(self.raw(src) if self.dl16 else src)

    def to_host(self, device: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A row-major ``device_size`` tensor -> a new contiguous host tensor (in
        ``dtype``, default the layout's).

        Never a view of ``device``: callers may overwrite device memory after.
        Without padding this is one copy: the re-lay and the cast in one pass.
        """
        if self._scalar_as_vector is not None:
            return self._scalar_as_vector.to_host(device, dtype).reshape(())
        padded, split_sizes, _, synthetic = self._plan
        x = device.reshape(self.device_size).permute(self._inverse_perm)
        if self._repeats:  # the first copy of the data
            x = x[(slice(None),) * len(split_sizes) + (slice(0, 1),) * len(synthetic)]
        if self.dl16:  # the bits in host order, then their values
            bits = torch.empty(x.shape, dtype=self.dtype)
            if fast_copy is None or not fast_copy(x, bits):
                bits.copy_(x)
            from torch_spyre import dl16

            out = dl16.decode(bits.view(torch.int16)).to(dtype or self.dtype)
            out = out.view(padded)
            if self.padded:
                return out[tuple(slice(0, h) for h in self.host_size)].clone(
                    memory_format=torch.contiguous_format
                )
            return out
        out = torch.empty(x.shape, dtype=dtype or self.dtype)
        if fast_copy is None or not fast_copy(x, out):
            out.copy_(x)
        out = out.view(padded)
        if self.padded:
            out = out[tuple(slice(0, h) for h in self.host_size)]
            return out.clone(memory_format=torch.contiguous_format)
        return out

    @cached_property
    def dim_offsets(self) -> tuple[torch.Tensor, ...]:
        """Per host dim k, the device element offset contributed by each index
        along k (int64, ``host_size[k]`` entries): every device dim indexes one
        host dim, so the device offset of a host element is the sum of these
        over its coordinates.  Gathers and scatters of rows use them."""
        if self._scalar_as_vector is not None:
            return ()
        tabs = []
        for k, size in enumerate(self.host_size):
            i = torch.arange(size, dtype=torch.int64)
            off = torch.zeros(size, dtype=torch.int64)
            for d, (kk, u) in enumerate(zip(self.dim_map, self.units)):
                if kk == k:
                    off += ((i // u) % self.device_size[d]) * self.device_strides[d]
            tabs.append(off)
        return tuple(tabs)

    def device_offsets(self, host_offsets: torch.Tensor) -> torch.Tensor:
        """Device element offsets of the given contiguous-host element offsets."""
        if self._scalar_as_vector is not None:
            return self._scalar_as_vector.device_offsets(host_offsets)
        out = torch.zeros_like(host_offsets)
        coords = {}
        for k, (size, stride) in enumerate(zip(self.host_size, self.host_strides)):
            coords[k] = (host_offsets // stride) % max(size, 1)
        for d, (k, u) in enumerate(zip(self.dim_map, self.units)):
            if k < 0:
                continue
            out += ((coords[k] // u) % self.device_size[d]) * self.device_strides[d]
        return out


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints (sticks, tiles, chunks)."""
    return -(-a // b)


@lru_cache(maxsize=4096)
def _default_layout(size: tuple[int, ...], dtype: torch.dtype) -> SpyreTensorLayout:
    check_dtype(dtype)
    se = stick_elems(dtype)
    n = len(size)
    if n == 0:
        return SpyreTensorLayout((), (1, se), (-1, -1), dtype)
    if n == 1:
        return SpyreTensorLayout(size, (ceil_div(size[0], se), se), (0, 0), dtype)
    dims = list(range(1, n - 1)) + [n - 1, 0, n - 1]
    sizes = list(size[1 : n - 1]) + [ceil_div(size[-1], se), size[0], se]
    return SpyreTensorLayout(size, tuple(sizes), tuple(dims), dtype)
