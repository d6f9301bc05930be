"""The `provision` command: one group whose commands live in the modules named below, each
loaded only when used (COMMANDS). Every user error ends as one line and an exit code here."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from provision import __version__
from provision.core.errors import ProvisionError, no_color
from provision.core.text import printable

# command name -> "module:attribute" of its click command.
COMMANDS = {
    "validate": "provision.cli.offline:validate",
    "render": "provision.cli.offline:render",
    "force-unlock": "provision.cli.offline:force_unlock",
    "state": "provision.cli.statecmd:state_group",
    "plan": "provision.cli.change:plan",
    "apply": "provision.cli.change:apply",
    "destroy": "provision.cli.change:destroy",
    "stop": "provision.cli.change:stop",
    "check": "provision.cli.change:check",
    "status": "provision.cli.observe:status",
    "logs": "provision.cli.observe:logs",
    "wait": "provision.cli.observe:wait",
    "jobs": "provision.cli.observe:jobs",
    "facts": "provision.cli.observe:facts",
    "exec": "provision.cli.everyday:exec_cmd",
    "ssh": "provision.cli.everyday:ssh_cmd",
    "init": "provision.cli.everyday:init_cmd",
    "fetch": "provision.cli.fetchcmd:fetch_cmd",
    "tune": "provision.cli.tunecmd:tune_cmd",
    "serve": "provision.cli.servecmd:serve",
    "cancel": "provision.cli.servecmd:cancel",
    "history": "provision.cli.servecmd:history",
    "events": "provision.cli.eventscmd:events",
    "notify": "provision.cli.notifycmd:notify_group",
    "health": "provision.cli.healthcmd:health_group",
    "policy": "provision.cli.policycmd:policy_group",
    "dev": "provision.cli.devcmd:dev_cmd",
    "import": "provision.cli.importcmd:import_group",
    "sandbox": "provision.cli.sandboxcmd:sandbox",
}


class _Main(click.Group):
    """Turns ProvisionError into one clear line and its exit code, never a traceback.
    Loads a command's module only when that command runs (COMMANDS)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        where = COMMANDS.get(name)
        if where is None:
            return None
        module, attr = where.split(":")
        # Lazy: each command imports only its own layers (start-up: `provision validate`
        # needs no SSH, `--help` needs no command's code; ~60-90 ms saved per run).
        command: click.Command = getattr(importlib.import_module(module), attr)
        return command

    def main(self, *args: Any, **kwargs: Any) -> Any:
        # Usage errors exit 1, not click's 2: exit 2 means "plan found changes".
        kwargs["standalone_mode"] = False
        if no_color():  # https://no-color.org: no ANSI styles, even on a terminal
            kwargs.setdefault("color", False)
        try:
            rv = super().main(*args, **kwargs)
        except click.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # bare `provision`: help, not an error
                help_ctx = getattr(e, "ctx", None)
                click.echo(help_ctx.get_help() if help_ctx else e.format_message())
                sys.exit(0)
            e.show()
            sys.exit(1)
        except click.exceptions.Abort:
            # Ctrl-C in a prompt (click turns it into Abort): the same 130 as anywhere else.
            click.echo("Interrupted.", err=True)
            sys.exit(130)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ProvisionError as e:
            # A message may carry what a host or a database said: shown, never interpreted.
            click.echo(f"Error: {printable(e.message)}", err=True)
            for line in e.details:
                click.echo(f"Error: {printable(line)}", err=True)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            sys.exit(130)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="provision")
def main() -> None:
    """Provision distributed ML training jobs on hosts you own."""


def run() -> None:
    """The console script (and `python -m provision`): the command, then the process ends
    without the interpreter's teardown. By then every file provision writes is closed (and
    the state and ledgers synced); what is left to tear down is modules and the SSH
    transports' threads, ~35 ms of a 32-host plan's 0.9 s. Tests call `main` instead."""
    try:
        main(prog_name="provision")
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit("message"), as Python prints it
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, OSError):  # `provision status | head`: the reader is gone
            code = code or 1
    os._exit(code)
