"""The catch-all for aten ops on spyre with no kernel of their own.

Order: a generic device kernel (pointwise, reductions, ...) if one serves the
op, then an adapter (a rewrite into supported ops), then the host fallback.
Which path an op takes is decided once per overload and cached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch_spyre.ops import movement, pointwise
from torch_spyre.ops.errors import annotated
from torch_spyre.runtime import dispatch_stats
from torch_spyre.runtime.fallback import host_fallback

Handler = Callable[[Any, tuple, dict], Any]
_routes: dict[Any, list[tuple[str, Handler]]] = {}
#: adapters by op base name ("sin"): set by torch_spyre.ops.adapters
ADAPTERS: dict[str, Handler] = {}


def _route(op) -> list[tuple[str, Handler]]:
    routes: list[tuple[str, Handler]] = []
    base = op._schema.name.split("::")[-1].rstrip("_")
    if base in ADAPTERS:
        routes.append(("adapter", ADAPTERS[base]))
    if pointwise.is_pointwise(op):
        routes.append(("kernel", pointwise.run))
    if base in movement.MOVEMENT:
        routes.append(("kernel", movement.run))
    return routes


_names: dict[Any, str] = {}


def catch_all(op, *args, **kwargs):
    routes = _routes.get(op)
    if routes is None:
        routes = _routes[op] = _route(op)
        _names[op] = str(op).removeprefix("aten.")
    try:
        for path, handler in routes:
            result = handler(op, args, kwargs)
            if result is not NotImplemented:
                dispatch_stats.record(path, _names[op])
                return result
        return host_fallback(op, *args, **kwargs)
    except Exception as err:
        raise annotated(err, _names[op], args, kwargs) from err.__cause__
