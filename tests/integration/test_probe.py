"""The fast probe (probe.sh) reports exactly what the Python agent's probe does, on real hosts.

plan reads hosts through the shell script and falls back to the agent when the script cannot
answer; both must give the same report in every state a host can be in, or plan would see a
different world depending on which one answered.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clirun import cli, sh
from provision.host import layout
from provision.host.protocol import ProbeRequest, to_wire
from provision.io import probe as fast_probe
from provision.run import context as engine
from provision.run.survey import SURVEY_ASK

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]


@pytest.fixture(scope="module")
def sb(sandbox_factory):
    sb = sandbox_factory(hosts=2, gpus_per_host=2)
    yield sb
    sandbox_factory.down(sb)


def both(inv: Path, state: Path | None = None, monkeypatch=None) -> tuple[dict, dict, list[str]]:
    """(fast reports, agent reports, hosts where the fast probe fell back to the agent)."""
    ctx = engine.open_context(str(inv), state_path=str(state) if state else None)
    fallbacks: list[str] = []
    real = fast_probe.call_agent

    def spy(session, target, req, **kw):
        fallbacks.append(target.name)
        return real(session, target, req, **kw)

    monkeypatch.setattr(fast_probe, "call_agent", spy)
    fast, slow = {}, {}
    try:
        # Both with and without the shared-host part (ledger, others' units, listeners).
        # And with plan's pre-flight checks (checks.py) and the cluster address's interface.
        # And what status asks (the clocks; the ledger without the listening ports), and
        # what plan asks a settled host (engine.Ask.settled).
        asks = {
            "": engine.Ask(facts="check"),
            "+tenancy": engine.Ask(facts="check", tenancy=True),
            "+checks": engine.Ask(facts="check", checks=True, interface=True),
            "+status": engine.Ask(files=False, tenancy=True, listening=False, clocks=True),
            "+settled": engine.Ask(facts="check", tenancy=True, checks=True, interface=True).settled(),
            "+health": SURVEY_ASK,  # the service's rounds: the ledger, the GPUs' use and their health read
        }
        for key, ask in asks.items():
            fast_res = engine.probe(ctx, ask, fast=True)
            slow_res = engine.probe(ctx, ask, fast=False)
            assert not fast_res.errors and not slow_res.errors, (fast_res.errors, slow_res.errors)
            # The agent's answers have the host's clocks; the script's only when asked, and
            # they agree (the monotonic clock within a second: /proc/uptime).
            for n, r in fast_res.ok.items():
                fast[n + key] = _steady(to_wire(r.without_clock()))
                if ask.clocks:
                    s = slow_res.ok[n]
                    assert r.now and s.now and abs(r.now - s.now) < 5, (r.now, s.now)
                    assert r.now_monotonic_us and s.now_monotonic_us, (r, s)
                    assert abs(r.now_monotonic_us - s.now_monotonic_us) < 5_000_000
                elif n not in fallbacks:  # the agent's answer has them anyway
                    assert r.now_monotonic_us is None, (key, n, fallbacks)
            for n, r in slow_res.ok.items():
                slow[n + key] = _steady(to_wire(r.without_clock()))
    finally:
        monkeypatch.setattr(fast_probe, "call_agent", real)
        ctx.close()
    return fast, slow, sorted(set(fallbacks))


def _steady(report: dict) -> dict:
    """Free disk space moves between two reads (journald writes): which paths were read is compared."""
    if (report.get("checks") or {}).get("disk"):
        report["checks"]["disk"] = sorted(report["checks"]["disk"])
    xid = ((report.get("checks") or {}).get("health") or {}).get("xid")
    if xid:  # the host's clocks when each read them
        xid["now"] = xid["uptime"] = None
    return report


def assert_same(fast: dict, slow: dict) -> None:
    for name in slow:
        assert json.dumps(fast[name], sort_keys=True, indent=1) == json.dumps(slow[name], sort_keys=True, indent=1), (
            name
        )


def test_fast_probe_reports_what_the_agent_does(sb, sandbox_inventory, tmp_path, monkeypatch):
    (tmp_path / "small.txt").write_text("pushed\n")
    (tmp_path / "big.bin").write_bytes(bytes(range(256)) * 1200)  # 300 KB: past content_max
    inv = tmp_path / "inv.yaml"
    pools = {
        "chief": {"replicas": 1, "accelerators": 1, "command": LONG},
        "worker": {"replicas": 2, "accelerators": 1, "command": LONG},
        "evaluator": {"replicas": 1, "command": ["/bin/sh", "-c", "exit 0"]},
    }
    files = [
        {"src": "small.txt", "dest": "/opt/probe-test/small.txt"},
        {"src": "big.bin", "dest": "/opt/probe-test/big.bin"},
        {"src": "small.txt", "dest": "/opt/probe-test/fifo.txt"},
    ]
    sandbox_inventory(sb, job="probe", pools=pools, path=inv, files=files)

    # Nothing there yet.
    fast, slow, fell_back = both(inv, monkeypatch=monkeypatch)
    assert fell_back == []
    assert_same(fast, slow)
    assert all(r["manifest"] is None and (k.endswith("+status") or r["facts"]["gpus"]) for k, r in fast.items())
    # The programs of the tasks about to start: looked at, not hashed (programs.py).
    sh_info = fast["host-1"]["files"]["/bin/sh"]
    assert sh_info["type"] in ("file", "symlink") and sh_info.get("sha256") is None

    # Applied and running; the evaluator has exited (exit records).
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    fast, slow, fell_back = both(inv, monkeypatch=monkeypatch)
    assert fell_back == []
    assert_same(fast, slow)
    big = fast["host-1"]["files"]["/opt/probe-test/big.bin"]
    assert big["type"] == "file" and big["size"] == 307200 and big["content"] is None
    assert any(any(v for v in r["exits"].values()) for r in fast.values()), "the evaluator's exit is recorded"
    held = fast["host-1+tenancy"]["ledger"]["probe"]
    assert held["started"] is True and held["gpus"] == [0]

    # Another job's ledger entry (one unit there, one gone) and a listener provision did not start.
    other = {"job": "other", "units": ["provision-probe-chief-0.service", "provision-other-gone.service"], "gpus": [1]}
    sh(sb, "host-1", f"echo '{json.dumps(other)}' > /var/lib/provision/.ledger/other.json", check=True)
    # ... with its runs and end marker (the service's rounds tell its end from them).
    sh(
        sb,
        "host-1",
        "mkdir -p /var/lib/provision/other /etc/provision/other && "
        """echo '[{"run": 2, "at": 1.5, "by": "ana"}]' > /var/lib/provision/other/runs.json && """
        """echo '{"phase": "Stopped", "reason": "by ana"}' > /etc/provision/other/lifecycle.json && """
        "echo '1796164694 success exited 0' > /var/lib/provision/other/gone.exits",
        check=True,
    )
    # ... a health record, an Xid since the last look, a throttled GPU (host/health.py's read).
    rec = {"gpus": {"1": {"state": "quarantined", "reason": "Xid 79", "since": 1.5, "by": "ana"}}}
    sh(sb, "host-1", f"echo '{json.dumps(rec)}' > {layout.HEALTH_PATH} && echo 1700000000.25 > {layout.XID_AFTER_PATH} && "
       f"echo '1800000000.5 h kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus.' > {layout.SANDBOX_KMSG} "
       "&& echo '0 hw_slowdown' > /etc/provision-sandbox/throttle", check=True)  # fmt: skip
    sh(sb, "host-1", "systemd-run --unit probe-listener python3 -m http.server 2290", check=True)
    # ... on a port of the job's (the checks name the process), whose pid is busy on a GPU too.
    sh(sb, "host-1", "systemd-run --unit probe-listener2 python3 -m http.server 2222", check=True)
    sh(
        sb,
        "host-1",
        "for i in $(seq 50); do grep -qi ':08AE [0:]* 0A' /proc/net/tcp && exit 0; sleep 0.1; done",
        check=True,
    )
    pid = sh(sb, "host-1", "systemctl show -p MainPID --value probe-listener2", check=True).strip()
    sh(sb, "host-1", f"echo '0 {pid} python3 10' > /etc/provision-sandbox/busy-gpus", check=True)
    sh(
        sb,
        "host-1",
        "for i in $(seq 50); do grep -qi ':08F2 ' /proc/net/tcp && exit 0; sleep 0.1; done; exit 1",
        check=True,
    )
    fast, slow, fell_back = both(inv, monkeypatch=monkeypatch)
    sh(
        sb,
        "host-1",
        "systemctl stop probe-listener probe-listener2; rm -r /var/lib/provision/.ledger/other.json "
        "/var/lib/provision/other /etc/provision/other",
        check=True,
    )
    sh(sb, "host-1", "rm /etc/provision-sandbox/busy-gpus", check=True)
    sh(sb, "host-1", f"rm {layout.HEALTH_PATH} {layout.XID_AFTER_PATH} {layout.SANDBOX_KMSG} /etc/provision-sandbox/throttle",
       check=True)  # fmt: skip
    assert fell_back == []
    assert_same(fast, slow)
    h1 = fast["host-1+health"]
    assert h1["health"] == rec and fast["host-2+health"]["health"] == {}
    read = h1["checks"]["health"]
    assert read["xid"]["source"] == "file" and read["xid"]["after"] == 1700000000.25 and len(read["xid"]["lines"]) == 1
    assert read["gpus"][0]["throttle"] == 0x8 and read["dcgm"]["code"] == 127  # the stand-in: DCGM not installed
    t1 = fast["host-1+tenancy"]
    assert sorted(t1["ledger"]) == ["other", "probe"] and 2290 in t1["listening"] and 22 in t1["listening"]
    assert t1["ledger_units"]["provision-probe-chief-0.service"]["ActiveState"] in ("active", "inactive")
    assert t1["ledger_units"]["provision-other-gone.service"]["LoadState"] == "not-found"
    assert t1["ledger_records"]["other"] == {
        "runs": [{"run": 2, "at": 1.5, "by": "ana"}],
        "lifecycle": {"phase": "Stopped", "reason": "by ana"},
        "exits": {"provision-other-gone.service": [["1796164694", "success", "exited", "0"]]},
    }
    c1 = fast["host-1+checks"]["checks"]
    assert [o["unit"] for o in c1["ports"]["2222"]] == ["probe-listener2.service"]  # chief-0's port
    assert [a["owner"]["unit"] for a in c1["gpus"]["apps"]] == ["probe-listener2.service"]
    assert fast["host-1+checks"]["interface"]["name"] == "eth0"

    # Drift of every kind on host-1, a stopped unit and odd things in the way.
    job_dir = "/etc/provision/probe"
    sh(sb, "host-1", f"for f in {job_dir}/*.env; do echo EXTRA=1 >> $f; done", check=True)
    sh(sb, "host-1", "chmod 0644 /etc/systemd/system/provision-probe.target", check=True)
    sh(sb, "host-1", "rm /opt/probe-test/small.txt && mkdir /opt/probe-test/small.txt", check=True)
    sh(sb, "host-1", "rm /opt/probe-test/big.bin && ln -s /etc/hostname /opt/probe-test/big.bin", check=True)
    sh(sb, "host-1", "rm /opt/probe-test/fifo.txt && mkfifo /opt/probe-test/fifo.txt", check=True)
    sh(
        sb,
        "host-2",
        "rm -f /etc/systemd/system/provision-probe-*.service; systemctl stop 'provision-probe-*'",
        check=True,
    )
    sh(sb, "host-2", f"echo '{{\"ended\": true}}' > {job_dir}/lifecycle.json", check=True)
    fast, slow, fell_back = both(inv, monkeypatch=monkeypatch)
    assert fell_back == []
    assert_same(fast, slow)
    env = next(v for p, v in fast["host-1"]["files"].items() if p.endswith(".env"))
    assert env["content"] is not None  # edited: the diff has the host's text
    assert fast["host-1"]["files"]["/opt/probe-test/fifo.txt"]["type"] == "other"
    assert fast["host-2"]["lifecycle"] == {"ended": True}

    # nvidia-smi missing on host-1 (the script answers), failing on host-2 (the agent does).
    sh(sb, "host-1", "mv /usr/bin/nvidia-smi /usr/bin/nvidia-smi.away", check=True)
    sh(sb, "host-2", "echo 0 > /etc/provision-sandbox/gpus", check=True)
    try:
        fast, slow, fell_back = both(inv, monkeypatch=monkeypatch)
    finally:
        sh(sb, "host-1", "mv /usr/bin/nvidia-smi.away /usr/bin/nvidia-smi", check=True)
        sh(sb, "host-2", "echo 2 > /etc/provision-sandbox/gpus", check=True)
    assert fell_back == ["host-2"]
    assert_same(fast, slow)
    assert fast["host-1"]["facts"]["nvidia_smi"] == "missing"

    # Local state lost, and the inventory shrank: the hosts' manifests name tasks the
    # controller no longer knows of, so the agent answers for those hosts.
    pools["worker"]["replicas"] = 1
    sandbox_inventory(sb, job="probe", pools=pools, path=inv, files=files)
    fast, slow, fell_back = both(inv, state=tmp_path / "elsewhere.state.json", monkeypatch=monkeypatch)
    assert fell_back
    assert_same(fast, slow)

    cli("destroy", "-y", inv, cwd=tmp_path)


def test_fast_probe_gives_way_to_the_agent_for_what_it_cannot_say():
    # Full facts, and names a shell word could not carry as they are.
    assert fast_probe.command(ProbeRequest("j", facts="all")) is None
    assert fast_probe.command(ProbeRequest("j", paths=["/opt/a b"])) is None
    assert fast_probe.command(ProbeRequest("j", units=["a;b.service"])) is None
    cmd = fast_probe.command(
        ProbeRequest("j", facts="check", facts_only=["gpus"], units=["provision-j-chief-0.service"])
    )
    assert cmd is not None and "nvidia-smi" in cmd
