"""The host agent's write, units and destroy ops, tested as tables (the way pyinfra tests
its facts: tests/facts/<fact>/*.json). Each tests/fixtures/agent/<op>/<case>.json holds:

    doc          what the case shows
    request      the wire request, as protocol.to_wire builds it (checked: it round-trips)
    before       the host's files before: {path: {"content"|"json", "mode", "mtime"}}; a
                 path whose value is {"dir": true} (optionally "mode") is a directory, one
                 whose value is {"link": target} a symbolic link (target as on the host)
    units        systemd's units before: {unit: {"ActiveState", "SubState", ...}}; a unit
                 is loaded when its unit file is under /etc/systemd/system (as systemd sees it)
    report       the wire report expected back (host paths as on the host)
    after        every file on the host afterwards (the same form as `before`; "json" is
                 compared parsed, "mtime" only when given, "mode" always)
    dirs         every directory afterwards beyond the base ones (SCAFFOLD): {path: mode}
    calls        every systemctl/journalctl call that changes something, in order, argv
                 with the program name (`systemctl show`, a read, is left out)
    units_after  (optional) units' ActiveState/SubState afterwards
    old_systemd  (optional) the unit files systemd read at its last daemon-reload: a systemd
                 before 246, which finds a new unit file only after a reload

The agent's own functions run in this process, with its host rooted in a tmp dir: its `os`
and `open` are replaced by ones that move every absolute path under that dir (and give the
host's paths back from os.walk), so no product code knows about the test. A fake
systemctl and journalctl on PATH record their argv and keep the units' states in a JSON
file. The clock is fixed at CLOCK, so what the agent writes with a time is comparable.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from provision.host import agent, layout
from provision.host import protocol as P

HERE = Path(__file__).parent / "fixtures" / "agent"
OPS = ("write", "units", "destroy")
CLOCK = 1700000000.0
# Directories every host has; `dirs` in a table lists the others.
SCAFFOLD = (
    "/etc",
    "/etc/systemd",
    "/etc/systemd/system",
    "/etc/systemd/system/multi-user.target.wants",
    "/var",
    "/var/lib",
    "/opt",
    "/mnt",
    "/proc",
)
# The host's ledger (host/ledger.py) has its own tests; a table never reserves anything.
IGNORED = (getattr(layout, "LEDGER_DIR", "/var/lib/provision/.ledger"),)
# systemd's own run-time files (the fake makes the invocation links a run has).
RUNTIME = "/run"


def cases() -> list[Any]:
    return [pytest.param(op, p, id=f"{op}/{p.stem}") for op in OPS for p in sorted((HERE / op).glob("*.json"))]


# --------------------------------------------------------------------------- a rooted host


class RootedPath:
    """os.path for the agent: the calls that look at the file system are rooted."""

    LOOKS = ("exists", "lexists", "isdir", "isfile", "islink", "getsize", "getmtime", "realpath")

    def __init__(self, rooted: RootedOs):
        self._r = rooted

    def __getattr__(self, name: str) -> Any:
        real = getattr(os.path, name)
        if name in self.LOOKS:
            return lambda p, *a, **kw: real(self._r.inside(p), *a, **kw)
        return real


class RootedOs:
    """os for the agent: every absolute path it passes lands under root."""

    # Calls whose string arguments are not paths on the host.
    NOT_PATHS = frozenset({"posix_spawnp", "posix_spawn", "getenv", "putenv", "fsencode", "fsdecode", "strerror"})

    def __init__(self, root: str):
        self.root = root
        self.path = RootedPath(self)

    def inside(self, p: Any) -> Any:
        if isinstance(p, str) and p.startswith("/"):
            assert not p.startswith(self.root), f"the agent was given a rooted path twice: {p}"
            return self.root + p
        return p

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if not callable(real) or name in self.NOT_PATHS or isinstance(real, type):
            return real
        return lambda *a, **kw: real(*map(self.inside, a), **{k: self.inside(v) for k, v in kw.items()})

    def walk(self, top: str, *a: Any, **kw: Any) -> Any:
        for d, subdirs, names in os.walk(self.inside(top), *a, **kw):
            yield d[len(self.root) :] or "/", subdirs, names

    def fchown(self, fd: int, uid: int, gid: int) -> None:
        """The agent makes its files root's; here they stay the test user's."""

    def symlink(self, target: str, link: str) -> None:
        """A link's target is data: kept as the host would read it, not rooted."""
        os.symlink(target, self.inside(link))


FAKE_SYSTEMCTL = r'''#!{python}
"""systemctl for the agent tables: records argv, keeps unit states in a JSON file."""
import json, os, sys

root, state_file = os.environ["FAKE_HOST_ROOT"], os.environ["FAKE_SYSTEMD_STATE"]
with open(os.environ["FAKE_SYSTEMD_LOG"], "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\n")
if os.path.basename(sys.argv[0]) != "systemctl":
    sys.exit(0)
with open(state_file) as f:
    state = json.load(f)
args = sys.argv[1:]
verb, units = args[0], [a for a in args[1:] if not a.startswith("-")]
reloaded_file = state_file + ".reloaded"  # an old systemd's: the unit files it read last
on_disk = lambda u: os.path.exists(root + "/etc/systemd/system/" + u)
if os.path.exists(reloaded_file):  # before 246: a new unit file needs a daemon-reload
    with open(reloaded_file) as f:
        known = json.load(f)
    loaded = lambda u: on_disk(u) and u in known
else:
    loaded = on_disk
code = 0
if verb == "show":
    props = [p for a in args if a.startswith("--property=") for p in a.split("=", 1)[1].split(",")]
    blocks = []
    for u in units:
        st = {{"Id": u, "LoadState": "loaded" if loaded(u) else "not-found", "ActiveState": "inactive",
              "SubState": "dead" if loaded(u) else "", **state.get(u, {{}})}}
        if "--value" in args:
            blocks.append("".join("%s\n" % st[p] for p in props if st.get(p)))
        else:
            blocks.append("".join("%s=%s\n" % (p, st[p]) for p in props if st.get(p)))
    sys.stdout.write("\n".join(blocks))
elif verb == "start":
    for u in units:
        if not loaded(u):
            sys.stderr.write("Failed to start %s: Unit %s not found.\n" % (u, u))
            code = 5
            continue
        state[u] = {{**state.get(u, {{}}), "ActiveState": "active", "SubState": "running"}}
        # systemd's link to the run's invocation, while it runs (layout.INVOCATION_PREFIX)
        link = root + "/run/systemd/units/invocation:" + u
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if not os.path.lexists(link) and not os.environ.get("FAKE_NO_INVOCATION"):
            os.symlink("0" * 32, link)
elif verb == "stop":
    for u in units:
        if u in state:
            state[u] = {{**state[u], "ActiveState": "inactive", "SubState": "dead"}}
        if os.path.lexists(root + "/run/systemd/units/invocation:" + u):
            os.unlink(root + "/run/systemd/units/invocation:" + u)
elif verb == "daemon-reload" and os.path.exists(reloaded_file):
    with open(reloaded_file, "w") as f:
        json.dump(sorted(os.listdir(root + "/etc/systemd/system")), f)
elif verb == "reset-failed":
    for u in units:
        if state.get(u, {{}}).get("ActiveState") == "failed":
            state[u] = {{**state[u], "ActiveState": "inactive", "SubState": "dead"}}
with open(state_file, "w") as f:
    json.dump(state, f, indent=1, sort_keys=True)
sys.exit(code)
'''


def data_of(spec: dict[str, Any]) -> bytes:
    if "json" in spec:
        return json.dumps(spec["json"], indent=1, sort_keys=True).encode()
    return spec.get("content", "").encode()


def mode_of(spec: dict[str, Any], default: int) -> int:
    return int(spec["mode"], 8) if "mode" in spec else default


class Host:
    """A tmp dir laid out as the table's host before the op."""

    def __init__(self, tmp: Path, table: dict[str, Any]):
        self.root = str(tmp / "host")
        self.bin = tmp / "bin"
        self.log = tmp / "calls.jsonl"
        self.state = tmp / "units.json"
        for d in SCAFFOLD:
            os.makedirs(self.root + d, exist_ok=True)
        for path, spec in sorted(table.get("before", {}).items()):
            p = self.root + path
            if spec.get("dir"):
                os.makedirs(p, exist_ok=True)
                os.chmod(p, mode_of(spec, 0o755))
                continue
            os.makedirs(os.path.dirname(p), exist_ok=True)
            if "link" in spec:
                os.symlink(spec["link"], p)
                continue
            Path(p).write_bytes(data_of(spec))
            os.chmod(p, mode_of(spec, 0o644))
            if "mtime" in spec:
                os.utime(p, (spec["mtime"], spec["mtime"]))
        os.makedirs(self.root + "/proc/sys/kernel/random", exist_ok=True)
        Path(self.root + "/proc/sys/kernel/random/boot_id").write_text("00000000-0000-0000-0000-000000000000\n")
        self.state.write_text(json.dumps(table.get("units", {})))
        if "old_systemd" in table:
            Path(str(self.state) + ".reloaded").write_text(json.dumps(table["old_systemd"]))
        self.log.write_text("")
        self.bin.mkdir()
        for prog in ("systemctl", "journalctl"):
            (self.bin / prog).write_text(FAKE_SYSTEMCTL.format(python=sys.executable))
            (self.bin / prog).chmod(0o755)

    def calls(self) -> list[list[str]]:
        calls = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [c for c in calls if c[:2] != ["systemctl", "show"]]

    def files(self) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """(files, dirs) on the host now, as the tables spell them."""
        files: dict[str, dict[str, Any]] = {}
        dirs: dict[str, str] = {}
        for d, subdirs, names in os.walk(self.root):
            host_d = d[len(self.root) :] or "/"
            if host_d.startswith(IGNORED) or host_d.startswith(("/proc", RUNTIME)):
                subdirs[:] = []
                continue
            if host_d not in SCAFFOLD and host_d != "/":
                dirs[host_d] = "%04o" % (os.stat(d).st_mode & 0o7777)
            for n in names:
                p = os.path.join(d, n)
                st = os.lstat(p)
                if os.path.islink(p):
                    files[os.path.join(host_d, n)] = {"link": os.readlink(p)}
                    continue
                files[os.path.join(host_d, n)] = {
                    "data": Path(p).read_bytes(),
                    "mode": "%04o" % (st.st_mode & 0o7777),
                    "mtime": int(st.st_mtime),
                }
        return files, dirs


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Makes a Host for a table and roots the agent (and the modules it calls) in it."""

    def make(table: dict[str, Any]) -> Host:
        h = Host(tmp_path, table)
        rooted = RootedOs(h.root)

        def rooted_open(file: Any, *a: Any, **kw: Any) -> Any:
            return open(rooted.inside(file), *a, **kw)

        clock = types.SimpleNamespace(time=lambda: CLOCK, monotonic=lambda: CLOCK, sleep=lambda s: None)
        mods = [agent] + [importlib.import_module(f"provision.host.{m}") for m in ("ledger", "hostlib", "hostfacts")]
        for m in mods:
            monkeypatch.setattr(m, "os", rooted, raising=False)
            monkeypatch.setattr(m, "open", rooted_open, raising=False)
        monkeypatch.setattr(agent, "time", clock)
        monkeypatch.setenv("PATH", f"{h.bin}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_HOST_ROOT", h.root)
        monkeypatch.setenv("FAKE_SYSTEMD_STATE", str(h.state))
        monkeypatch.setenv("FAKE_SYSTEMD_LOG", str(h.log))
        return h

    old = os.umask(0o022)
    try:
        yield make
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- the tables


@pytest.mark.parametrize("op,path", cases())
def test_table(op: str, path: Path, host: Any) -> None:
    table = json.loads(path.read_text())
    assert table["request"]["op"] == op
    req = P.request_from_wire(table["request"])
    assert P.to_wire(req) == {**P.to_wire(req), **table["request"]}, "the request is in the wire form"
    h = host(table)

    report = json.loads(json.dumps(P.to_wire(agent.OPS[op](req))).replace(h.root, ""))
    expected_report = P.to_wire(P.report_from_wire(op, table["report"]))
    assert report == expected_report

    assert h.calls() == table.get("calls", [])

    files, dirs = h.files()
    want = table["after"]
    assert sorted(files) == sorted(want), "the files on the host afterwards"
    for p, spec in want.items():
        got = files[p]
        if "link" in spec or "link" in got:
            assert got == {"link": spec.get("link")}, p
            continue
        if "json" in spec:
            assert json.loads(got["data"]) == spec["json"], p
        else:
            assert got["data"].decode() == spec.get("content", ""), p
        assert got["mode"] == spec.get("mode", "0644"), p
        if "mtime" in spec:
            assert got["mtime"] == spec["mtime"], f"{p} was rewritten"
    assert dirs == table.get("dirs", {}), "the directories on the host afterwards"

    if "units_after" in table:
        states = json.loads(h.state.read_text())
        got_units = {
            u: {k: states.get(u, {}).get(k) for k in ("ActiveState", "SubState")} for u in table["units_after"]
        }
        assert got_units == table["units_after"]


def test_every_op_has_at_least_four_tables() -> None:
    for op in OPS:
        assert len(list((HERE / op).glob("*.json"))) >= 4, op


def test_the_rooted_host_reaches_nothing_outside(tmp_path: Path) -> None:
    """The seam itself: paths go under root, host paths come back from walk."""
    r = RootedOs(str(tmp_path))
    r.makedirs("/etc/x", exist_ok=True)
    assert (tmp_path / "etc" / "x").is_dir() and r.path.isdir("/etc/x") and not r.path.isdir("/x")
    assert [d for d, _, _ in r.walk("/etc")] == ["/etc", "/etc/x"]
    assert r.path.join("/a", "b") == "/a/b" and r.path.dirname("/a/b") == "/a"
    with pytest.raises(AssertionError, match="rooted path twice"):
        r.path.isdir(str(tmp_path / "etc"))  # a path that leaked out of the seam and back


def test_units_just_started_are_not_shown_again(host: Any) -> None:
    # A started unit whose invocation link is there runs: its state comes back without a
    # `systemctl show` (the tables leave reads out of `calls`; here they are counted).
    table = json.loads((HERE / "units" / "start.json").read_text())
    h = host(table)
    report = agent.OPS["units"](P.request_from_wire(table["request"]))
    assert {u: s["ActiveState"] for u, s in report.units.items()} == dict.fromkeys(report.units, "active")
    shows = [c for c in map(json.loads, h.log.read_text().splitlines()) if c[:2] == ["systemctl", "show"]]
    assert shows == []


def test_units_without_an_invocation_link_are_shown(host: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A systemd without the links (before 236), or a run that ended at once: systemctl says.
    monkeypatch.setenv("FAKE_NO_INVOCATION", "1")
    table = json.loads((HERE / "units" / "start.json").read_text())
    h = host(table)
    report = agent.OPS["units"](P.request_from_wire(table["request"]))
    assert P.to_wire(report) == P.to_wire(P.report_from_wire("units", table["report"]))
    shows = [c for c in map(json.loads, h.log.read_text().splitlines()) if c[:2] == ["systemctl", "show"]]
    assert len(shows) == 1
