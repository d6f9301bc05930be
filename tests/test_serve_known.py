"""What the service knows (serve/source.Known): the --hosts file (checked as an inventory is,
one line or every problem at FILE:LINE; read again when it changes, the last good one kept),
the latest finished submissions (their snapshot put in place again when its directory is
gone; one that no longer reads left out), and the hosts of finished work only shown while
they answer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from provision.core.errors import ProvisionError
from provision.core.submission import Kind, Status
from provision.inventory.inventory import load
from provision.io.servicestore import ServiceStore, Submission
from provision.rules.rounds import Round
from provision.rules.tenancy import HostView, jobs_json
from provision.serve.hostsfile import HOSTS_JOB, HostsFile
from provision.serve.snapshot import snapshot_of, store_files
from provision.serve.source import Known, ServiceSource

INV = """\
job: {job}
ssh: {{user: root}}
hosts:
  - {{name: {host}, address: 192.0.2.{n}, accelerators: {{type: nvidia-h100, count: 2}}}}
pools:
  chief: {{replicas: 1, accelerators: 1, command: [/bin/true]}}
"""


@pytest.fixture
def store(tmp_path):
    s = ServiceStore.open_local(tmp_path / "service.sqlite")
    yield s
    s.close()


def test_a_hosts_file_is_checked_as_an_inventory_and_read_again(tmp_path):
    f = tmp_path / "hosts.yaml"
    f.write_text("hosts:\n  - {name: gpu-1, address: 192.0.2.1, accelerators: {type: nvidia-h100, count: 8}}\n")
    hf = HostsFile(f, tmp_path / "work")
    assert [h.name for h in load(hf.refresh()).hosts] == ["gpu-1"] and load(hf.refresh()).job == HOSTS_JOB
    f.write_text("hosts:\n  - {name: gpu-1, address: 192.0.2.1}\n  - {name: gpu-2, address: 192.0.2.2}\n")
    assert [h.name for h in load(hf.refresh()).hosts] == ["gpu-1", "gpu-2"]
    said: list[str] = []
    hf.say = said.append
    f.write_text("hosts:\n  - {name: gpu-1, address: 192.0.2.1, acelerators: 8}\n")
    assert [h.name for h in load(hf.refresh()).hosts] == ["gpu-1", "gpu-2"]  # the last good one stays
    hf.refresh()
    assert len(said) == 1 and said[0].startswith(f"{f}:2: hosts[0].acelerators"), said  # said once, FILE:LINE


@pytest.mark.parametrize(
    "text, why",
    [
        ("job: x\nhosts: []\n", "job: only hosts: and ssh: go in a hosts file"),
        ("- a\n", "expected a mapping with hosts: (and ssh:), as an inventory has them"),
        ("hosts: [\n", "not YAML"),
    ],
)
def test_a_bad_hosts_file_is_one_line_at_start(tmp_path, text, why):
    f = tmp_path / "hosts.yaml"
    f.write_text(text)
    with pytest.raises(ProvisionError) as e:
        HostsFile(f, tmp_path / "work")
    assert e.value.message.startswith(f"--hosts {f}: ") and why in e.value.message and "\n" not in e.value.message
    with pytest.raises(ProvisionError, match="cannot read"):
        HostsFile(tmp_path / "none.yaml", tmp_path / "work")


def _finished(store: ServiceStore, tmp_path: Path, job: str, host: str, n: int) -> Submission:
    src = tmp_path / "src" / job
    src.mkdir(parents=True)
    (src / "inv.yaml").write_text(INV.format(job=job, host=host, n=n))
    snap = snapshot_of(load(src / "inv.yaml"))
    sub = store.submit(
        Submission(f"sub-{job}", Kind.APPLY, job, "ana", "pg", "", snap.inventory, store_files(store, snap))
    )
    store.claim(sub.id, "svc")
    store.finish(sub.id, Status.DONE, "applied; the job Succeeded")
    return sub


def test_finished_work_is_known_its_snapshot_put_back_and_its_hosts_shown_while_they_answer(store, tmp_path):
    work = tmp_path / "work"
    _finished(store, tmp_path, "done-a", "gpu-a", 1)
    _finished(store, tmp_path, "done-b", "gpu-b", 2)
    known = Known(store, work)
    got = known.read()
    assert set(got) == {"done-a", "done-b"}  # their snapshots, put in place (no service ran them here)
    assert (work / "sub-done-a" / "inv.yaml").is_file() and known.finished_only == {"gpu-a", "gpu-b"}
    (work / "sub-done-b" / "inv.yaml").write_text("job: [broken\n")
    assert set(known.read()) == {"done-a"}  # one that no longer reads: left out, the others shown
    doc = jobs_json([HostView("gpu-a", 2), HostView("gpu-b", 2, error="ssh: timed out")], time.time())

    class Latest:
        latest = Round(1, time.time(), {}, doc)

        def look(self) -> None:
            pass

    source = ServiceSource(store, work, known=known, rounds=Latest())  # type: ignore[arg-type]
    (work / "sub-done-b" / "inv.yaml").write_text(INV.format(job="done-b", host="gpu-b", n=2))
    assert set(known.read()) == {"done-a", "done-b"}
    assert set(source.hosts()["hosts"]) == {"gpu-a"}  # a host only finished work names: shown while it answers
