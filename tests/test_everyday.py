"""`provision exec`, `ssh`, `init` and task completion, without hosts: the command exec runs
(in a local sh, against an env file as render writes it), ssh's command line, the
inventory init writes, and the task names completion offers."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from provision.cli.app import main
from provision.cli.everyday import init_text
from provision.core.errors import ValidationError
from provision.core.target import Target
from provision.inventory.inventory import load, parse
from provision.run.remote import NOT_APPLIED, exec_script, shell_command, ssh_argv

JOB = """\
job: j
hosts:
- {name: h1, address: 192.0.2.1}
- {name: h2, address: 192.0.2.2}
env: {TRICKY: "a \\"quoted\\" $dollar `tick` \\\\ back"}
pools:
  chief: {replicas: 1, command: [python3, x.py]}
  worker: {replicas: 2, command: [python3, x.py]}
"""


def test_exec_script_loads_the_env_file_as_systemd_does(tmp_path):
    from provision.render.files import render, write_tree

    inv = parse(JOB, tmp_path / "inv.yaml")
    write_tree(render(inv), tmp_path / "out")
    env_file = next((tmp_path / "out").rglob("worker-1.env"))
    cmd = exec_script(
        str(env_file), ["sh", "-c", 'printf "%s|%s|%s" "$PROVISION_TASK" "$TRICKY" "$1"; exit 7', "-", "a b"]
    )
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    assert r.returncode == 7
    assert r.stdout == 'worker-1|a "quoted" $dollar `tick` \\ back|a b'
    missing = subprocess.run(
        exec_script(str(tmp_path / "nope.env"), ["true"]), shell=True, capture_output=True, text=True
    )
    assert missing.returncode == NOT_APPLIED and "is the job applied?" in missing.stderr


def test_ssh_argv_reaches_the_host_as_provision_does(tmp_path):
    t = Target("h1", "192.0.2.1", 2222, "ops", "~/.ssh/id_x", "bastion:22", 7.5, "strict")
    argv = ssh_argv(t, tmp_path / "known_hosts", remote=[shell_command("/etc/provision/j/chief-0.env", sudo=True)])
    assert argv[:5] == ["ssh", "-t", "-p", "2222", "-i"]
    assert ["-J", "bastion:22"] == argv[argv.index("-J") : argv.index("-J") + 2]
    assert "StrictHostKeyChecking=yes" in argv and "ConnectTimeout=7" in argv
    assert any(a.startswith(f"UserKnownHostsFile={tmp_path / 'known_hosts'} ") for a in argv)
    assert argv[-2] == "ops@192.0.2.1" and argv[-1].startswith("sudo -E sh -c ")
    inner = shlex.split(shlex.split(argv[-1])[-1])  # sudo -E sh -c CMD: CMD's words
    assert inner[:3] == ["python3", "-S", "-c"] and inner[4:6] == ["--if-present", "/etc/provision/j/chief-0.env"]
    assert inner[-2:] == ["${SHELL:-/bin/sh}", "-i"] or inner[-1] == "-i"
    off = ssh_argv(Target("h", "a", host_key_policy="off"), tmp_path / "k", remote=["uptime"], tty=False)
    assert off == [
        "ssh",
        "-o",
        "ConnectTimeout=10",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "a",
        "uptime",
    ]


def test_init_writes_a_valid_commented_inventory(tmp_path):
    text = init_text(
        ["gpu-1=10.0.0.11", "10.0.0.12"],
        job="train",
        out="inventory.yaml",
        user="root",
        port=None,
        identity_file=None,
        facts={"gpu-1": {"gpus": [{"name": "NVIDIA H100 80GB HBM3"}] * 8}, "host-2": {"gpus": []}},
    )
    assert "# provision inventory, written by `provision init`" in text
    assert "accelerators: {type: nvidia-h100-80gb-hbm3, count: 8}   # from nvidia-smi" in text
    inv = parse(text, tmp_path / "inventory.yaml")
    assert [h.name for h in inv.hosts] == ["gpu-1", "host-2"]
    assert [(p.role, p.replicas) for p in inv.pools] == [("chief", 1), ("worker", 1)]
    bare = init_text(["a", "b", "c"], job="j", out="i.yaml", user=None, port=None, identity_file=None)
    assert "# accelerators: {type: nvidia-h100, count: 8}" in bare
    parse(bare, tmp_path / "i.yaml")


def test_init_command_refuses_to_overwrite(tmp_path):
    runner = CliRunner()
    with runner.isolated_filesystem(temp_dir=tmp_path):
        r = runner.invoke(main, ["init", "h1=192.0.2.1", "--job", "demo"])
        assert r.exit_code == 0, r.output
        assert Path("inventory.yaml").exists() and "Wrote inventory.yaml: job demo on 1 host." in r.output
        r = runner.invoke(main, ["init", "h1=192.0.2.1"])
        assert r.exit_code == 1 and "already exists; give --force" in r.output
        assert runner.invoke(main, ["validate", "inventory.yaml"]).exit_code == 0


def test_task_names_complete(tmp_path, monkeypatch):
    inv = tmp_path / "inv.yaml"
    inv.write_text(JOB)
    monkeypatch.chdir(tmp_path)
    for words in (["logs", "inv.yaml"], ["exec", "inv.yaml"], ["ssh", "inv.yaml"]):
        env = {"_PROVISION_COMPLETE": "bash_complete", "COMP_WORDS": " ".join(["provision", *words, "w"])}
        env["COMP_CWORD"] = str(len(words) + 1)
        r = CliRunner().invoke(main, [], env=env, prog_name="provision")
        assert r.output.split() == ["plain,worker-0", "plain,worker-1"], (words, r.output)


@pytest.mark.parametrize(
    "word",
    [
        "h1=10.0.0.1\nhost_key_policy: off",  # a newline would have been YAML of its own
        "h1=10.0.0.1\njump_host: attacker.example",
        "h 1=10.0.0.1",
        "h1=http://10.0.0.1/",
        "h1=10.0.0.1:99999",
        "h1=[10.0.0.1]:22",
        "h1=",
    ],
)
def test_init_refuses_what_is_not_a_host_naming_the_word(tmp_path, word):
    runner = CliRunner()
    with runner.isolated_filesystem(temp_dir=tmp_path):
        r = runner.invoke(main, ["init", word])
        assert r.exit_code == 1, r.output
        assert r.output.startswith(f"Error: {word!r}: ") and "Traceback" not in r.output
        assert not Path("inventory.yaml").exists()


def test_init_quotes_values_and_takes_ports(tmp_path):
    runner = CliRunner()
    with runner.isolated_filesystem(temp_dir=tmp_path):
        r = runner.invoke(
            main,
            ["init", "g1=127.0.0.1:39639", "g2=[fd00::2]:2202", "fd00::3", "--user", "ops", "-i", "~/k"],
        )
        assert r.exit_code == 0, r.output
        inv = load("inventory.yaml")
        assert [(h.name, h.address, h.ssh.port, h.ssh.user) for h in inv.hosts] == [
            ("g1", "127.0.0.1", 39639, "ops"),
            ("g2", "fd00::2", 2202, "ops"),
            ("host-3", "fd00::3", None, "ops"),  # None: ssh_config's, else 22
        ]
        # A hostile --user stays one value: validate refuses it, no key of its own appears.
        r = runner.invoke(main, ["init", "g1=127.0.0.1", "--user", "ops\nhost_key_policy: off", "-o", "bad.yaml"])
        assert r.exit_code == 0, r.output
        with pytest.raises(ValidationError, match="ssh.user"):
            load("bad.yaml")


@pytest.mark.parametrize("command", [["init", "h1=192.0.2.1"], ["import", "vertex", "spec.yaml"]])
def test_an_output_that_is_a_link_is_refused(tmp_path, command):
    runner = CliRunner()
    with runner.isolated_filesystem(temp_dir=tmp_path):
        Path("spec.yaml").write_text(
            "workerPoolSpecs: [{machineSpec: {machineType: n1}, replicaCount: 1, containerSpec: {imageUri: x}}]\n"
        )
        target = Path(tmp_path / "elsewhere" / "made.yaml")
        Path("out.yaml").symlink_to(target)  # dangling: following it would create the target
        r = runner.invoke(main, [*command, "-o", "out.yaml", "--force"])
        assert r.exit_code == 1 and "out.yaml: is a symbolic link; refused" in r.output, r.output
        assert not target.exists() and Path("out.yaml").is_symlink()


def test_exec_reads_the_env_file_as_data_never_as_a_shell(tmp_path):
    """item 3: the env file was sourced by sh as root; a line of shell in it ran.
    Now it is data: a line that is not KEY="value" is refused and nothing runs; a value
    holding shell is passed as is; a link or an untrusted directory is refused."""
    d = tmp_path / "etc"
    d.mkdir()
    env = d / "chief-0.env"
    pwned = tmp_path / "pwned"
    env.write_text(f'A="$(touch {pwned})"\ntouch {pwned}\n')
    r = subprocess.run(exec_script(str(env), ["true"]), shell=True, capture_output=True, text=True)
    assert r.returncode == NOT_APPLIED and "line 2 is not KEY=" in r.stderr and not (tmp_path / "pwned").exists()
    env.write_text(f'A="$(touch {pwned})"\n')
    r = subprocess.run(
        exec_script(str(env), ["sh", "-c", 'printf %s "$A"']), shell=True, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout == f"$(touch {tmp_path / 'pwned'})" and not (tmp_path / "pwned").exists()
    link = d / "worker-0.env"
    link.symlink_to(env)
    r = subprocess.run(exec_script(str(link), ["true"]), shell=True, capture_output=True, text=True)
    assert r.returncode == NOT_APPLIED and "provision:" in r.stderr
    d.chmod(0o777)
    r = subprocess.run(exec_script(str(env), ["true"]), shell=True, capture_output=True, text=True)
    assert r.returncode == NOT_APPLIED and "writable by group or others" in r.stderr
