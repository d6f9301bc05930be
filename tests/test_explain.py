"""Why a task ended, in words (explain.py), and the pure pieces around it: the journal's
systemd lines in `logs`, the follow window and boundary, status with journal lines, the
progress lines, the programs plan warns about."""

from __future__ import annotations

import io
import json

import pytest

from provision.core import explain as E
from provision.core.lifecycle import JobPhase, TaskState, start_failure, task_state
from provision.host.protocol import FileInfo
from provision.io import journal as J
from provision.run import logs as L

# --------------------------------------------------------------------------- the words


@pytest.mark.parametrize(
    "kind, status, result, words",
    [
        ("exited", "3", "exit-code", "exit code 3"),
        ("exited", "1", "exit-code", "exit code 1"),
        ("exited", "203", "exit-code", "the program could not be started (exit status 203/EXEC)"),
        ("exited", "200", "exit-code", "could not change to the working directory (exit status 200/CHDIR)"),
        ("exited", "217", "exit-code", "could not determine or change to the user (exit status 217/USER)"),
        ("exited", "127", "exit-code", "exit code 127: a command was not found (the shell's code)"),
        ("exited", "126", "exit-code", "exit code 126: a command was found but could not be run (not executable?)"),
        ("exited", "137", "exit-code", "exit code 137: a process it ran was killed by SIGKILL"),
        ("killed", "KILL", "signal", "killed by SIGKILL (out of memory, or killed by hand: see `dmesg` on the host)"),
        ("killed", "9", "signal", "killed by SIGKILL (out of memory, or killed by hand: see `dmesg` on the host)"),
        ("killed", "KILL", "oom-kill", "killed by the kernel's out-of-memory killer"),
        ("dumped", "SEGV", "core-dump", "core dumped, killed by SIGSEGV (segmentation fault: the program crashed)"),
        (
            "dumped",
            "ABRT",
            "core-dump",
            "core dumped, killed by SIGABRT (the program aborted: a failed assertion or a fatal error)",
        ),
        ("killed", "TERM", "signal", "killed by SIGTERM"),
        ("killed", "USR1", "signal", "killed by SIGUSR1"),
        ("killed", "64", "signal", "killed by signal 64"),
        ("none", "-", "", "between tries"),
    ],
)
def test_exit_words(kind, status, result, words):
    assert E.exit_words(kind, status, result) == words


def test_every_systemd_exit_status_has_a_name_and_words():
    assert set(range(200, 244)) - set(E.SYSTEMD_EXIT) <= {223, 234}  # unused by systemd
    for code, (name, words) in E.SYSTEMD_EXIT.items():
        assert name.isupper() and words and words[0].islower(), code


MISSING = [
    "[systemd] Failed at step EXEC spawning /opt/venv/bin/torchrun: No such file or directory",
    "[systemd] Main process exited, code=exited, status=203/EXEC",
    "[systemd] Failed with result 'exit-code'.",
]


@pytest.mark.parametrize(
    "lines, why",
    [
        (MISSING, "/opt/venv/bin/torchrun: No such file or directory"),
        (
            ["[systemd] provision-j-t.service: Failed to locate executable /opt/x: No such file or directory"],
            "/opt/x: No such file or directory",
        ),
        (["[systemd] Failed to execute /opt/train.sh: Permission denied"], "/opt/train.sh: Permission denied"),
        (["[systemd] Failed to determine user credentials: No such process"], "No such process"),
        (["[systemd] A process of this unit has been killed by the OOM killer."], "killed by the out-of-memory killer"),
        (["step 1", "Traceback (most recent call last):"], None),
        ([], None),
    ],
)
def test_journal_reason(lines, why):
    assert E.journal_reason(lines) == why


def test_reason_adds_the_path_and_keeps_what_follows():
    detail = "the program could not be started (exit status 203/EXEC), restart limit (2) reached"
    assert E.reason(detail, 203, MISSING) == (
        "the program could not be started: /opt/venv/bin/torchrun: No such file or directory "
        "(exit status 203/EXEC), restart limit (2) reached"
    )
    assert E.reason("exit code 3", 3, MISSING) == "exit code 3"  # its own exit: its own words
    assert E.reason("exit code 3", 3, []) == "exit code 3"


def test_task_state_words_a_failed_exec():
    failed = {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code"}
    out = task_state(failed, [["1", "exit-code", "exited", "203"]])
    assert out == (TaskState.FAILED, 203, "the program could not be started (exit status 203/EXEC)")
    # A stop keeps the plain words ("stopped by provision: job failed (killed by SIGTERM)").
    stopped = task_state(failed, [["1", "success", "killed", "TERM", "stop"]], {"phase": "Failed"})
    assert stopped.detail == "stopped by provision: job failed (killed by SIGTERM)"


def test_start_failure_words_apply_uses():
    unit = {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code"}
    unit |= {"ExecMainCode": "1", "ExecMainStatus": "203"}
    assert start_failure("chief-0", unit, [], MISSING) == (
        "the program could not be started: /opt/venv/bin/torchrun: No such file or directory (exit status 203/EXEC)"
    )


# --------------------------------------------------------------------------- logs: systemd's lines


def _entry(**fields) -> bytes:
    base = {"__REALTIME_TIMESTAMP": "1700000000000000", "__CURSOR": "c1"}
    return json.dumps({**base, **fields}).encode()


def test_systemd_lines_about_the_unit_are_labelled():
    idents = {"provision-j-chief-0": "chief-0"}
    units = {"provision-j-chief-0.service": "chief-0"}
    got = J.parse_line(
        _entry(
            MESSAGE="provision-j-chief-0.service: Main process exited, code=exited, status=203/EXEC",
            SYSLOG_IDENTIFIER="systemd",
            UNIT="provision-j-chief-0.service",
        ),
        "h1",
        idents,
        units,
    )
    assert [e.text for e in got] == [
        "[systemd] Main process exited, code=exited, status=203/EXEC"
        " [the program could not be started (exit status 203/EXEC)]"
    ]
    # The program's own lines are not labelled; other units' lines are not shown.
    assert [
        e.text for e in J.parse_line(_entry(MESSAGE="hi", SYSLOG_IDENTIFIER="provision-j-chief-0"), "h1", idents, units)
    ] == ["hi"]
    assert (
        J.parse_line(_entry(MESSAGE="x", SYSLOG_IDENTIFIER="systemd", UNIT="ssh.service"), "h1", idents, units) is None
    )


# --------------------------------------------------------------------------- follow: window, boundary


def _e(ts: int, host: str = "h1", task: str = "t", cursor: str | None = None) -> J.Entry:
    return J.Entry(ts, host, task, f"line {ts}", cursor or f"c{ts}")


def test_reorder_window_prints_in_time_order_across_hosts():
    out: list[int] = []
    r = L.Reorder(lambda e: out.append(e.ts), window=1.0)
    r.push(_e(10, "h1"), now=0.0)
    r.push(_e(30, "h1"), now=0.1)
    r.push(_e(20, "h2"), now=0.5)  # a slower host: older line, later
    r.due(now=0.9)
    assert out == []
    r.due(now=1.05)
    assert out == [10]
    r.due(now=1.6)
    assert out == [10, 20, 30]
    r.push(_e(40), now=2.0)
    r.drain()
    assert out == [10, 20, 30, 40]


def test_boundary_prints_each_line_once_after_a_tail():
    b = L.Boundary()
    printed = [_e(100, cursor="a"), _e(200, cursor="b")]  # --tail 2 printed these
    for e in printed:
        b.printed(e)
    b.start("h1", ["t", "quiet"], now_us=250)
    stream = [_e(150, cursor="x"), _e(200, cursor="b"), _e(200, cursor="y"), _e(300, cursor="c")]
    assert [e.cursor for e in stream if b.accept(e)] == ["y", "c"]
    # A task that printed nothing: what is newer than the fetch.
    assert not b.accept(_e(240, task="quiet")) and b.accept(_e(260, task="quiet"))
    # After a reconnect: nothing twice.
    b.start("h1", ["t"], now_us=0)
    assert not b.accept(_e(300, cursor="c")) and b.accept(_e(301, cursor="d"))


# --------------------------------------------------------------------------- status and progress


def _status(states, phase=JobPhase.RUNNING):
    from provision.rules.status import JobStatus, TaskStatus

    tasks = tuple(
        TaskStatus(name, "worker", "h1", "a:1", [], state, code, 0, 5, detail) for name, state, code, detail in states
    )
    return JobStatus("j", phase, "", tasks)


def test_with_lines_makes_the_detail_and_reason_precise(tmp_path):
    from provision.inventory.inventory import parse
    from provision.rules.status import needs_lines, with_lines

    inv = parse(
        "job: j\nhosts:\n- {name: h1, address: 192.0.2.1}\npools:\n  worker: {replicas: 2, command: [/opt/x]}\n",
        tmp_path / "inv.yaml",
    )
    words = "the program could not be started (exit status 203/EXEC)"
    st = _status(
        [("worker-0", TaskState.FAILED, 203, words), ("worker-1", TaskState.RUNNING, None, "running")], JobPhase.FAILED
    )
    assert needs_lines(st) == {"h1": ["worker-0"]}
    got = with_lines(inv, st, {"worker-0": MISSING})
    w0 = got.task("worker-0")
    assert w0.detail.startswith("the program could not be started: /opt/venv/bin/torchrun: No such file")
    assert w0.last_lines == tuple(MISSING)
    assert got.phase is JobPhase.FAILED and "/opt/venv/bin/torchrun" in got.reason
    j = got.to_json()
    assert j["tasks"][0]["last_lines"] == MISSING and j["tasks"][1]["last_lines"] == []


def test_progress_plain_lines_on_change_and_every_10_seconds():
    from provision.cli.progress import Display

    now = [0.0]
    out = io.StringIO()
    d = Display(out, tty=False, every=10, clock=lambda: now[0])
    running = _status([("worker-0", TaskState.RUNNING, None, "running")])
    d.update(running)
    now[0] = 5
    d.update(running)
    now[0] = 11
    d.update(running)
    now[0] = 12
    d.update(_status([("worker-0", TaskState.SUCCEEDED, 0, "exited 0")]))
    assert out.getvalue().splitlines() == [
        "[0s] job Running",
        "[0s] worker-0@h1 Running",
        "[11s] job Running: 1 Running",
        "[12s] worker-0@h1 Succeeded: exited 0",
    ]


def test_progress_redraws_in_place_on_a_terminal():
    from provision.cli.progress import Display

    out = io.StringIO()
    d = Display(out, tty=True)
    d.update(_status([("worker-0", TaskState.RUNNING, None, "running")]), {"worker-0": "step 3"})
    d.update(_status([("worker-0", TaskState.RUNNING, None, "running")]), {"worker-0": "step 4"})
    text = out.getvalue()
    assert text.count("\x1b[2F") == 1  # the second drawing goes back over the two lines
    assert "step 3" in text and text.rstrip().endswith("| step 4")


# --------------------------------------------------------------------------- programs


def test_program_warnings(tmp_path):
    from provision.inventory.inventory import parse
    from provision.render.files import render
    from provision.rules import programs

    (tmp_path / "run.sh").write_text("echo hi\n")
    (tmp_path / "run.sh").chmod(0o644)
    inv = parse(
        "job: j\nhosts:\n- {name: h1, address: 192.0.2.1}\npools:\n"
        "  chief: {replicas: 1, command: [/opt/venv/bin/torchrun, x.py]}\n"
        "  worker: {replicas: 1, command: [python3, x.py]}\n"
        "  evaluator: {replicas: 1, command: [/opt/j/run.sh]}\n"
        "files:\n- {src: run.sh, dest: /opt/j/run.sh}\n",
        tmp_path / "inv.yaml",
    )
    bundle = render(inv).hosts["h1"]
    keyed = str
    asked = programs.paths(inv, bundle, None, keyed)
    assert "/opt/venv/bin/torchrun" in asked and "/usr/bin/python3" in asked and "/opt/j/run.sh" not in asked
    files: dict[str, FileInfo | None] = {p: None for p in asked}
    got = programs.warnings(inv, "h1", bundle, None, keyed, files)
    assert any("/opt/venv/bin/torchrun (chief-0 on h1): no such file on the host" in w for w in got)
    assert any("python3 (worker-0 on h1): not found in systemd's search path" in w for w in got)
    assert any("/opt/j/run.sh (evaluator-0 on h1): pushed by files: without execute permission" in w for w in got)
    files["/usr/bin/python3"] = FileInfo("symlink")
    files["/opt/venv/bin/torchrun"] = FileInfo("file", mode=0o644)
    got = programs.warnings(inv, "h1", bundle, None, keyed, files)
    assert not any("python3" in w for w in got)
    assert any("/opt/venv/bin/torchrun is not executable (mode 0644)" in w for w in got)
    # item 5: the job's setup, about to run, may make the program (a venv): no
    # warning for a missing one then; what is there but broken is still said.
    files = {p: None for p in asked}
    got = programs.warnings(inv, "h1", bundle, None, keyed, files, setup_pending=True)
    assert not any("no such file" in w or "not found" in w for w in got)
    assert any("without execute permission" in w for w in got)


@pytest.mark.parametrize(
    "line, note",
    [
        (
            "Main process exited, code=exited, status=3/NOTIMPLEMENTED",
            "[the program's exit code 3; systemd's name for it does not apply]",
        ),
        (
            "Main process exited, code=exited, status=203/EXEC",
            "[the program could not be started (exit status 203/EXEC)]",
        ),
        ("Main process exited, code=killed, status=9/KILL", "[killed by SIGKILL (out of memory, or killed by hand"),
        ("Start request repeated too quickly.", "[systemd refused to start it again: it was started too often"),
        ("Failed with result 'start-limit-hit'.", "[the pool's restart limit was reached]"),
        ("Scheduled restart job, restart counter is at 2.", "[restart 2 of the pool's policy]"),
        ("State 'stop-sigterm' timed out. Killing.", "[SIGTERM's grace period is over: SIGKILL]"),
    ],
)
def test_systemd_words_are_translated(line, note):
    assert E.systemd_words(line).startswith(line + " " + note)


@pytest.mark.parametrize("line", ["Main process exited, code=exited, status=0/SUCCESS", "Deactivated successfully."])
def test_plain_systemd_lines_stay_as_they_are(line):
    assert E.systemd_words(line) == line
