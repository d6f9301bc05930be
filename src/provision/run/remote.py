"""`provision exec` and `provision ssh`: a command, or a shell, on a task's host, in the
task's environment; and the shell completion of task names.

exec runs a small Python program on the host (host/taskenv.main) that reads the task's
environment file as data, as systemd reads it (never sourced by a shell; its directories
checked as the agent checks them, the file opened without following a link), and then
execs the command with its words as given, as root (or through `sudo -n`, like every
other command: the file is the job's, mode 0600). Output is streamed as it comes, stdout to stdout and stderr to stderr;
the exit code is the command's.

ssh replaces this process with OpenSSH's `ssh`, with what the inventory says of the host
(user, port, identity file, jump host, timeout) and the host keys the state has learnt.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from click.shell_completion import CompletionItem

from provision.core.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_UNREACHABLE, ProvisionError
from provision.core.target import HostError, Target
from provision.host import bundle, layout
from provision.inventory.inventory import load
from provision.placement.tasks import place
from provision.run.context import Context

NOT_APPLIED = 125  # the script's own code when the env file is not there


def task_target(ctx: Context, task: str) -> tuple[Target, str]:
    """The task's host as a Target, and its env file, or a one-line error naming the tasks."""
    placed = {t.name: t for t in ctx.rendered.placement.tasks}
    if task not in placed:
        names = ", ".join(placed) or "none"
        raise ProvisionError(f"no task named {task} in job {ctx.inventory.job} (tasks: {names})")
    host = placed[task].host.name
    if host not in ctx.targets:
        raise ProvisionError(f"{task} runs on {host}, which is not among the --target hosts")
    return ctx.targets[host], layout.env_path(ctx.inventory.job, task)


def _loader() -> str:
    """The host program that reads the env file as data (host/taskenv.main, with
    host/trust.py's check) and execs the command."""
    trust, taskenv = bundle.source("trust"), bundle.source("taskenv")
    return (
        "import sys\ng = {'__name__': 'provision_exec'}\n"
        f"exec(compile({trust!r}, 'trust', 'exec'), g)\nexec(compile({taskenv!r}, 'taskenv', 'exec'), g)\n"
        "g['main'](sys.argv[1:])\n"
    )


def exec_script(env_file: str, argv: Sequence[str]) -> str:
    """The command for the host: argv run with the task's environment added, read from the
    env file as data (never sourced by a shell; its directories checked, no link followed)."""
    words = ["python3", "-S", "-c", _loader(), env_file, *argv]
    return " ".join(shlex.quote(w) for w in words)


def run_exec(ctx: Context, task: str, argv: Sequence[str], *, stdout: Any = None, stderr: Any = None) -> int:  # noqa: C901  the channel's pump and the exit code's meanings in one place
    """Run argv on the task's host in its environment; stream its output; its exit code."""

    if not argv:
        raise ProvisionError("exec: no command given (provision exec INVENTORY TASK -- COMMAND...)")
    target, env_file = task_target(ctx, task)
    out = stdout or sys.stdout.buffer
    err = stderr or sys.stderr.buffer
    session = ctx.session
    try:
        conn = session.connect(target)
    except HostError as e:  # a down host (3) or a changed key (1): one line, as every command
        raise ProvisionError(str(e), exit_code=EXIT_UNREACHABLE if e.unreachable else EXIT_ERROR) from None
    command = exec_script(env_file, argv)
    if not session.is_root(target):
        command = "sudo -n " + command
    if session.verbose:
        print(f"[{target.name}] $ {command}", file=sys.stderr)
    chan = conn.client.get_transport().open_session(timeout=target.connect_timeout)
    try:
        # The words' bytes as the shell gave them to us (not UTF-8 too: surrogate-escaped).
        chan.exec_command(command.encode("utf-8", "surrogateescape"))
        chan.shutdown_write()
        while True:
            busy = False
            if chan.recv_ready():
                out.write(chan.recv(65536))
                out.flush()
                busy = True
            if chan.recv_stderr_ready():
                err.write(chan.recv_stderr(65536))
                err.flush()
                busy = True
            # The exit status comes after all of the output (one ordered channel).
            if not busy and chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                break
            if not busy:
                time.sleep(0.01)
        status = chan.recv_exit_status()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        chan.close()
    if status == NOT_APPLIED:
        return EXIT_ERROR
    return status if status >= 0 else EXIT_ERROR


def ssh_argv(target: Target, known_hosts: Path, *, remote: Sequence[str] = (), tty: bool = True) -> list[str]:
    """OpenSSH's command line for the host, as provision itself reaches it."""
    argv = ["ssh"]
    if tty:
        argv.append("-t")
    if target.port:
        argv += ["-p", str(target.port)]
    if target.identity_file:
        argv += ["-i", os.path.expanduser(target.identity_file), "-o", "IdentitiesOnly=yes"]
    if target.jump_host:
        argv += ["-J", target.jump_host]
    argv += ["-o", f"ConnectTimeout={max(1, int(target.connect_timeout))}"]
    policy = target.host_key_policy
    if policy == "off":
        argv += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    else:
        # The keys provision learnt (beside the state), then the user's own.
        files = f"{known_hosts} {os.path.expanduser('~/.ssh/known_hosts')}"
        argv += ["-o", f"UserKnownHostsFile={files}"]
        argv += ["-o", "StrictHostKeyChecking=" + ("yes" if policy == "strict" else "accept-new")]
    dest = f"{target.user}@{target.address}" if target.user else target.address
    argv.append(dest)
    argv += list(remote)
    return argv


def shell_command(env_file: str, sudo: bool) -> str:
    """An interactive login shell in /, with the task's environment added when its file
    is there (read as data, as for exec)."""
    inner = 'cd / && exec "$@"'
    loader = " ".join(
        shlex.quote(w) for w in ["python3", "-S", "-c", _loader(), "--if-present", env_file, "sh", "-c", inner, "sh"]
    )
    cmd = loader + ' "${SHELL:-/bin/sh}" -i'
    return f"sudo -E sh -c {shlex.quote(cmd)}" if sudo else cmd


def complete_tasks(ctx: Any, param: Any, incomplete: str) -> list[Any]:
    """Shell completion of TASK: the task names of the inventory given before it."""

    inventory = ctx.params.get("inventory")
    if not inventory:
        return []
    try:
        inv = load(inventory)
        names = [t.name for t in place(inv).tasks]
    except Exception:  # noqa: BLE001 - completion must never fail loudly
        return []
    return [CompletionItem(n) for n in names if n.startswith(incomplete)]
