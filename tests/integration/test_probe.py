"""The fast probe (probe.sh) reports exactly what the Python agent's probe does, on real hosts.

plan reads hosts through the shell script and falls back to the agent when the script cannot
answer; both must give the same report in every state a host can be in, or plan would see a
different world depending on which one answered.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from provision import engine
from provision import probe as fast_probe
from provision.host.protocol import ProbeRequest, to_wire

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]


@pytest.fixture(scope="module")
def sb(sandbox_factory):
    sb = sandbox_factory(hosts=2, gpus_per_host=2)
    yield sb
    sandbox_factory.down(sb)


def sh(sb, host: str, cmd: str) -> str:
    code, out = sb.docker_exec(host, ["/bin/sh", "-c", cmd])
    assert code == 0, (cmd, out)
    return out


def both(inv: Path, state: Path | None = None, monkeypatch=None) -> tuple[dict, dict, list[str]]:
    """(fast reports, agent reports, hosts where the fast probe fell back to the agent)."""
    ctx = engine.open_context(str(inv), state_path=str(state) if state else None)
    fallbacks: list[str] = []
    real = fast_probe.call_agent

    def spy(session, target, req, **kw):
        fallbacks.append(target.name)
        return real(session, target, req, **kw)

    monkeypatch.setattr(fast_probe, "call_agent", spy)
    try:
        fast_res = engine.probe(ctx, facts="check", fast=True)
        slow_res = engine.probe(ctx, facts="check", fast=False)
    finally:
        monkeypatch.setattr(fast_probe, "call_agent", real)
        ctx.close()
    assert not fast_res.errors and not slow_res.errors, (fast_res.errors, slow_res.errors)
    # The agent's answers have the host's clocks, the script's do not.
    fast = {n: to_wire(r.without_clock()) for n, r in fast_res.ok.items()}
    slow = {n: to_wire(r.without_clock()) for n, r in slow_res.ok.items()}
    return fast, slow, sorted(fallbacks)


def assert_same(fast: dict, slow: dict) -> None:
    for name in slow:
        assert json.dumps(fast[name], sort_keys=True, indent=1) == json.dumps(slow[name], sort_keys=True, indent=1), (
            name
        )


def cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "provision", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=180
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
    assert all(r["manifest"] is None and r["facts"]["gpus"] for r in fast.values())

    # Applied and running; the evaluator has exited (exit records).
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    fast, slow, fell_back = both(inv, monkeypatch=monkeypatch)
    assert fell_back == []
    assert_same(fast, slow)
    big = fast["host-1"]["files"]["/opt/probe-test/big.bin"]
    assert big["type"] == "file" and big["size"] == 307200 and big["content"] is None
    assert any(any(v for v in r["exits"].values()) for r in fast.values()), "the evaluator's exit is recorded"

    # Drift of every kind on host-1, a stopped unit and odd things in the way.
    job_dir = "/etc/provision/probe"
    sh(sb, "host-1", f"for f in {job_dir}/*.env; do echo EXTRA=1 >> $f; done")
    sh(sb, "host-1", "chmod 0644 /etc/systemd/system/provision-probe.target")
    sh(sb, "host-1", "rm /opt/probe-test/small.txt && mkdir /opt/probe-test/small.txt")
    sh(sb, "host-1", "rm /opt/probe-test/big.bin && ln -s /etc/hostname /opt/probe-test/big.bin")
    sh(sb, "host-1", "rm /opt/probe-test/fifo.txt && mkfifo /opt/probe-test/fifo.txt")
    sh(sb, "host-2", "rm -f /etc/systemd/system/provision-probe-*.service; systemctl stop 'provision-probe-*'")
    sh(sb, "host-2", f"echo '{{\"ended\": true}}' > {job_dir}/lifecycle.json")
    fast, slow, fell_back = both(inv, monkeypatch=monkeypatch)
    assert fell_back == []
    assert_same(fast, slow)
    env = next(v for p, v in fast["host-1"]["files"].items() if p.endswith(".env"))
    assert env["content"] is not None  # edited: the diff has the host's text
    assert fast["host-1"]["files"]["/opt/probe-test/fifo.txt"]["type"] == "other"
    assert fast["host-2"]["lifecycle"] == {"ended": True}

    # nvidia-smi missing on host-1 (the script answers), failing on host-2 (the agent does).
    sh(sb, "host-1", "mv /usr/bin/nvidia-smi /usr/bin/nvidia-smi.away")
    sh(sb, "host-2", "echo 0 > /etc/provision-sandbox/gpus")
    try:
        fast, slow, fell_back = both(inv, monkeypatch=monkeypatch)
    finally:
        sh(sb, "host-1", "mv /usr/bin/nvidia-smi.away /usr/bin/nvidia-smi")
        sh(sb, "host-2", "echo 2 > /etc/provision-sandbox/gpus")
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
