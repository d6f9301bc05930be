"""The service's parts wired (cli/serveparts.py): every round subscriber and every event
delivery the service has is there, so a merge or a new part cannot drop one silently."""

from __future__ import annotations

import threading

from provision.cli.serveparts import parts
from provision.io.servicestore import ServiceStore
from provision.serve.checkpoints import CheckpointKeeper
from provision.serve.devreaper import DevReaper
from provision.serve.health import HealthKeeper
from provision.serve.keeper import LogKeeper
from provision.serve.notify import Notifications
from provision.serve.recovery import Recoverer
from provision.serve.rounds import EventMaker, GpuRecorder
from provision.serve.stream import Delivery, HistoryWriter


def test_every_subscriber_and_delivery_is_wired(tmp_path, monkeypatch):
    monkeypatch.setenv("PROVISION_SERVICE_DB", str(tmp_path / "service.sqlite"))
    store = ServiceStore.open_local(tmp_path / "service.sqlite")
    got = parts("local", store, (), None, None, threading.Event(), lambda line: None)
    try:
        subs = {type(s) for s in got.rounds.subscribers}
        assert subs == {GpuRecorder, EventMaker, HealthKeeper, DevReaper, Recoverer, CheckpointKeeper}
        order = [type(s) for s in got.rounds.subscribers]
        # A quarantine waits for no other subscriber's work, and is in place before a recovery.
        assert order[0] is HealthKeeper and order.index(HealthKeeper) < order.index(Recoverer)
        handlers = {type(d.handler) for d in got.deliveries if isinstance(d, Delivery)}
        assert handlers == {HistoryWriter, LogKeeper}
        assert any(isinstance(d, Notifications) for d in got.deliveries)
        assert got.source.dev is not None and got.source.keeper is not None
    finally:
        got.source.close()
        got.side.close()
        got.keeping.close()
        store.close()
