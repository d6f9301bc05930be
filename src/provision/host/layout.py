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
    /etc/systemd/system/multi-user.target.wants/provision-J.target
                                            the job's target enabled: only while the job should
                                            run (the agent adds and removes the link)
    /var/lib/provision/J/T.exits            every exit of the task (ExecStopPost=)
    /var/lib/provision/J/T.stopping         a stop was asked for (ExecStop=), until the exit
    /var/lib/provision/J/T.boot             the boot the task last started in (the unit's gate)
    /var/lib/provision/J/T.run              a run is in progress; "reboot": a shutdown ended it
    /var/lib/provision/J/originals/         host files that `replace: true` moved aside
Host-wide:
    /var/lib/provision/.ledger/J.json       what job J holds here (ledger.py)
    /var/lib/provision/.ledger/.health.json the host's and its GPUs' health states (health.py)
    /etc/provision/.setups/K/, /var/lib/provision/.setups/
                                            a `setup:` shared by the jobs that need it (below)
    /var/cache/provision/agent/             0700, the agent's modules compiled by this host's
                                            python3 (host/bundle.py); a cache: any of it
                                            may be deleted, and destroy leaves it
"""

from __future__ import annotations

ETC = "/etc/provision"
VAR = "/var/lib/provision"
SYSTEMD_DIR = "/etc/systemd/system"
# `files:` may not write where provision keeps its own files.
RESERVED_DIRS = (ETC, SYSTEMD_DIR)
TMP_SUFFIX = ".provision-tmp"
AGENT_CACHE = "/var/cache/provision/agent"
PREFIX = "provision-"


def job_dir(job: str) -> str:
    return ETC + "/" + job


def state_dir(job: str) -> str:
    """Run-time records; outlive reboots; removed by destroy."""
    return VAR + "/" + job


def checkpoint_copy_dir(job: str) -> str:
    """A peer's copy of the job's newest checkpoint (`checkpoint: {copy: peer}`): removed
    with the job's records by destroy."""
    return state_dir(job) + "/checkpoint-copy"


# The host's side of the checkpoint copy (run/checkpoints.py). On a peer: sh -c
# CHECKPOINT_KEEP_SH x DIR NAME KEEP, a tar on stdin: unpacked beside (a hidden name),
# renamed to NAME once whole; the copies but NAME and KEEP (the one the controller's record
# still names) removed. Into a checkpoint directory (after outdirs.read_prefix made it the
# working directory): put_sh(UNPACK), UNPACK filling "$w": unpacked beside under a hidden
# name (the trainer never takes one), then each entry renamed into place.
CHECKPOINT_KEEP_SH = (
    'd=$1; n=$2; k=$3; mkdir -p -m 0700 -- "$d" && cd -P -- "$d" && w=.new-$$ && rm -rf -- "$w" && '
    'mkdir -m 0700 -- "$w" && tar -xf - -C "$w" --no-same-owner --no-same-permissions && '
    'rm -rf -- "$n" && mv -- "$w" "$n" && for e in c-*; do [ "$e" = "$n" ] || [ "$e" = "$k" ] || rm -rf -- "$e"; done'
)
UNPACK_STDIN = 'tar -xf - -C "$w" --no-same-owner --no-same-permissions'


def put_sh(unpack: str) -> str:
    return (
        'w=.provision-restore-$$; rm -rf -- "$w"; { mkdir -m 0700 -- "$w" && ' + unpack + "; } || "
        '{ rm -rf -- "$w"; exit 1; }; for e in "$w"/* "$w"/.[!.]*; do [ -e "$e" ] || continue; '
        'rm -rf -- "./${e##*/}"; mv -f -- "$e" . || exit 1; done; rm -rf -- "$w"'
    )


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


# systemd's link naming a running unit's invocation (systemd 236+; journald reads it). It
# goes when the run ends.
INVOCATION_PREFIX = "/run/systemd/units/invocation:"


def unit_known_paths(unit: str) -> tuple[str, str]:
    """Where a provision unit shows that systemd may know it: its file, or its running
    invocation. Neither there: systemd has not loaded it, or keeps only a stopped unit whose
    file is gone, and the probes report it as never loaded without asking systemctl (a
    first apply's units: one systemctl run and a unit-file scan in PID 1 saved)."""
    return SYSTEMD_DIR + "/" + unit, INVOCATION_PREFIX + unit


# Where systemd reads drop-ins (UNIT.d/*.conf) of a system unit: every directory of its unit
# search path (systemd.unit(5)). provision writes none, so any that applies to one of its
# units is drift: it can replace ExecStart= while the unit file stays as provision wrote it.
# A base whose top directory is a link (/lib on a merged-/usr host) is the same files again.
DROPIN_BASES = (
    "/etc/systemd/system.control",
    "/run/systemd/system.control",
    "/run/systemd/transient",
    "/run/systemd/generator.early",
    SYSTEMD_DIR,
    "/etc/systemd/system.attached",
    "/run/systemd/system",
    "/run/systemd/system.attached",
    "/run/systemd/generator",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
    "/run/systemd/generator.late",
)
DROPIN_DIRS = PREFIX + "*.d"  # what the probes look for in each base: drop-in directories named provision-...
DROPIN_SUFFIX = ".conf"


def dropin_unit(path: str) -> str | None:
    """The unit name (or prefix, ending in "-.TYPE") a drop-in file's directory names, when
    path is BASE/provision-*.d/NAME.conf for a base of DROPIN_BASES; None otherwise."""
    base, _, rest = path.rpartition("/")
    base, _, d = base.rpartition("/")
    if base not in DROPIN_BASES or not d.startswith(PREFIX) or not d.endswith(".d") or "/" in rest:
        return None
    if rest.startswith(".") or not rest.endswith(DROPIN_SUFFIX) or len(rest) == len(DROPIN_SUFFIX):
        return None
    return d[:-2]


def dropin_applies(path: str, unit: str) -> bool:
    """Whether systemd reads the drop-in at path for unit: its directory is UNIT.d, or a
    prefix of the name up to a dash (provision-J-.service.d for provision-J-chief-0.service)."""
    named = dropin_unit(path)
    if named is None:
        return False
    if named == unit:
        return True
    head, dot, kind = named.rpartition(".")
    return bool(dot) and head.endswith("-") and unit.endswith("." + kind) and unit.startswith(head)


def unit_path(job: str, task: str) -> str:
    return SYSTEMD_DIR + "/" + unit_name(job, task)


def target_name(job: str) -> str:
    return PREFIX + job + ".target"


def target_path(job: str) -> str:
    return SYSTEMD_DIR + "/" + target_name(job)


# The job's target is wanted by this one while the job should run, so its tasks come back
# when the host boots (each through its unit's gate, exec_condition_command).
BOOT_TARGET = "multi-user.target"


def wants_link(job: str) -> str:
    """The link that enables the job's target at boot (what `systemctl enable` would make)."""
    return SYSTEMD_DIR + "/" + BOOT_TARGET + ".wants/" + target_name(job)


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


def boot_path(job: str, task: str) -> str:
    return state_dir(job) + "/" + task + ".boot"


def run_path(job: str, task: str) -> str:
    return state_dir(job) + "/" + task + ".run"


def metric_file(job: str, task: str) -> str:
    """A trial's task reports its metric here (CLOUD_ML_HP_METRIC_FILE: cloudml-hypertune's
    default, /tmp/hypertune/output.metrics, is shared by every job on a host)."""
    return state_dir(job) + "/hypertune/" + task + ".metrics"


def heartbeat_path(job: str, task: str) -> str:
    """PROVISION_HEARTBEAT: a file the task touches to say it progresses (a job with
    `progress:`); only its modification time is read, never its content."""
    return state_dir(job) + "/" + task + ".heartbeat"


def originals_dir(job: str) -> str:
    return state_dir(job) + "/originals"


def original_path(job: str, path: str) -> str:
    """Where `replace: true` keeps the host's own file at path until destroy puts it back."""
    return originals_dir(job) + "/" + path.strip("/").replace("%", "%25").replace("/", "%2F")


# --------------------------------------------------------------------------- .exits records
#
# One line per exit of a task, appended by the unit's ExecStopPost= (and by the agent for a
# task stopped while it waited to restart, which runs no ExecStopPost):
#     TIME SERVICE_RESULT EXIT_CODE EXIT_STATUS [stop|reboot]
# TIME: epoch seconds on the host; SERVICE_RESULT, EXIT_CODE and EXIT_STATUS as systemd
# passes them to ExecStopPost= (systemd.exec(5)); "stop" when the run ended because a stop
# was asked for (ExecStop= saw $MAINPID and left the .stopping mark); "reboot" when that stop
# was the host shutting down. A host that went down without a shutdown left no record: the
# unit's gate writes one at the next boot, `TIME reboot none - reboot`.

STOP_MARK = "stop"
REBOOT_MARK = "reboot"


def exit_record(time: int, result: str, code: str, status: str, stopped: bool) -> str:
    """One line of the .exits file, newline included."""
    return "%d %s %s %s%s\n" % (time, result, code, status, " " + STOP_MARK if stopped else "")


def parse_exits(text: str) -> list[list[str]]:
    """The records of one .exits file as lists of words, oldest first; junk lines skipped."""
    return [line.split() for line in text.splitlines() if 4 <= len(line.split()) <= 5]


def exec_stop_command(job: str, task: str) -> str:
    """ExecStop= of a task's unit: mark that a stop was asked for, and whether the host is
    shutting down (then the mark says "reboot"). ExecStop= runs after every run, but
    $MAINPID is set only when the task was still running, i.e. when someone (or the
    shutdown) asked systemd to stop it. Nothing is killed here; systemd sends the KillSignal
    as usual. ($$ is systemd's escape for a literal $.)"""
    mark = stopping_path(job, task)
    return (
        '/bin/sh -c \'if [ -n "$$MAINPID" ]; then mkdir -p %s; '
        'if [ "$$(systemctl is-system-running 2>/dev/null)" = stopping ]; then echo %s > %s; else : > %s; fi; fi\''
        % (state_dir(job), REBOOT_MARK, mark, mark)
    )


def exec_stop_post_command(job: str, task: str) -> str:
    """ExecStopPost= of a task's unit: append the exit record (exit_record's format, with the
    mark of exec_stop_command turned into the last field). A run that the shutdown ended
    leaves its .run mark saying so; any other exit ends the run. A start the gate refused
    (SERVICE_RESULT exec-condition) ran nothing: no record."""
    mark, exits, run = stopping_path(job, task), exits_path(job, task), run_path(job, task)
    return (
        '/bin/sh -c \'mkdir -p %s; [ "$$SERVICE_RESULT" = exec-condition ] && exit 0; '
        's=; if [ -e %s ]; then read m < %s; s=" $${m:-%s}"; rm -f %s; fi; '
        'echo "$$(date +%%%%s) $$SERVICE_RESULT $$EXIT_CODE $$EXIT_STATUS$$s" >> %s; '
        'if [ "$$s" = " %s" ]; then echo %s > %s; else rm -f %s; fi\''
        % (state_dir(job), mark, mark, STOP_MARK, mark, exits, REBOOT_MARK, REBOOT_MARK, run, run)
    )


# --------------------------------------------------------------------------- boots
#
# A boot is named by the kernel's boot id and PID 1's start time (clock ticks since the
# kernel booted): a container restarted on the same kernel (`docker restart` of a sandbox
# host) is a new boot of its systemd but keeps the kernel's id.

KERNEL_BOOT_ID = "/proc/sys/kernel/random/boot_id"
# The same in sh, with builtins only: sets $b (and the positional parameters).
BOOT_ID_SH = "read k < %s; read p < /proc/1/stat; set -- $p; b=$k.${22}" % KERNEL_BOOT_ID


def boot_id() -> str:
    with open(KERNEL_BOOT_ID) as f:
        kernel = f.read().strip()
    try:
        with open("/proc/1/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return kernel
    return kernel + "." + start


def _systemd_escaped(sh: str) -> str:
    """A sh script as one single-quoted word of a unit's command line ($ and % escaped)."""
    return "/bin/sh -c '" + sh.replace("%", "%%").replace("$", "$$") + "'"


def exec_condition_command(job: str, task: str, budget: int, fail_on_reboot: bool, restart_due: str) -> str:
    """ExecCondition= of a task's unit: the gate every start goes through, provision's,
    systemd's automatic restarts and the boot's. Exit 0 starts the task; 1 leaves it as it
    is (systemd runs nothing, the unit is inactive).

    The values come from lifecycle.boot_gate (the rules, and lifecycle.gate their reference):
    - the first start after a reboot (the .boot file names another boot): nothing starts if
      the job ended (lifecycle marker); a task whose run the reboot ended (.run is there) gets
      its exit record if the shutdown wrote none, then stays down when `fail_on_reboot`;
      a task that had ended before comes back only when its last exit was due a restart
      (`restart_due`: a sh test on the record's words $2 $3 $4);
    - every start: no more than `budget` restarts, counted in the .exits file (systemd's own
      start counter begins again at every boot).
    The agent removes .boot, .run and the records before a start of its own."""
    d, e, r, o = state_dir(job), exits_path(job, task), run_path(job, task), boot_path(job, task)
    # sh builtins only (read, set, test, arithmetic), but for mkdir and date when needed: it
    # runs at every start. The records are counted as parse_exits counts them.
    sh = (
        "set -f; %s; [ -d %s ] || mkdir -p %s; "
        "n=0; l=; if [ -f %s ]; then while read -r a; do set -- $a; "
        "if [ $# -ge 4 ] && [ $# -le 5 ]; then n=$((n+1)); l=$a; fi; done < %s; fi; set -- $l; "
        'c=; if [ -f %s ]; then read c < %s; fi; if [ -n "$c" ] && [ "$c" != "$b" ]; then echo "$b" > %s; '
        "if [ -e %s ]; then rm -f %s; exit 1; fi; "
        "if [ -e %s ]; then "
        'if [ ! -s %s ]; then echo "$(date +%%s) %s none - %s" >> %s; n=$((n+1)); fi; %s'
        'elif [ -z "$4" ] || [ -n "$5" ] || ! { %s; }; then exit 1; fi; fi; '
        "%s"
        'echo "$b" > %s; : > %s; exit 0'
    ) % (
        BOOT_ID_SH,
        d,
        d,
        e,
        e,
        o,
        o,
        o,
        lifecycle_path(job),
        r,
        r,
        r,
        REBOOT_MARK,
        REBOOT_MARK,
        e,
        "rm -f %s; exit 1; " % r if fail_on_reboot else "",
        restart_due,
        "if [ $n -gt %d ]; then rm -f %s; exit 1; fi; " % (budget, r) if budget else "",
        o,
        r,
    )
    return _systemd_escaped(sh)


# --------------------------------------------------------------------------- the host's ledger
#
# What each provision job holds on the host (GPUs, ports), one JSON file per job, shared by
# every job and every operator that applies to the host; host/ledger.py reads and writes it
# under LEDGER_LOCK (flock). A dot name: job names are DNS labels, so no job's state_dir
# can be this directory.

LEDGER_DIR = VAR + "/.ledger"
LEDGER_LOCK = LEDGER_DIR + "/.lock"
LEDGER_SUFFIX = ".json"


def ledger_path(job: str) -> str:
    return LEDGER_DIR + "/" + job + LEDGER_SUFFIX


def job_of_ledger_path(path: str) -> str:
    return path.rsplit("/", 1)[-1][: -len(LEDGER_SUFFIX)]


# The host's health (host/health.py): a state per GPU and for the host, changed under the
# ledger's lock (a reservation of a quarantined GPU is refused there), and the time of the
# last kernel message the health read has dealt with. Dot names: never a job's entry.
HEALTH_PATH = LEDGER_DIR + "/.health.json"
XID_AFTER_PATH = LEDGER_DIR + "/.xid-after"
# On provision's sandbox hosts (containers share this machine's kernel, whose log no test
# may write), the kernel messages the health read takes are this file's, when it is there.
SANDBOX_KMSG = "/etc/provision-sandbox/kmsg"


# --------------------------------------------------------------------------- setup
#
# A `setup:` on a host is keyed by what it is (its commands, env, user, timeout and the
# contents of its inputs: render/files.py), not by the job: every job that needs the same
# one shares one run of it and its result. Its script, env and oneshot unit are named by
# the key (a sha256, hex: nothing of the inventory reaches a name); each job's manifest
# lists them as it lists a shared pushed file, so the last job to leave removes them.
#     /etc/provision/.setups/K/setup.sh, setup.env
#     /etc/systemd/system/provision-setup-K.service
#     /var/lib/provision/.setups/K.done     the full key, once the setup succeeded here
#     /var/lib/provision/.setups/K.lock     flock: one run at a time, the others wait for it
#     /var/lib/provision/.setups/holds/S    the setups study S holds between its trials
# K: the key's first 32 hex digits (128 bits). Dot names: job names are DNS labels.

SETUP = "setup"  # not a task name: task names are ROLE-INDEX
SETUPS_ETC = ETC + "/.setups"
SETUPS_VAR = VAR + "/.setups"
SETUPS_HOLDS = SETUPS_VAR + "/holds"


def setup_short(key: str) -> str:
    return key[:32]


def setup_dir(key: str) -> str:
    return SETUPS_ETC + "/" + setup_short(key)


def setup_script_path(key: str) -> str:
    return setup_dir(key) + "/setup.sh"


def setup_env_path(key: str) -> str:
    return setup_dir(key) + "/setup.env"


def setup_log_identifier(key: str) -> str:
    """journald's SYSLOG_IDENTIFIER of the setup's output; also its unit's name. A job's unit
    is PREFIX-JOB-ROLE-INDEX: a task name has a dash, this hex has none, so none is this."""
    return PREFIX + SETUP + "-" + setup_short(key)


def setup_unit(key: str) -> str:
    return setup_log_identifier(key) + ".service"


def is_setup_unit(unit: str) -> bool:
    head, tail = PREFIX + SETUP + "-", ".service"
    name = unit[len(head) : -len(tail)] if unit.startswith(head) and unit.endswith(tail) else ""
    return len(name) == 32 and not name.strip("0123456789abcdef")


def setup_unit_path(key: str) -> str:
    return SYSTEMD_DIR + "/" + setup_unit(key)


def setup_done_path(key: str) -> str:
    return SETUPS_VAR + "/" + setup_short(key) + ".done"


def setup_lock_path(key: str) -> str:
    return SETUPS_VAR + "/" + setup_short(key) + ".lock"


def setup_hold_path(study: str) -> str:
    """A study's holds on the setups its trials use, one K a line: a trial's removal leaves
    its setup for the study's next trials (they follow one another on a host) until the
    study is destroyed."""
    return SETUPS_HOLDS + "/" + study


def setup_done_record(key: str) -> bytes:
    """What setup_done_path holds once the setup succeeded (plan compares its sha256)."""
    return (key + "\n").encode()


def runs_path(job: str) -> str:
    """The job's runs on this host (core/runs.py): [{"run", "at", "by"}, ...], last 100."""
    return state_dir(job) + "/runs.json"


def preempt_at_path(job: str) -> str:
    """PROVISION_PREEMPT_AT: while a preemption is under way, the deadline of the
    job's tasks as Unix seconds (one decimal number and a newline); absent otherwise."""
    return state_dir(job) + "/preempt-at"


def resume_env_path(job: str) -> str:
    """An optional EnvironmentFile= of a preemptible job's units: PROVISION_RESUME="1" in
    the run that resumes a preempted one (host/preempt.py writes it, the next start clears)."""
    return state_dir(job) + "/resume.env"


def with_run(runs: object, run: dict[str, object], at: float) -> list[object]:
    """A host's runs with `run` ({"run", "by"}) added at host time `at`: the last 100."""
    kept: list[object] = [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []
    return [*kept, dict(run, at=at)][-100:]


# Releases up to 1a5e7ca ran a job's setup per job: these names let render recognise a
# setup done that way (its key still counts for the job's tasks: no restart on upgrade).


def setup_key_path(job: str) -> str:
    """The key of the job's last per-job setup that succeeded (those releases')."""
    return state_dir(job) + "/setup.key"


def legacy_setup_script_path(job: str) -> str:
    return job_dir(job) + "/setup.sh"


def legacy_setup_env_path(job: str) -> str:
    return job_dir(job) + "/setup.env"


def legacy_setup_log_identifier(job: str) -> str:
    return PREFIX + job + "-" + SETUP
