"""The unit's ExecStop= and ExecStopPost= (host/layout.py) write the .exits record that
lifecycle.task_state reads: run here with sh as systemd would run them (its $$ and %%
escapes undone, its variables set), for a run that was stopped and one that failed."""

from __future__ import annotations

import os
import subprocess

import pytest

from provision.core.lifecycle import TaskState, task_state
from provision.host import layout
from provision.inventory.inventory import load
from provision.render.files import FileKind, render


def unit_lines(tmp_path) -> dict[str, str]:
    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "job: rec\nhosts: [{name: h1, address: 10.0.0.1}]\npools: {chief: {replicas: 1, command: [/bin/true]}}\n"
    )
    bundle = render(load(inv)).hosts["h1"]
    unit = next(f for f in bundle.files if f.kind is FileKind.UNIT).data().decode()
    return {
        k: v for k, _, v in (line.partition("=") for line in unit.splitlines()) if k in ("ExecStop", "ExecStopPost")
    }


def systemd_runs(line: str, state_dir: str, env: dict[str, str]) -> None:
    """What systemd executes for an Exec line: '-' prefix dropped, %% and $$ unescaped; the
    paths moved to a temporary directory."""
    cmd = line.removeprefix("-").replace("%%", "%").replace("$$", "$")
    cmd = cmd.replace(layout.state_dir("rec"), state_dir)
    argv = ["/bin/sh", "-c", cmd.split(" -c ", 1)[1][1:-1]]
    subprocess.run(argv, env={**os.environ, **env}, check=True)


@pytest.mark.parametrize(
    "stopped, result, code, status, want",
    [
        (True, "success", "exited", "0", TaskState.STOPPED),  # a server that caught SIGTERM
        (True, "success", "killed", "TERM", TaskState.STOPPED),
        (False, "exit-code", "exited", "3", TaskState.FAILED),
        (False, "success", "exited", "0", TaskState.SUCCEEDED),
    ],
)
def test_the_units_exit_record_is_what_lifecycle_reads(tmp_path, stopped, result, code, status, want):
    lines = unit_lines(tmp_path)
    assert lines["ExecStop"] == "-" + layout.exec_stop_command("rec", "chief-0")
    assert lines["ExecStopPost"] == "-" + layout.exec_stop_post_command("rec", "chief-0")
    sd = str(tmp_path / "state")
    # ExecStop= runs after every run; $MAINPID is set only when a stop was asked for.
    systemd_runs(lines["ExecStop"], sd, {"MAINPID": "42"} if stopped else {"MAINPID": ""})
    systemd_runs(lines["ExecStopPost"], sd, {"SERVICE_RESULT": result, "EXIT_CODE": code, "EXIT_STATUS": status})
    text = open(os.path.join(sd, "chief-0.exits")).read()
    records = layout.parse_exits(text)
    assert len(records) == 1 and records[0][1:4] == [result, code, status]
    assert (records[0][4:] == [layout.STOP_MARK]) == stopped
    assert not os.path.exists(os.path.join(sd, "chief-0.stopping")), "the mark is used up"
    unit = {"LoadState": "loaded", "ActiveState": "inactive" if result == "success" else "failed", "SubState": "dead"}
    assert task_state(unit, records).state is want
    # The agent's own record (a stop between tries) has the same shape.
    assert layout.parse_exits(layout.exit_record(5, "success", "none", "-", True)) == [
        ["5", "success", "none", "-", "stop"]
    ]
