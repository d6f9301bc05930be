"""host/trust.py: which of provision's directories a host may trust (OpenSSH's StrictModes
rule, every component from /), and host/taskenv.py: the env file read as data (
items 1-5)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from provision.core.encode import env_assignment
from provision.host import outdirs, taskenv, trust

_spec = importlib.util.spec_from_file_location("_provision_test_encode", Path(__file__).with_name("test_encode.py"))
_ports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ports)  # type: ignore[union-attr]
HOSTILE, parse_env_file = _ports.HOSTILE, _ports.parse_env_file

USER = 4242  # a uid that is not root's (the tests run as root: chown works)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def test_a_tree_only_root_can_write_passes(tmp_path):
    d = tmp_path / "etc" / "provision" / "job"
    d.mkdir(parents=True)
    assert trust.problem(str(d)) is None
    assert trust.problem(str(d / "not" / "there")) is None  # made later, by the agent


@pytest.mark.parametrize("where", ["etc", "etc/provision", "etc/provision/job"])
def test_a_component_another_user_owns_is_refused(tmp_path, where):
    d = tmp_path / "etc" / "provision" / "job"
    d.mkdir(parents=True)
    os.chown(tmp_path / where, USER, USER)
    why = trust.problem(str(d))
    assert (
        why == f"{tmp_path / where} is owned by uid {USER} (mode 0755): provision uses only directories owned by root"
    )


def test_group_or_other_write_is_refused_unless_sticky(tmp_path):
    d = tmp_path / "var" / ".ledger"
    d.mkdir(parents=True)
    d.chmod(0o777)
    assert trust.problem(str(d)) == (
        f"{d} is writable by group or others (mode 0777): provision uses only directories only root may write"
    )
    d.chmod(0o1777)  # as /tmp: others cannot rename or remove what they do not own
    assert trust.problem(str(d)) is None


def test_a_link_counts_where_it_leads_and_by_whom_it_was_made(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "home").mkdir()
    os.chown(tmp_path / "home", USER, USER)
    link = tmp_path / "cache"
    link.symlink_to(tmp_path / "home")
    assert "is owned by uid" in (trust.problem(str(link / "agent")) or "")  # leads to a user's directory
    link.unlink()
    link.symlink_to(real)
    assert trust.problem(str(link / "agent")) is None  # root's link to root's directory
    os.lchown(link, USER, USER)
    assert f"{link} is owned by uid {USER}" in (trust.problem(str(link / "agent")) or "")


def test_a_file_inside_is_never_opened_through_a_link(tmp_path):
    (tmp_path / "a.env").write_text('A="1"\n')
    (tmp_path / "b.env").symlink_to(tmp_path / "a.env")
    assert taskenv.open_file(str(tmp_path / "a.env")) == b'A="1"\n'
    with pytest.raises(OSError):
        taskenv.open_file(str(tmp_path / "b.env"))


def test_env_files_read_as_systemd_reads_them():
    entries = [(f"K{i}", v) for i, v in enumerate(HOSTILE) if "\x00" not in v]
    text = "# made by provision\n" + "\n".join(env_assignment(k, v) for k, v in entries) + "\n"
    assert taskenv.parse_env(text) == entries == parse_env_file(text)


@pytest.mark.parametrize("bad", ["rm -rf /\n", 'A="unterminated\n', "A=1\n", '1A="x"\n', 'A B="x"\n'])
def test_anything_but_provisions_own_lines_is_refused(bad):
    with pytest.raises(ValueError):
        taskenv.parse_env(bad)


# ----------------------------------------------------------------- outputs:

DIR, LNK, REG = 0o040000, 0o120000, 0o100000


@pytest.mark.parametrize(
    "mode, uid, why",
    [
        (DIR | 0o755, 0, None),
        (DIR | 0o700, 0, None),
        (DIR | 0o1777, 0, None),  # /tmp: others cannot rename or remove root's directory there
        (DIR | 0o755, USER, "/d is owned by uid 4242 (mode 0755): outputs: must be in directories owned by root"),
        (DIR | 0o1777, USER, "/d is owned by uid 4242 (mode 1777): outputs: must be in directories owned by root"),
        (DIR | 0o775, 0, "/d is writable by group or others (mode 0775): outputs: must be in directories only root"),
        (DIR | 0o757, 0, "/d is writable by group or others (mode 0757): outputs: must be in directories only root"),
        (LNK | 0o777, 0, "/d is a symbolic link: provision follows none on the way to outputs:"),  # root's too
        (LNK | 0o777, USER, "/d is a symbolic link"),
        (REG | 0o644, 0, "/d is not a directory"),
    ],
)
def test_outputs_directories_are_judged_component_by_component(mode, uid, why):
    got = outdirs.judged("/d", mode, uid)
    assert got == why if why is None else got is not None and got.startswith(why)


def guard(make: bool, *paths: str) -> tuple[int, str]:
    r = subprocess.run(
        ["sh", "-c", outdirs.GUARD_SH, "t", "1" if make else "0", *paths], capture_output=True, text=True
    )
    return r.returncode, r.stderr.strip()


def spoil(tmp_path, how):
    """/data owned by a user who made /data/runs a link to root's directory (as found),
    and the other ways a component can be another's."""
    data, secret = tmp_path / "data", tmp_path / "root" / "x"
    data.mkdir()
    secret.mkdir(parents=True)
    (secret / "key").write_text("root's\n")
    if how == "user owns /data, runs links to root's":
        os.chown(data, USER, USER)
        (data / "runs").symlink_to(secret)
    elif how == "root's link":
        (data / "runs").symlink_to(secret)
    elif how == "user's runs":
        (data / "runs").mkdir()
        os.chown(data / "runs", USER, USER)
    elif how == "writable /data":
        data.chmod(0o777)
    elif how == "a file":
        (data / "runs").write_text("")
    return data / "runs", secret


SPOILS = ["user owns /data, runs links to root's", "root's link", "user's runs", "writable /data", "a file"]


@pytest.mark.parametrize("how", SPOILS)
def test_the_agent_and_the_units_guard_refuse_the_same_outputs(tmp_path, how):
    runs, secret = spoil(tmp_path, how)
    want = [f"{runs / 'model'}", f"{runs / 'checkpoints'}"]
    why = outdirs.problem(want[0])
    assert why is not None
    assert outdirs.refusals(want) == [f"outputs: {want[0]}: {why}; refused (nothing was done on this host)"]
    assert guard(False, *want) == (1, why)
    assert guard(True, *want) == (1, why)  # the unit's: nothing made, nothing followed
    assert sorted(p.name for p in secret.iterdir()) == ["key"]


def test_the_units_guard_makes_what_is_missing_and_sticky_parents_are_fine(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    want = [f"{tmp}/runs/3/model", f"{tmp}/runs/3/logs"]
    assert outdirs.problem(want[0]) is None and guard(False, *want) == (0, "")  # nothing there yet
    assert guard(True, *want) == (0, "")
    assert all(os.path.isdir(p) and os.stat(p).st_mode & 0o7777 == 0o755 for p in want)
    assert guard(True, *want) == (0, "")  # the next start


def test_a_directory_a_user_made_first_in_a_sticky_parent_is_refused(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    (tmp / "runs").mkdir()
    os.chown(tmp / "runs", USER, USER)
    code, why = guard(True, f"{tmp}/runs/model")
    assert code == 1 and why.startswith(f"{tmp}/runs is owned by uid {USER}")
    assert not (tmp / "runs" / "model").exists()


def test_the_units_command_is_the_guard_as_systemd_passes_it(tmp_path):
    """What systemd runs of the rendered ExecStartPre= ($$ and %% unescaped) makes the
    directories, and refuses a spoiled path as the agent does."""

    cmd = outdirs.unit_command([f"{tmp_path}/runs/model", f"{tmp_path}/runs/logs"])
    head, script, args = cmd.split("'")
    assert head == "/bin/sh -c "
    script = script.replace("$$", "$").replace("%%", "%")
    assert script == outdirs.GUARD_SH
    words = args.split()
    assert words[:2] == ["provision-outputs", "1"]
    r = subprocess.run(["/bin/sh", "-c", script, *words], capture_output=True, text=True)
    assert r.returncode == 0 and (tmp_path / "runs" / "logs").is_dir()


@pytest.mark.parametrize("how", SPOILS)
def test_fetch_reads_no_outputs_directory_another_could_redirect(tmp_path, how):
    runs, secret = spoil(tmp_path, how)
    r = subprocess.run(["sh", "-c", outdirs.read_prefix(str(runs)) + "ls"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == outdirs.problem(str(runs)), r.stderr
    assert r.stdout == ""


def test_fetch_of_outputs_not_made_yet_reads_nothing(tmp_path):
    r = subprocess.run(["sh", "-c", outdirs.read_prefix(f"{tmp_path}/none") + "echo read"], capture_output=True)
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")


# ----------------------------------------------------------------- drop-ins

UNIT = "provision-j-chief-0.service"


@pytest.mark.parametrize(
    "path, applies",
    [
        (f"/etc/systemd/system/{UNIT}.d/override.conf", True),
        (f"/run/systemd/system/{UNIT}.d/50-exec.conf", True),
        (f"/etc/systemd/system.control/{UNIT}.d/50-CPUQuota.conf", True),  # systemctl set-property
        (f"/usr/lib/systemd/system/{UNIT}.d/x.conf", True),
        ("/etc/systemd/system/provision-.service.d/all.conf", True),  # a prefix up to a dash
        ("/etc/systemd/system/provision-j-.service.d/job.conf", True),
        ("/etc/systemd/system/provision-j-chief-.service.d/role.conf", True),
        ("/etc/systemd/system/provision-j-chief-0.service.d/.hidden.conf", False),  # systemd skips it
        (f"/etc/systemd/system/{UNIT}.d/notes.txt", False),
        ("/etc/systemd/system/provision-k-.service.d/other-job.conf", False),
        ("/etc/systemd/system/provision-j-chief-1.service.d/x.conf", False),
        ("/etc/systemd/system/provision-.target.d/x.conf", False),  # another type
        ("/etc/systemd/system/provision-j.service.d/x.conf", False),  # not a prefix up to a dash
        (f"/opt/{UNIT}.d/x.conf", False),  # not where systemd looks
        ("/etc/systemd/system/service.d/x.conf", False),  # every service's: the host's own policy
    ],
)
def test_which_drop_ins_systemd_reads_for_a_unit(path, applies):
    from provision.host import layout

    assert layout.dropin_applies(path, UNIT) is applies


def test_a_drop_in_beside_a_task_unit_is_drift_that_apply_removes(tmp_path):
    """`plan` said "No changes" while a drop-in replaced the task's ExecStart=: now the
    drop-in is a line of its own (removed, [drift]) and its task restarts."""
    from dataclasses import replace

    import click

    from provision.cli.output import plan_lines
    from provision.rules.plan import FileAction
    from provision.rules.planner import make_plan

    spec = importlib.util.spec_from_file_location(
        "_provision_test_counts", Path(__file__).with_name("test_plan_counts.py")
    )
    counts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(counts)  # type: ignore[union-attr]
    r = counts.rendered(tmp_path)
    reports = {n: counts.applied(r, n) for n in counts.targets(r)}
    assert not make_plan(r, counts.targets(r), reports).changed
    host, unit = next((h, u.unit) for h, b in r.hosts.items() for u in b.tasks if u.task.name == "chief-0")
    dropin = f"/etc/systemd/system/{unit}.d/override.conf"
    other = "/etc/systemd/system/provision-other-chief-0.service.d/x.conf"  # another job's unit
    reports[host] = replace(reports[host], dropins=[dropin, other])
    plan = make_plan(r, counts.targets(r), reports)
    hp = next(h for h in plan.hosts if h.name == host)
    (f,) = hp.files
    assert (f.path, f.action, f.drift) == (dropin, FileAction.DELETE, True)
    (t,) = [t for t in hp.tasks if t.task == "chief-0"]
    assert t.action.starts and t.drift and dropin in t.why
    assert hp.units_changed  # apply reloads systemd after removing it
    # The job's tasks run together: the others restart with it (lifecycle.whole_job).
    assert plan.summary() == "Plan: 0 to add, 3 to change, 1 to destroy."
    text = "\n".join(click.unstyle(line) for line in plan_lines(plan, destroying=False))
    assert f"- unit {dropin} (a drop-in provision did not write: it changes what {unit} runs) [drift]" in text
