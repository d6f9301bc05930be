"""A dev session on its host: the task `provision dev` starts (pushed to the host as one
file and run there as `python3 -S FILE`), and what the agent and the service ask of it.

The task runs a private sshd on the host's loopback, at the task's port (MASTER_PORT),
with the host's own host keys and every user's own authorized keys, so that a login to
it (through the host's sshd: the ssh config provision writes jumps there) lands in the
task's environment: sshd's `SetEnv` hands every session the variables systemd gave the
task (CUDA_VISIBLE_DEVICES, PROVISION_JOB, ...), whatever the client (OpenSSH, VS Code's
Remote-SSH, JetBrains Gateway: no RemoteCommand, nothing to set up on the client). Every
login's processes are the unit's: the session's end (idle, its hours, a preemption, its
`--stop`) takes them with it, and who is logged in is whoever has a connection to it.

With PROVISION_DEV_IMAGE the GPUs are held by a container of that image and each login
enters it (`docker exec`, through sshd's ForceCommand: this file's `enter`). With
PROVISION_DEV_JUPYTER, JupyterLab is started too, on the host's loopback, as the login
user, with a token of its own; the ready file (0600, root's) says where, or why not.

On SIGTERM: the logged-in terminals are told why (a stop's or a preemption's end marker),
and, in a preemption, the session waits for them until its deadline (the preemption's
grace), then ends everything it started.

The program the host gets is host/logins.py followed by this file (inventory/devsession.py
puts them together): who is logged in, and a message to their terminals, are the agent's
and the session's alike. Stdlib only.
"""

from __future__ import annotations

import os
import sys
import time

try:  # in provision's package (tests, mypy); on the host, logins.py's text comes first in the file
    from .logins import PREFIX, _read, hang_up, unit_logins, warn
except ImportError:
    pass

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# host/layout.py's (this file runs without it; tests/test_devsession.py keeps them equal).
ETC = "/etc/provision"
VAR = "/var/lib/provision"
SSHD = "/usr/sbin/sshd"
HOST_KEYS = ("/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_ecdsa_key", "/etc/ssh/ssh_host_rsa_key")
READY_WAIT = 15.0  # seconds for the private sshd (and JupyterLab: JUPYTER_WAIT) to listen
JUPYTER_WAIT = 60.0
# What systemd (and a shell) puts in a unit's environment: not the task's, not handed on.
NOT_PASSED = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "PWD", "OLDPWD", "SHLVL", "_", "LANG", "LANGUAGE",
    "INVOCATION_ID", "JOURNAL_STREAM", "SYSTEMD_EXEC_PID", "NOTIFY_SOCKET", "MANAGERPID", "MAINPID",
    "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "WATCHDOG_PID", "WATCHDOG_USEC", "SERVICE_RESULT",
    "EXIT_CODE", "EXIT_STATUS", "RUNTIME_DIRECTORY", "STATE_DIRECTORY", "CACHE_DIRECTORY",
    "LOGS_DIRECTORY", "CONFIGURATION_DIRECTORY", "CREDENTIALS_DIRECTORY", "MEMORY_PRESSURE_WATCH",
    "MEMORY_PRESSURE_WRITE",
)  # fmt: skip


def unit_of(job: str, task: str) -> str:
    return PREFIX + job + "-" + task + ".service"


def dev_dir(job: str) -> str:
    return VAR + "/" + job + "/dev"


def ready_path(job: str) -> str:
    """What the session says once it answers: {"port", "jupyter": {...}} (0600, root's)."""
    return dev_dir(job) + "/ready.json"


def container_of(job: str) -> str:
    return PREFIX + job + "-dev"


# --------------------------------------------------------------------------- the session


def _sshd_word(value: str) -> str:
    """A value as one double-quoted word of sshd_config (its argv_split's escapes)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def passed_env(env: dict[str, str]) -> list[tuple[str, str]]:
    """The task's variables every login gets: what systemd added left out, and values sshd's
    config cannot hold (a line break) too."""
    out = []
    for k, v in sorted(env.items()):
        if k in NOT_PASSED or k.startswith("LC_") or "\n" in v or "\r" in v or "\0" in v:
            continue
        out.append((k, v))
    return out


def sshd_config(port: int, env: dict[str, str], user: str, enter: str, keys: list[str]) -> str:
    """The private sshd's config: loopback only, keys only, no PAM (a PAM session would
    move each login's processes out of the unit), the task's variables for every session,
    and with `enter` every login handed to that command (an image's container)."""
    lines = [
        "# A provision dev session's sshd (host/devsession.py); removed when the session ends.",
        "ListenAddress 127.0.0.1:%d" % port,
        *("HostKey " + k for k in keys),
        "PidFile none",
        "UsePAM no",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PubkeyAuthentication yes",
        "PermitRootLogin prohibit-password",
        "PrintMotd no",
        "PrintLastLog no",
        "UseDNS no",
        "X11Forwarding no",
        "AllowTcpForwarding local",
        "AcceptEnv LANG LC_*",
        "ClientAliveInterval 30",
        "ClientAliveCountMax 4",
        "Subsystem sftp internal-sftp",
    ]
    if user:
        lines.append("AllowUsers " + user)
    passed = passed_env(env)
    if passed:  # one line: sshd keeps the first SetEnv it reads
        lines.append("SetEnv " + " ".join(_sshd_word(k + "=" + v) for k, v in passed))
    if enter:
        lines.append("ForceCommand " + enter)
    return "\n".join(lines) + "\n"


def _write_private(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def _listens(port: int) -> bool:
    import socket  # the session's own start (the agent never needs it)

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_listening(port: int, proc: Any, within: float) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        if _listens(port):
            return True
        time.sleep(0.05)
    return False


def _free_port() -> int:
    import socket  # as above

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _subprocess() -> Any:
    import subprocess  # the session's own work: the agent's probe and warning never pay for it

    return subprocess


class Session:
    """The session's task: what it started, and its end."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.job, self.task = env["PROVISION_JOB"], env["PROVISION_TASK"]
        self.unit = unit_of(self.job, self.task)
        self.port = int(env["MASTER_PORT"])
        self.user = env.get("PROVISION_DEV_USER", "")
        self.image = env.get("PROVISION_DEV_IMAGE", "")
        self.procs: list[Any] = []
        self.ending = False

    def say(self, text: str) -> None:
        print(text, flush=True)  # the task's journal: `provision logs`

    def _docker(self, args: list[str], **kw: Any) -> Any:
        return _subprocess().run(["docker", *args], capture_output=True, text=True, **kw)

    def _container(self) -> str:
        """Start the image's container holding the GPUs, with the task's variables; the
        command that enters it, for sshd's ForceCommand."""
        name = container_of(self.job)
        self._docker(["rm", "-f", name], timeout=120)
        argv = ["run", "-d", "--rm", "--name", name, "--network", "host"]
        gpus = self.env.get("CUDA_VISIBLE_DEVICES", "")
        if gpus:
            argv += ["--gpus", '"device=%s"' % gpus]
        for k, _ in passed_env(self.env):  # names only: docker takes each value from ours
            argv += ["-e", k]
        r = self._docker([*argv, self.image, "tail", "-f", "/dev/null"], timeout=3600)
        if r.returncode != 0:
            raise SystemExit("dev session: docker run %s failed: %s" % (self.image, (r.stderr or r.stdout).strip()))
        return "/usr/bin/env python3 -S %s enter %s" % (os.path.abspath(sys.argv[0]), name)

    def _jupyter(self) -> dict[str, Any]:
        """JupyterLab on the host's loopback (in the container with an image), as the login
        user, with a token of its own: where it answers, or why it does not."""
        import secrets  # only a session with JupyterLab needs it

        token, port = secrets.token_hex(24), _free_port()
        args = ["--no-browser", "--ip=127.0.0.1", "--port=%d" % port, "--ServerApp.port_retries=0"]
        args += ["--ServerApp.token=" + token]
        if self.image:
            name = container_of(self.job)
            if self._docker(["exec", name, "sh", "-c", "command -v jupyter-lab"], timeout=60).returncode != 0:
                return {"error": "JupyterLab is not installed in the image %s (no jupyter-lab)" % self.image}
            argv = ["docker", "exec", name, "jupyter-lab", "--allow-root", *args]
            preexec = None
        else:
            import shutil  # as above

            found = shutil.which("jupyter-lab", path=self.env.get("PATH") or os.defpath)
            if found is None:
                return {"error": "JupyterLab is not installed (no jupyter-lab on PATH)"}
            argv, preexec = [found, *args], self._as_user(args)
            if preexec is None:
                argv.append("--allow-root")
        sp = _subprocess()
        p = sp.Popen(argv, stdin=sp.DEVNULL, preexec_fn=preexec, cwd=self._home())  # noqa: PLW1509 - the login user's
        self.procs.append(p)
        if not _wait_listening(port, p, JUPYTER_WAIT):
            return {"error": "JupyterLab did not answer within %d s (its output: provision logs)" % JUPYTER_WAIT}
        return {"port": port, "token": token}

    def _home(self) -> str:
        import pwd  # as above

        try:
            return pwd.getpwnam(self.user or "root").pw_dir
        except KeyError:
            return "/"

    def _as_user(self, args: list[str]) -> Any:
        """A login user who is not root runs JupyterLab as themselves."""
        import pwd  # as above

        if not self.user or self.user == "root":
            return None
        try:
            pw = pwd.getpwnam(self.user)
        except KeyError:
            return None

        def drop() -> None:  # pragma: no cover - in the child
            os.setgid(pw.pw_gid)
            os.initgroups(pw.pw_name, pw.pw_gid)
            os.setuid(pw.pw_uid)
            os.environ["HOME"] = pw.pw_dir

        return drop

    def start(self) -> None:
        d = dev_dir(self.job)
        os.makedirs(d, 0o700, exist_ok=True)
        try:
            os.unlink(ready_path(self.job))
        except FileNotFoundError:
            pass
        enter = self._container() if self.image else ""
        keys = [k for k in HOST_KEYS if os.path.exists(k)]
        conf = d + "/sshd_config"
        _write_private(conf, sshd_config(self.port, self.env, self.user, enter, keys).encode())
        os.makedirs("/run/sshd", 0o755, exist_ok=True)  # sshd's privilege separation directory
        sp = _subprocess()
        sshd = sp.Popen([SSHD, "-D", "-e", "-f", conf], stdin=sp.DEVNULL)
        self.procs.append(sshd)
        if not _wait_listening(self.port, sshd, READY_WAIT):
            self.stop_all()
            raise SystemExit("dev session: sshd did not listen on 127.0.0.1:%d (its words above)" % self.port)
        ready: dict[str, Any] = {"port": self.port}
        if self.env.get("PROVISION_DEV_JUPYTER"):
            ready["jupyter"] = self._jupyter()
        import json  # as above

        _write_private(ready_path(self.job), json.dumps(ready).encode())
        self.say("dev session %s ready on 127.0.0.1:%d" % (self.env.get("PROVISION_DEV", ""), self.port))

    def why_ending(self) -> tuple[str, float | None]:
        """What the end marker says (a stop's reason, a preemption's preemptor) and, in a
        preemption, its deadline."""
        import json  # as above

        try:
            marker = json.loads(_read(ETC + "/" + self.job + "/lifecycle.json", 1 << 16).decode() or "null")
        except ValueError:
            marker = None
        at = None
        path = self.env.get("PROVISION_PREEMPT_AT", "")
        if path:
            try:
                at = float(_read(path, 64).decode().strip())
            except ValueError:
                at = None
        if isinstance(marker, dict) and marker.get("phase") == "Preempted":
            got = marker.get("preempted")
            mark = got if isinstance(got, dict) else {}
            by = "%s (%s)" % (mark.get("by", "?"), mark.get("who", "?"))
            return "this session was preempted by job " + by, at
        if isinstance(marker, dict) and isinstance(marker.get("reason"), str):
            return "this session ended: " + marker["reason"][:200], None
        return "this session is ending", None

    def end(self) -> None:
        """SIGTERM: tell the terminals why; in a preemption, wait for them until its
        deadline; then end what the session started."""
        why, deadline = self.why_ending()
        if deadline is not None:
            left = max(0, int(deadline - time.time()))
            at = time.strftime("%H:%M:%S", time.localtime(deadline))
            told = warn(self.unit, "%s: it ends in %d s (at %s); save your work" % (why, left, at))
            while time.time() < deadline - 1 and unit_logins(self.unit):
                time.sleep(0.5)
        else:
            told = warn(self.unit, why)
        self.say("dev session: %s (told %d terminal%s)" % (why, told, "" if told == 1 else "s"))
        if told:
            time.sleep(1.0)  # sshd forwards what the terminals were told before it is hung up
        self.stop_all()

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(5)
            except _subprocess().TimeoutExpired:
                p.kill()
        if self.image:
            self._docker(["rm", "-f", container_of(self.job)], timeout=120)
        hang_up(self.unit, but=os.getpid())
        try:
            os.unlink(ready_path(self.job))
        except FileNotFoundError:
            pass

    def run(self) -> int:
        import signal  # as above

        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "ending", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "ending", True))
        self.start()
        sshd = self.procs[0]  # the first it started
        while not self.ending:
            if sshd.poll() is not None:  # sshd died: the session cannot be reached
                self.say("dev session: its sshd ended (exit %s)" % sshd.returncode)
                self.stop_all()
                return 1
            time.sleep(0.5)
        self.end()
        return 0


def enter(container: str) -> None:
    """sshd's ForceCommand for an image's session: the login's command (or a login shell)
    in the session's container, with a terminal when the login has one."""
    argv = ["docker", "exec", "-i"]
    if os.environ.get("SSH_TTY"):
        argv.append("-t")
    for k in ("TERM", "LANG"):
        if os.environ.get(k):
            argv += ["-e", k]
    cmd = os.environ.get("SSH_ORIGINAL_COMMAND")
    if cmd:
        argv += [container, "sh", "-c", cmd]
    else:
        argv += [container, "sh", "-c", "if command -v bash >/dev/null; then exec bash -l; fi; exec sh -l"]
    os.execvp("docker", argv)


def main(argv: list[str]) -> int:
    if argv[:1] == ["warn"] and len(argv) == 3:
        import base64  # as above

        print(warn(argv[1], base64.b64decode(argv[2]).decode("utf-8", "replace")))
        return 0
    if argv[:1] == ["enter"] and len(argv) == 2:
        enter(argv[1])
        return 1
    if argv:
        print("usage: %s [warn UNIT BASE64 | enter CONTAINER]" % sys.argv[0], file=sys.stderr)
        return 2
    return Session(dict(os.environ)).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
