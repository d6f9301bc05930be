"""GPU and host health on sandbox hosts, each signal injected for real through the stand-ins
(the image's nvidia-smi and dcgmi read their faults from /etc/provision-sandbox/; the kernel
messages the health read takes are /etc/provision-sandbox/kmsg there, never this machine's
kernel log): what `provision health`, `check`, `status` and `facts` say of each; a fatal Xid
on a held GPU quarantined by the service within a round, its owner told (status, jobs, the
events, the dashboard, the history); no new work placed there, the host refusing it even
when the controller did not know; a release only after a passing test; a flood of Xid lines
one incident."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clirun import cli, ok, output_until, sh, wait_until
from provision.host import layout
from webserve import ask

from .servehelp import Service, service_env, show_logs

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]
FAULTS = "/etc/provision-sandbox"
HOSTS = ("host-1", "host-2")


@pytest.fixture(scope="module")
def sb(sandbox_factory):
    sb = sandbox_factory(hosts=2, gpus_per_host=2)
    yield sb
    sandbox_factory.down(sb)


@pytest.fixture
def clean(sb):
    """Every fault, the kernel file and the health record gone from both hosts, after the test."""
    yield
    for h in HOSTS:
        sh(sb, h, f"cd {FAULTS} && rm -f kmsg nvidia-smi-hang missing-gpus lost-gpus ecc-errors remap-pending "
                  "remap-failed throttle pcie legacy-driver dcgm dcgm-health dcgm-diag-fail dcgm-diag-seconds; "
                  f"rm -f {layout.HEALTH_PATH} {layout.XID_AFTER_PATH}")  # fmt: skip


def pci(sb, host: str, gpu: int) -> str:
    """The GPU's PCI address as the driver's Xid lines name it (0000:18:00)."""
    out = sh(sb, host, "nvidia-smi --query-gpu=index,pci.bus_id --format=csv,noheader", check=True)
    bus = dict(line.split(", ") for line in out.strip().splitlines())[str(gpu)]
    return "0000:" + bus.split(":", 1)[1][:5].lower()


def xid(sb, host: str, gpu: int, code: int = 79, words: str = "GPU has fallen off the bus.") -> str:
    """An Xid for the GPU in the host's kernel messages (as the sandbox's probe reads them), at its clock."""
    line = f"NVRM: Xid (PCI:{pci(sb, host, gpu)}): {code}, pid=4242, name=python3, {words}"
    sh(sb, host, f'echo "$(date +%s.%N | cut -c1-17) {host} kernel: {line}" >> {FAULTS}/kmsg', check=True)
    return line


def record(sb, host: str) -> dict:
    out = sh(sb, host, f"cat {layout.HEALTH_PATH} 2>/dev/null || echo {{}}")
    return json.loads(out)


def looked(inv: Path, *, env: dict | None = None) -> dict:
    r = cli("health", "--json", inv, cwd=inv.parent, env=env)
    assert r.returncode in (0, 3), r.stdout + r.stderr
    return json.loads(r.stdout)


def signals(doc: dict, host: str) -> list[tuple]:
    h = next(x for x in doc["hosts"] if x["host"] == host)
    return [(s["gpu"], s["level"]) for s in h["signals"]]


def gpu_of(doc: dict, host: str, gpu: int) -> dict:
    return next(g for g in doc["gpus"] if g["host"] == host and g["gpu"] == gpu)


@pytest.fixture
def job(sb, sandbox_inventory, tmp_path):
    """chief-0 on host-1, GPU 0, applied and running; destroyed after."""
    inv = tmp_path / "inv.yaml"
    pools = {"chief": {"replicas": 1, "accelerators": 1, "command": LONG, "hosts": ["host-1"]}}
    sandbox_inventory(sb, job="hl", pools=pools, path=inv)
    ok(cli("apply", "-y", inv, cwd=tmp_path, env={"PROVISION_OWNER": "ann@example.com"}))
    yield inv
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_each_signal_is_read_through_the_stand_ins(sb, job, clean, sandbox_inventory, tmp_path):
    assert signals(looked(job), "host-1") == []  # a healthy host says nothing
    cases = [
        (lambda: xid(sb, "host-1", 0), [(0, "fatal")]),
        (lambda: xid(sb, "host-1", 1, 13, "Graphics SM Warp Exception"), [(1, "program")]),
        (lambda: xid(sb, "host-1", 1, 8, "timeout"), [(1, "warn")]),
        (lambda: sh(sb, "host-1", f"echo '1 2' > {FAULTS}/ecc-errors"), [(1, "fatal")]),
        (lambda: sh(sb, "host-1", f"echo 0 > {FAULTS}/remap-failed"), [(0, "fatal")]),
        (lambda: sh(sb, "host-1", f"echo 1 > {FAULTS}/remap-pending"), [(1, "warn"), (1, "warn")]),
        (lambda: sh(sb, "host-1", f"echo 1 > {FAULTS}/missing-gpus"), [(None, "fatal")]),
        (lambda: sh(sb, "host-1", f"echo 1 > {FAULTS}/lost-gpus"), [(None, "fatal")]),
        (lambda: sh(sb, "host-1", f"echo 30 > {FAULTS}/nvidia-smi-hang"), [(None, "fatal")]),
        (lambda: sh(sb, "host-1", f"echo '0 power_brake hw_thermal' > {FAULTS}/throttle"), [(0, "warn")]),
        (
            lambda: sh(sb, "host-1", f"echo '1 power_brake' > {FAULTS}/throttle; touch {FAULTS}/legacy-driver"),
            [(1, "warn")],
        ),
        (lambda: sh(sb, "host-1", f"echo '1 5 8' > {FAULTS}/pcie"), [(1, "warn")]),
        (
            lambda: sh(
                sb, "host-1", f"touch {FAULTS}/dcgm; echo '0 Failure NVLink: a fatal error' > {FAULTS}/dcgm-health"
            ),
            [(0, "fatal")],
        ),  # fmt: skip
    ]
    quick = {"PROVISION_CHECK_GPU_TIMEOUT": "3"}  # the hang's bound
    for i, (inject, want) in enumerate(cases):
        inject()
        t0 = time.monotonic()
        doc = looked(job, env=quick)
        assert signals(doc, "host-1") == want, (i, doc["hosts"][0])
        assert signals(doc, "host-2") == [], i
        assert time.monotonic() - t0 < 60, i  # a hang is bounded
        sh(sb, "host-1", f"cd {FAULTS} && rm -f kmsg nvidia-smi-hang missing-gpus lost-gpus ecc-errors "
                         "remap-pending remap-failed throttle pcie legacy-driver dcgm dcgm-health", check=True)  # fmt: skip
    # The file system of outputs: nearly full (a 64 MiB /dev/shm) is the host's warning.
    out = tmp_path / "out.yaml"
    sandbox_inventory(sb, job="hlout", pools={"chief": {"replicas": 1, "command": LONG}}, path=out,
                      outputs="/dev/shm/runs")  # fmt: skip
    assert (None, "warn") in signals(looked(out), "host-1")


def test_check_status_and_facts_read_the_signals_too(sb, job, clean):
    line = xid(sb, "host-1", 0)
    r = cli("check", "--json", job, cwd=job.parent)
    assert r.returncode == 1, r.stdout + r.stderr
    found = [c for c in json.loads(r.stdout)["hosts"]["host-1"]["checks"] if c["check"] == "gpu signals"]
    assert found and found[0]["status"] == "fail" and line in found[0]["detail"], found
    st = json.loads(ok(cli("status", "--json", job, cwd=job.parent)).stdout)
    assert any("chief-0: GPU 0 of host-1 now: Xid 79" in n for n in st["health"]), st["health"]
    r = cli("facts", "--json", job, cwd=job.parent)
    assert (
        r.returncode == 1
        and "GPU 0: Xid 79: GPU has fallen off the bus" in json.loads(r.stdout)["hosts"]["host-1"]["problems"]
    )


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_fatal_xid_on_a_held_gpu_is_quarantined_its_owner_told_and_it_proves_itself(
    sb, job, clean, tmp_path, sandbox_inventory
):
    env = service_env(tmp_path / "svc")
    port = _port()
    svc = Service(tmp_path / "svc", env, ("--listen", f"127.0.0.1:{port}", "--inventory", str(job)))
    svc.start()
    try:
        # A page is looking: rounds every 10 s (the service's period while someone looks).
        wait_until(lambda: "host-1" in ask(port, "GET", "/api/v1/hosts").text, timeout=90, what="a first round")
        line = xid(sb, "host-1", 0)
        t0 = time.monotonic()
        wait_until(lambda: ask(port, "GET", "/api/v1/health").status == 200
                   and record(sb, "host-1").get("gpus", {}).get("0", {}).get("state") == "quarantined",
                   timeout=120, every=0.5, what="GPU 0 of host-1 quarantined")  # fmt: skip
        took = time.monotonic() - t0
        mark = record(sb, "host-1")["gpus"]["0"]
        assert mark["evidence"].endswith(line) and mark["job"] == "hl" and mark["owner"] == "ann@example.com"
        assert mark["by"].startswith("provision serve (") and "Xid 79" in mark["reason"]
        print(f"quarantined {took:.1f} s after the Xid")

        # Its owner is told: status, jobs, the events, the dashboard, the history.
        st = json.loads(ok(cli("status", "--json", job, cwd=job.parent)).stdout)
        assert any("chief-0: GPU 0 of host-1 is quarantined" in n for n in st["health"]), st["health"]
        assert st["phase"] == "Running"  # what runs goes on: recovering it is its owner's (or a later helper's)
        jobs = json.loads(ok(cli("jobs", "--json", job, cwd=job.parent)).stdout)
        assert jobs["hosts"]["host-1"]["health"]["gpus"]["0"]["state"] == "quarantined"
        assert 0 not in jobs["hosts"]["host-1"]["free_gpus"]
        wait_until(lambda: _kinds(job, env).count("gpu.quarantined") == 1, timeout=60, what="the event")
        ev = [e for e in _events(job, env) if e["kind"] == "gpu.quarantined"][0]
        assert (ev["job"], ev["owner"], ev["host"]) == ("hl", "ann@example.com", "host-1") and "GPU 0 of host-1" in ev[
            "words"
        ]
        hosts = json.loads(ask(port, "GET", "/api/v1/hosts").text)
        assert hosts["hosts"]["host-1"]["health"]["gpus"]["0"]["state"] == "quarantined"
        page = ask(port, "GET", "/").text
        assert 'class="health quarantined">quarantined: Xid 79' in page
        wait_until(lambda: "Xid 79" in ask(port, "GET", "/health").text, timeout=30, what="the Health page")
        rep = json.loads(ok(cli("health", "--report", "--json", cwd=tmp_path, env=env)).stdout)
        assert rep["ranked"][0]["target"] == "host-1:0" and rep["ranked"][0]["incidents"] == 1
        seen = json.loads(ok(cli("health", "--json", cwd=tmp_path, env=env)).stdout)  # as the service saw it
        assert gpu_of(seen, "host-1", 0)["state"] == "quarantined" and gpu_of(seen, "host-1", 0)["job"] == "hl"

        # No new work there: another job's task goes to GPU 1, or to host-2.
        other = tmp_path / "other.yaml"
        sandbox_inventory(sb, job="hl2", pools={"chief": {"replicas": 1, "accelerators": 1, "command": LONG,
                                                          "hosts": ["host-1"]}}, path=other)  # fmt: skip
        ok(cli("apply", "-y", other, cwd=tmp_path, env=env))
        held = json.loads(sh(sb, "host-1", f"cat {layout.ledger_path('hl2')}"))
        assert held["gpus"] == [1]
        three = tmp_path / "three.yaml"
        sandbox_inventory(sb, job="hl3", pools={"chief": {"replicas": 1, "accelerators": 1, "command": LONG,
                                                          "hosts": ["host-1"]}}, path=three)  # fmt: skip
        r = cli("apply", "-y", three, cwd=tmp_path, env=env)
        assert r.returncode == 1 and "GPU 0 is quarantined: Xid 79" in r.stderr, r.stdout + r.stderr
        cli("destroy", "-y", other, cwd=tmp_path, env=env)

        # The release asks for a test first (the policy's default): none to test with here.
        r = cli("health", "release", job, "host-1:0", cwd=tmp_path, env=env)
        assert r.returncode == 1 and "held by job hl, which runs there" in r.stderr, r.stdout + r.stderr
        ok(cli("destroy", "-y", job, cwd=tmp_path, env=env))
        r = cli("health", "release", job, "host-1:0", cwd=tmp_path, env=env)
        assert r.returncode == 1 and "not run, nothing to test with" in r.stdout, r.stdout + r.stderr
        assert record(sb, "host-1")["gpus"]["0"]["state"] == "quarantined"
        # A failing test keeps it quarantined, with the evidence.
        sh(
            sb,
            "host-1",
            f"touch {FAULTS}/dcgm; echo 0 > {FAULTS}/dcgm-diag-seconds; echo 0 > {FAULTS}/dcgm-diag-fail",
            check=True,
        )
        r = cli("health", "test", job, "host-1:0", cwd=tmp_path, env=env)
        assert r.returncode == 1 and "failed dcgmi diag -r 2: Memory: Fail - GPU: 0" in r.stdout, r.stdout + r.stderr
        assert record(sb, "host-1")["gpus"]["0"]["evidence"].startswith("Memory: Fail - GPU: 0")
        # Repaired: the test passes and releases it.
        sh(sb, "host-1", f"rm {FAULTS}/dcgm-diag-fail", check=True)
        r = ok(cli("health", "release", job, "host-1:0", cwd=tmp_path, env=env))
        assert "passed dcgmi diag -r 2 (every test passed)" in r.stdout
        assert record(sb, "host-1") == {}
        wait_until(lambda: "gpu.released" in _kinds(job, env), timeout=60, what="the released event")
        rep = json.loads(ok(cli("health", "--report", "--json", cwd=tmp_path, env=env)).stdout)
        ended = [i for i in rep["incidents"] if i["host"] == "host-1" and i["gpu"] == 0 and i["state"] == "quarantined"]
        assert ended and all(i["ended"] for i in ended)
        ok(cli("apply", "-y", three, cwd=tmp_path, env=env))  # it gets work again
        assert json.loads(sh(sb, "host-1", f"cat {layout.ledger_path('hl3')}"))["gpus"] == [0]
        cli("destroy", "-y", three, cwd=tmp_path, env=env)
    finally:
        svc.stop()
        show_logs(tmp_path / "svc")


def _events(inv: Path, env: dict) -> list[dict]:
    r = cli("events", "--json", cwd=inv.parent, env=env)
    return json.loads(r.stdout)["events"] if r.returncode == 0 else []


def _kinds(inv: Path, env: dict) -> list[str]:
    return [e["kind"] for e in _events(inv, env)]


def test_the_host_refuses_a_quarantined_gpu_the_controller_did_not_know(sb, clean, sandbox_inventory, tmp_path):
    """An apply planned before the quarantine: the host's compare-and-set refuses its
    reservation, and writes nothing."""
    inv = tmp_path / "late.yaml"
    sandbox_inventory(sb, job="hllate", pools={"chief": {"replicas": 1, "accelerators": 1, "command": LONG,
                                                         "hosts": ["host-2"]}}, path=inv)  # fmt: skip
    p = subprocess.Popen(
        [sys.executable, "-m", "provision", "apply", "-y", str(inv)], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PROVISION_TEST_PAUSE": "WRITE:15", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        said = output_until(p, "Plan: ", timeout=90)  # planned on a free GPU 0, paused before its write
        assert "gpu" not in said.lower() or "quarantine" not in said
        ok(cli("health", "quarantine", inv, "host-2:0", "--reason", "fan noise", cwd=tmp_path))
        out = said + p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0 and "GPU 0 is quarantined here (fan noise): no new work is placed on it" in out, out
    assert sh(sb, "host-2", f"test -e {layout.ledger_path('hllate')}").code != 0  # nothing was written
    # The next plan knows: it places the task on GPU 1.
    ok(cli("apply", "-y", inv, cwd=tmp_path))
    assert json.loads(sh(sb, "host-2", f"cat {layout.ledger_path('hllate')}"))["gpus"] == [1]
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_bad_input_is_one_line_and_changes_nothing(sb, job, clean, tmp_path):
    cases = [
        (("quarantine", job, "host-9:0", "--reason", "x"), "host-9:0: no host named host-9"),
        (("quarantine", job, "host-1:7", "--reason", "x"), "host-1:7: host-1 declares GPUs 0-1; nothing was changed"),
        (("quarantine", job, "host-1:x", "--reason", "x"), "'host-1:x': expected HOST or HOST:GPU"),
        (("quarantine", job, "host-1:1", "--reason", " "), "--reason: say why"),
        (("release", job, "host-1:1"), "GPU 1 of host-1 is healthy (it is not quarantined): nothing was changed"),
        (("test", job, "host-3"), "host-3: no host named host-3"),
    ]
    for args, want in cases:
        r = cli("health", *args, cwd=tmp_path)
        assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and want in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
    assert record(sb, "host-1") == {}


def test_a_flood_of_xid_lines_is_one_bounded_read_and_one_incident(sb, job, clean, tmp_path):
    env = service_env(tmp_path / "svc")
    port = _port()
    bus = pci(sb, "host-2", 1)
    # 100,000 Xid lines in a minute's worth of stamps, in the host's kernel messages.
    sh(sb, "host-2", f"awk -v t=$(date +%s) 'BEGIN {{ for (i = 0; i < 100000; i++) printf \"%d.%06d host-2 kernel: "
                     f"NVRM: Xid (PCI:{bus}): 79, pid=%d, name=python3, GPU has fallen off the bus.\\n\", t - 60 + i / 1700, "
                     f"i % 1000000, i }}' >> {FAULTS}/kmsg", check=True)  # fmt: skip
    assert sh(sb, "host-2", f"wc -l < {FAULTS}/kmsg").strip() == "100000"
    t0 = time.monotonic()
    doc = looked(job)
    read = time.monotonic() - t0
    (s,) = [x for x in next(h for h in doc["hosts"] if h["host"] == "host-2")["signals"]]
    assert s["gpu"] == 1 and "200 times (at least; the read keeps the newest lines)" in s["what"]
    print(f"a look at a host with 100,000 Xid lines: {read:.1f} s")
    svc = Service(tmp_path / "svc", env, ("--listen", f"127.0.0.1:{port}", "--inventory", str(job)))
    svc.start()
    try:
        wait_until(lambda: ask(port, "GET", "/api/v1/health").status == 200
                   and record(sb, "host-2").get("gpus", {}).get("1", {}).get("state") == "quarantined",
                   timeout=120, every=0.5, what="GPU 1 of host-2 quarantined")  # fmt: skip
        t1 = time.monotonic()
        r = ask(port, "GET", "/api/v1/events")
        assert r.status == 200 and time.monotonic() - t1 < 10  # the service answers
        # Two more rounds (each adds a point to a GPU's last hour): the flood is behind the
        # last look, and one incident it stays.
        assert float(sh(sb, "host-2", f"cat {layout.XID_AFTER_PATH}")) > 0
        seen = _points(port)
        wait_until(lambda: _points(port) >= seen + 2, timeout=120, every=1, what="two more rounds")
        kinds = _kinds(job, env)
        assert kinds.count("gpu.quarantined") == 1, kinds
        rep = json.loads(ok(cli("health", "--report", "--json", cwd=tmp_path, env=env)).stdout)
        assert [(r["target"], r["incidents"]) for r in rep["ranked"]] == [("host-2:1", 1)]
        assert signals(looked(job), "host-2") == []  # the next look reads past them
    finally:
        svc.stop()
        show_logs(tmp_path / "svc")


def _points(port: int) -> int:
    """Rounds so far, as a GPU's last hour counts them (a look: the rounds keep coming every 10 s)."""
    hosts = json.loads(ask(port, "GET", "/api/v1/hosts").text)["hosts"]
    return len((hosts.get("host-1", {}).get("gpu_history") or {}).get("0") or [])


def test_a_policy_naming_an_xid_that_is_not_a_number_is_one_line_and_changes_nothing(postgres, tmp_path):
    # A team database of its own: the policy it sets is no other test's (test_priority reads
    # the shared one's as never set).
    postgres.sql("CREATE DATABASE health_policy")
    url = postgres.url(database="health_policy")
    env = {**postgres.env(), "PROVISION_STATE": url, "PROVISION_OWNER": "ana@lab.example"}
    pol = tmp_path / "policy.yaml"
    pol.write_text("health:\n  xids: {31: fatal}\n")
    ok(cli("policy", "set", pol, cwd=tmp_path, env=env))
    before = json.loads(ok(cli("policy", "show", "--json", cwd=tmp_path, env=env)).stdout)
    assert before["health"] == {"xids": {"31": "fatal"}, "test_before_release": True}
    pol.write_text("health:\n  xids: {abc: fatal}\n")
    r = cli("policy", "set", pol, cwd=tmp_path, env=env)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"Error: {pol}:2: health.xids.abc: an Xid is a number from 1 to 1023, got 'abc'"
    ], r.stderr
    assert json.loads(ok(cli("policy", "show", "--json", cwd=tmp_path, env=env)).stdout) == before
    assert "Health: Xids changed: 31 fatal" in ok(cli("policy", "show", cwd=tmp_path, env=env)).stdout
