"""How the simulation carries bytes between the cards' processes: the group's
c10d store (a TCPStore under ``torchrun`` / ``init_process_group``).

Every collective is one exchange: each rank posts one message to each other
rank under ``c/<seq>/<src>><dst>`` (possibly empty: a broadcast's non-roots
post only their arrival) and reads the messages posted to it.  Each key has one
reader, which deletes it after reading.  A message is a pickled header
(collective, shape, dtype, reduce op, the sender's card clock) plus the
tensor's raw bytes.  Point-to-point messages use ``p/<src>><dst>/<tag>/<n>``.

Every wait is bounded: a peer whose message does not arrive within the
timeout is named in the exception (a dead or stuck process), never a hang.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class SpyreCCLError(RuntimeError):
    """A collective that cannot complete: mismatched arguments across ranks."""


class SpyreCCLTimeout(SpyreCCLError, TimeoutError):
    """A peer did not take part in a collective within the timeout."""


@dataclass
class Message:
    header: dict[str, Any]
    payload: bytes = b""

    def encode(self) -> bytes:
        return pickle.dumps((self.header, self.payload), protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def decode(raw: bytes) -> Message:
        header, payload = pickle.loads(raw)
        return Message(header, payload)


def tensor_bytes(values: torch.Tensor) -> bytes:
    """The raw bytes of a contiguous CPU tensor (any dtype, bf16 included)."""
    flat = values.contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def bytes_tensor(raw: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


class StoreTransport:
    """Messages between the ranks of one group over its c10d store."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.seq = 0
        self._p2p: dict[tuple[int, int, int], int] = {}

    # ---------------------------------------------------------- collectives
    def exchange(self, what: str, outgoing: dict[int, Message]) -> dict[int, Message]:
        """Post ``outgoing[dst]`` to every other rank, return every other rank's
        message to this one, keyed by source rank."""
        seq = self.seq
        self.seq += 1
        peers = [r for r in range(self.size) if r != self.rank]
        if peers:
            keys = [f"c/{seq}/{self.rank}>{dst}" for dst in peers]
            values = [outgoing[dst].encode() for dst in peers]
            self._call(what, lambda: self.store.multi_set(keys, values))
        wanted = {src: f"c/{seq}/{src}>{self.rank}" for src in peers}
        return self._receive(f"{what} (collective #{seq})", wanted)

    # ------------------------------------------------------- point to point
    def send(self, dst: int, tag: int, msg: Message) -> None:
        n = self._p2p.get((self.rank, dst, tag), 0)
        self._p2p[(self.rank, dst, tag)] = n + 1
        key = f"p/{self.rank}>{dst}/{tag}/{n}"
        self._call("send", lambda: self.store.set(key, msg.encode()))

    def recv(self, src: int, tag: int) -> Message:
        n = self._p2p.get((src, self.rank, tag), 0)
        self._p2p[(src, self.rank, tag)] = n + 1
        key = f"p/{src}>{self.rank}/{tag}/{n}"
        return self._receive(f"recv (tag {tag}, message #{n})", {src: key})[src]

    # ------------------------------------------------------------- helpers
    def _receive(self, what: str, wanted: dict[int, str]) -> dict[int, Message]:
        if not wanted:
            return {}
        deadline = time.monotonic() + self.timeout.total_seconds()
        got: dict[int, Message] = {}
        for src, key in wanted.items():  # fixed order: the error names the first missing
            left = max(deadline - time.monotonic(), 0.001)
            try:
                self.store.wait([key], timedelta(seconds=left))
            except Exception as e:  # DistStoreError (timeout) or a lost store
                missing = [s for s, k in wanted.items() if s not in got and not self._has(k)]
                raise SpyreCCLTimeout(
                    f"spyreccl {what} on rank {self.rank}: rank(s) "
                    f"{', '.join(map(str, missing or [src]))} did not take part within "
                    f"{self.timeout.total_seconds():g} s (the peer process died, hangs, or "
                    f"called a different collective); set the timeout with "
                    f"init_process_group(timeout=...) or TORCH_SPYRE_CCL_TIMEOUT_S "
                    f"[{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}]"
                ) from None
            raw = self._call(what, lambda key=key: self.store.get(key))
            self._call(what, lambda key=key: self.store.delete_key(key))
            got[src] = Message.decode(raw)
        return got

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:
            return False

    def _call(self, what: str, fn):
        try:
            return fn()
        except Exception as e:
            raise SpyreCCLTimeout(
                f"spyreccl {what} on rank {self.rank}: lost the group's store (the process "
                f"hosting it, rank 0 or the torchrun agent, is gone?): {e}"
            ) from None
