"""The dashboard's health: each GPU's state on the Cluster page, and the Health page's
repeat offenders and incidents (a fake Source, as tests/test_web.py's; the service's own
in tests/integration/test_health.py)."""

from __future__ import annotations

from typing import Any

from starlette.testclient import TestClient

from provision.rules.healthlog import Incident, report_doc
from provision.web.app import make_app
from provision.web.auth import Auth
from provision.web.views import cluster_groups
from test_web import EVIL, HERE, FakeSource

T0 = 1_800_000_000.0


class HealthSource(FakeSource):
    def hosts(self) -> dict[str, Any]:
        doc = super().hosts()
        doc["hosts"]["gpu-1"]["health"] = {
            "host": {"state": "healthy"},
            "gpus": {"0": {"state": "healthy"}, "1": {"state": "quarantined", "reason": f"Xid 79 {EVIL}", "since": T0}},
        }
        doc["hosts"]["gpu-2"]["health"] = {"host": {"state": "draining", "reason": "a GPU is gone", "since": T0},
                                           "gpus": {"0": {"state": "healthy"}}}  # fmt: skip
        return doc

    def jobs(self) -> dict[str, Any]:
        return self.hosts()

    def incidents(self) -> dict[str, Any]:
        rows = [
            Incident(
                "a",
                "gpu-1",
                1,
                "quarantined",
                "Xid 79: GPU has fallen off the bus",
                EVIL,
                T0,
                None,
                "svc",
                "bert",
                "ana",
            ),
            Incident("b", "gpu-1", 1, "quarantined", "Xid 48", "", T0 - 7200, T0 - 3600, "svc"),
            Incident("c", "gpu-2", None, "draining", "a GPU is gone", "nvidia-smi lists 0", T0, None, "svc", gpus=1),
        ]
        return report_doc(rows, T0 + 3600, T0 - 86400)


def test_each_gpu_shows_its_health_and_why():
    rows = {r.name: r for _, rs in cluster_groups(HealthSource().hosts()) for r in rs}
    g = {x.index: x for x in rows["gpu-1"].gpus}
    assert (g[0].health, g[1].health) == ("healthy", "quarantined") and g[1].health_reason.startswith("Xid 79")
    assert g[1].state == "held"  # bert holds it: what runs there goes on
    assert rows["gpu-2"].gpus[0].state == "draining"  # free, but no new work goes there
    assert "since 2027-01-15T08:00:00Z" in g[1].health_reason
    (d,) = rows["gpu-2"].gpus  # the host's state is its GPUs' when it keeps new work off them
    assert d.health == "draining" and d.health_reason.startswith("the host: a GPU is gone")


def test_the_cluster_and_health_pages_show_the_states_and_the_incidents():
    c = TestClient(make_app(HealthSource(), auth=Auth.loopback()), client=HERE, base_url="http://127.0.0.1:8470")
    page = c.get("/")
    assert page.status_code == 200 and '<td class="health quarantined">quarantined: Xid 79' in page.text
    assert EVIL not in page.text and "&lt;script&gt;" in page.text
    health = c.get("/health")
    assert health.status_code == 200 and '<a href="/health">Health</a>' in health.text
    body = health.text
    assert body.index("gpu-1:1") < body.index("gpu-2")  # two incidents before one
    assert "Xid 79: GPU has fallen off the bus" in body and "nvidia-smi lists 0" in body and EVIL not in body
    api = c.get("/api/v1/health").json()
    assert [r["target"] for r in api["ranked"]] == ["gpu-1:1", "gpu-2"] and api["ranked"][0]["incidents"] == 2
    assert api["incidents"][0]["job"] == "bert" and api["incidents"][0]["owner"] == "ana"


def test_a_source_without_the_service_has_no_health_history():
    c = TestClient(make_app(FakeSourceWithNone(), auth=Auth.loopback()), client=HERE, base_url="http://127.0.0.1:8470")
    assert "(the service keeps the health history)" in c.get("/health").text


class FakeSourceWithNone(FakeSource):
    def incidents(self) -> dict[str, Any]:
        from provision.web.inventories import InventorySource

        return InventorySource.incidents(None)  # type: ignore[arg-type]
