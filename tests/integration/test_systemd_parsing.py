"""Rendered env files and units, read by a REAL systemd (252, Debian bookworm sandbox host).

A job whose env values and command arguments are hostile (quotes, backslashes, `$`, `%`,
backquotes, `#`, `;`, spaces, unicode, newlines, carriage returns, a value that looks like
`"\\nEVIL=1`, `=`, an empty string, ...) is rendered offline; the host's files are pushed
over SSH (paramiko/fabric with the sandbox key) and the unit is started by systemd. The
task is `python3 -c <program>` whose program text is itself full of quotes and newlines:
it writes its sys.argv and os.environ as JSON. The test compares them, exactly, with the
arguments of the inventory and the values `clusterenv.task_env` computed.

Also: the env file alone through `systemd-run -p EnvironmentFile=` (the parser without
the rest of the unit), and systemd's own view of the unit (loaded, no parse warnings).
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest
import yaml

from clirun import wait_until
from provision.inventory.inventory import parse
from provision.render.clusterenv import job_cluster, task_env
from provision.render.files import render

pytestmark = pytest.mark.integration

HOSTILE = {
    "Q_EMPTY": "",
    "Q_SPACES": "  leading and trailing  ",
    "Q_DQUOTE": 'say "hi"',
    "Q_SQUOTE": "it's",
    "Q_BACKSLASH": "C:\\path\\to",
    "Q_TRAILING_BACKSLASH": "ends\\",
    "Q_DOLLAR": "$HOME ${HOME} $$ $",
    "Q_PERCENT": "%h %n %% 100%",
    "Q_BACKQUOTE": "`id` $(id)",
    "Q_HASH": "# not a comment",
    "Q_SEMICOLON": "a;b ; c",
    "Q_EQUALS": "a=b=c",
    "Q_ONLY_EQUALS": "=",
    "Q_TAB": "a\tb",
    "Q_NEWLINE": "line1\nline2\n",
    "Q_CR": "carriage\rreturn",
    "Q_CRLF": "crlf\r\n",
    "Q_INJECT": '"\nEVIL=1',
    "Q_INJECT2": '\\"\nEVIL2=1\n#',
    "Q_CONTINUATION": "x\\\nEVIL3=1",
    "Q_UNICODE": "ünïcödé ✓ 日本語 🚀",
    "Q_CONTROL": "\x01\x1b[31mred\x7f",
    "Q_JSON": '{"a":[1,"b\\"c"],"d":"$e"}',
}

HOSTILE_ARGS = [
    ";",
    "a;b",
    "$HOME",
    "${HOME}",
    "$$",
    "%h",
    "%%",
    '"',
    "'",
    "\\",
    "\\;",
    "two words",
    " ",
    "",
    "line1\nline2",
    "cr\r",
    "tab\t",
    "`id`",
    "#hash",
    "-",
    "--flag=x y",
    "ünïcödé 🚀",
    "\x01\x7f",
]

# The task: its program text has quotes, newlines, '%', '$', '#', backslashes.
PROGRAM = r"""
import json, os, sys
# a comment with "double" and 'single' quotes, $HOME, %h, `id` and a backslash \
out = {"argv": sys.argv[1:], "env": dict(os.environ)}
path = "/run/provision-test/%s-%s.json" % (os.environ["PROVISION_JOB"], os.environ["PROVISION_TASK"])
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(out, f)
os.replace(path + ".tmp", path)
"""


@pytest.fixture(scope="module")
def rendered_job(sandbox4, sandbox_inventory, tmp_path_factory):
    job = f"sysparse-{int(time.time()) % 100000}"
    command = ["/usr/bin/python3", "-c", PROGRAM, *HOSTILE_ARGS]
    inv_dict = sandbox_inventory(
        sandbox4,
        job=job,
        hosts=["host-1"],
        pools={"chief": {"replicas": 1, "command": command}, "worker": {"replicas": 1, "command": command}},
        env=HOSTILE,
    )
    path = tmp_path_factory.mktemp("sysparse") / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv_dict, allow_unicode=True, sort_keys=False))
    inv = parse(path.read_text(), path)
    rendered = render(inv)
    jc = job_cluster(inv, rendered.placement)
    expected = {t.name: dict(task_env(inv, t, jc)) for t in rendered.placement.tasks}
    return inv, rendered, expected, command


def _sh(c, cmd: str, **kw):
    return c.run(cmd, hide=True, warn=True, **kw)


@pytest.fixture(scope="module")
def installed(sandbox4, rendered_job):
    """Push every rendered file of host-1 (modes kept), daemon-reload, start each task unit
    and wait until it has finished; yield the connection. Removed afterwards."""
    inv, rendered, _expected, _ = rendered_job
    bundle = rendered.hosts["host-1"]
    c = sandbox4.connection("host-1")
    sftp = c.sftp()
    for f in bundle.files:
        _sh(c, f"mkdir -p {shlex.quote(str(Path(f.path).parent))}")
        with sftp.open(f.path, "wb") as out:
            out.write(f.data())
        sftp.chmod(f.path, f.mode)
    assert _sh(c, "systemctl daemon-reload").ok
    for u in bundle.tasks:
        _sh(c, f"rm -f /run/provision-test/{inv.job}-{u.task.name}.json")
        r = _sh(c, f"systemctl start {u.unit}")
        assert r.ok, r.stderr
    for u in bundle.tasks:
        wait_until(
            lambda unit=u.unit: not _sh(c, f"systemctl is-active -q {unit}").ok, 60, 0.2, what=f"{u.unit} to end"
        )
    yield c
    units = " ".join(u.unit for u in bundle.tasks)
    _sh(c, f"systemctl stop {units} provision-{inv.job}.target; systemctl reset-failed {units}")
    paths = " ".join(shlex.quote(f.path) for f in bundle.files)
    _sh(c, f"rm -rf {paths} /etc/provision/{inv.job} /run/provision-test; systemctl daemon-reload")
    c.close()


def _dump(c, job: str, task: str) -> dict:
    r = _sh(c, f"cat /run/provision-test/{job}-{task}.json")
    assert r.ok, f"{task} wrote nothing: " + _sh(c, f"journalctl -u provision-{job}-{task} --no-pager -n 30").stdout
    return json.loads(r.stdout)


@pytest.mark.parametrize("task", ["chief-0", "worker-0"])
def test_unit_runs_with_exact_argv_and_environment(installed, rendered_job, task):
    inv, _rendered, expected, command = rendered_job
    unit = f"provision-{inv.job}-{task}.service"
    show = _sh(installed, f"systemctl show {unit} -p Result -p ExecMainStatus -p LoadState").stdout
    assert "LoadState=loaded" in show and "Result=success" in show and "ExecMainStatus=0" in show, show
    got = _dump(installed, inv.job, task)
    # argv: every hostile argument arrives as one argv entry, byte for byte
    assert got["argv"] == command[3:]
    # environment: every value provision computed, exactly (TF_CONFIG, CLUSTER_SPEC, ...)
    env = got["env"]
    want = expected[task]
    mismatched = {k: (v, env.get(k)) for k, v in want.items() if env.get(k) != v}
    assert not mismatched
    for evil in ("EVIL", "EVIL2", "EVIL3"):
        assert evil not in env, f"a value injected {evil}"
    # and the JSON values parse as what they are
    assert json.loads(env["CLUSTER_SPEC"])["task"]["type"] == ("workerpool0" if task == "chief-0" else "workerpool1")
    assert json.loads(env["TF_CONFIG"])["task"]["index"] == 0


def test_unit_file_loads_without_warnings(installed, rendered_job):
    """systemd read every line of the unit: no 'Unknown key', 'Invalid', 'Ignoring' about it."""
    inv, *_ = rendered_job
    log = _sh(installed, "journalctl -b --no-pager -o cat _PID=1").stdout  # PID 1 reads unit files
    assert "Reload" in log or "reload" in log or "Started" in log, "no PID 1 messages in the journal"
    complaints = [
        line
        for line in log.splitlines()
        if f"provision-{inv.job}-" in line
        and any(w in line for w in ("Unknown", "Invalid", "Ignoring", "Failed to parse", "not valid", "Missing"))
    ]
    assert not complaints, complaints


def test_env_file_alone_through_systemd_run(installed, rendered_job):
    """The EnvironmentFile= parser by itself: systemd-run with only that property."""
    inv, _rendered, expected, _ = rendered_job
    env_path = f"/etc/provision/{inv.job}/chief-0.env"
    prog = "import json,os,sys; sys.stdout.write(json.dumps(dict(os.environ)))"
    r = _sh(
        installed,
        f"systemd-run --quiet --wait --pipe --collect -p EnvironmentFile={env_path} /usr/bin/python3 -c {shlex.quote(prog)}",
    )
    assert r.ok, r.stderr
    env = json.loads(r.stdout)
    want = expected["chief-0"]
    assert {k: env.get(k) for k in want} == want
    assert not {"EVIL", "EVIL2", "EVIL3"} & set(env)


def test_every_hostile_value_was_in_the_file(rendered_job):
    """Guard: the inventory really carried the hostile values to the rendered env file."""
    _inv, _rendered, expected, _command = rendered_job
    for env in expected.values():
        for k, v in HOSTILE.items():
            assert env[k] == v
