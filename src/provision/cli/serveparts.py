"""The service's parts wired together (`provision serve`): the rounds and their
subscribers, the event stream's deliveries, the pages' source, each on the connection it
needs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from provision.inventory.statebackend import Backend
from provision.io.servicestore import ServiceStore
from provision.rules.priority import Policy
from provision.run.survey import KeptContexts
from provision.serve.checkpoints import CheckpointKeeper
from provision.serve.devreaper import DevReaper
from provision.serve.gpusample import few_arenas
from provision.serve.health import HealthKeeper
from provision.serve.hostsfile import HostsFile
from provision.serve.keeper import LogKeeper
from provision.serve.notify import Notifications
from provision.serve.places import open_place, work_root
from provision.serve.recovery import Recoverer
from provision.serve.rounds import EventMaker, GpuRecorder, Rounds
from provision.serve.source import Known, ServiceSource
from provision.serve.stream import Delivery, HistoryWriter


class Parts(NamedTuple):
    side: ServiceStore
    keeping: ServiceStore
    rounds: Rounds
    deliveries: list[Delivery | Notifications]
    source: ServiceSource


def parts(
    url: str,
    store: ServiceStore,
    inventories: tuple[str, ...],
    hosts: HostsFile | None,
    public: str | None,
    leading: threading.Event,
    say: Callable[[str], None],
) -> Parts:
    """The rounds, their subscribers, the event stream's deliveries and the pages' source."""
    few_arenas()  # before any of their threads
    # The rounds and the pages on a connection of their own: a slow page or round never
    # holds up the service's loop. The leader alone makes rounds (two services on one
    # database: one set of samples, one stream of events).
    side = open_place(url)
    known = Known(side, work_root(store), inventories, hosts)
    gpus = GpuRecorder(side)
    deliveries: list[Delivery | Notifications] = [Delivery(side, HistoryWriter(side), leading, say)]
    # The rules' deliveries on a connection of their own: a burst of sends never waits on the round's.
    deliveries.append(Notifications(open_place(url), leading, say, public))
    made = EventMaker(side, wake=lambda: _wake(deliveries))
    contexts = KeptContexts(known)  # the rounds' thread's: the survey's and the health keeper's
    health = HealthKeeper(side, known.read, contexts, wake=lambda: _wake(deliveries))
    dev = DevReaper(side, known.read, contexts, say, wake=lambda: _wake(deliveries))  # idle GPUs go back
    # Jobs with progress: or recovery: (serve/recovery.py), after the health keeper: a
    # quarantine this round makes is in place before a recovery places the job again.
    recoveries = Recoverer(side, say, contexts, wake=lambda: _wake(deliveries))
    copies = CheckpointKeeper(side, say)  # each watched job's newest checkpoint kept off its host
    # The health keeper first: a fatal Xid's quarantine and its event wait for no other
    # subscriber's work (the samples', the stream's) in the round that read it.
    rounds = Rounds(known.read, contexts, [health, gpus, made, dev, recoveries, copies], leading, say)
    source = ServiceSource(
        side,
        work_root(store),
        rounds=rounds,
        gpus=gpus,
        known=known,
        policy=policy_reader(url),
        health=health,
        dev=dev.view_of,
    )
    # The kept logs on a connection of their own: a run's last lines are megabytes.
    keeping = open_place(url)
    deliveries.append(Delivery(keeping, LogKeeper(keeping, source.tail, say), leading, say))
    return Parts(side, keeping, rounds, deliveries, source)


def policy_reader(url: str) -> Callable[[], Policy]:
    """What reads the team's policy (the Quotas page's): the local state's defaults, or its
    PostgreSQL's row."""

    def read() -> Policy:
        # start-up time: psycopg loads only for a PostgreSQL state (the embedded service needs none)
        from provision.io.policystore import policy_of

        return policy_of(Backend(url))

    return read


def _wake(deliveries: list[Delivery | Notifications]) -> None:
    for d in deliveries:
        d.wake()
