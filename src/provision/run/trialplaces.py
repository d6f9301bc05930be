"""Where one runner's trials go, before their plans: a lock per host (this runner's trials
are planned one after another on a host) and the slots each trial takes (placement is a
pure function: trials starting at once take different GPUs and ports)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from provision.core.model import Inventory
from provision.placement.tasks import Held, PlacementError, Slot, place


class HostLocks:
    """A lock per host, taken in the hosts' order (two trials never wait for each other)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._each: dict[str, threading.Lock] = {}

    def acquire(self, hosts: Iterable[str]) -> list[threading.Lock]:
        with self._lock:
            locks = [self._each.setdefault(h, threading.Lock()) for h in sorted(set(hosts))]
        for i, lock in enumerate(locks):
            try:
                lock.acquire()
            except BaseException:
                self.release(locks[:i])
                raise
        return locks

    @staticmethod
    def release(locks: list[threading.Lock]) -> None:
        for lock in reversed(locks):
            lock.release()


class Places:
    """Where this runner's trials run or are about to: a trial about to start is placed
    beside them here first (placement is a pure function), so that trials starting at once
    take different GPUs and ports, and wait only for those placed on the same hosts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: dict[int, Mapping[str, Slot]] = {}

    def take(self, number: int, inv: Inventory, hint: Mapping[str, Slot] | None) -> Mapping[str, Slot] | None:
        """Where trial `number` goes (`hint` first, if no other trial has it), kept as taken;
        None: no room beside this runner's other trials (it waits, in turn, as before)."""
        with self._lock:
            gpus: dict[str, set[int]] = {}
            ports: dict[str, set[int]] = {}
            for n, slots in self._taken.items():
                for slot in slots.values() if n != number else ():
                    gpus.setdefault(slot.host, set()).update(slot.accelerators)
                    ports.setdefault(slot.host, set()).add(slot.port)
            held = {host: Held(frozenset(gpus[host]), frozenset(ports.get(host, ()))) for host in gpus}
            try:
                slots = place(inv, hint, held).slots()
            except PlacementError:
                return None
            self._taken[number] = slots
            return slots

    def hold(self, number: int, slots: Mapping[str, Slot]) -> None:
        with self._lock:
            self._taken[number] = dict(slots)

    def leave(self, number: int) -> None:
        with self._lock:
            self._taken.pop(number, None)
