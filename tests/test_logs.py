"""`provision logs`: parsing journald's JSON (with its quirks), merging, commands. No hosts."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import wait_until
from provision.core.errors import ProvisionError
from provision.io import journal as J
from provision.run import logprinter as LP

IDENTS = {"provision-j-chief-0": "chief-0", "provision-j-worker-0": "worker-0"}


def _line(**fields) -> bytes:
    entry = {
        "__CURSOR": "s=1;i=1",
        "__REALTIME_TIMESTAMP": "1700000000000000",
        "SYSLOG_IDENTIFIER": "provision-j-chief-0",
    }
    entry.update(fields)
    entry = {k: v for k, v in entry.items() if v is not ...}
    return json.dumps(entry).encode()


def _texts(line: bytes) -> list[str]:
    got = J.parse_line(line, "h1", IDENTS)
    assert isinstance(got, list), got
    return [e.text for e in got]


# ------------------------------------------------------------------ MESSAGE quirks


def test_plain_message():
    assert _texts(_line(MESSAGE="[chief:0] step 1 loss 0.5")) == ["[chief:0] step 1 loss 0.5"]


def test_message_missing_gives_no_line():
    assert _texts(_line(MESSAGE=...)) == []


def test_message_null_says_so():
    # journalctl prints null for a field it did not show (over 4096 bytes without --all).
    assert _texts(_line(MESSAGE=None)) == [J.NO_MESSAGE]


def test_message_as_byte_values_non_utf8():
    raw = b"\xff\xfe latin-1 caf\xe9 ok"
    assert _texts(_line(MESSAGE=list(raw))) == [raw.decode("utf-8", "replace")]


def test_message_as_byte_values_valid_utf8_with_control_chars():
    raw = "gr\u00fc\u00dfe \x1b[32mgreen\x1b[0m".encode()
    assert _texts(_line(MESSAGE=list(raw))) == [raw.decode()]


def test_message_as_byte_values_with_embedded_newline_gives_two_lines():
    assert _texts(_line(MESSAGE=list(b"one\ntwo\n"))) == ["one", "two"]


def test_repeated_message_field_gives_every_value():
    assert _texts(_line(MESSAGE=["first", list(b"second\xff")])) == ["first", "second\ufffd"]


def test_byte_values_out_of_range_do_not_crash():
    assert _texts(_line(MESSAGE=[104, 105, 256 + 33])) == ["hi!"]


@pytest.mark.parametrize(
    "raw, shown",
    [
        ("progress 10%\rprogress 50%\rprogress 100%", "progress 100%"),
        ("done\r", "done"),  # CRLF line end: the text stays
        ("a\r\r", "a"),
        ("\rstarting", "starting"),
        ("x" * 10 + "\r" + "y" * 3, "yyy"),  # the text after the last \r, as the brief says
        ("no carriage return", "no carriage return"),
    ],
)
def test_carriage_returns_keep_what_the_terminal_shows_last(raw, shown):
    assert _texts(_line(MESSAGE=raw)) == [shown]
    assert _texts(_line(MESSAGE=list(raw.encode()))) == [shown]


def test_very_long_line_is_kept_whole():
    msg = "x" * 1_000_000 + " end"
    got = _texts(_line(MESSAGE=msg))
    assert got == [msg]


def test_other_identifiers_and_junk_are_ignored():
    assert J.parse_line(_line(MESSAGE="x", SYSLOG_IDENTIFIER="sshd"), "h1", IDENTS) is None
    assert J.parse_line(b"-- No entries --", "h1", IDENTS) is None
    assert J.parse_line(b'{"MESSAGE": "cut off', "h1", IDENTS) is None
    assert J.parse_line(b"", "h1", IDENTS) is None
    assert J.parse_line(b"[1, 2]", "h1", IDENTS) is None


def test_missing_or_bad_timestamp_is_zero_not_an_error():
    got = J.parse_line(_line(MESSAGE="m", __REALTIME_TIMESTAMP="bogus"), "h1", IDENTS)
    assert got[0].ts == 0
    got = J.parse_line(_line(MESSAGE="m", __REALTIME_TIMESTAMP=...), "h1", IDENTS)
    assert got[0].ts == 0


def test_control_records_pass_through():
    assert J.parse_line(b'{"__provision_rc":0,"__provision_task":"chief-0"}', "h1", IDENTS) == {
        "__provision_rc": 0,
        "__provision_task": "chief-0",
    }


# ------------------------------------------------------------------ a host's fetch output


def _fetch_output(*lines) -> bytes:
    return b"\n".join(lines) + b"\n"


def test_parse_fetch_orders_and_reverses_tail_queries():
    out = _fetch_output(
        b'{"__provision_now":1700000000123456789}',
        _line(MESSAGE="c2", __REALTIME_TIMESTAMP="20", __CURSOR="c2"),  # --reverse: newest first
        _line(MESSAGE="c1", __REALTIME_TIMESTAMP="10", __CURSOR="c1"),
        b'{"__provision_rc":0,"__provision_task":"chief-0"}',
        _line(MESSAGE="w1", __REALTIME_TIMESTAMP="15", SYSLOG_IDENTIFIER="provision-j-worker-0"),
        b'{"__provision_rc":0,"__provision_task":"worker-0"}',
    )
    hl = J.parse_fetch("h1", out, b"", IDENTS, {"chief-0"})
    assert hl.now_us == 1700000000123456
    assert [e.text for e in hl.entries if e.task == "chief-0"] == ["c1", "c2"]
    assert [e.text for e in J.merge([hl.entries])] == ["c1", "w1", "c2"]
    assert not hl.errors


def test_parse_fetch_pins_journalctl_errors_on_the_task():
    out = _fetch_output(b'{"__provision_rc":1,"__provision_task":"worker-0"}')
    hl = J.parse_fetch("h1", out, b"Failed to parse timestamp: bogus\n", IDENTS, set())
    assert hl.errors == ["worker-0: Failed to parse timestamp: bogus"]


def test_merge_orders_hosts_by_time_and_keeps_each_hosts_order_on_ties():
    a = [
        J.Entry(1, "h1", "chief-0", "a1", ""),
        J.Entry(3, "h1", "chief-0", "a3", ""),
        J.Entry(3, "h1", "chief-0", "a3b", ""),
    ]
    b = [J.Entry(2, "h2", "worker-0", "b2", ""), J.Entry(3, "h2", "worker-0", "b3", "")]
    assert [e.text for e in J.merge([a, b])] == ["a1", "b2", "a3", "a3b", "b3"]


# ------------------------------------------------------------------ commands and options


def test_fetch_command_quotes_and_uses_cursor_or_tail():
    cmd = J.fetch_command("j", ["chief-0", "worker-0"], since="-10min", tail=5, cursors={"worker-0": "s=abc;i=1f;b=x"})
    assert cmd.startswith("sh -c ")
    script = shlex.split(cmd)[2]
    parts = script.split("; ")
    assert "date +%s%N" in parts[0] and "__provision_runs" in parts[1]  # the clock, the job's runs
    chief = shlex.split(parts[2])
    assert chief[:2] == ["journalctl", "-o"] and "--all" in chief
    # The program's output, or systemd's notices and restarts of its unit (terms joined by +).
    assert chief[chief.index("--reverse") :] == [
        "--reverse",
        "-n",
        "5",
        "SYSLOG_IDENTIFIER=provision-j-chief-0",
        "+",
        "UNIT=provision-j-chief-0.service",
        *(f"PRIORITY={p}" for p in range(6)),
        "+",
        "UNIT=provision-j-chief-0.service",
        "MESSAGE_ID=5eb03494b6584870a536b337290809b3",
    ]
    assert chief[chief.index("--since") + 1] == "-10min"
    worker = shlex.split(parts[4])
    assert worker[worker.index("--after-cursor") + 1] == "s=abc;i=1f;b=x"
    assert "--reverse" not in worker  # with a cursor, --tail is applied on the controller


def test_fetch_command_runs_in_sh(tmp_path):
    # The quoting survives a real shell: journalctl replaced by a function printing argv.
    cmd = J.fetch_command("j", ["chief-0"], since="2024-05-01 12:00:00", tail=None, cursors=None)
    script = shlex.split(cmd)[2]
    fake = 'journalctl() { printf "%s\\n" "$@" > ' + shlex.quote(str(tmp_path / "argv")) + "; }; "
    out = subprocess.run(["sh", "-c", fake + script], capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    assert json.loads(lines[0])["__provision_now"] > 0
    assert json.loads(lines[1]) == {"__provision_runs": None}  # no runs.json on this machine
    assert json.loads(lines[2]) == {"__provision_rc": 0, "__provision_task": "chief-0"}
    argv = (tmp_path / "argv").read_text().splitlines()
    assert argv[argv.index("--since") + 1] == "2024-05-01 12:00:00"


def descendants(pid: int) -> list[str]:
    """The command lines of pid's children, their children, and so on (read from /proc)."""
    procs: dict[int, tuple[int, str]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            argv = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        procs[int(d)] = (ppid, " ".join(a.decode(errors="replace") for a in argv.split(b"\0") if a))
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, cmd) in procs.items():
            if ppid == parent:
                out.append(cmd)
                todo.append(child)
    return out


def test_follow_command_kills_journalctl_when_the_channel_closes():
    script = shlex.split(J.follow_command("j", ["chief-0", "worker-0"], 1700000000))[2]
    assert "--follow" in script and "--since @1700000000" in script
    words = shlex.split(script.split(" </dev/null")[0])
    terms = " ".join(words[words.index("--since") + 2 :]).split(" + ")
    assert terms[0] == "SYSLOG_IDENTIFIER=provision-j-chief-0" and terms[3] == "SYSLOG_IDENTIFIER=provision-j-worker-0"
    assert terms[1].startswith("UNIT=provision-j-chief-0.service PRIORITY=0") and len(terms) == 6
    # With journalctl replaced by a long sleep: closing stdin ends the whole command.
    fake = "journalctl() { exec sleep 30; }; " + script
    p = subprocess.Popen(["sh", "-c", fake], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    # Both running: the stand-in journalctl and the watcher of stdin (its `cat`).
    wait_until(
        lambda: {"sleep 30", "cat"} <= set(descendants(p.pid)), 10, 0.05, what="journalctl and the watcher to start"
    )
    assert p.poll() is None  # follows while the channel (stdin) is open
    p.stdin.close()
    assert p.wait(timeout=10) != 0  # the sleep was killed, well before its 30 s


@pytest.mark.parametrize(
    "given, passed",
    [
        ("10m", "-10min"),
        ("2h", "-2h"),
        ("30s", "-30s"),
        ("1d", "-1d"),
        ("2024-05-01T12:00:00", "2024-05-01 12:00:00"),
        ("2024-05-01T12:00:00Z", "2024-05-01 12:00:00 UTC"),
        ("yesterday", "yesterday"),
        ("@1700000000", "@1700000000"),
        (None, None),
    ],
)
def test_since(given, passed):
    assert J.normalize_since(given) == passed


def test_since_empty_is_a_user_error():
    with pytest.raises(ProvisionError, match="--since"):
        J.normalize_since("  ")


def test_cursor_file_round_trip_and_wrong_job(tmp_path):
    assert LP.load_cursors(tmp_path, "j") == {}
    LP.save_cursors(tmp_path, "j", {"h1": {"chief-0": "s=1"}})
    assert LP.load_cursors(tmp_path, "j") == {"h1": {"chief-0": "s=1"}}
    with pytest.raises(ProvisionError, match="holds the logs of job 'j'"):
        LP.load_cursors(tmp_path, "other")
    (tmp_path / LP.CURSOR_FILE).write_text("{not json")
    with pytest.raises(ProvisionError, match="unreadable"):
        LP.load_cursors(tmp_path, "j")


def test_printer_prefix_and_files(tmp_path, capsys):
    p = LP.Printer(
        ["chief-0", "worker-10"], {"chief-0": "h1", "worker-10": "h2"}, out_dir=None, timestamps=False, color=False
    )
    p.write(J.Entry(1, "h1", "chief-0", "hello", "c1"))
    p.write(J.Entry(2, "h2", "worker-10", "world", "c2"))
    assert capsys.readouterr().out.splitlines() == ["chief-0@h1   | hello", "worker-10@h2 | world"]
    assert p.cursors == {"h1": {"chief-0": "c1"}, "h2": {"worker-10": "c2"}}
    f = LP.Printer(["chief-0"], {"chief-0": "h1"}, out_dir=tmp_path, timestamps=False)
    f.write(J.Entry(1_700_000_000_000_000, "h1", "chief-0", "to file", "c"))
    f.close()
    assert (tmp_path / "chief-0.log").read_text() == "2023-11-14T22:13:20.000000Z h1 to file\n"


def test_printer_shows_a_tasks_escape_sequences_and_raw_prints_them(tmp_path, capsys):
    """A task's (or a run's starter's) control characters are shown, not interpreted, on
    the terminal; --raw prints the task's text as it wrote it; -o DIR files keep it."""
    text = "\x1b[31mred\x1b[0m \x1b]0;TITLE\x07 bell\x07 tab\tend"
    p = LP.Printer(["chief-0"], {"chief-0": "h1"}, out_dir=None, timestamps=False, color=False)
    p.run_records = {"h1": [{"run": 1, "at": 0, "by": "mallory\x1b[2J"}]}
    p.write(J.Entry(1, "h1", "chief-0", text, "c"))
    assert capsys.readouterr().out.splitlines() == [
        "── run 1, started 1970-01-01 00:00:00 UTC by mallory\\e[2J ──",
        "chief-0@h1 | \\e[31mred\\e[0m \\e]0;TITLE\\x07 bell\\x07 tab\tend",
    ]
    raw = LP.Printer(["chief-0"], {"chief-0": "h1"}, out_dir=None, timestamps=False, color=False, raw=True)
    raw.write(J.Entry(1, "h1", "chief-0", text, "c"))
    assert capsys.readouterr().out == f"chief-0@h1 | {text}\n"
    f = LP.Printer(["chief-0"], {"chief-0": "h1"}, out_dir=tmp_path, timestamps=False)
    f.write(J.Entry(1, "h1", "chief-0", text, "c"))
    f.close()
    assert (tmp_path / "chief-0.log").read_text().endswith(f" h1 {text}\n")


def test_printer_colours_only_when_asked(capsys):
    p = LP.Printer(["chief-0"], {"chief-0": "h1"}, out_dir=None, timestamps=False, color=True)
    p.write(J.Entry(1, "h1", "chief-0", "x", ""))
    assert "\x1b[" in capsys.readouterr().out
    p = LP.Printer(["chief-0"], {"chief-0": "h1"}, out_dir=None, timestamps=False)  # not a tty
    p.write(J.Entry(1, "h1", "chief-0", "x", ""))
    assert "\x1b[" not in capsys.readouterr().out


def test_reader_going_away_is_not_an_error():
    """`provision logs INV | head -1`: no BrokenPipeError traceback, the printer stops."""
    code = (
        "import sys\n"
        "from provision.io import journal as J\nfrom provision.run import logprinter as LP\n"
        "p = LP.Printer(['t'], {'t': 'h'}, out_dir=None, timestamps=False)\n"
        "stopped = []\n"
        "p.on_pipe_closed = lambda: stopped.append(1)\n"
        "for i in range(200000):\n"
        "    p.write(J.Entry(i, 'h', 't', 'line %d' % i, ''))\n"
        "assert p.pipe_closed and stopped == [1]\n"
    )
    r = subprocess.run(
        f"{shlex.quote(sys.executable)} -c {shlex.quote(code)} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout == "t@h | line 0\n"
    assert r.stderr == ""


def test_a_line_marks_where_each_run_begins(capsys):
    """Runs (core/runs.py): the first line shown of each run is preceded by its line."""
    p = LP.Printer(["chief-0"], {"chief-0": "h1"}, out_dir=None, timestamps=False, color=False)
    p.run_records = {
        "h1": [{"run": 1, "at": 10.0, "by": "ana@lab"}, {"run": 2, "at": 20.0, "by": "ana@lab"}],
        "h2": [{"run": 2, "at": 19.5, "by": "ana@lab"}, "junk"],
    }
    for ts, text in ((11, "a"), (12, "b"), (19.6, "c"), (25, "d")):
        p.write(J.Entry(int(ts * 1e6), "h1", "chief-0", text, ""))
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "── run 1, started 1970-01-01 00:00:10 UTC by ana@lab ──",
        "chief-0@h1 | a",
        "chief-0@h1 | b",
        "── run 2, started 1970-01-01 00:00:19 UTC by ana@lab ──",  # the earliest host's time
        "chief-0@h1 | c",
        "chief-0@h1 | d",
    ]
    # After --tail or --since, only the crossings: the first line is not a run's first.
    p = LP.Printer(["chief-0"], {"chief-0": "h1"}, out_dir=None, timestamps=False, color=False)
    p.run_records, p.lead_boundary = (
        {"h1": [{"run": 1, "at": 10.0, "by": "a"}, {"run": 2, "at": 20.0, "by": "a"}]},
        False,
    )
    for ts in (12, 21):
        p.write(J.Entry(int(ts * 1e6), "h1", "chief-0", "x", ""))
    assert [l[:8] for l in capsys.readouterr().out.splitlines()] == ["chief-0@", "── run 2", "chief-0@"]


def test_runs_rules():
    from provision.core import runs as R

    assert R.starts_run(starting=2, kept=2, running=2)  # everything restarts
    assert R.starts_run(starting=1, kept=3, running=0)  # nothing ran: a start after an end
    assert not R.starts_run(starting=1, kept=3, running=2)  # joins the run under way
    assert not R.starts_run(starting=0, kept=3, running=0)
    runs = R.merged([[{"run": 1, "at": 5}, {"run": 2, "at": 9}], None, {"_unreadable": "x"}])
    assert [r.number for r in runs] == [1, 2] and R.next_number(runs) == 3 and R.next_number([]) == 1
    assert R.pick(runs, 1, False) == (runs[0], runs[1])
    assert R.pick(runs, None, True) == (runs[0], runs[1])
    assert R.pick(runs, 2, False) == (runs[1], None)
    assert "no such run; the job's runs are 1, 2" in str(R.pick(runs, 7, False))
    assert "only one run" in str(R.pick(runs[:1], None, True))
