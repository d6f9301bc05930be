"""sandbox down/up around Docker's stale network endpoints (moby#17217): a network Docker
will not remove for endpoints of containers already gone must not fail `down`, nor block
the next `up` of the same name. Fakes stand in for the engine: the bug cannot be caused
on purpose."""

from __future__ import annotations

import docker.errors
import pytest

from provision.sandbox import core


class FakeNetwork:
    def __init__(self, name: str, stale: bool):
        self.name, self.stale, self.removed, self.attrs = name, stale, False, {"Containers": {}}

    def remove(self):
        if self.stale:
            raise docker.errors.APIError(f"error while removing network: network {self.name} id 1 has active endpoints")
        self.removed = True

    def reload(self):
        pass

    def disconnect(self, *a, **kw):
        pass


@pytest.fixture
def fake(monkeypatch, tmp_path):
    nets: list[FakeNetwork] = []
    monkeypatch.setattr(core, "_labelled", lambda client, name=None: ([], [n for n in nets if not n.removed]))
    monkeypatch.setattr(core, "sandbox_dir", lambda name: tmp_path / name)
    monkeypatch.setattr(core._remove_network, "__defaults__", (0.0,))  # no waiting for endpoints to go
    return nets


def test_down_reports_a_stale_network_without_failing(fake):
    fake += [FakeNetwork("provision-sandbox-x", stale=True), FakeNetwork("provision-sandbox-x-1", stale=False)]
    r = core.down("x", client=object())
    assert r.errors == [] and r.stale_networks == ["provision-sandbox-x"] and r.networks == 1
    assert r.found


def test_another_network_error_still_fails_down(fake, monkeypatch):
    n = FakeNetwork("provision-sandbox-x", stale=False)
    monkeypatch.setattr(n, "remove", lambda: (_ for _ in ()).throw(docker.errors.APIError("permission denied")))
    fake.append(n)
    with pytest.raises(core.ProvisionError, match="permission denied"):
        core.down("x", client=object())


def test_a_stale_network_is_a_leftover_up_may_pass_over(fake):
    assert core._leftover_removed(FakeNetwork("provision-sandbox-x", stale=True))
    n = FakeNetwork("provision-sandbox-x", stale=False)
    assert core._leftover_removed(n) and n.removed
