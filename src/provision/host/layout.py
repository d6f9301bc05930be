"""Where provision keeps things on a host, and the records it keeps there.

The one place that spells a path or a name provision uses on a host: the controller
(render, plan, probe, logs, validation) and the host agent both read them from here, and
templates get them as values. Standard library only, no imports at all: this module is
shipped to hosts with the agent (host/bundle.py) and runs there under `python3 -S`.

For job J and task T:
    /etc/provision/J/                       0700, provision's own directory
    /etc/provision/J/T.env                  0600, the task's EnvironmentFile=
    /etc/provision/J/manifest.json          0600, everything provision manages on the host
    /etc/provision/J/lifecycle.json         0600, the end-of-job marker (phase, reason, time)
    /etc/provision/J/created-dirs.json      0600, directories provision created for files:
    /etc/systemd/system/provision-J-T.service, /etc/systemd/system/provision-J.target
    /var/lib/provision/J/T.exits            every exit of the task (ExecStopPost=)
    /var/lib/provision/J/T.stopping         a stop was asked for (ExecStop=), until the exit
    /var/lib/provision/J/originals/         host files that `replace: true` moved aside
"""

from __future__ import annotations

ETC = "/etc/provision"
VAR = "/var/lib/provision"
SYSTEMD_DIR = "/etc/systemd/system"
# `files:` may not write where provision keeps its own files.
RESERVED_DIRS = (ETC, SYSTEMD_DIR)
TMP_SUFFIX = ".provision-tmp"
PREFIX = "provision-"


def job_dir(job: str) -> str:
    return ETC + "/" + job


def state_dir(job: str) -> str:
    """Run-time records; outlive reboots; removed by destroy."""
    return VAR + "/" + job


def manifest_path(job: str) -> str:
    return job_dir(job) + "/manifest.json"


def lifecycle_path(job: str) -> str:
    return job_dir(job) + "/lifecycle.json"


def created_dirs_path(job: str) -> str:
    return job_dir(job) + "/created-dirs.json"


def env_path(job: str, task: str) -> str:
    return job_dir(job) + "/" + task + ".env"


def unit_name(job: str, task: str) -> str:
    return PREFIX + job + "-" + task + ".service"


def unit_path(job: str, task: str) -> str:
    return SYSTEMD_DIR + "/" + unit_name(job, task)


def target_name(job: str) -> str:
    return PREFIX + job + ".target"


def target_path(job: str) -> str:
    return SYSTEMD_DIR + "/" + target_name(job)


def container_name(job: str, task: str) -> str:
    return PREFIX + job + "-" + task


def log_identifier(job: str, task: str) -> str:
    """journald's SYSLOG_IDENTIFIER of the task's output (`journalctl -t`)."""
    return PREFIX + job + "-" + task


def task_of_unit(job: str, unit: str) -> str:
    """The task a unit of job belongs to (the inverse of unit_name)."""
    head, tail = PREFIX + job + "-", ".service"
    if unit.startswith(head) and unit.endswith(tail):
        return unit[len(head) : -len(tail)]
    return unit


def exits_path(job: str, task: str) -> str:
    return state_dir(job) + "/" + task + ".exits"


def stopping_path(job: str, task: str) -> str:
    return state_dir(job) + "/" + task + ".stopping"


def originals_dir(job: str) -> str:
    return state_dir(job) + "/originals"


def original_path(job: str, path: str) -> str:
    """Where `replace: true` keeps the host's own file at path until destroy puts it back."""
    return originals_dir(job) + "/" + path.strip("/").replace("%", "%25").replace("/", "%2F")


# --------------------------------------------------------------------------- .exits records
#
# One line per exit of a task, appended by the unit's ExecStopPost= (and by the agent for a
# task stopped while it waited to restart, which runs no ExecStopPost):
#     TIME SERVICE_RESULT EXIT_CODE EXIT_STATUS [stop]
# TIME: epoch seconds on the host; SERVICE_RESULT, EXIT_CODE and EXIT_STATUS as systemd
# passes them to ExecStopPost= (systemd.exec(5)); "stop" when the run ended because a stop
# was asked for (ExecStop= saw $MAINPID and left the .stopping mark).

STOP_MARK = "stop"


def exit_record(time: int, result: str, code: str, status: str, stopped: bool) -> str:
    """One line of the .exits file, newline included."""
    return "%d %s %s %s%s\n" % (time, result, code, status, " " + STOP_MARK if stopped else "")


def parse_exits(text: str) -> list[list[str]]:
    """The records of one .exits file as lists of words, oldest first; junk lines skipped."""
    return [line.split() for line in text.splitlines() if 4 <= len(line.split()) <= 5]


def exec_stop_command(job: str, task: str) -> str:
    """ExecStop= of a task's unit: mark that a stop was asked for. ExecStop= runs after every
    run, but $MAINPID is set only when the task was still running, i.e. when someone asked
    systemd to stop it. Nothing is killed here; systemd sends the KillSignal as usual.
    ($$ is systemd's escape for a literal $.)"""
    mark = stopping_path(job, task)
    return "/bin/sh -c 'if [ -n \"$$MAINPID\" ]; then mkdir -p %s && : > %s; fi'" % (state_dir(job), mark)


def exec_stop_post_command(job: str, task: str) -> str:
    """ExecStopPost= of a task's unit: append the exit record (exit_record's format, with the
    mark of exec_stop_command turned into the stop field)."""
    mark, exits = stopping_path(job, task), exits_path(job, task)
    return (
        '/bin/sh -c \'mkdir -p %s && s= && if [ -e %s ]; then s=" %s"; rm -f %s; fi && '
        'echo "$$(date +%%%%s) $$SERVICE_RESULT $$EXIT_CODE $$EXIT_STATUS$$s" >> %s\''
        % (state_dir(job), mark, STOP_MARK, mark, exits)
    )
