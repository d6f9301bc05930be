"""`provision dev` on sandbox hosts (2 hosts of 2 stand-in GPUs): a session reached by
OpenSSH's own `ssh` through the config provision wrote, its variables there, `jobs` and
`--list` showing it, `--extend` and `--stop`; bad input refused in one line with nothing
left reserved; JupyterLab (a stand-in) through the forwarded port; the service ending an
idle session after its warning and never a busy or logged-in one for idleness (test knobs
for short windows), its hours' end warned on the logged-in terminal, the dashboard and
the history showing it; a higher-priority job preempting a session with a warning; and
an image's session through a `docker` stand-in.

OpenSSH reads ~/.ssh/config from the passwd entry's home, not $HOME: each test's ssh gets
`-F $HOME/.ssh/config`, the user's own file with the Include line provision added, so
what runs is what the user's `ssh provision-dev-NAME` runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from clirun import cli, ok, sh, wait_until

pytestmark = pytest.mark.integration

OWNER = "ana@lab.example"
SLEEP = ["/bin/sh", "-c", "exec sleep 600"]
# The service's test knobs: a session's idle time, and its warning's lead. Longer than a quiet
# minute of rounds: the service sees a new session at its next round (60 s while nothing is
# due), as with a real hour's idle time.
IDLE_S, WARN_S = 60, 20


@pytest.fixture(scope="module")
def hosts(sandbox_factory):
    sb = sandbox_factory(hosts=2, gpus_per_host=2)
    yield sb
    sandbox_factory.down(sb)


@pytest.fixture
def team(hosts, sandbox_inventory, tmp_path) -> Path:
    inv = tmp_path / "team.yaml"
    pools = {"chief": {"replicas": 1, "accelerators": 1, "command": SLEEP}}
    sandbox_inventory(hosts, job="team", pools=pools, path=inv, env={"TEAM_VAR": "the team's"})
    return inv


@pytest.fixture
def home(tmp_path) -> Path:
    h = tmp_path / "home"
    (h / ".ssh").mkdir(parents=True, mode=0o700)
    (h / ".ssh" / "config").write_text("Host *\n  ServerAliveInterval 45\n")
    return h


def env_of(home: Path, **more: str) -> dict[str, str]:
    return {
        "HOME": str(home),
        "PROVISION_OWNER": OWNER,
        "PROVISION_SERVICE_DB": str(home.parent / "svc.sqlite"),
        **more,
    }


def dev(team: Path, home: Path, *args: str, **more: str) -> subprocess.CompletedProcess:
    return cli("dev", team, *args, cwd=team.parent, env=env_of(home, **more))


def ssh(home: Path, name: str, command: str, *more: str, timeout: float = 60) -> subprocess.CompletedProcess:
    argv = ["ssh", "-F", str(home / ".ssh" / "config"), "-o", "BatchMode=yes", *more, f"provision-dev-{name}", command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, "HOME": str(home)})


def logged_in(home: Path, name: str, out: Path, seconds: int = 300) -> subprocess.Popen:
    """A login with a terminal (ssh -tt), its output in `out`, open until killed."""
    argv = ["ssh", "-F", str(home / ".ssh" / "config"), "-o", "BatchMode=yes", "-tt", f"provision-dev-{name}"]
    f = open(out, "wb")  # noqa: SIM115 - the process writes it until it ends
    return subprocess.Popen([*argv, f"sleep {seconds}"], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.PIPE)


def listed(team: Path, home: Path) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads(ok(dev(team, home, "--list", "--json")).stdout)["sessions"]}


def jobs(team: Path, home: Path) -> dict:
    return json.loads(ok(cli("jobs", "--json", team, cwd=team.parent, env=env_of(home))).stdout)


def stop_all(team: Path, home: Path, *names: str) -> None:
    for n in names:
        dev(team, home, "--stop", n)


# --------------------------------------------------------------------------- reached, listed, extended, stopped


def test_a_session_is_reached_by_openssh_through_the_written_config(team, home, hosts):
    t0 = time.monotonic()
    r = ok(dev(team, home, "--gpus", "1", "--name", "nb"))
    line = r.stdout.strip()
    assert len(r.stdout.splitlines()) == 1 and line.startswith("ssh provision-dev-nb    # dev session nb: GPU "), (
        r.stdout
    )
    try:
        got = ssh(home, "nb", "nvidia-smi -L && env")
        took = time.monotonic() - t0
        assert got.returncode == 0, got.stdout + got.stderr
        env = dict(x.split("=", 1) for x in got.stdout.splitlines() if "=" in x and not x.startswith("GPU "))
        assert env["CUDA_VISIBLE_DEVICES"] in ("0", "1") and env["PROVISION_DEV"] == "nb"
        assert env["PROVISION_JOB"].startswith("dev-ana-") and env["TEAM_VAR"] == "the team's"
        print(f"provision dev to a working ssh nvidia-smi: {took:.1f} s")  # bench/dev_start.py measures it
        config = (home / ".ssh" / "config").read_text()
        assert config == f"Include {home / '.ssh' / 'provision' / 'config'}\nHost *\n  ServerAliveInterval 45\n"

        view = {j["job"]: j for j in jobs(team, home)["jobs"]}
        (job,) = [j for j in view.values() if j["dev"]]
        assert job["job"] == env["PROVISION_JOB"] and job["dev"]["name"] == "nb" and job["preemptible"]
        assert job["owner"] == OWNER and job["state"] == "running"
        text = ok(cli("jobs", team, cwd=team.parent, env=env_of(home))).stdout
        assert "running (dev session nb)" in text

        s = listed(team, home)["nb"]
        assert s["yours"] and s["logins"] == [] and s["ssh"] == "provision-dev-nb" and s["state"] == "running"
        login = logged_in(home, "nb", home.parent / "tty.out")
        try:
            wait_until(lambda: listed(team, home)["nb"]["logins"], timeout=60, what="the login in --list")
            assert re.fullmatch(r"root@pts/\d+", listed(team, home)["nb"]["logins"][0])
            _probe_agrees(team, s["host"])
        finally:
            login.kill()
            login.wait()
        r = ok(dev(team, home, "--extend", "2h", "nb"))
        assert r.stdout.startswith("Dev session nb now ends at ")
        assert abs(listed(team, home)["nb"]["until"] - s["until"] - 7200) < 5
    finally:
        r = dev(team, home, "--stop", "nb")
    assert r.returncode == 0 and r.stdout.startswith("Dev session nb ended and removed ("), r.stdout + r.stderr
    assert "provision-dev-nb" not in (home / ".ssh" / "provision" / "config").read_text()
    assert jobs(team, home)["jobs"] == []


def _probe_agrees(team: Path, host: str) -> None:
    """The shell probe (its own answer, not the agent's fallback) and the agent read the
    same logins."""
    from provision.host.protocol import ProbeRequest
    from provision.io.probe import command, parse
    from provision.io.ssh import call_agent
    from provision.run.context import open_context

    ctx = open_context(str(team), render_secrets=False)
    try:
        req = ProbeRequest("team", files=False, tenancy=True, listening=False, logins=True, content_max=1 << 18)
        res = ctx.session.run(ctx.targets[host], command(req) or "false", timeout=60)
        fast, agent = parse(res.stdout, req), call_agent(ctx.session, ctx.targets[host], req)
    finally:
        ctx.close()
    assert fast.logins and fast.logins == agent.logins


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_one_line_and_leaves_nothing_reserved(team, home, hosts, tmp_path):
    def one_line(r: subprocess.CompletedProcess, text: str) -> None:
        assert r.returncode == 1, r.stdout + r.stderr
        errors = [x for x in r.stderr.splitlines() if x.startswith("Error: ")]
        assert len(errors) == 1 and text in errors[0] and "Traceback" not in r.stderr, r.stderr

    one_line(dev(team, home, "--gpus", "3"), "--gpus 3: no host has 3 GPUs (they have: host-1 2, host-2 2)")
    try:
        ok(dev(team, home, "--name", "a"))
        ok(dev(team, home, "--name", "b", "--gpus", "2"))  # the other host, whole
        free = {n: len(h["free_gpus"]) for n, h in jobs(team, home)["hosts"].items()}
        assert sorted(free.values()) == [0, 1]
        where = ", ".join(f"{n} {k}" for n, k in sorted(free.items()))
        one_line(
            dev(team, home, "--gpus", "2", "--name", "c"), f"--gpus 2: no host has 2 GPUs free (free now: {where})"
        )
        one_line(dev(team, home, "--name", "a"), "--name a: your session a already runs")
        one_line(
            dev(team, home, "--name", "jl", "--jupyter"),
            "JupyterLab is not installed (no jupyter-lab on PATH); nothing was left reserved",
        )
        assert sorted(j["dev"]["name"] for j in jobs(team, home)["jobs"]) == ["a", "b"]  # nothing else held

        dev(team, home, "--stop", "b")
        other = tmp_path / "other-home"
        (other / ".ssh" / "config").mkdir(parents=True)  # a config that cannot be written
        r = ok(dev(team, other, "--name", "ro"))
        assert r.stdout.startswith("Dev session ro is up (GPU ") and "cannot add the Include line" in r.stdout
        by_hand = r.stdout.strip().split("connect with: ", 1)[1]
        got = subprocess.run(
            [*shlex.split(by_hand), "-o", "BatchMode=yes", "echo CUDA=$CUDA_VISIBLE_DEVICES"],
            capture_output=True, text=True, timeout=60, env={**os.environ, "HOME": str(other)},
        )  # fmt: skip
        assert got.returncode == 0 and re.fullmatch(r"CUDA=[01]\n", got.stdout), got.stdout + got.stderr
    finally:
        stop_all(team, home, "a", "b", "ro")


# --------------------------------------------------------------------------- JupyterLab

JUPYTER = r"""#!/usr/bin/python3
# provision test stand-in for JupyterLab: answers on --ip:--port, only with ?token=
import http.server, sys
a = dict(w[2:].split("=", 1) for w in sys.argv[1:] if "=" in w)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        good = "token=" + a["ServerApp.token"] in self.path
        self.send_response(200 if good else 403)
        self.end_headers()
        self.wfile.write(b"jupyter stand-in" if good else b"no")
http.server.HTTPServer((a["ip"], int(a["port"])), H).serve_forever()
"""


def test_jupyterlab_through_the_forwarded_port(team, home, hosts):
    for h in ("host-1", "host-2"):
        sh(
            hosts,
            h,
            f"cat > /usr/local/bin/jupyter-lab <<'EOF'\n{JUPYTER}EOF\nchmod 755 /usr/local/bin/jupyter-lab",
            check=True,
        )
    tunnel = None
    try:
        r = ok(dev(team, home, "--name", "jl", "--jupyter"))
        first, second = r.stdout.strip().splitlines()
        assert first.startswith("ssh provision-dev-jl")
        m = re.fullmatch(
            r"JupyterLab: ssh -N -L (\d+):127\.0\.0\.1:(\d+) provision-dev-jl, then (http://127\.0\.0\.1:\d+/lab\?token=\w+)",
            second,
        )
        assert m, second
        tunnel = subprocess.Popen(
            ["ssh", "-F", str(home / ".ssh" / "config"), "-o", "BatchMode=yes", "-N", "-L", f"{m[1]}:127.0.0.1:{m[2]}", "provision-dev-jl"],
            env={**os.environ, "HOME": str(home)},
        )  # fmt: skip

        def page() -> str | None:
            try:
                with urllib.request.urlopen(m[3], timeout=5) as resp:
                    return str(resp.read().decode())
            except OSError:
                return None

        assert wait_until(page, timeout=60, what="JupyterLab through the tunnel") == "jupyter stand-in"
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(m[3].split("?")[0], timeout=5)  # no token: refused
    finally:
        if tunnel is not None:
            tunnel.kill()
            tunnel.wait()
        stop_all(team, home, "jl")
        for h in ("host-1", "host-2"):
            sh(hosts, h, "rm -f /usr/local/bin/jupyter-lab")


# --------------------------------------------------------------------------- the service


class Served:
    """`provision serve --inventory TEAM` with the dev knobs, its dashboard on loopback."""

    def __init__(self, team: Path, home: Path):
        self.log = home.parent / "serve.log"
        knobs = {"PROVISION_TEST_DEV_IDLE_S": str(IDLE_S), "PROVISION_TEST_DEV_WARN_S": str(WARN_S)}
        with open(self.log, "wb") as out:
            self.p = subprocess.Popen(
                [sys.executable, "-m", "provision", "serve", "--poll", "0.5", "--listen", "127.0.0.1:0", "--inventory", str(team)],
                cwd=team.parent, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env_of(home, **knobs)},
            )  # fmt: skip
        m = wait_until(lambda: re.search(r"Dashboard on http://127\.0\.0\.1:(\d+)/", self.text()), what="the dashboard")
        self.port = int(m[1])
        wait_until(lambda: "leading" in self.text(), what="the service to lead")
        # Its first round done (the GPU samples it stored): what starts after is its to see start.
        from provision.io.servicestore import ServiceStore

        store = ServiceStore.open_local(home.parent / "svc.sqlite")
        try:
            wait_until(lambda: store.gpu_round_times(0), timeout=120, what="the service's first round")
        finally:
            store.close()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def page(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as resp:
            return str(resp.read().decode())

    def stop(self) -> None:
        self.p.terminate()
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()


def events(team: Path, home: Path, kind: str) -> list[dict]:
    r = ok(cli("events", "--kind", kind, "--json", cwd=team.parent, env=env_of(home)))
    return json.loads(r.stdout)["events"]


def test_the_service_ends_an_idle_session_after_its_warning_and_never_a_busy_or_logged_in_one(team, home, hosts):
    svc = Served(team, home)
    login = None
    try:
        for name in ("idle", "busy"):
            ok(dev(team, home, "--name", name))
        ok(dev(team, home, "--name", "here", "--hours", "0.03"))  # 108 s, logged in throughout
        s = listed(team, home)
        b = s["busy"]
        sh(hosts, b["host"], f"printf '{b['gpus'][0]} 60\\n' > /etc/provision-sandbox/utilization", check=True)
        login = logged_in(home, "here", home.parent / "here.tty")
        wait_until(lambda: listed(team, home)["here"]["logins"], timeout=60, what="the login to `here`")

        def job_ended(name: str) -> dict | None:
            return next((e for e in events(team, home, "job.ended") if e["job"] == s[name]["job"]), None)

        limit = s["idle"]["since"] + IDLE_S
        idle_gpu, idle_host = s["idle"]["gpus"][0], s["idle"]["host"]
        wait_until(
            lambda: idle_gpu in jobs(team, home)["hosts"][idle_host]["free_gpus"],
            timeout=IDLE_S + 120, every=1, what="the idle session's GPU free",
        )  # fmt: skip
        freed = time.time()
        # Within a round (10 s while an end is due) of its limit, and a loaded machine's margin
        # (bench/dev_start.py measures it).
        assert freed - limit < 30, f"freed {freed - limit:.0f} s after its idle limit"
        print(f"idle session's GPUs free {freed - limit:.1f} s after its idle limit")
        ended = wait_until(lambda: job_ended("idle"), timeout=60, every=1, what="the idle session's job.ended")
        (warned,) = [e for e in events(team, home, "dev.ending") if e["job"] == s["idle"]["job"]]
        assert "dev session idle of ana@lab.example" in warned["words"] and "(idle)" in warned["words"]
        assert ended["how"] == "stopped" and "its GPUs below 5 % with nobody logged in" in ended["words"], ended

        # The logged-in one: warned on its terminal before its hours, then ended by them.
        here = wait_until(lambda: job_ended("here"), timeout=240, every=2, what="`here` ended at its hours")
        assert "are up" in here["words"] and "idle" not in here["words"], here
        tty = (home.parent / "here.tty").read_text(errors="replace")
        assert "*** provision: dev session here of ana@lab.example" in tty and "its hours" in tty, tty
        assert "this session ended: ended by the service: its 0.03 h are up" in tty, tty

        # The busy one, busy for longer than its idle time by now: never ended.
        assert time.time() - s["busy"]["since"] > IDLE_S + WARN_S
        assert job_ended("busy") is None and listed(team, home)["busy"]["state"] == "running"
        page = svc.page("/jobs")
        assert "dev session busy: until " in page and "logged in" in page
        history = json.loads(ok(cli("history", "--json", cwd=team.parent, env=env_of(home))).stdout)["events"]
        row = next(e for e in history if e["job"] == s["idle"]["job"])
        assert row["ended"] is not None and row["gpus"] == 1 and row["owner"] == OWNER
    finally:
        if login is not None:
            login.kill()
            login.wait()
        svc.stop()
        print(svc.text())
        sh(hosts, "host-1", "rm -f /etc/provision-sandbox/utilization")
        sh(hosts, "host-2", "rm -f /etc/provision-sandbox/utilization")
        stop_all(team, home, "idle", "busy", "here")


# --------------------------------------------------------------------------- preemption


def test_a_higher_priority_job_preempts_a_session_after_warning_its_terminal(
    team, home, hosts, sandbox_inventory, tmp_path
):
    urgent = tmp_path / "urgent.yaml"
    pools = {
        "chief": {"replicas": 1, "accelerators": 2, "command": SLEEP},
        "worker": {"replicas": 1, "accelerators": 2, "command": SLEEP},
    }
    sandbox_inventory(hosts, job="urgent", pools=pools, path=urgent, priority="high")
    bob = env_of(home, PROVISION_OWNER="bob@lab.example")
    ok(dev(team, home, "--name", "pre"))
    login = logged_in(home, "pre", tmp_path / "pre.tty")
    apply = None
    try:
        wait_until(lambda: listed(team, home)["pre"]["logins"], timeout=60, what="the login")
        apply = subprocess.Popen(
            [sys.executable, "-m", "provision", "apply", "-y", str(urgent)],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **bob},
        )  # fmt: skip
        wait_until(lambda: "preempted by job urgent (bob@lab.example)" in (tmp_path / "pre.tty").read_text(errors="replace"),
                   timeout=120, what="the warning on the session's terminal")  # fmt: skip
        assert "save your work" in (tmp_path / "pre.tty").read_text(errors="replace")
        login.kill()  # the person leaves: the session ends before its grace does
        login.wait()
        out, _ = apply.communicate(timeout=240)
        assert apply.returncode == 0, out
        assert "preempted job dev-ana-" in out and "(lower priority)" in out, out
        assert listed(team, home)["pre"]["state"] == "preempted by urgent"
    finally:
        if login.poll() is None:
            login.kill()
        if apply is not None and apply.poll() is None:
            apply.kill()
        cli("destroy", "-y", urgent, cwd=tmp_path, env=bob)
        stop_all(team, home, "pre")


# --------------------------------------------------------------------------- an image

DOCKER = r"""#!/bin/sh
# provision test stand-in for /usr/bin/docker: records each call; `exec` runs the command here
echo "$*" >> /var/tmp/docker-standin.log
case "$1" in
    exec) shift; while [ "$1" = -i ] || [ "$1" = -t ] || [ "$1" = -e ]; do [ "$1" = -e ] && shift; shift; done
          shift; exec "$@" ;;
    run) echo 0123456789ab ;;
esac
exit 0
"""


def test_an_images_session_holds_the_gpus_in_a_container_and_logins_enter_it(hosts, sandbox_inventory, home, tmp_path):
    one = tmp_path / "one.yaml"
    sandbox_inventory(hosts, job="team", pools={"chief": {"replicas": 1, "command": SLEEP}}, path=one, hosts=["host-1"])
    sh(
        hosts,
        "host-1",
        f"cat > /usr/bin/docker <<'EOF'\n{DOCKER}EOF\nchmod 755 /usr/bin/docker; rm -f /var/tmp/docker-standin.log",
        check=True,
    )
    try:
        r = ok(dev(one, home, "--name", "img", "--image", "registry.example/torch:2"))
        assert r.stdout.startswith("ssh provision-dev-img")
        got = ssh(home, "img", "echo IN=$CUDA_VISIBLE_DEVICES")
        assert got.returncode == 0 and got.stdout.strip() in ("IN=0", "IN=1"), got.stdout + got.stderr
        calls = sh(hosts, "host-1", "cat /var/tmp/docker-standin.log", check=True).splitlines()
        run = next(c for c in calls if c.startswith("run "))
        assert re.match(
            r'run -d --rm --name provision-dev-ana-\w+-img-dev --network host --gpus "device=[01]" -e ', run
        ), run
        assert run.endswith("registry.example/torch:2 tail -f /dev/null") and "-e CUDA_VISIBLE_DEVICES" in run
        assert any(
            c.startswith("exec -i provision-dev-ana-") and c.endswith("sh -c echo IN=$CUDA_VISIBLE_DEVICES")
            for c in calls
        ), calls
    finally:
        stop_all(one, home, "img")
        calls = sh(hosts, "host-1", "cat /var/tmp/docker-standin.log").splitlines()
        sh(hosts, "host-1", "rm -f /usr/bin/docker /var/tmp/docker-standin.log")
    assert any(c.startswith("rm -f provision-dev-ana-") for c in calls), calls  # its container goes with it
