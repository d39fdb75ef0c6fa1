"""The persistent compiled-artifact cache: one directory, shared by processes.

``TORCH_SPYRE_CACHE_DIR`` (default ``~/.cache/torch_spyre/compiled``; ``off``
turns it off) holds everything a later process can reuse instead of
compiling again:

* ``spyre/<namespace>/<k[:2]>/<k>``: torch_spyre's own entries (finished
  kernel searches: the planned programs of the compiler and of eager kernels,
  ``kernels.search.Memo(persist=...)``);
* ``inductor/``: Inductor's and AOTAutograd's caches (FX graph cache,
  ``aotautograd/``), pointed here at import through
  ``TORCHINDUCTOR_CACHE_DIR`` when the user has not set that variable
  (``adopt_torch_caches``).

An entry's key is the SHA-256 of its namespace, the code version
(``code_version``: torch_spyre's version and a hash of the sources that shape
programs) and a canonical form of what the caller keys it by (the graph or
kernel structure, shapes, dtypes, the hardware config: ``canonical``).  A
key that cannot be put in canonical form (an object with no stable text) is
not persisted.

Writers write a temporary file beside the entry and rename it into place
(atomic on POSIX): a reader sees a whole entry or none, and concurrent
writers of one key leave one of their (equal) entries.  Each entry starts
with a header holding the format, the code version, its key, and the
payload's length and SHA-256; an entry whose header or checksum does not
match (a truncated file, another version) is removed with a warning and
rebuilt by the caller, never loaded.

The directory is capped (``TORCH_SPYRE_CACHE_SIZE``): past the cap, the
least recently used entries go first (a hit touches its entry's mtime),
Inductor's included.  ``spyre cache --info`` / ``--clear``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import os
import pathlib
import pickle
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch_spyre import settings

MAGIC = b"SPYRE-ARTIFACT\n"
FORMAT = 1
#: our own entries, under the cache directory
OWN = "spyre"
#: Inductor's and AOTAutograd's caches, under the cache directory
INDUCTOR = "inductor"
#: subdirectories whose files may be evicted one by one: our entries, and
#: Inductor's (FX graph and AOTAutograd entries, and the generated code they
#: write again on a hit); lock files are kept
_EVICTABLE = (OWN, INDUCTOR)
#: a file newer than this is never evicted (a writer may still be using it)
_GRACE_S = 2.0


class Uncacheable(TypeError):
    """A key holds an object with no stable canonical form (not persisted)."""


class CacheWarning(UserWarning):
    """A cache entry was corrupt or stale and is rebuilt."""


# ----------------------------------------------------------------- versions
@functools.cache
def code_version() -> str:
    """torch_spyre's version plus a hash of the sources that shape programs.

    Computed once per process: the key must describe the code this process
    loaded, not files edited on disk since (an entry keyed by new sources but
    built by old code would be loaded by every later run)."""
    from torch_spyre import _version

    h = hashlib.sha256(_version.__version__.encode())
    _hash_sources(h, ("compiler", "kernels", "ir", "sim", "runtime", "ops"))
    root = pathlib.Path(__file__).resolve().parent.parent
    for name in ("layout.py", "hardware.py", "settings.py"):
        if (root / name).exists():
            h.update((root / name).read_bytes())
    return f"{_version.__version__}+{h.hexdigest()[:16]}"


def sources_hash(*packages: str) -> str:
    """A hash of the sources of these torch_spyre sub-packages (for a key that
    depends on sources ``code_version`` leaves out)."""
    h = hashlib.sha256()
    _hash_sources(h, packages)
    return h.hexdigest()[:16]


def _hash_sources(h: Any, packages: tuple[str, ...]) -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    for sub in packages:
        for p in sorted((root / sub).rglob("*.py")):
            h.update(p.relative_to(root).as_posix().encode())
            h.update(p.read_bytes())


# ---------------------------------------------------------------- canonical
def canonical(x: Any) -> Any:
    """``x`` as JSON-able data that is the same in every process for equal
    keys (sets sorted, floats exact, dataclasses by class and fields);
    ``Uncacheable`` for anything else."""
    if x is None or isinstance(x, bool | str):
        return x
    if isinstance(x, int):
        return ["i", str(x)]
    if isinstance(x, float):
        return ["f", x.hex()]
    if isinstance(x, enum.Enum):
        return ["e", type(x).__qualname__, x.name]
    if isinstance(x, tuple | list):
        return ["t" if isinstance(x, tuple) else "l", [canonical(v) for v in x]]
    if isinstance(x, set | frozenset):
        return ["s", sorted((canonical(v) for v in x), key=_text)]
    if isinstance(x, Mapping):
        items = [[canonical(k), canonical(v)] for k, v in x.items()]
        return ["d", sorted(items, key=lambda kv: _text(kv[0]))]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        name = f"{type(x).__module__}.{type(x).__qualname__}"
        return ["c", name, [[f.name, canonical(getattr(x, f.name))] for f in dataclasses.fields(x)]]
    import torch

    if isinstance(x, torch.dtype):
        return ["dtype", str(x)]
    if isinstance(x, torch.device):
        return ["device", str(x)]
    raise Uncacheable(f"{type(x).__module__}.{type(x).__qualname__} has no canonical form")


def _text(c: Any) -> str:
    return json.dumps(c, separators=(",", ":"))


def key_of(namespace: str, parts: Any) -> str:
    """The entry key of ``parts`` in ``namespace`` (``Uncacheable`` when a part
    has no canonical form)."""
    text = _text([FORMAT, namespace, code_version(), canonical(parts)])
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- directory
def root() -> pathlib.Path | None:
    """The cache directory, or None when ``TORCH_SPYRE_CACHE_DIR=off``."""
    raw = settings.get().cache_dir
    if raw is None:
        return pathlib.Path("~/.cache/torch_spyre/compiled").expanduser()
    if raw.lower() in ("off", "0", "none"):
        return None
    return pathlib.Path(raw).expanduser()


def adopt_torch_caches() -> str | None:
    """Point Inductor's and AOTAutograd's caches at ``<cache dir>/inductor``,
    unless the user set ``TORCHINDUCTOR_CACHE_DIR`` (theirs is kept) or the
    cache is off.  Inductor reads the variable each time it needs its cache
    directory (``torch._inductor.runtime.cache_dir_utils.cache_dir``), the
    public way to place it; processes started later inherit it.  Returns the
    directory set, or None."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return None
    base = root()
    if base is None:
        return None
    where = str(base / INDUCTOR)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
    return where


def _entry_path(base: pathlib.Path, namespace: str, key: str) -> pathlib.Path:
    return base / OWN / namespace / key[:2] / key


# -------------------------------------------------------------- read, write
@dataclass
class Stats:
    """This process's use of the cache."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    rebuilt: int = 0  # corrupt or stale entries removed
    evicted: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


stats = Stats()
_lock = threading.Lock()


def load(namespace: str, key: str) -> Any | None:
    """The value stored under ``key``, or None (a miss; a corrupt or stale
    entry is removed with a ``CacheWarning``, and is a miss)."""
    base = root()
    if base is None:
        return None
    path = _entry_path(base, namespace, key)
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        stats.misses += 1
        return None
    except OSError as e:
        _reject(path, f"cannot be read ({e})")
        return None
    why, payload = _check(data, key)
    if why is not None:
        _reject(path, why)
        return None
    try:
        value = pickle.loads(payload)
    except Exception as e:  # a payload that passed its checksum but not the unpickler
        _reject(path, f"does not unpickle ({type(e).__name__}: {e})")
        return None
    stats.hits += 1
    with _ignore_missing():
        os.utime(path)  # recently used: evicted last
    return value


def store(namespace: str, key: str, value: Any) -> bool:
    """Store ``value`` under ``key`` (atomically); False when the cache is off
    or ``value`` does not pickle.  Enforces the size cap."""
    base = root()
    if base is None:
        return False
    try:
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return False
    header = {
        "format": FORMAT,
        "version": code_version(),
        "key": key,
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    data = MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload
    path = _entry_path(base, namespace, key)
    try:
        _write_atomic(path, data)
    except OSError as e:  # a full disk, a read-only directory: compile on, uncached
        _warn_unwritable(base, e)
        return False
    stats.writes += 1
    _account(base, len(data))
    return True


def discard(namespace: str, key: str, why: str) -> None:
    """Remove the entry under ``key`` with a ``CacheWarning`` saying ``why``: a
    caller found it unusable after ``load`` (its payload passed the checksum
    but not the caller's own loading); the caller rebuilds it."""
    base = root()
    if base is not None:
        _reject(_entry_path(base, namespace, key), why)
        stats.hits -= 1  # ``load`` counted it a hit; it is a rebuilt miss


_unwritable_warned: set[pathlib.Path] = set()


def _warn_unwritable(base: pathlib.Path, err: OSError) -> None:
    if base in _unwritable_warned:
        return
    _unwritable_warned.add(base)
    warnings.warn(
        f"torch_spyre artifact cache: cannot write to {base} ({err}); compiling without "
        "storing (set TORCH_SPYRE_CACHE_DIR to a writable directory, or `off`)",
        CacheWarning,
        stacklevel=3,
    )


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with _ignore_missing():
            os.unlink(tmp)
        raise


def _check(data: bytes, key: str) -> tuple[str | None, bytes]:
    """(why the entry is unusable or None, its payload)."""
    if not data.startswith(MAGIC):
        return "has no torch_spyre cache header", b""
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        return "is truncated in its header", b""
    try:
        header = json.loads(data[len(MAGIC) : end])
    except ValueError:
        return "has a malformed header", b""
    payload = data[end + 1 :]
    if header.get("format") != FORMAT:
        return f"is of cache format {header.get('format')} (this is {FORMAT})", b""
    if header.get("version") != code_version():
        return f"was built by torch_spyre {header.get('version')} (this is {code_version()})", b""
    if header.get("key") != key:
        return "holds another key", b""
    if header.get("size") != len(payload):
        return f"is truncated ({len(payload)} of {header.get('size')} payload bytes)", b""
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        return "fails its checksum", b""
    return None, payload


def _reject(path: pathlib.Path, why: str) -> None:
    stats.rebuilt += 1
    stats.misses += 1
    warnings.warn(
        f"torch_spyre artifact cache: {path} {why}; removed, rebuilding it "
        "(`spyre cache --clear` empties the cache)",
        CacheWarning,
        stacklevel=3,
    )
    try:
        path.unlink()
    except OSError:  # gone already, or not a file: the next write replaces it
        pass


class _ignore_missing:
    """``with``: a file another process removed first is no error."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is not None and issubclass(kind, FileNotFoundError)


# ------------------------------------------------------------------ size cap
#: per cache directory: (bytes as last counted plus writes since, when counted)
_counted: dict[pathlib.Path, tuple[float, float]] = {}
#: recount the directory after this many seconds (other processes write too)
_RECOUNT_S = 30.0


def _account(base: pathlib.Path, added: int) -> None:
    """Add a write to the directory's running total; evict past the cap."""
    cap = settings.get().cache_size
    with _lock:
        now = time.monotonic()
        total, at = _counted.get(base, (0.0, -1e9))
        if now - at > _RECOUNT_S:
            total, at = float(usage(base)["bytes"]), now
        else:
            total += added
        if total > cap:
            total, at = float(evict(base, cap)), time.monotonic()
        _counted[base] = (total, at)


def _files(base: pathlib.Path) -> Iterator[tuple[pathlib.Path, os.stat_result, bool]]:
    """(file, stat, evictable) for every file under ``base``."""
    for dirpath, _dirs, names in os.walk(base):
        rel = os.path.relpath(dirpath, base).replace(os.sep, "/")
        evictable = any(rel == e or rel.startswith(e + "/") for e in _EVICTABLE)
        for name in names:
            p = pathlib.Path(dirpath) / name
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            yield p, st, evictable and not name.endswith((".tmp", ".lock"))


def evict(base: pathlib.Path, cap: int) -> int:
    """Remove least recently used entries until the directory holds at most
    ``cap`` bytes (entries written in the last seconds stay); returns the
    bytes left."""
    files = list(_files(base))
    total = sum(st.st_size for _, st, _ in files)
    now = time.time()
    for p, st, evictable in sorted(files, key=lambda f: f[1].st_mtime):
        if total <= cap:
            break
        if not evictable or now - st.st_mtime < _GRACE_S:
            continue
        with _ignore_missing():
            p.unlink()
            total -= st.st_size
            stats.evicted += 1
    return total


def usage(base: pathlib.Path | None = None) -> dict[str, Any]:
    """Bytes and files in the cache directory, in all and per part."""
    base = root() if base is None else base
    out: dict[str, Any] = {"dir": str(base) if base else None, "bytes": 0, "files": 0, "parts": {}}
    if base is None or not base.exists():
        return out
    for p, st, _ in _files(base):
        rel = p.relative_to(base).parts
        part = "/".join(rel[:2]) if len(rel) > 2 else rel[0]
        slot = out["parts"].setdefault(part, {"bytes": 0, "files": 0})
        slot["bytes"] += st.st_size
        slot["files"] += 1
        out["bytes"] += st.st_size
        out["files"] += 1
    return out


def clear(base: pathlib.Path | None = None) -> int:
    """Empty the cache directory (ours and Inductor's parts); returns the bytes freed."""
    base = root() if base is None else base
    if base is None or not base.exists():
        return 0
    freed = usage(base)["bytes"]
    for part in (OWN, INDUCTOR):
        shutil.rmtree(base / part, ignore_errors=True)
    _counted.pop(base, None)
    return int(freed)


__all__ = [
    "CacheWarning",
    "Stats",
    "Uncacheable",
    "adopt_torch_caches",
    "canonical",
    "clear",
    "code_version",
    "evict",
    "key_of",
    "load",
    "root",
    "stats",
    "store",
    "usage",
]
