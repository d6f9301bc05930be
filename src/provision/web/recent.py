"""Answers kept a short while: what asks many hosts (a job's status over 128 hosts is a few
hundred ms) answers every request of the next `fresh` seconds from one probe. Between
`fresh` and `stale` seconds old, an answer is still given while one thread asks again
behind it; older, the request asks and the others asking the same wait for its answer
(one probe, not one each)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Recent(Generic[V]):
    def __init__(self, fresh: float, stale: float):
        assert stale >= fresh
        self.fresh, self.stale = fresh, stale
        # key -> (monotonic time it was answered, answer): a probe that took long under load
        # still answers the next `fresh` seconds (stamped at its start, it would be stale at once).
        self._got: dict[Hashable, tuple[float, V]] = {}
        self._locks: dict[Hashable, threading.Lock] = {}
        self._forgot: dict[Hashable, float] = {}  # key -> when forget() was called
        self._guard = threading.Lock()

    def get(self, key: Hashable, ask: Callable[[], V]) -> V:
        with self._guard:
            got = self._got.get(key)
            lock = self._locks.setdefault(key, threading.Lock())
        if got is not None:
            age = time.monotonic() - got[0]
            if age < self.fresh:
                return got[1]
            if age < self.stale:
                if lock.acquire(blocking=False):  # one asks behind the answer; the others take it as it is
                    threading.Thread(target=self._behind, args=(key, ask, lock), daemon=True).start()
                return got[1]
        with lock:
            got = self._got.get(key)
            if got is not None and time.monotonic() - got[0] < self.fresh:
                return got[1]  # asked by another request meanwhile
            return self._ask(key, ask)

    def last(self, key: Hashable, ask: Callable[[], V]) -> V:
        """The last answer however old, without waiting: past `fresh`, one thread asks
        behind it (what no request should wait for, such as whether a page shows a
        button). Only when there is none yet, the request asks as get() does."""
        with self._guard:
            got = self._got.get(key)
            lock = self._locks.setdefault(key, threading.Lock())
        if got is None:
            return self.get(key, ask)
        if time.monotonic() - got[0] >= self.fresh and lock.acquire(blocking=False):
            threading.Thread(target=self._behind, args=(key, ask, lock), daemon=True).start()
        return got[1]

    def put(self, key: Hashable, value: V, began: float) -> None:
        """An answer asked elsewhere (began: its asking's monotonic time)."""
        with self._guard:
            if began < self._forgot.get(key, float("-inf")):
                return  # asked before an action changed it
            self._got[key] = (time.monotonic(), value)

    def forget(self, key: Hashable) -> None:
        """An action changed it: the next request asks."""
        with self._guard:
            self._got.pop(key, None)
            self._forgot[key] = time.monotonic()

    def _ask(self, key: Hashable, ask: Callable[[], V]) -> V:
        began = time.monotonic()
        value = ask()
        self.put(key, value, began)
        return value

    def _behind(self, key: Hashable, ask: Callable[[], V], lock: threading.Lock) -> None:
        try:
            self._ask(key, ask)
        except Exception:  # the next request past `stale` asks itself and sees the error
            pass
        finally:
            lock.release()
