"""A dev session's parts without hosts: its names and terms (core/devsession.py), its job
(inventory/devsession.py), its program's sshd config and who is logged in
(host/devsession.py, host/logins.py: run here as the host runs them), the shell probe's
login lines (io/probe.py), and its ssh config entries (io/sshconfig.py)."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path

import paramiko
import pytest

from provision.core import devsession as dv
from provision.core.target import Target
from provision.host import devsession as hostdev
from provision.host import layout, logins
from provision.inventory.devsession import SessionSpec, program_dest, program_text, session_env, session_inventory
from provision.inventory.inventory import load
from provision.io import probe as fastprobe
from provision.io.hostkeys import KnownHosts
from provision.io.sshconfig import SshConfig, block, hops, names_in, with_include, without
from provision.render.files import render

# --------------------------------------------------------------------------- names and terms


def test_two_peoples_sessions_of_one_name_are_two_jobs():
    a, b = dv.session_job("ana@lab.example", "nb"), dv.session_job("ana@other.example", "nb")
    assert a.startswith("dev-ana-") and a.endswith("-nb") and a != b
    assert dv.session_job("ana@lab.example", "nb") == a  # the same person's: the same job
    longest = dv.session_job("averyveryverylongname@x", "a" * 20)
    assert len(longest) <= 40 and dv.alias("nb") == "provision-dev-nb"
    assert dv.default_name("Ana.Maria@lab") == "anamaria"


@pytest.mark.parametrize("name", ["", "NB", "-nb", "nb-", "a" * 21, "n b", "nb;x", "../x"])
def test_a_bad_name_is_one_line(name):
    assert dv.name_problem(name) is not None


def test_terms_from_a_host_are_bounded():
    t = dv.DevTerms("nb", "ana@lab", 10.0, 20.0, 3600, 5, "root", "img:1", True)
    assert dv.DevTerms.parse(t.to_json()) == t
    for bad in (
        {**t.to_json(), "name": "../x"},
        {**t.to_json(), "idle_s": 0},
        {**t.to_json(), "idle_below": 500},
        {**t.to_json(), "until": 5.0},  # ends before it started
        {**t.to_json(), "started": "yesterday"},
        "not terms",
    ):
        assert dv.DevTerms.parse(bad) is None, bad
    assert dv.logins_of(["ana@pts/3", "ana@notty", "x@tty1", "a b@pts/1", 7, "ana@pts/" + "9" * 9]) == (
        "ana@pts/3",
        "ana@notty",
    )
    assert dv.logins_of("ana@pts/3") == () and len(dv.logins_of(["a@notty"] * 99)) == dv.MAX_LOGINS


# --------------------------------------------------------------------------- its job


TEAM = """\
job: team
ssh: {user: root}
env: {TEAM_VAR: "from the team"}
secret_env: [NOT_FOR_SESSIONS]
hosts:
  - {name: h1, address: 127.0.0.1, accelerators: {type: nvidia-h100, count: 2}}
pools:
  chief: {replicas: 1, accelerators: 2, command: [/bin/true]}
  worker: {replicas: 0, accelerators: 2, command: [/bin/true]}
setup: {commands: ["pip install -r requirements.txt"]}
"""


def test_the_session_is_a_job_of_one_task_on_the_teams_hosts(tmp_path):
    (tmp_path / "team.yaml").write_text(TEAM)
    team = load(str(tmp_path / "team.yaml"), files_here=False)
    program = tmp_path / "session.py"
    program.write_text(program_text())
    spec = SessionSpec("dev-ana-1a2b-nb", "nb", "ana@lab", 1, "normal", "root", jupyter=True)
    inv = session_inventory(team, spec, program)
    assert [(p.role, p.replicas, p.accelerators) for p in inv.pools] == [("chief", 1, 1)]
    assert inv.setup is None and inv.secret_env == () and inv.scheduling.preemptible is True
    assert [f.dest for f in inv.files] == [program_dest(program_text())]
    env = dict(_env(render(inv)))
    assert env["PROVISION_DEV"] == "nb" and env["PROVISION_DEV_JUPYTER"] == "1" and env["TEAM_VAR"] == "from the team"
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["MASTER_PORT"] == "2222"  # the session's sshd listens there
    assert ("PROVISION_DEV_IMAGE", "x") in session_env(SessionSpec("j", "n", "o", 1, "", image="x"))


def _env(rendered) -> list[tuple[str, str]]:
    text = next(f for f in rendered.hosts["h1"].files if f.path.endswith(".env")).data().decode()
    out = []
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out.append((k, v.strip('"')))
    return out


# --------------------------------------------------------------------------- its program


def test_the_program_names_provisions_paths_as_layout_does():
    assert (hostdev.ETC, hostdev.VAR, logins.PREFIX) == (layout.ETC, layout.VAR, layout.PREFIX)
    assert hostdev.unit_of("j", "chief-0") == layout.unit_name("j", "chief-0")
    assert hostdev.ready_path("j").startswith(layout.state_dir("j") + "/")


def test_the_program_runs_alone_as_the_host_runs_it(tmp_path):
    prog = tmp_path / "session.py"
    prog.write_text(program_text())
    r = subprocess.run([sys.executable, "-S", str(prog), "bogus"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "usage:" in r.stderr
    msg = base64.b64encode(b"hello").decode()
    r = subprocess.run(
        [sys.executable, "-S", str(prog), "warn", "provision-x.service", msg],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout.strip()) == (0, "0")  # nobody logged in to a unit that is not there


@pytest.mark.parametrize(
    ("title", "want"),
    [
        ("sshd: ana@pts/3", "ana@pts/3"),
        ("sshd: ana@notty", "ana@notty"),
        ("sshd-session: ana@pts/12", "ana@pts/12"),
        ("sshd: ana [priv]", None),  # the privileged half of the same connection
        ("sshd: /usr/sbin/sshd -D -e -f /var/lib/provision/j/dev/sshd_config [listener] 0 of 10-100", None),
        ("bash: ana@pts/3", None),
        ("sshd: ana@tty1", None),
        ("sshd: an$a@pts/3", None),
    ],
)
def test_a_login_from_sshds_process_title(title, want):
    assert logins.login_of(title) == want


def test_only_a_provision_units_cgroup_is_read():
    assert logins.unit_pids("../../etc") == [] and logins.unit_pids("sshd.service") == []
    assert logins.unit_pids("provision-x/../../y.service") == []


def test_every_login_gets_the_tasks_variables_in_one_setenv_line():
    env = {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "TF_CONFIG": '{"cluster": {"chief": ["h:2222"]}, "task": {"type": "chief"}}',
        "ODD": 'a "quoted" \\ backslash # not a comment',
        "LINES": "two\nlines",  # sshd's config cannot hold it: left out
        "PATH": "/usr/bin",  # systemd's, not the task's
        "INVOCATION_ID": "abc",
        "LC_ALL": "C",
    }
    text = hostdev.sshd_config(2222, env, "ana", "", ["/etc/ssh/ssh_host_ed25519_key"])
    assert "ListenAddress 127.0.0.1:2222" in text and "UsePAM no" in text and "AllowUsers ana" in text
    setenv = [line for line in text.splitlines() if line.startswith("SetEnv")]
    assert len(setenv) == 1
    assert '"CUDA_VISIBLE_DEVICES=0,1"' in setenv[0]
    assert '"ODD=a \\"quoted\\" \\\\ backslash # not a comment"' in setenv[0]
    assert "LINES" not in setenv[0] and "PATH" not in setenv[0] and "LC_ALL" not in setenv[0]
    assert "ForceCommand" not in text
    assert "ForceCommand /x enter c" in hostdev.sshd_config(2222, env, "", "/x enter c", [])


def test_the_shell_probes_login_lines_read_as_the_agent_reads_them():
    lines = [
        "provision-dev-a-chief-0.service sshd: ana@pts/0",
        "provision-dev-a-chief-0.service sshd: ana [priv]",
        "provision-dev-a-chief-0.service sshd: ana@notty",
        "provision-dev-b-chief-0.service sshd-D-e-f/var/lib/provision/b/dev/sshd_config",
    ]
    assert fastprobe._logins(lines) == {"provision-dev-a-chief-0.service": ["ana@pts/0", "ana@notty"]}
    with pytest.raises(fastprobe._Mismatch):
        fastprobe._logins(["../x sshd: ana@pts/0"])


# --------------------------------------------------------------------------- ssh config


def _target(**kw) -> Target:
    base = {"name": "host-1", "address": "10.0.0.5", "port": 2200, "user": "ana", "identity_file": "/k/id"}
    return Target(**{**base, **kw})


def test_the_sessions_block_two_hops_and_its_key_alias(tmp_path):
    text = block("nb", "dev-ana-1a2b-nb", hops("provision-dev-nb", _target(), 2222), tmp_path / "kh")
    assert text.startswith("# >>> provision dev nb (job dev-ana-1a2b-nb)") and text.endswith("# <<< provision dev nb\n")
    host, session = text.split("Host provision-dev-nb\n")
    assert "Host provision-dev-nb-host\n  HostName 10.0.0.5\n  Port 2200\n  User ana\n  IdentityFile /k/id\n" in host
    assert "  HostName 127.0.0.1\n  Port 2222\n" in session and "  ProxyJump provision-dev-nb-host\n" in session
    assert (
        f"  HostKeyAlias provision-dev-nb\n  StrictHostKeyChecking accept-new\n  UserKnownHostsFile {tmp_path / 'kh'}\n"
        in session
    )
    assert "RemoteCommand" not in text  # editors connect to it as to any host
    jumped = block("nb", "j", hops("provision-dev-nb", _target(jump_host="bob@jump:2022"), 2222), tmp_path / "kh")
    assert "Host provision-dev-nb-jump\n  HostName jump\n  Port 2022\n  User bob\n" in jumped
    assert "  ProxyJump provision-dev-nb-jump\n" in jumped
    off = block("nb", "j", hops("provision-dev-nb", _target(host_key_policy="off"), 2222), tmp_path / "kh")
    assert "UserKnownHostsFile /dev/null" in off


def test_blocks_come_and_go_whole_and_the_include_line_once_at_the_top(tmp_path):
    mine = "Host *\n  ServerAliveInterval 60\n"
    two = (
        mine
        + block("a", "ja", hops("provision-dev-a", _target(), 1), tmp_path)
        + block("b", "jb", hops("provision-dev-b", _target(), 2), tmp_path)
    )
    assert names_in(two) == ["a", "b"]
    assert without(two, "a") == mine + block("b", "jb", hops("provision-dev-b", _target(), 2), tmp_path)
    assert without(without(two, "a"), "b") == mine
    inc = tmp_path / "p" / "config"
    added = with_include(mine, inc)
    assert added == f"Include {inc}\n" + mine and with_include(added, inc) is None


def test_put_and_remove_in_a_home_of_its_own(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host work\n  User me\n")
    kh = tmp_path / "known_hosts"
    key = paramiko.Ed25519Key.from_private_key_file(_key(tmp_path))
    known = KnownHosts(kh)
    known.learn("[10.0.0.5]:2200", key)
    cfg = SshConfig(home)
    cfg.put("nb", "dev-ana-1a2b-nb", _target(), 2222, known)
    main = (home / ".ssh" / "config").read_text()
    assert main == f"Include {home / '.ssh' / 'provision' / 'config'}\nHost work\n  User me\n"
    lines = cfg.known.read_text().splitlines()
    b64 = base64.b64encode(key.asbytes()).decode()
    assert sorted(lines) == sorted([f"[10.0.0.5]:2200 ssh-ed25519 {b64}", f"provision-dev-nb ssh-ed25519 {b64}"])
    assert oct(cfg.config.stat().st_mode & 0o777) == "0o600" and cfg.names() == ["nb"]
    cfg.put("nb", "dev-ana-1a2b-nb", _target(), 2223, known)  # again: replaced, not added
    assert cfg.config.read_text().count("# >>> provision dev nb") == 1 and "Port 2223" in cfg.config.read_text()
    assert cfg.remove("nb") and cfg.names() == [] and not cfg.remove("nb")
    assert (home / ".ssh" / "config").read_text() == main  # the Include stays; the user's lines as they were


def _key(tmp_path: Path) -> str:
    path = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return str(path)
