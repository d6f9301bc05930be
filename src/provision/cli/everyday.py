"""Everyday commands: `provision exec`, `provision ssh`, `provision init`."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from provision.core.errors import ProvisionError
from provision.core.target import HostError, Target
from provision.core.text import printable
from provision.host import layout
from provision.host.protocol import ALL_FACTS, ProbeRequest
from provision.inventory.address import split as address_split
from provision.inventory.inventory import DNS_LABEL, HOST_NAME
from provision.io.hostkeys import KnownHosts
from provision.io.outfile import check_output, write_output
from provision.io.ssh import Session, call_agent
from provision.rules.fabricfacts import fabric_of
from provision.run.context import open_context
from provision.run.remote import complete_tasks, exec_script, run_exec, shell_command, ssh_argv


def _words(command: Sequence[str]) -> list[str]:
    """The command's words (click keeps the `--` that separates them)."""
    words = list(command)
    return words[1:] if words[:1] == ["--"] else words


@click.command(
    "exec",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.argument("inventory", type=click.Path())
@click.argument("task", shell_complete=complete_tasks)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- COMMAND...")
@click.option("--state", "state_path", type=click.Path(), help="State file.")
@click.option("-v", "--verbose", is_flag=True, help="Show the SSH commands.")
def exec_cmd(inventory: str, task: str, command: tuple[str, ...], state_path: str | None, verbose: bool) -> None:
    """Run COMMAND on TASK's host with the task's environment; its output and exit code.

    The words after `--` are run as given (no shell), as root, with every variable of the
    task's environment file set (TF_CONFIG, MASTER_ADDR, CUDA_VISIBLE_DEVICES, ...).
    """

    words = _words(command)
    ctx = open_context(inventory, state_path=state_path, verbose=verbose, render_secrets=False)
    try:
        code = run_exec(ctx, task, words)
    finally:
        ctx.close()
    sys.exit(code)


@click.command("ssh", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("inventory", type=click.Path())
@click.argument("task", shell_complete=complete_tasks)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, metavar="[-- COMMAND...]")
@click.option("--state", "state_path", type=click.Path(), help="State file.")
@click.option("--print", "print_only", is_flag=True, help="Print the ssh command line instead of running it.")
def ssh_cmd(inventory: str, task: str, command: tuple[str, ...], state_path: str | None, print_only: bool) -> None:
    """An interactive shell on TASK's host, in the task's environment (OpenSSH's ssh).

    With `-- COMMAND...`, that command instead of a shell, in the task's environment, its
    words passed as given (as `provision exec` does; no remote shell re-reads them).
    """
    words = _words(command)
    ctx = open_context(inventory, state_path=state_path, render_secrets=False)
    ctx.close()  # nothing to ask the hosts: the placement and the known hosts are enough
    tasks = {t.name: t for t in ctx.rendered.placement.tasks}
    if task not in tasks:
        raise ProvisionError(f"no task named {task} in job {ctx.inventory.job} (tasks: {', '.join(tasks) or 'none'})")
    target = Target.from_host(tasks[task].host)
    env_file = layout.env_path(ctx.inventory.job, task)
    sudo = (target.user or "root") != "root"
    if words:  # one string the remote shell reads back into exactly these words
        remote = [("sudo -n " if sudo else "") + exec_script(env_file, words)]
    else:
        remote = [shell_command(env_file, sudo=sudo)]
    argv = ssh_argv(target, ctx.state.known_hosts_path, remote=remote, tty=not words)
    if print_only:
        click.echo(" ".join(shlex.quote(a) for a in argv))
        return
    if shutil.which("ssh") is None:
        raise ProvisionError(
            "ssh: OpenSSH's `ssh` is not installed here (use `provision ssh --print` to see the command)"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp("ssh", argv)


INIT_TEMPLATE = """\
# provision inventory, written by `provision init`. Reference: docs/inventory.md.
# Next: edit the pools, then
#   provision validate {out}
#   provision plan {out}
#   provision apply {out}
job: {job}

# How to reach the hosts (each host may override any of these).
ssh:
{ssh}
# The machines the job runs on. `address` is where SSH connects; `cluster_address` (if
# given) is where the tasks reach each other. Declare the accelerators each host has:
# plan checks them against nvidia-smi (GPUs) or /dev/accel* (TPU chips).
hosts:
{hosts}
# What runs: one pool per role (chief, worker, ps, evaluator, reduction_server).
# Each replica is one task, placed on a host with enough free accelerators.
pools:
  chief:
    replicas: 1
{acc_line}    command: [python3, train.py]      # CHANGE: your program (an absolute path is safest)
  worker:
    replicas: {workers}
{acc_line}    command: [python3, train.py]      # CHANGE

# Files to copy to every host before the tasks start (src is relative to this file):
# files:
#   - {{src: train.py, dest: /opt/{job}/train.py}}

# Environment for every task (provision adds TF_CONFIG, MASTER_ADDR, ...: docs/environment.md):
# env:
#   EPOCHS: "10"
# secret_env: [WANDB_API_KEY]   # copied from your shell at apply time, never stored
"""


def _host_entry(spec: str, i: int) -> tuple[str, str, int | None]:
    """`[NAME=]ADDRESS[:PORT]` -> (name, address, port or None); one line naming the word
    for anything that is not a host name or IP literal (a newline or a YAML key would
    otherwise land in the inventory as YAML of its own)."""
    name, eq, address = spec.partition("=")
    if not eq:
        name, address = f"host-{i}", spec
    if not HOST_NAME.fullmatch(name):
        raise ProvisionError(f"{spec!r}: the name {name!r} is not a host name (letters, digits, '.', '_', '-')")
    try:
        host, port = address_split(address)
    except ValueError as e:
        raise ProvisionError(f"{spec!r}: {e}") from None
    return name, host, port


def _q(value: str) -> str:
    """A value as a YAML scalar that stays one value: JSON's double-quoted string is YAML's."""
    return json.dumps(value, ensure_ascii=False)


def init_text(
    hosts: list[str],
    *,
    job: str,
    out: str,
    user: str | None,
    port: int | None,
    identity_file: str | None,
    facts: dict[str, dict[str, Any]] | None = None,
) -> str:
    """The commented inventory `provision init` writes (facts: host name -> its facts)."""
    ssh = []
    ssh.append(
        f"  user: {_q(user)}" if user else "  # user: root                 # default: ~/.ssh/config, then your login"
    )
    ssh.append(f"  port: {port}" if port else "  # port: 22")
    ssh.append(f"  identity_file: {_q(identity_file)}" if identity_file else "  # identity_file: ~/.ssh/id_ed25519")
    ssh.append("  host_key_policy: accept-new     # strict | accept-new | off")
    lines = []
    counts = []
    for i, spec in enumerate(hosts, 1):
        name, address, host_port = _host_entry(spec, i)
        lines.append(f"  - name: {_q(name)}")
        lines.append(f"    address: {_q(address)}")
        if host_port is not None:
            lines.append(f"    port: {host_port}")
        f = (facts or {}).get(name)
        gpus = (f or {}).get("gpus") or []
        tpu = int((f or {}).get("tpu_chips") or 0)
        if gpus:
            model = sorted({g.get("name", "gpu") for g in gpus})[0]
            kind = "nvidia-" + model.lower().replace("nvidia ", "").replace(" ", "-")
            lines.append(f"    accelerators: {{type: {kind}, count: {len(gpus)}}}   # from nvidia-smi")
            counts.append(len(gpus))
        elif tpu:
            found = f"{tpu} chip{'' if tpu == 1 else 's'} found"
            lines.append(f"    accelerators: {{type: tpu-v4, count: {tpu}}}   # CHANGE the type; {found}")
            counts.append(tpu)
        elif f is not None:
            lines.append("    # no accelerators found (nvidia-smi, /dev/accel*)")
            counts.append(0)
        else:
            lines.append("    # accelerators: {type: nvidia-h100, count: 8}")
        hw = fabric_of(f).labels() if f is not None else {}
        if hw:  # what placement's prefer_same can group the hosts by
            pairs = ", ".join(f"{k}: {_q(v)}" for k, v in sorted(hw.items()))
            lines.append(f"    labels: {{{pairs}}}   # from the hardware (provision facts)")
    per = min(counts) if counts and min(counts) > 0 else 0
    acc_line = f"    accelerators: {per}\n" if per else "    # accelerators: 1               # per replica\n"
    workers = max(1, len(hosts) - 1)
    return INIT_TEMPLATE.format(
        out=out, job=job, ssh="\n".join(ssh), hosts="\n".join(lines), acc_line=acc_line, workers=workers
    )


@click.command("init")
@click.argument("hosts", nargs=-1, required=True, metavar="[NAME=]ADDRESS...")
@click.option("-o", "--output", "out", default="inventory.yaml", show_default=True, help="The inventory to write.")
@click.option("--job", default="train", show_default=True, help="The job's name (a DNS label).")
@click.option("--user", help="SSH user (default: ~/.ssh/config, then your login).")
@click.option("--port", type=click.IntRange(1, 65535), help="SSH port (default 22).")
@click.option("-i", "--identity-file", "identity_file", help="SSH private key.")
@click.option("--facts", "read_facts", is_flag=True, help="Connect to the hosts and fill in their accelerators.")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
def init_cmd(
    hosts: tuple[str, ...],
    out: str,
    job: str,
    user: str | None,
    port: int | None,
    identity_file: str | None,
    read_facts: bool,
    force: bool,
) -> None:
    """Write a commented inventory for HOSTS (NAME=ADDRESS, or ADDRESS named host-1, ...)."""

    path = Path(out)
    check_output(path, out, force=force)
    for i, spec in enumerate(hosts, 1):
        _host_entry(spec, i)  # every word checked before anything is asked or written
    if not DNS_LABEL.fullmatch(job):
        raise ProvisionError(f"--job {job!r}: expected a DNS-1035 label (a-z, 0-9, '-', starting with a letter)")
    facts = _facts(hosts, user, port, identity_file, path) if read_facts else None
    text = init_text(list(hosts), job=job, out=out, user=user, port=port, identity_file=identity_file, facts=facts)
    write_output(path, text, out, force=force)
    click.echo(
        f"Wrote {out}: job {job} on {len(hosts)} host{'s' if len(hosts) != 1 else ''}. Next: edit its pools, then"
    )
    click.echo(f"  provision validate {out}")


def _facts(
    hosts: Sequence[str], user: str | None, port: int | None, identity_file: str | None, path: Path
) -> dict[str, dict[str, Any]]:
    """Each host's facts, asked in parallel over SSH (host keys learnt beside the inventory)."""

    targets = []
    for i, spec in enumerate(hosts, 1):
        name, address, host_port = _host_entry(spec, i)
        targets.append(Target(name, address, host_port or port, user, identity_file, None, 10.0, "accept-new"))
    known = KnownHosts(path.resolve().parent / ".provision" / "known_hosts")
    out: dict[str, dict[str, Any]] = {}
    with Session(known) as session:
        res = session.map(lambda t: call_agent(session, t, ProbeRequest("init", files=False, facts=ALL_FACTS)), targets)
    for name, r in res.items():
        if isinstance(r, HostError):
            click.echo(
                f"Warning: {r.target.where}: {printable(r.message)}; its accelerators are left to fill in", err=True
            )
        else:
            out[name] = r.facts or {}
    return out
