"""Every ``TORCH_SPYRE_*`` setting, in one typed object read once.

``get()`` is the process's ``Settings``: the environment is read the first
time it is asked for (and by nothing else in torch_spyre), each variable
parsed and checked here, with an error that names the variable and what it
takes.  Code changes a setting through this module's API, never through
``os.environ``:

* ``update(**fields)``: from now on (``torch_spyre.set_fallback_policy`` and
  the like call it);
* ``override(**fields)``: for a ``with`` block (tests); the variables are
  exported for the block too, so that processes started inside it (vLLM's
  engine, ``torchrun`` workers) see the same values;
* ``reload()``: read the environment again.

``VARIABLES`` is the table of every variable (docs/settings.md is generated
from it, and a test keeps the two equal).  ``handoff`` / ``inherited`` are the
two variables torch_spyre passes to its own child processes (vLLM's metrics
proxy), which are not settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


class SettingsError(ValueError):
    """A ``TORCH_SPYRE_*`` variable holds a value its setting does not take."""


def _flag(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no", ""):
        return False
    raise SettingsError(f"{name} must be 1/on/true or 0/off/false, got {raw!r}")


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in allowed:
            raise SettingsError(f"{name} must be one of {', '.join(allowed)}; got {raw!r}")
        return v

    return parse


def _int(lo: int, hi: int | None = None) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            v = int(raw.strip())
        except ValueError:
            raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
        if v < lo or (hi is not None and v > hi):
            span = f"{lo}..{hi}" if hi is not None else f"at least {lo}"
            raise SettingsError(f"{name} must be {span}, got {v}")
        return v

    return parse


def _seconds(name: str, raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not v > 0:
        raise SettingsError(f"{name} must be positive, got {raw!r}")
    return v


def _text(name: str, raw: str) -> str:
    return raw.strip()


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20,
               "mib": 1 << 20, "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
               "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}  # fmt: skip


def _bytes(name: str, raw: str) -> int:
    text = raw.strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num) :]
    try:
        v = float(num) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise SettingsError(f"{name} must be a size such as 2GiB or 500MB, got {raw!r}") from None
    if v < 1:
        raise SettingsError(f"{name} must be at least one byte, got {raw!r}")
    return int(v)


def _buckets(name: str, raw: str) -> tuple[int, ...]:
    try:
        sizes = sorted({int(s) for s in raw.replace(" ", "").split(",") if s})
    except ValueError:
        raise SettingsError(f"{name}: comma-separated token counts, got {raw!r}") from None
    if not sizes or sizes[0] <= 0:
        raise SettingsError(f"{name}: positive token counts, got {raw!r}")
    return tuple(sizes)


@dataclass(frozen=True)
class Var:
    """One environment variable: the setting it fills and how."""

    env: str
    field: str
    parse: Callable[[str, str], Any]
    meaning: str
    default: str


#: every variable torch_spyre reads (docs/settings.md is this table)
VARIABLES: tuple[Var, ...] = (
    Var("TORCH_SPYRE_NUM_CARDS", "num_cards", _int(1, 8),
        "cards in this process (`spyre:0`..`spyre:N-1`), 1..8; IBM's `AIU_WORLD_SIZE` "
        "when unset", "1"),
    Var("TORCH_SPYRE_DEVICE_MEMORY", "device_memory", _text,
        "usable device memory per card, e.g. `64MiB` (a `HardwareConfig` field)", "112 GiB"),
    Var("TORCH_SPYRE_HW_CONFIG", "hw_config", _text,
        "a JSON or TOML file of hardware model fields (docs/hardware-model.md)", "the card"),
    Var("TORCH_SPYRE_HW_<FIELD>", "hw", _text,
        "one hardware model field, e.g. `TORCH_SPYRE_HW_LX_BYTES=4MiB` (beats the file)",
        "the card"),
    Var("TORCH_SPYRE_FALLBACK", "fallback", _choice("warn", "silent", "error"),
        "host fallback policy: `warn`, `silent`, `error` (`torch_spyre.set_fallback_policy`)",
        "warn"),
    Var("TORCH_SPYRE_FP16_FORMAT", "fp16_format", _choice("ieee", "dl16"),
        "how device memory holds fp16/bf16: `ieee` (bit-exact), `dl16` (the card's DL16: "
        "its range, 9 fraction bits)", "ieee"),
    Var("TORCH_SPYRE_WARM_PATH", "warm_path", _flag,
        "`0`: every eager launch in Python (no C++ warm path for `a + b` & co; same "
        "figures, slower; `torch_spyre.runtime.cards.warm_path`)", "1"),
    Var("TORCH_SPYRE_HOST_VIEWS", "host_views", _text,
        "host memory for the simulator's converted views of device memory: `1.0x` device "
        "bytes, a size, or `off`", "1.0x"),
    Var("TORCH_SPYRE_STICK_GEMM", "stick_gemm", _flag,
        "`0`: the simulator's matmuls convert their weights to fp32 host tensors instead "
        "of reading them in place from the stick layout; same modelled figures, more host "
        "memory", "1"),
    Var("TORCH_SPYRE_TIMING_ONLY", "timing_only", _flag,
        "kernel programs are validated, timed and traced but not executed (output memory "
        "holds unspecified values; `torch_spyre.sim.timing_only()` for a block)", "0"),
    Var("TORCH_SPYRE_COMPILE_FALLBACK", "compile_fallback", _choice("warn", "allow", "error"),
        "what the compiler does with a group it cannot plan: `warn` / `allow` split it and "
        "run what still does not plan as eager kernels inside the graph (counted; `warn` "
        "also warns), `error` raises (docs/compiler.md, \"The degrade path\")", "warn"),
    Var("TORCH_SPYRE_DEBUG", "debug", _flag,
        "print every compiled kernel program and its LX use", "0"),
    Var("TORCH_SPYRE_CCL_TIMEOUT_S", "ccl_timeout_s", _seconds,
        "seconds a spyreccl collective waits for its peers", "the group's timeout"),
    Var("TORCH_SPYRE_CACHE_DIR", "cache_dir", _text,
        "the persistent compiled-artifact cache: kernel searches, and Inductor's and "
        "AOTAutograd's caches (`<dir>/inductor` unless `TORCHINDUCTOR_CACHE_DIR` is set); "
        "`off`: none of ours, Inductor's where it was (docs/compiler.md, \"The artifact cache\")",
        "`~/.cache/torch_spyre/compiled`"),
    Var("TORCH_SPYRE_CACHE_SIZE", "cache_size", _bytes,
        "size cap of `TORCH_SPYRE_CACHE_DIR`: past it the least recently used entries "
        "are evicted (`spyre cache --info`)", "10 GiB"),
    Var("TORCH_SPYRE_PRECOMPILE", "precompile", _flag,
        "a `models.prepare(compile=True)` forward, and the vLLM plugin's forward (traced "
        "once for every token bucket), is compiled whole ahead of time and kept "
        "in `TORCH_SPYRE_CACHE_DIR`, so a later process loads it without tracing (`0`: "
        "`torch.compile`'s own path; docs/compiler.md, \"Precompiled forwards\")", "1"),
    Var("TORCH_SPYRE_MODEL_CACHE", "model_cache", _text,
        "where offline models are converted and cached", "`~/.cache/torch_spyre/models`"),
    Var("TORCH_SPYRE_VLLM", "vllm", _flag,
        "`0`: the vLLM platform plugin stands down", "1"),
    Var("TORCH_SPYRE_VLLM_COMPILE", "vllm_compile", _flag,
        "compile vLLM's forward (`0`: eager); pooling models run eagerly unless `1`",
        "on for generative models"),
    Var("TORCH_SPYRE_VLLM_PIECEWISE", "vllm_piecewise", _flag,
        "compile vLLM's forward piece by piece between attention ops, each distinct "
        "piece once (`0`: the whole graph)", "1"),
    Var("TORCH_SPYRE_VLLM_REGIONS", "vllm_regions", _flag,
        "trace a model's repeated layers once (nested compile regions) and its "
        "forward once for every token bucket (`0`: every layer, every bucket)", "1"),
    Var("TORCH_SPYRE_VLLM_BUCKETS", "vllm_buckets", _buckets,
        "token-count buckets compiled for vLLM, e.g. `16,64`", "16, 32, ... and the max"),
    Var("TORCH_SPYRE_VLLM_WARMUP", "vllm_warmup", _text,
        "buckets compiled at start-up: `all`, `none` or a list", "all"),
    Var("TORCH_SPYRE_VLLM_KV_CACHE_BYTES", "vllm_kv_cache_bytes", _int(1),
        "device bytes for vLLM's KV cache (when `kv_cache_memory_bytes` is not set)",
        "vLLM's share"),
    Var("TORCH_SPYRE_VLLM_METRICS_PORT", "vllm_metrics_port", _int(1, 65535),
        "port of the vLLM worker's `spyre:*` Prometheus series", "picked by the server"),
    Var("TORCH_SPYRE_VLLM_LOG_STEPS", "vllm_log_steps", _int(0),
        "log every Nth engine step's modelled time (0: never)", "1"),
)  # fmt: skip

_BY_FIELD = {v.field: v for v in VARIABLES}
_HW_PREFIX = "TORCH_SPYRE_HW_"


@dataclass(frozen=True)
class Settings:
    num_cards: int = 1
    device_memory: str | None = None
    hw_config: str | None = None
    #: hardware model fields by name (lower case), from ``TORCH_SPYRE_HW_<FIELD>``
    hw: Mapping[str, str] = field(default_factory=dict)
    fallback: str = "warn"
    fp16_format: str = "ieee"
    warm_path: bool = True
    host_views: str = "1.0x"
    stick_gemm: bool = True
    timing_only: bool = False
    compile_fallback: str = "warn"
    debug: bool = False
    ccl_timeout_s: float | None = None
    cache_dir: str | None = None
    cache_size: int = 10 << 30
    precompile: bool = True
    model_cache: str | None = None
    vllm: bool = True
    #: None: the default (on for generative models, off for pooling models)
    vllm_compile: bool | None = None
    vllm_piecewise: bool = True
    vllm_regions: bool = True
    vllm_buckets: tuple[int, ...] | None = None
    vllm_warmup: str = "all"
    vllm_kv_cache_bytes: int | None = None
    vllm_metrics_port: int | None = None
    vllm_log_steps: int = 1

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> Settings:
        """The settings an environment gives (``os.environ`` by default)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for var in VARIABLES:
            if var.field == "hw":
                continue
            raw = env.get(var.env)
            if raw is not None and (raw.strip() or var.parse is _flag):
                values[var.field] = var.parse(var.env, raw)
        if "num_cards" not in values and env.get("AIU_WORLD_SIZE"):
            values["num_cards"] = _int(1, 8)("AIU_WORLD_SIZE", env["AIU_WORLD_SIZE"])
        values["hw"] = {
            k[len(_HW_PREFIX) :].lower(): v
            for k, v in env.items()
            if k.startswith(_HW_PREFIX) and k != "TORCH_SPYRE_HW_CONFIG"
        }
        return Settings(**values)

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


_lock = threading.RLock()
_current: Settings | None = None


def get() -> Settings:
    """The process's settings (the environment, read on first use)."""
    s = _current
    if s is None:
        with _lock:
            s = _current
            if s is None:
                s = _set(Settings.from_env())
    return s


def _set(s: Settings) -> Settings:
    global _current
    _current = s
    for fn in list(_watchers):
        fn(s)
    return s


def update(**changes: Any) -> Settings:
    """Change settings from now on (checked as the environment would be)."""
    for name, value in changes.items():
        _check(name, value)
    with _lock:
        return _set(get().replace(**changes))


def reload(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the environment (or ``environ``) again."""
    with _lock:
        return _set(Settings.from_env(environ))


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Settings]:
    """These settings inside the block, in this process and in the variables
    that processes started inside it read; both restored after."""
    for name, value in changes.items():
        _check(name, value)
    before = get()
    saved = {}
    for name, value in changes.items():
        for env, text in _exported(name, value).items():
            saved[env] = os.environ.get(env)
            if text is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = text
    try:
        with _lock:
            inside = _set(before.replace(**changes))
        yield inside
    finally:
        for env, old in saved.items():
            if old is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = old
        with _lock:
            _set(before)


def _check(name: str, value: Any) -> None:
    if name not in {f.name for f in dataclasses.fields(Settings)}:
        raise SettingsError(
            f"no setting {name!r}; settings: {', '.join(f.name for f in dataclasses.fields(Settings))}"
        )
    var = _BY_FIELD.get(name)
    if var is None or name == "hw" or value is None:
        return
    if isinstance(value, bool) or var.parse is _flag:
        if not isinstance(value, bool):
            raise SettingsError(f"{var.env}: {name} takes True or False, got {value!r}")
        return
    if var.parse is _buckets:
        var.parse(var.env, ",".join(str(v) for v in value))
        return
    var.parse(var.env, str(value))


def _exported(name: str, value: Any) -> dict[str, str | None]:
    """The environment variables holding setting ``name`` = ``value``."""
    if name == "hw":
        return {_HW_PREFIX + k.upper(): str(v) for k, v in dict(value).items()}
    var = _BY_FIELD[name]
    if value is None:
        return {var.env: None}
    if isinstance(value, bool):
        return {var.env: "1" if value else "0"}
    if isinstance(value, tuple):
        return {var.env: ",".join(str(v) for v in value)}
    return {var.env: str(value)}


#: told the new settings whenever they change (modules that keep a derived value)
_watchers: list[Callable[[Settings], None]] = []


def watch(fn: Callable[[Settings], None]) -> None:
    """Call ``fn(settings)`` whenever the settings change (not on first read)."""
    _watchers.append(fn)


# ---------------------------------------------------------------- hand-offs
#: variables torch_spyre sets for its own child processes (not settings)
HANDOFFS = ("_TORCH_SPYRE_VLLM_METRICS_PROXY_PID", "_TORCH_SPYRE_VLLM_METRICS_PICKED_PORT")


def handoff(name: str, value: str) -> None:
    """Pass ``value`` to the processes this one starts (and to ``inherited``)."""
    if name not in HANDOFFS and name != "TORCH_SPYRE_VLLM_METRICS_PORT":
        raise SettingsError(f"{name} is not a hand-off variable; hand-offs: {HANDOFFS}")
    os.environ[name] = value
    if name == "TORCH_SPYRE_VLLM_METRICS_PORT":
        update(vllm_metrics_port=int(value))


def inherited(name: str) -> str | None:
    """A hand-off variable as this process received or set it."""
    if name not in HANDOFFS:
        raise SettingsError(f"{name} is not a hand-off variable; hand-offs: {HANDOFFS}")
    return os.environ.get(name)


def table() -> str:
    """The variables as a Markdown table (docs/settings.md)."""
    rows = ["| variable | meaning | default |", "|---|---|---|"]
    for v in VARIABLES:
        rows.append(f"| `{v.env}` | {v.meaning} | {v.default} |")
    return "\n".join(rows) + "\n"


__all__ = [
    "HANDOFFS",
    "VARIABLES",
    "Settings",
    "SettingsError",
    "Var",
    "get",
    "handoff",
    "inherited",
    "override",
    "reload",
    "table",
    "update",
    "watch",
]
