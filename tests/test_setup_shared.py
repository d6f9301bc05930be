"""A setup is done once per host for every job that needs the same one:
its key (what it is, not whose), plan's rule for whether it runs, and the host's side (one
run at a time, a failed run not reused, removed with the last job using it). Tables."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from provision.host import layout, ledger, setups
from provision.host.protocol import FileInfo, ProbeReport, SetupReport, SetupRequest
from provision.inventory.inventory import parse
from provision.inventory.trial import trial_inventory
from provision.render.files import SetupUnit, render
from provision.rules.sharing import setup_done, setup_note, setup_reason
from provision.run.destroy import study_of

INV = """\
job: {job}
ssh: {{user: {user}}}
hosts:
  - {{name: h1, address: 192.0.2.11}}
  - {{name: h2, address: 192.0.2.12}}
pools:
  chief: {{replicas: 1, hosts: [h1], command: [/bin/true]}}
  worker: {{replicas: 1, hosts: [h2], command: [/bin/true]{pool}}}
files:
  - {{src: req.txt, dest: /opt/x/req.txt}}
  - {{src: train.py, dest: /opt/x/train.py}}
setup: {{commands: [{commands}], env: {{A: "{a}"}}, timeout: {timeout}, inputs: [/opt/x/req.txt]}}
"""
SAME = dict(job="study-t1", user="root", pool="", commands='"pip install -r /opt/x/req.txt"', a="1", timeout=600)


def keys(tmp_path: Path, req: str = "numpy\n", train: str = "print(1)\n", **change: object) -> dict[str, str]:
    (tmp_path / "req.txt").write_text(req)
    (tmp_path / "train.py").write_text(train)
    text = INV.format(**{**SAME, **change})
    r = render(parse(text, tmp_path / "inv.yaml"))
    return {h: b.setup.key for h, b in r.hosts.items() if b.setup is not None}


@pytest.mark.parametrize(
    "change, shared",
    [
        ({"job": "study-t2"}, True),  # another trial of the study
        ({"job": "variant"}, True),  # a variant of the job, or a teammate's (the owner is not in it)
        ({"train": "print(2)\n"}, True),  # the code it does not name as an input
        ({"req": "numpy\ntorch\n"}, False),  # the contents of its inputs
        ({"commands": '"pip install -r /opt/x/req.txt", "true"'}, False),
        ({"a": "2"}, False),  # its env
        ({"user": "trainer"}, False),  # who it runs as
        ({"timeout": 601}, False),
    ],
)
def test_a_setup_is_keyed_by_what_it_is_not_by_the_job(tmp_path, change, shared):
    first = keys(tmp_path)
    assert set(first) == {"h1", "h2"} and first["h1"] == first["h2"]  # the same setup on both hosts
    again = keys(tmp_path, **change)
    assert (again == first) is shared


def test_a_pools_setup_makes_the_hosts_setup_another_one(tmp_path):
    k = keys(tmp_path, pool=", setup: {commands: [echo worker]}")
    assert k["h1"] != k["h2"]


def test_no_inventory_value_reaches_a_name_or_the_unit(tmp_path):
    evil = '"x\'; rm -rf / #", "$(reboot)"'
    (tmp_path / "req.txt").write_text("r\n")
    (tmp_path / "train.py").write_text("t\n")
    text = INV.format(**{**SAME, "commands": evil, "job": "evil"})
    b = render(parse(text, tmp_path / "inv.yaml")).hosts["h1"]
    assert b.setup is not None
    short = b.setup.key[:32]
    assert b.setup.unit == f"provision-setup-{short}.service" and layout.is_setup_unit(b.setup.unit)
    files = {f.path: f.data() for f in b.files if f.kind.value == "setup" or f.path.endswith(b.setup.unit)}
    assert set(files) == {
        f"/etc/provision/.setups/{short}/setup.sh",
        f"/etc/provision/.setups/{short}/setup.env",
        f"/etc/systemd/system/provision-setup-{short}.service",
    }
    unit = files[f"/etc/systemd/system/provision-setup-{short}.service"]
    assert b"rm -rf" not in unit and b"reboot" not in unit and b"evil" not in unit
    assert b"rm -rf" in files[f"/etc/provision/.setups/{short}/setup.sh"]  # only in its script
    assert b"evil" not in b"".join(files.values())  # nothing of the job: every job writes the same bytes
    assert not layout.is_setup_unit("provision-setup-x-chief-0.service")  # a job named "setup-x"


LEGACY_INV = """\
job: legacy
hosts:
  - {name: h1, address: 192.0.2.11}
pools:
  chief: {replicas: 1, command: [/bin/true], setup: {commands: [echo pool], env: {B: "2"}}}
setup: {commands: ["echo one", "pip install x"], env: {A: "1"}, timeout: 900}
"""


def test_a_setup_done_by_the_previous_release_counts_and_restarts_no_task(tmp_path):
    """What release 1a5e7ca rendered for LEGACY_INV (its setup key, its task's inputs),
    computed with that release's source: this version takes both as its own."""
    b = render(parse(LEGACY_INV, tmp_path / "inv.yaml")).hosts["h1"]
    assert b.setup is not None
    assert b.setup.legacy_key == "afb373b0d5c2508e3b33a4701a71a18f9ce891dffcff2e4cd2d456f0b30cb032"
    assert "678f644564c9a60e4b426e69cff7ba7dbd42616a5ac84855e27f714898c19a06" in b.tasks[0].accepted
    report = ProbeReport(manifest={"setup": {"key": b.setup.legacy_key}}, setup_key=b.setup.legacy_key)
    assert setup_reason(b.setup, report, False) is None


# --------------------------------------------------------------------------- plan's rule

S = SetupUnit(layout.setup_unit("a" * 64), "a" * 64, 600, legacy_key="b" * 64)
MARK = FileInfo("file", 0o600, 0, sha256=hashlib.sha256(layout.setup_done_record(S.key)).hexdigest())
UNIT = FileInfo("file", 0o644, 0, sha256="u" * 64)
OTHER_MARK = FileInfo("file", 0o600, 0, sha256="0" * 64)


@pytest.mark.parametrize(
    "files, manifest_key, legacy, force, why",
    [
        ({}, None, None, False, "new"),  # the first job here
        ({S.done_path: MARK, layout.setup_unit_path(S.key): UNIT}, None, None, False, None),  # another job did it
        ({S.done_path: MARK, layout.setup_unit_path(S.key): UNIT}, S.key, None, False, None),
        ({S.done_path: MARK, layout.setup_unit_path(S.key): UNIT}, S.key, None, True, "forced"),
        ({layout.setup_unit_path(S.key): UNIT}, S.key, None, False, "new"),  # its last run failed
        ({S.done_path: MARK}, None, None, False, "new"),  # a mark whose unit went with its last user
        ({S.done_path: OTHER_MARK, layout.setup_unit_path(S.key): UNIT}, None, None, False, "new"),
        ({}, "c" * 64, None, False, "changed"),  # this job had another setup
        ({}, "b" * 64, "b" * 64, False, None),  # done per job by release 1a5e7ca
        ({}, "b" * 64, "d" * 64, False, "new"),
    ],
)
def test_whether_a_setup_runs(files, manifest_key, legacy, force, why):
    manifest = {"setup": {"unit": "u", "key": manifest_key}} if manifest_key else None
    report = ProbeReport(manifest=manifest, files=files, setup_key=legacy)
    assert setup_reason(S, report, force) == why
    assert setup_done(S, report) is (why is None and not force or force and MARK in files.values())


@pytest.mark.parametrize(
    "others, said",
    [
        ([], "done on this host"),
        (["study-t1"], "done on this host, shared with 1 other job (study-t1)"),
        (["a", "b", "c", "d", "e"], "done on this host, shared with 5 other jobs (a, b, c and 2 more)"),
    ],
)
def test_what_plan_says_of_a_setup_done_here(others, said):
    assert setup_note(others) == said


# --------------------------------------------------------------------------- the host's side


@pytest.fixture
def host(tmp_path, monkeypatch):
    """layout's directories under tmp_path, and systemctl a fake that counts its starts."""
    for name, sub in [("ETC", "etc"), ("VAR", "var"), ("SYSTEMD_DIR", "systemd")]:
        monkeypatch.setattr(layout, name, str(tmp_path / sub))
    monkeypatch.setattr(layout, "SETUPS_ETC", str(tmp_path / "etc" / ".setups"))
    monkeypatch.setattr(layout, "SETUPS_VAR", str(tmp_path / "var" / ".setups"))
    monkeypatch.setattr(layout, "LEDGER_DIR", str(tmp_path / "var" / ".ledger"))
    monkeypatch.setattr(layout, "LEDGER_LOCK", str(tmp_path / "var" / ".ledger" / ".lock"))
    (tmp_path / "systemd").mkdir()
    fake = Fake()
    monkeypatch.setattr(setups, "run", fake.run)
    monkeypatch.setattr(setups, "unit_states", lambda units: {u: {"ExecMainStatus": "3"} for u in units})
    monkeypatch.setattr(ledger, "renewing", lambda job, every: threading.Event())
    return fake


class Fake:
    def __init__(self) -> None:
        self.starts = 0
        self.code = 0
        self.gate: threading.Event | None = None

    def run(self, argv: list[str], timeout: float = 60) -> tuple[int, str, str]:
        if argv[:2] == ["systemctl", "start"]:
            self.starts += 1
            if self.gate is not None:
                self.gate.wait(10)
            return self.code, "", "" if self.code == 0 else "failed"
        return 0, "", ""


KEY = "f" * 64


def job_uses(job: str, key: str = KEY) -> None:
    """What apply leaves on the host: the job's manifest lists the setup's files, there."""
    Path(layout.job_dir(job)).mkdir(parents=True, exist_ok=True)
    paths = [layout.setup_script_path(key), layout.setup_env_path(key), layout.setup_unit_path(key)]
    for p in paths:
        Path(p).parent.mkdir(parents=True, exist_ok=True)
        Path(p).write_text("x\n")
    files = {p: {"sha256": "", "kind": "setup"} for p in paths}
    manifest = {"files": files, "setup": {"unit": layout.setup_unit(key), "key": key}}
    Path(layout.manifest_path(job)).write_text(json.dumps(manifest))


def req(job: str, force: bool = False) -> SetupRequest:
    return SetupRequest(job, layout.setup_unit(KEY), KEY, force=force)


def test_a_setup_runs_once_and_a_failed_run_is_not_reused(host):
    # (job, force, start fails) -> (ran, starts so far, done after)
    steps = [
        ("t1", False, False, True, 1, True),
        ("t2", False, False, False, 1, True),  # another trial: takes the result
        ("teammate", False, False, False, 1, True),
        ("t2", True, False, True, 2, True),  # --force-setup
        ("t3", True, True, True, 3, False),  # a run that fails takes the mark away...
        ("t4", False, False, True, 4, True),  # ... and the next job runs it again
    ]
    for job, force, fails, ran, starts, done in steps:
        host.code = 1 if fails else 0
        rep = setups.op_setup(req(job, force))
        assert (rep.ran, host.starts, setups.done(KEY)) == (ran, starts, done), job
        assert bool(rep.errors) is fails and (rep.exit_code == 3) is fails


def test_jobs_that_ask_together_share_one_run(host):
    host.gate = threading.Event()
    reports: dict[str, SetupReport] = {}

    def ask(job: str) -> None:
        reports[job] = setups.op_setup(req(job))

    threads = [threading.Thread(target=ask, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    host.gate.set()
    for t in threads:
        t.join(10)
    assert host.starts == 1
    assert sorted(r.ran for r in reports.values()) == [False, False, False, True]


def test_the_last_job_using_a_setup_removes_it(host):
    for job in ("a", "b"):
        job_uses(job)
    setups.op_setup(req("a"))
    unit, mark = layout.setup_unit_path(KEY), layout.setup_done_path(KEY)
    setup = {"unit": layout.setup_unit(KEY), "key": KEY}
    # a leaves: b uses it (its unit is not stopped, its files and mark stay)
    assert setups.used_elsewhere("a", setup)
    ledger.remove_unowned("a", [layout.setup_script_path(KEY), unit])
    assert not setups.release(setup)
    Path(layout.manifest_path("a")).unlink()
    assert Path(unit).exists() and setups.done(KEY)
    # b leaves: the last one
    assert not setups.used_elsewhere("b", setup)
    ledger.remove_unowned("b", [layout.setup_script_path(KEY), layout.setup_env_path(KEY), unit])
    assert setups.release(setup)
    assert not Path(unit).exists() and not Path(mark).exists() and not setups.done(KEY)
    assert not Path(layout.setup_dir(KEY)).exists() and not Path(layout.SETUPS_VAR).exists()


@pytest.mark.parametrize(
    "setup",
    [
        None,
        {"unit": "provision-legacy-setup.service", "key": KEY},  # a release up to 1a5e7ca's, per job
        {"unit": layout.setup_unit(KEY), "key": KEY[:-1] + "g"},  # not a key
        {"unit": layout.setup_unit("e" * 64), "key": KEY},  # not its unit
    ],
)
def test_only_a_shared_setups_record_is_released(host, setup):
    assert setups.shared_key(setup) is None and not setups.release(setup)


def test_a_study_holds_its_trials_setup_until_it_is_destroyed(host):
    """Trials follow one another on a host: the removal of one must not take the setup the
    next one finds done. The study holds it; destroying the study lets it go."""
    setup = {"unit": layout.setup_unit(KEY), "key": KEY}

    def removed(trial: str, study: str = "study") -> None:  # as op_destroy does it
        kept = setups.hold(setup, study)
        files = json.loads(Path(layout.manifest_path(trial)).read_text())["files"]
        ledger.remove_unowned(trial, [p for p in files if p not in kept])
        Path(layout.manifest_path(trial)).unlink()
        setups.release(setup)

    job_uses("study-t1")
    setups.op_setup(req("study-t1"))
    removed("study-t1")
    assert setups.done(KEY) and Path(layout.setup_unit_path(KEY)).exists()  # the next trial takes it
    job_uses("study-t2")
    assert setups.op_setup(req("study-t2")).ran is False and host.starts == 1
    assert setups.release_holds("other") == 0 and setups.done(KEY)
    assert setups.release_holds("study") == 0  # study-t2 runs with it: only the hold goes
    assert setups.done(KEY) and not Path(layout.setup_hold_path("study")).exists()
    removed("study-t2")
    job_uses("b-t1")
    removed("b-t1", "b")  # another study with the same setup holds it too
    assert setups.release_holds("study") == 0 and setups.done(KEY)
    assert setups.release_holds("b") == 1  # the last hold
    assert not setups.done(KEY) and not Path(layout.setup_unit_path(KEY)).exists()
    assert not Path(layout.SETUPS_VAR).exists() and not Path(layout.SETUPS_ETC).exists()


@pytest.mark.parametrize("study", ["", "../x", "Study", "a" * 64, "a/b"])
def test_a_hold_needs_a_job_name(host, study):
    assert setups.hold({"unit": layout.setup_unit(KEY), "key": KEY}, study) == []


def test_a_trials_removal_names_its_study(tmp_path):
    text = LEGACY_INV.replace("job: legacy", "job: sweep-t12")
    inv = parse(text, tmp_path / "inv.yaml")
    assert study_of(inv) == ""  # no tune: an ordinary job
    tune = parse(TUNED, tmp_path / "inv.yaml")
    assert tune.tune is not None and study_of(tune) == ""  # the study itself
    assert study_of(trial_inventory(tune, 12, {"lr": 0.1})) == "sweep"


TUNED = """\
job: sweep
hosts:
  - {name: h1, address: 192.0.2.11}
pools:
  chief: {replicas: 1, command: [/bin/true]}
setup: {commands: [echo one]}
tune:
  metric: {name: loss, goal: minimize}
  parameters: {lr: {type: double, min: 0.01, max: 1.0}}
  max_trials: 2
"""
