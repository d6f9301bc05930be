#!/usr/bin/env python3
"""provision next to pyinfra and Ansible on the same sandbox hosts, in one run.

    python bench/compare.py                      # 8, 32 and 128 hosts; results file + table
    python bench/compare.py --hosts 8 --runs 1   # a quick look
    python bench/compare.py --tools provision --hosts 8 --runs 1 --noop-runs 2   # quicker
    python bench/compare.py --readme             # also refresh README.md's Benchmark section
    python bench/compare.py --tools provision --provision-rev HEAD~2   # provision as of a commit

Not a test: a script anyone can run on a machine where `provision sandbox up` works (root,
Docker). For each host count it starts a fresh sandbox, then measures, interleaving the
tools round by round so that background load falls on all of them alike:

- the floor: one SSH round trip to every host at once (paramiko, a thread per host,
  connect + key auth + host key check + `true`), in this process;
- first apply (fresh hosts: the job's units and files removed, provision's state file
  deleted), no-op apply, one-file-changed apply (BENCH_GEN in every host's env file bumped,
  so every task restarts), and for provision also `plan`, `status`, `logs --tail 10` and
  `check`;
- launch latency: from the start of the first apply to the last task's unit entering
  active (systemd's ActiveEnterTimestampMonotonic on every host; the hosts are containers on
  this machine's kernel, so their monotonic clock is this process's);
- the controller's peak memory: ru_maxrss of each run's process from wait4() (the largest
  single process of its tree; every tool is started by a small spawner, so the figure is the
  tool's own and not this bench's), and in one extra first apply per tool the peak PSS of the
  whole process tree (Ansible forks a worker and an ssh per host), sampled from /proc, with
  the tree's threads and open file descriptors (and the same for one extra `plan`).

The three tools do the same work: the same env file bytes (from `provision render`, job
name aside) and the same unit on every host, then the unit runs (restarted after a
change). Workloads: bench/workload/. ansible-core and pyinfra live in their own venv
(~/.cache/provision/bench-venv, made when missing). Every tool checks host keys against
the sandbox's known_hosts and logs in with the sandbox's key; every tool works on all
hosts at once. After each apply the hosts are checked (file hashes, unit active, the
task's process environment) before a time counts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import paramiko
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKLOAD = HERE / "workload"
CACHE = Path(os.environ.get("PROVISION_CACHE_DIR") or Path.home() / ".cache" / "provision")
VENV = CACHE / "bench-venv"
TOOLS = ("provision", "pyinfra", "ansible")
JOBS = {"provision": "bprov", "pyinfra": "bpyinfra", "ansible": "bansible"}
PIP_PACKAGES = ("ansible-core", "pyinfra")
README_BEGIN = "<!-- benchmark:begin (bench/compare.py --readme rewrites this block) -->"
README_END = "<!-- benchmark:end -->"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------- tools


def ensure_venv() -> Path:
    """ansible-core and pyinfra in their own venv, so the project's stays clean."""
    bin_dir = VENV / "bin"
    if not (bin_dir / "ansible-playbook").exists() or not (bin_dir / "pyinfra").exists():
        log(f"creating {VENV} with {', '.join(PIP_PACKAGES)} (pip, from PyPI)")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(bin_dir / "pip"), "install", "-q", *PIP_PACKAGES], check=True)
    return bin_dir


def tool_env() -> dict[str, str]:
    """The tools' environment: bytecode caching on, as after an ordinary install (pip wrote
    .pyc files for pyinfra and Ansible; an editable provision gets its own on the first run)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def tool_versions(bin_dir: Path, provision_cmd: list[str]) -> dict[str, str]:
    def first_line(cmd):
        out = subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()
        return out[0] if out else "?"

    out = {"provision": first_line([*provision_cmd, "--version"])}
    if (bin_dir / "pyinfra").exists():
        out["pyinfra"] = first_line([str(bin_dir / "pyinfra"), "--version"])
    if (bin_dir / "ansible-playbook").exists():
        out["ansible"] = first_line([str(bin_dir / "ansible-playbook"), "--version"])
    out["python"] = platform.python_version()
    out["paramiko (provision's)"] = paramiko.__version__
    return out


def provision_command(rev: str | None) -> list[str]:
    """How to run provision: the console script beside this interpreter (no pyenv/asdf shim
    in the timings), or with --provision-rev the source of that git revision, extracted."""
    if rev:
        sha = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True, capture_output=True, text=True
        ).stdout.strip()
        dest = CACHE / "bench" / f"provision-{sha}"
        if not (dest / "src" / "provision").is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", sha, "src", "templates"], check=True, capture_output=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        # That revision's own `python -m provision` (its __main__ knows its entry point).
        return [
            sys.executable,
            "-c",
            f"import sys, runpy; sys.path.insert(0, {str(dest / 'src')!r}); "
            "runpy.run_module('provision', run_name='__main__', alter_sys=True)",
        ]
    cand = Path(sys.executable).parent / "provision"
    if cand.exists():
        return [str(cand)]
    found = shutil.which("provision")
    if not found:
        sys.exit("provision is not installed (pip install -e .)")
    return [found]


def warm_up(provision_cmd: list[str]) -> None:
    """Write provision's .pyc files, every module of it, before anything is timed (see
    tool_env); with --provision-rev, that revision's (the same sys.path line first)."""
    code = "import compileall, os, provision; compileall.compile_dir(os.path.dirname(provision.__file__), quiet=1)"
    if provision_cmd[0] == sys.executable:
        m = re.search(r"sys\.path\.insert\(0, '[^']+'\)", provision_cmd[2])
        assert m, provision_cmd
        code = "import sys; " + m.group(0) + "; " + code
    subprocess.run([sys.executable, "-c", code], check=True, env=tool_env())


# --------------------------------------------------------------------------- measuring


@dataclass
class Run:
    seconds: float
    maxrss_kib: int
    cpu_seconds: float
    peak_pss_kib: int | None = None
    host_cpu_seconds: float = 0.0
    start_monotonic: float = 0.0  # time.monotonic() just before the fork
    peak_threads: int | None = None  # whole tree, when sampled
    peak_fds: int | None = None
    exit_code: int = 0


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out += [int(x) for x in f.read().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def _threads_fds(pid: int) -> tuple[int, int]:
    threads = fds = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            threads = next((int(line.split()[1]) for line in f if line.startswith("Threads:")), 0)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return threads, fds


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class TreeSampler(threading.Thread):
    """Peak PSS, threads and open fds of a process and all its descendants (each summed over
    the tree), sampled every `interval` s."""

    def __init__(self, pid: int, interval: float = 0.05):
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval, 0
        self.peak_threads = self.peak_fds = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            todo, total, threads, fds, seen = [self.pid], 0, 0, 0, set()
            while todo:
                p = todo.pop()
                if p in seen:
                    continue
                seen.add(p)
                total += _pss_kib(p)
                th, fd = _threads_fds(p)
                threads, fds = threads + th, fds + fd
                todo += _children(p)
            self.peak = max(self.peak, total)
            self.peak_threads = max(self.peak_threads, threads)
            self.peak_fds = max(self.peak_fds, fds)
            self.stop.wait(self.interval)


# Every tool is started by a small spawner process, not by this one: Linux charges a child's
# ru_maxrss with the memory of the process it was forked from (the forked copy's high-water
# mark is folded in at exec), so a tool forked from this bench (paramiko, docker, 128
# connections: ~120 MiB) would report the bench's size as its own. The spawner is a bare
# `python -S` of about 10 MiB, so its children's ru_maxrss is their own.
SPAWNER = r"""
import json, os, sys, time
for line in sys.stdin.buffer:
    req = json.loads(line)
    out = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    m0, t0 = time.monotonic(), time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(req["cwd"])
            os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.execvpe(req["cmd"][0], req["cmd"], req["env"])
        except BaseException as e:
            os.write(2, ("spawner: %s\n" % e).encode())
        os._exit(127)
    os.close(out)
    sys.stdout.write("%d\n" % pid)
    sys.stdout.flush()
    _, status, ru = os.wait4(pid, 0)
    elapsed = time.perf_counter() - t0
    sys.stdout.write(json.dumps({"m0": m0, "elapsed": elapsed, "code": os.waitstatus_to_exitcode(status),
        "maxrss": ru.ru_maxrss, "cpu": ru.ru_utime + ru.ru_stime}) + "\n")
    sys.stdout.flush()
"""
_spawner: subprocess.Popen | None = None
_spawner_lock = threading.Lock()


def _spawn(cmd: list[str], cwd: Path, env: dict | None, log_path: Path) -> subprocess.Popen:
    global _spawner
    if _spawner is None or _spawner.poll() is not None:
        _spawner = subprocess.Popen(
            [sys.executable, "-S", "-c", SPAWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
    req = {"cmd": cmd, "cwd": str(cwd), "env": dict(os.environ) if env is None else env, "log": str(log_path)}
    assert _spawner.stdin and _spawner.stdout
    _spawner.stdin.write(json.dumps(req) + "\n")
    _spawner.stdin.flush()
    return _spawner


def timed(
    cmd: list[str],
    *,
    cwd: Path,
    env: dict | None = None,
    log_path: Path,
    sample: bool = False,
    ok_codes: tuple[int, ...] = (0,),
    timeout: float = 900,
    host_cpu=lambda: 0.0,
) -> Run:
    """Run cmd through the spawner; wall time from fork to exit, its ru_maxrss and CPU (wait4),
    the hosts' CPU."""
    h0 = host_cpu()
    with open(log_path, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
    with _spawner_lock:  # one tool at a time; the lock only guards the pipe's framing
        sp = _spawn(cmd, cwd, env, log_path)
        assert sp.stdout
        pid_line = sp.stdout.readline()
        if not pid_line:  # killed, or a broken pipe: say so rather than fail on int("")
            raise RuntimeError(f"the spawner died starting {' '.join(cmd)} (log {log_path})")
        pid = int(pid_line)
        sampler = TreeSampler(pid) if sample else None
        if sampler:
            sampler.start()
        killer = threading.Timer(timeout, os.kill, (pid, 9))  # a blocking read costs this process no CPU
        killer.start()
        line = sp.stdout.readline()
        killer.cancel()
        if sampler:
            sampler.stop.set()
            sampler.join()
    if not line:
        raise RuntimeError(f"the spawner died running {' '.join(cmd)}")
    res = json.loads(line)
    if res["elapsed"] >= timeout:
        raise RuntimeError(f"timed out after {timeout}s: {' '.join(cmd)} (log {log_path})")
    if res["code"] not in ok_codes:
        raise RuntimeError(f"exit {res['code']}: {' '.join(cmd)} (see {log_path})")
    return Run(
        res["elapsed"],
        res["maxrss"],
        res["cpu"],
        sampler.peak if sampler else None,
        host_cpu() - h0,
        res["m0"],
        sampler.peak_threads if sampler else None,
        sampler.peak_fds if sampler else None,
        res["code"],
    )


# --------------------------------------------------------------------------- hosts


class Fleet:
    """Plain paramiko connections to every host, for the floor, cleaning and checking."""

    def __init__(self, sb):
        self.sb = sb
        self.key = paramiko.Ed25519Key.from_private_key_file(str(sb.key_path))
        self.pool = ThreadPoolExecutor(max_workers=len(sb.hosts))
        self.conns: dict[str, paramiko.SSHClient] = {}
        self._cpu_files: list[str] = []
        try:
            import docker

            client = docker.from_env()
            for h in sb.hosts:
                cid = client.containers.get(h.container).id
                for path in (
                    f"/sys/fs/cgroup/cpuacct/docker/{cid}/cpuacct.usage",
                    f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/cpu.stat",
                ):
                    if os.path.exists(path):
                        self._cpu_files.append(path)
                        break
        except Exception:  # noqa: BLE001 - host CPU is extra information
            self._cpu_files = []

    def host_cpu(self) -> float:
        """CPU seconds the hosts' containers used so far (cgroup v1 cpuacct or v2 cpu.stat)."""
        total = 0.0
        for path in self._cpu_files:
            try:
                text = open(path).read()
            except OSError:
                continue
            if path.endswith("cpuacct.usage"):
                total += int(text) / 1e9
            else:
                total += int(text.split("usage_usec", 1)[1].split()[0]) / 1e6
        return total

    def _client(self, h) -> paramiko.SSHClient:
        c = paramiko.SSHClient()
        c.load_host_keys(str(self.sb.known_hosts_path))
        c.set_missing_host_key_policy(paramiko.RejectPolicy())
        # TCP_NODELAY, as provision sets it (ssh._tcp): without it every small SSH packet
        # waits for the host's delayed acknowledgement, which no tool needs to pay.
        sock = socket.create_connection((h.ssh_host, h.ssh_port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.connect(
            h.ssh_host,
            h.ssh_port,
            sock=sock,
            username=self.sb.user,
            pkey=self.key,
            look_for_keys=False,
            allow_agent=False,
            timeout=10,
            banner_timeout=10,
            auth_timeout=10,
        )
        return c

    def floor(self) -> float:
        """Connect + auth + `true` on every host at once, a thread per host (fresh connections)."""
        barrier = threading.Barrier(len(self.sb.hosts) + 1)
        errors: list[BaseException] = []

        def one(h):
            barrier.wait()
            try:
                c = self._client(h)
                _, out, _ = c.exec_command("true")
                out.channel.recv_exit_status()
                c.close()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(h,)) for h in self.sb.hosts]
        for t in threads:
            t.start()
        t0 = time.perf_counter()
        barrier.wait()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"floor: {errors[0]!r}")
        return elapsed

    def run_all(self, command_for) -> dict[str, str]:
        """command_for(host) on every host over the kept connections; stdout by host name."""

        def one(h):
            c = self.conns.get(h.name)
            if c is None:
                c = self.conns[h.name] = self._client(h)
            _, out, err = c.exec_command(command_for(h), timeout=120)
            text = out.read().decode()
            if out.channel.recv_exit_status() != 0:
                raise RuntimeError(f"{h.name}: {err.read().decode()[-500:]}")
            return h.name, text

        try:
            return dict(self.pool.map(one, self.sb.hosts))
        finally:
            self.close_connections()  # nothing of this process stays busy while a tool is timed

    def close_connections(self) -> None:
        conns, self.conns = list(self.conns.values()), {}
        for c in conns:
            c.close()

    def close(self) -> None:
        self.close_connections()
        self.pool.shutdown()


def clean_command(job: str) -> str:
    """Remove every trace of a job from a host (units stopped, files gone)."""
    return (
        f"systemctl stop 'provision-{job}-*.service' 'provision-{job}.target' 2>/dev/null; "
        f"rm -rf /etc/provision/{job} /var/lib/provision/{job} /etc/systemd/system/provision-{job}-*.service "
        f"/etc/systemd/system/provision-{job}.target; "
        f"systemctl daemon-reload; systemctl reset-failed 2>/dev/null; true"
    )


def check_command(job: str, task: str) -> str:
    unit = f"provision-{job}-{task}.service"
    env = f"/etc/provision/{job}/{task}.env"
    return (
        f"sha256sum {env} /etc/systemd/system/{unit} | cut -d' ' -f1; systemctl is-active {unit}; "
        f"pid=$(systemctl show -p MainPID --value {unit}); "
        f"tr '\\0' '\\n' < /proc/$pid/environ | grep -E '^BENCH_GEN=' || echo BENCH_GEN=none; "
        f"grep '^TF_CONFIG=' {env} | sha256sum | cut -d' ' -f1"
    )


# --------------------------------------------------------------------------- the bench


def stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


@dataclass
class Figures:
    hosts: int
    floor: list[float] = field(default_factory=list)
    times: dict[tuple[str, str], list[Run]] = field(default_factory=dict)  # (tool, op) -> runs
    pss: dict[str, int] = field(default_factory=dict)  # tool -> peak tree PSS (KiB), first apply
    load: list[str] = field(default_factory=list)
    launch: dict[str, list[float]] = field(default_factory=dict)  # tool -> first apply start to all Running (s)
    procs: dict[str, tuple[int, int]] = field(default_factory=dict)  # "tool op" -> peak (threads, fds), sampled
    tf_config_equal: bool = False

    def add(self, tool: str, op: str, run: Run) -> None:
        self.times.setdefault((tool, op), []).append(run)

    def median(self, tool: str, op: str) -> float | None:
        runs = self.times.get((tool, op))
        return statistics.median(r.seconds for r in runs) if runs else None


class Bench:
    def __init__(self, n: int, args, bin_dir: Path, provision_bin: list[str]):
        from provision import sandbox

        self.n, self.args, self.bin_dir, self.provision_bin = n, args, bin_dir, provision_bin
        self.sandbox = sandbox
        self.name = f"benchcmp-{n}"
        self.work = CACHE / "bench" / f"{n}-hosts"
        self.fig = Figures(n)
        self.tasks: dict[str, str] = {}  # host -> task
        self.expected: dict[tuple[str, int], dict[str, tuple[str, str]]] = {}  # (tool, gen) -> host -> shas
        self.gen = {t: 1 for t in TOOLS}
        self.tools = args.tools

    # -- set-up

    def up(self) -> None:
        try:
            self.sandbox.down(self.name)  # leftovers of an interrupted run of this script
        except Exception:  # noqa: BLE001
            pass
        log(f"{self.n} hosts: starting sandbox {self.name}")
        self.sb = self.sandbox.up(self.name, hosts=self.n, progress=lambda s: log("  " + s))
        self.fleet = Fleet(self.sb)
        if self.work.exists():
            shutil.rmtree(self.work)
        for d in ("provision", "ansible", "pyinfra", "rendered", "logs"):
            (self.work / d).mkdir(parents=True)
        self._write_provision()
        self._write_ansible()
        for tool in self.tools:
            self.render(tool, 1)

    def inventory(self, job: str, gen: int) -> dict:
        wl = yaml.safe_load((WORKLOAD / "provision.yaml").read_text())
        inv = self.sandbox.inventory_dict(
            self.sb,
            job,
            wl["pools"],
            ssh={**wl["ssh"], "identity_file": str(self.sb.key_path)},
            env={**wl["env"], "BENCH_GEN": str(gen)},
        )
        inv["pools"]["worker"]["replicas"] = self.n - 1
        if self.n == 1:
            del inv["pools"]["worker"]
        return inv

    def _write_provision(self) -> None:
        d = self.work / "provision"
        (d / ".provision").mkdir()
        # Strict host key checking against the sandbox's known_hosts, as for the other tools.
        shutil.copy(self.sb.known_hosts_path, d / ".provision" / "known_hosts")
        self.set_provision_gen(1)

    def set_provision_gen(self, gen: int) -> None:
        path = self.work / "provision" / "inventory.yaml"
        path.write_text(yaml.safe_dump(self.inventory(JOBS["provision"], gen), sort_keys=False))

    def render(self, tool: str, gen: int) -> Path:
        """`provision render` for this tool's job: the bytes the other tools push."""
        out = self.work / "rendered" / tool / f"gen{gen}"
        if (tool, gen) in self.expected:
            return out
        inv_path = self.work / "rendered" / f"{tool}-gen{gen}.yaml"
        inv_path.write_text(yaml.safe_dump(self.inventory(JOBS[tool], gen), sort_keys=False))
        subprocess.run([*self.provision_bin, "render", str(inv_path), "-o", str(out)], check=True, capture_output=True)
        job, exp = JOBS[tool], {}
        for h in self.sb.hosts:
            env_dir = out / h.name / "etc" / "provision" / job
            task = next(p.stem for p in env_dir.glob("*.env"))
            self.tasks[h.name] = task
            env_b = (env_dir / f"{task}.env").read_bytes()
            unit_b = (out / h.name / "etc" / "systemd" / "system" / f"provision-{job}-{task}.service").read_bytes()
            tf = next(line for line in env_b.decode().splitlines(keepends=True) if line.startswith("TF_CONFIG="))
            exp[h.name] = (
                hashlib.sha256(env_b).hexdigest(),
                hashlib.sha256(unit_b).hexdigest(),
                hashlib.sha256(tf.encode()).hexdigest(),
            )
        self.expected[(tool, gen)] = exp
        return out

    def _write_ansible(self) -> None:
        d = self.work / "ansible"
        hosts = {h.name: {"ansible_host": h.ssh_host, "ansible_port": h.ssh_port, "task": None} for h in self.sb.hosts}
        inv = {
            "all": {
                "vars": {
                    "job": JOBS["ansible"],
                    "ansible_user": self.sb.user,
                    "ansible_ssh_private_key_file": str(self.sb.key_path),
                    "ansible_python_interpreter": "/usr/bin/python3",
                },
                "hosts": hosts,
            }
        }
        self._ansible_inv = inv
        (d / "ansible.cfg").write_text(
            "[defaults]\n"
            f"forks = {self.n}\n"
            "host_key_checking = True\n"
            "gathering = explicit\n"
            "retry_files_enabled = False\n"
            "deprecation_warnings = False\n"
            "interpreter_python = /usr/bin/python3\n"
            f"local_tmp = {d / 'tmp'}\n"
            "[ssh_connection]\n"
            "pipelining = True\n"
            # ControlPersist as Ansible ships it; a fresh control_path_dir per run (below)
            # keeps one run from reusing another's connections.
            f"ssh_args = -o ControlMaster=auto -o ControlPersist=60s -o IdentitiesOnly=yes "
            f"-o UserKnownHostsFile={self.sb.known_hosts_path} -o StrictHostKeyChecking=yes\n"
        )

    def _tool_files(self) -> None:
        """Inventories that name each host's task (known after the first render)."""
        inv = self._ansible_inv
        for name in inv["all"]["hosts"]:
            inv["all"]["hosts"][name]["task"] = self.tasks[name]
        (self.work / "ansible" / "hosts.yml").write_text(yaml.safe_dump(inv, sort_keys=False))
        lines = ["# pyinfra inventory written by bench/compare.py", "hosts = ["]
        for h in self.sb.hosts:
            data = {
                "ssh_hostname": h.ssh_host,
                "ssh_port": h.ssh_port,
                "ssh_user": self.sb.user,
                "ssh_key": str(self.sb.key_path),
                "ssh_known_hosts_file": str(self.sb.known_hosts_path),
                "ssh_strict_host_key_checking": "yes",
                "ssh_allow_agent": False,
                "ssh_look_for_keys": False,
                "job": JOBS["pyinfra"],
                "task": self.tasks[h.name],
            }
            lines.append(f"    ({h.name!r}, {data!r}),")
        lines.append("]")
        (self.work / "pyinfra" / "inventory.py").write_text("\n".join(lines) + "\n")

    # -- one tool, one operation

    def command(self, tool: str, op: str) -> tuple[list[str], dict | None, Path]:
        env = tool_env()
        if tool == "provision":
            inv = str(self.work / "provision" / "inventory.yaml")
            args = {
                "apply": ["apply", "-y", inv],
                "plan": ["plan", inv],
                "status": ["status", inv],
                "logs": ["logs", "--tail", "10", inv],
                "check": ["check", inv],
            }[op]
            return [*self.provision_bin, *args], env, self.work / "provision"
        rendered = self.render(tool, self.gen[tool])
        if tool == "pyinfra":
            cmd = [
                str(self.bin_dir / "pyinfra"),
                "-y",
                "--parallel",
                str(self.n),
                "--data",
                f"rendered={rendered}",
                "inventory.py",
                str(WORKLOAD / "pyinfra" / "deploy.py"),
            ]
            return cmd, env, self.work / "pyinfra"
        d = self.work / "ansible"
        env["ANSIBLE_CONFIG"] = str(d / "ansible.cfg")
        self._control_dir = Path(f"/tmp/bc{self.n}-{time.monotonic_ns() % 10**9}")
        self._control_dir.mkdir()
        env["ANSIBLE_SSH_CONTROL_PATH_DIR"] = str(self._control_dir)
        cmd = [
            str(self.bin_dir / "ansible-playbook"),
            "-i",
            "hosts.yml",
            "-e",
            f"rendered={rendered}",
            str(WORKLOAD / "ansible" / "site.yml"),
        ]
        return cmd, env, d

    def after_ansible(self) -> None:
        """Close the run's ControlPersist masters (a later run must connect afresh)."""
        d = getattr(self, "_control_dir", None)
        if d is None:
            return
        socks = list(d.iterdir())

        def close(sock):
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "x"], capture_output=True, timeout=20)

        with ThreadPoolExecutor(8) as ex:
            list(ex.map(close, socks))
        shutil.rmtree(d, ignore_errors=True)
        self._control_dir = None

    def measure(self, tool: str, op: str, label: str, *, sample: bool = False) -> Run:
        cmd, env, cwd = self.command(tool, op)
        log_path = self.work / "logs" / f"{tool}-{label}.log"
        # `check` exits 1 when a check fails: still a complete run (the log says which check).
        ok = (0, 1) if op == "check" else (0,)
        try:
            run = timed(
                cmd, cwd=cwd, env=env, log_path=log_path, sample=sample, host_cpu=self.fleet.host_cpu, ok_codes=ok
            )
            if run.exit_code:
                log(f"{self.n} hosts: {tool} {op} exited {run.exit_code} (see {log_path})")
        finally:
            if tool == "ansible":
                self.after_ansible()
        text = log_path.read_text(errors="replace")
        last = text[text.rfind("\n$ ") :]
        self._check_output(tool, op, label, last)
        return run

    def _check_output(self, tool: str, op: str, label: str, out: str) -> None:
        """A no-op must change nothing; an apply must change something."""
        if op != "apply":
            return
        noop = label.startswith("noop")
        if tool == "provision":
            changed = "No changes" not in out
        elif tool == "ansible":
            counts = [int(x) for x in re.findall(r"changed=(\d+)", out)]
            if len(counts) != self.n:
                raise RuntimeError(f"ansible {label}: no recap for every host (see logs)")
            changed = any(counts)
        else:
            # Results table, last row: "Grand total  HOSTS  SUCCESS  ERROR  NO-CHANGE" ("-" for 0);
            # SUCCESS counts operations that ran commands, i.e. changed something.
            m = re.search(r"Grand total\s+(\S+)\s+(\S+)\s+(\S+)", out)
            if not m:
                raise RuntimeError(f"pyinfra {label}: no results table (see logs)")
            if m.group(3) != "-":
                raise RuntimeError(f"pyinfra {label}: {m.group(3)} operations failed (see logs)")
            changed = m.group(2) != "-"
        if changed == noop:
            raise RuntimeError(f"{tool} {label}: {'changed something' if noop else 'changed nothing'}")

    def verify(self, tool: str) -> None:
        """Every host: the files are the rendered bytes and the task runs with them."""
        job, gen = JOBS[tool], self.gen[tool]
        exp = self.expected[(tool, gen)]
        got = self.fleet.run_all(lambda h: check_command(job, self.tasks[h.name]))
        for host, text in got.items():
            lines = text.split()
            env_sha, unit_sha, active, gen_line, tf_sha = lines[:5]
            want = exp[host]
            problems = []
            if (env_sha, unit_sha) != want[:2]:
                problems.append("files differ from the rendered ones")
            if active != "active":
                problems.append(f"unit is {active}")
            if gen_line != f"BENCH_GEN={gen}":
                problems.append(f"task runs with {gen_line}, not BENCH_GEN={gen}")
            if problems:
                raise RuntimeError(
                    f"{tool} on {host}: " + "; ".join(problems) + f" (host said: {text!r}, expected {want!r})"
                )

    def launch_latency(self, tool: str, run: Run) -> float:
        """Seconds from the start of `run` (an apply) to the last task's unit entering active."""
        job = JOBS[tool]
        got = self.fleet.run_all(
            lambda h: (
                f"systemctl show -p ActiveEnterTimestampMonotonic --value provision-{job}-{self.tasks[h.name]}.service"
            )
        )
        entered = [int(v.strip()) / 1e6 for v in got.values()]
        if not all(entered):
            raise RuntimeError(f"{tool}: a task's unit never entered active: {got}")
        return max(entered) - run.start_monotonic

    def clean(self, tool: str) -> None:
        self.fleet.run_all(lambda h: clean_command(JOBS[tool]))
        if tool == "provision":
            for p in (self.work / "provision" / ".provision").glob(f"{JOBS['provision']}.state.json*"):
                p.unlink()
            self.set_provision_gen(1)
        self.gen[tool] = 1

    def set_gen(self, tool: str, gen: int) -> None:
        self.gen[tool] = gen
        if tool == "provision":
            self.set_provision_gen(gen)
        self.render(tool, gen)  # for the others, the files they push; for all, what to expect

    # -- the whole sequence

    def tools_for(self, i: int) -> tuple[str, ...]:
        """The tools measured in round i: Ansible only in its first --ansible-runs rounds."""
        limit = self.args.ansible_runs
        return tuple(t for t in self.tools if t != "ansible" or limit is None or i < limit)

    def run(self) -> Figures:  # noqa: C901  one step after another of a comparison run, each optional by its flag
        a = self.args
        fig = self.fig
        fig.load.append(load_avg())
        self._tool_files()
        for _ in range(3):  # the sandbox just booted: let sshd and systemd settle
            self.fleet.floor()
        for _ in range(a.runs):
            fig.floor.append(self.fleet.floor())
        log(f"{self.n} hosts: floor {statistics.median(fig.floor):.3f} s")

        # First apply on fresh hosts, tools interleaved.
        for i in range(a.runs):
            for tool in self.tools_for(i):
                self.clean(tool)
                r = self.measure(tool, "apply", f"first{i}")
                self.verify(tool)
                fig.add(tool, "first apply", r)
                fig.launch.setdefault(tool, []).append(self.launch_latency(tool, r))
                log(
                    f"{self.n} hosts: {tool} first apply #{i + 1}: {r.seconds:.2f} s, "
                    f"all Running after {fig.launch[tool][-1]:.2f} s"
                )
        # One more first apply per tool with the process tree's memory, threads and fds
        # sampled (not timed); for provision also one sampled plan.
        for tool in self.tools:
            self.clean(tool)
            r = self.measure(tool, "apply", "first-mem", sample=True)
            self.verify(tool)
            fig.pss[tool] = r.peak_pss_kib or 0
            fig.procs[f"{tool} first apply"] = (r.peak_threads or 0, r.peak_fds or 0)
            if tool == "provision":
                r = self.measure(tool, "plan", "plan-mem", sample=True)
                fig.procs[f"{tool} plan"] = (r.peak_threads or 0, r.peak_fds or 0)
        fig.load.append(load_avg())

        # TF_CONFIG is byte-equal across the tools on every host.
        tf = {
            tool: self.fleet.run_all(
                lambda h, t=tool: f"grep '^TF_CONFIG=' /etc/provision/{JOBS[t]}/{self.tasks[h.name]}.env"
            )
            for tool in self.tools
        }
        fig.tf_config_equal = all(len({tf[t][h] for t in self.tools}) == 1 for h in tf[self.tools[0]])

        # No-op apply, plan and status; the floor again each round.
        for i in range(a.noop_runs):
            fig.floor.append(self.fleet.floor())
            for tool in self.tools_for(i):
                r = self.measure(tool, "apply", f"noop{i}")
                fig.add(tool, "no-op apply", r)
                if tool == "provision":
                    fig.add(tool, "plan", self.measure(tool, "plan", f"plan{i}"))
                    fig.add(tool, "status", self.measure(tool, "status", f"status{i}"))
                    fig.add(tool, "logs --tail 10", self.measure(tool, "logs", f"logs{i}"))
                    fig.add(tool, "check", self.measure(tool, "check", f"check{i}"))
            log(
                f"{self.n} hosts: no-op round {i + 1}: "
                + ", ".join(f"{t} {fig.times[(t, 'no-op apply')][-1].seconds:.2f} s" for t in self.tools_for(i))
            )
        fig.load.append(load_avg())

        # One file changed on every host (BENCH_GEN in the env file): every task restarts.
        for i in range(a.runs):
            for tool in self.tools_for(i):
                self.set_gen(tool, 2 + i)
                r = self.measure(tool, "apply", f"changed{i}")
                self.verify(tool)
                fig.add(tool, "changed apply", r)
                log(f"{self.n} hosts: {tool} changed apply #{i + 1}: {r.seconds:.2f} s")
        fig.load.append(load_avg())
        return fig

    def down(self) -> None:
        try:
            self.fleet.close()
        except Exception:  # noqa: BLE001
            pass
        log(f"{self.n} hosts: removing sandbox {self.name}")
        self.sandbox.down(self.name)


# --------------------------------------------------------------------------- report

OPS = ("first apply", "no-op apply", "changed apply", "plan", "status", "logs --tail 10", "check")


def fmt_s(xs: list[float]) -> str:
    m, lo, hi = stats(xs)
    return f"{m:.2f} ({lo:.2f}–{hi:.2f})"


def table(fig: Figures, tools: tuple[str, ...]) -> list[str]:  # noqa: C901  one row per figure of the table, each optional by the tools compared
    floor = statistics.median(fig.floor)
    head = ["figure (s: median (min–max))"] + list(tools)
    if "pyinfra" in tools:
        head.append("provision / pyinfra")
    if "ansible" in tools:
        head.append("provision / Ansible")
    head.append("provision / floor")
    rows = [head, ["---"] * len(head)]
    for op in OPS:
        row = [op]
        for t in tools:
            runs = fig.times.get((t, op))
            row.append(fmt_s([r.seconds for r in runs]) if runs else "–")
        p = fig.median("provision", op)
        for other in ("pyinfra", "ansible"):
            if other in tools:
                o = fig.median(other, op)
                row.append(f"{p / o:.2f}x" if p and o else "–")
        row.append(f"{p / floor:.2f}x" if p else "–")
        rows.append(row)
    rows.append(["floor: parallel connect + `true`", fmt_s(fig.floor)] + [""] * (len(head) - 2))
    if fig.launch:
        row = ["launch latency: first apply's start to every task Running"]
        row += [fmt_s(fig.launch[t]) if fig.launch.get(t) else "–" for t in tools]
        p, lat = fig.median("provision", "first apply"), fig.launch.get("provision")
        for other in ("pyinfra", "ansible"):
            if other in tools:
                o = fig.launch.get(other)
                row.append(f"{statistics.median(lat) / statistics.median(o):.2f}x" if lat and o else "–")
        row.append(f"{statistics.median(lat) / floor:.2f}x" if lat else "–")
        rows.append(row)
    for op in ("plan", "first apply"):
        if any(f"{t} {op}" in fig.procs for t in tools):
            row = [f"peak threads / open fds, whole tree, {op}"]
            row += ["{} / {}".format(*fig.procs[f"{t} {op}"]) if f"{t} {op}" in fig.procs else "–" for t in tools]
            rows.append(row + [""] * (len(head) - len(row)))
    mem = ["peak RSS, largest process (MiB)"]
    for t in tools:
        rss = max(r.maxrss_kib for op in OPS for r in fig.times.get((t, op), []))
        mem.append(f"{rss / 1024:.0f}")
    rows.append(mem + [""] * (len(head) - len(mem)))
    pss = ["peak PSS, whole tree, first apply (MiB)"] + [f"{fig.pss.get(t, 0) / 1024:.0f}" for t in tools]
    rows.append(pss + [""] * (len(head) - len(pss)))
    return ["| " + " | ".join(r) + " |" for r in rows]


def cpu_table(fig: Figures, tools: tuple[str, ...]) -> list[str]:
    """CPU seconds (medians): the tool's process tree, and the hosts' containers (cgroups)."""
    rows = [["CPU s: controller + hosts"] + list(tools), ["---"] * (len(tools) + 1)]
    for op in OPS:
        row = [op]
        for t in tools:
            runs = fig.times.get((t, op))
            if runs:
                c = statistics.median(r.cpu_seconds for r in runs)
                h = statistics.median(r.host_cpu_seconds for r in runs)
                row.append(f"{c:.2f} + {h:.2f}")
            else:
                row.append("–")
        rows.append(row)
    return ["| " + " | ".join(r) + " |" for r in rows]


# the benchmark's targets: provision's figure <= factor x the floor, at the largest host count measured
FLOOR_TARGETS = {"plan": 1.25, "no-op apply": 1.3, "first apply": 2.0, "status": 1.5, "logs --tail 10": 2.0}
PYINFRA_RATIO = 0.3  # every provision figure at most this x pyinfra's for the same work
GROWTH = (32, 128, 4.5)  # the figure at 128 hosts at most 4.5x the one at 32
RSS_MIB = 200


def targets(figs: dict[int, Figures], tools) -> list[str]:  # noqa: C901  one check per target, in its order
    """The targets, checked on this run's medians."""
    out = []

    def check(ok: bool, text: str) -> None:
        out.append(f"- {'met' if ok else 'MISSED'}: {text}")

    if not figs:
        return out
    n = max(figs)
    f = figs[n]
    floor = statistics.median(f.floor)
    for op, factor in FLOOR_TARGETS.items():
        p = f.median("provision", op)
        if p is not None:
            check(
                p <= factor * floor,
                f"{n} hosts, {op}: {p:.2f} s ≤ {factor:g} × floor {floor:.2f} s ({p / floor:.2f}x)",
            )
    c, pl = f.median("provision", "check"), f.median("provision", "plan")
    if c is not None and pl:
        check(c <= 2 * pl, f"{n} hosts, check: {c:.2f} s ≤ 2 × plan {pl:.2f} s ({c / pl:.2f}x)")
    if "pyinfra" in tools:
        for m, fm in sorted(figs.items()):
            ratios = [
                (fm.median("provision", op) / o, op)
                for op in ("first apply", "no-op apply", "changed apply")
                if fm.median("provision", op) and (o := fm.median("pyinfra", op))
            ]
            if ratios:
                worst = max(ratios)
                check(
                    worst[0] <= PYINFRA_RATIO,
                    f"{m} hosts: every apply ≤ {PYINFRA_RATIO:g} × pyinfra's (highest: {worst[1]}, {worst[0]:.2f}x)",
                )
    lo, hi, factor = GROWTH
    if lo in figs and hi in figs:
        growth = [
            (figs[hi].median("provision", op) / figs[lo].median("provision", op), op)
            for op in OPS
            if figs[hi].median("provision", op) and figs[lo].median("provision", op)
        ]
        worst = max(growth)
        check(
            worst[0] <= factor,
            f"linear growth: every provision figure at {hi} hosts ≤ {factor:g} × at {lo} "
            f"(highest: {worst[1]}, {worst[0]:.2f}x)",
        )
    else:
        out.append(f"- not checked: growth from {lo} to {hi} hosts (both were not measured)")
    rss = max((r.maxrss_kib for op in OPS for r in f.times.get(("provision", op), [])), default=0) / 1024
    check(rss <= RSS_MIB, f"{n} hosts: provision's peak RSS {rss:.0f} MiB ≤ {RSS_MIB} MiB")
    lat = f.launch.get("provision")
    if lat:
        out.append(
            f"- reported: {n} hosts, launch latency (first apply's start to every task Running): "
            f"{fmt_s(lat)} s, {statistics.median(lat) / floor:.2f}x the floor"
        )
    for op in ("plan", "first apply"):
        if f"provision {op}" in f.procs:
            th, fd = f.procs[f"provision {op}"]
            out.append(
                f"- reported: {n} hosts, provision {op}: peak {th} threads, {fd} open fds "
                "(bounded by --parallelism, default from the fd limit; see the integration test "
                "tests/integration/test_parallelism.py for a run below the host count)"
            )
    return out


def run_counts(figs: dict[int, Figures]) -> tuple[int, int]:
    """(runs of first/changed apply, runs of no-op apply) as measured."""
    n_apply = max((len(r) for f in figs.values() for (t, op), r in f.times.items() if op == "first apply"), default=0)
    n_noop = max((len(r) for f in figs.values() for (t, op), r in f.times.items() if op == "no-op apply"), default=0)
    return n_apply, n_noop


def report(
    figs: dict[int, Figures],
    tools: tuple[str, ...],
    versions: dict,
    started: str,
    skipped: dict,
    command: str,
    before: dict | None = None,
) -> str:
    n_apply, n_noop = run_counts(figs)
    lines = [
        f"# provision vs pyinfra vs Ansible — {started}",
        "",
        f"Made by `{('python bench/compare.py ' + command).strip()}`. Sandbox hosts: Docker containers "
        "(systemd + sshd) on this machine, SSH on 127.0.0.1; controller and hosts share its "
        f"{os.cpu_count()} cores.",
        "",
        "Versions: " + "; ".join(v if k.split()[0] in v.lower() else f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        "How each tool ran (all hosts at once for every tool; key auth with the sandbox's key; "
        "host keys checked against the sandbox's known_hosts by every tool):",
        "",
        "- provision: `provision apply -y`, `plan`, `status`, `logs --tail 10`, `check` (default "
        "parallelism: all hosts up to 512, the bench raising its fd limit; "
        "`host_key_policy: strict`, the sandbox's known_hosts copied beside the state).",
        "- pyinfra: `pyinfra -y --parallel N inventory.py bench/workload/pyinfra/deploy.py` "
        "(`files.put` + `systemd.service`; default operation ordering, every host per operation; "
        "`ssh_strict_host_key_checking=yes`).",
        "- Ansible: `ansible-playbook` of bench/workload/ansible/site.yml (`copy` + `systemd_service`), "
        "`forks = N`, `strategy: linear`, facts not gathered, `pipelining = True`, OpenSSH with "
        "ControlPersist inside a run but a fresh control path per run (no connection reuse across runs), "
        "`StrictHostKeyChecking=yes`.",
        "- pyinfra and Ansible push the files `provision render` wrote for their own job name: the "
        "env file (TF_CONFIG byte-equal across the tools, checked on every host) and the unit; "
        "they are not charged for rendering. Each tool has its own job/unit names.",
        "- First apply: hosts cleaned first (units stopped, files removed; provision's state deleted). "
        "Changed apply: BENCH_GEN in the env file of every host bumped, so every task restarts. "
        "After every apply the hosts were checked: file hashes, unit active, BENCH_GEN in the "
        "task process's environment.",
        "- Floor: in the bench process, a thread per host, paramiko connect + key auth + host key "
        "check + `true`, fresh connections. Times are wall clock of the tool's process (start-up "
        "and imports included), with bytecode caching on for every tool (PYTHONDONTWRITEBYTECODE "
        "removed from their environment, as after an ordinary install). provision runs from the "
        "project's interpreter, whose site-packages may hold .pth files the tools' venv does not "
        "(on the machine of the results below one imports certifi at every start, about 20 ms).",
        "- Memory: peak RSS = ru_maxrss from wait4() over all timed runs (the largest single process "
        "of the tool's tree; the tools are started by a bare `python -S` spawner, since Linux folds "
        "the forking process's size into a child's ru_maxrss); peak PSS = the whole process tree "
        "(Ansible's forks and ssh clients included), sampled every 50 ms from /proc in one extra "
        "first apply per tool.",
        "- provision only: `logs --tail 10` and `check` (after the first applies, with the job "
        "running; `check` counts even when it exits 1 for a failed check, the log says which). "
        "Launch latency: from the fork of the first apply to the last task's unit entering "
        "active (systemd's ActiveEnterTimestampMonotonic on every host, the same kernel clock "
        "as the bench's). Peak threads / open fds: summed over the tool's process tree, sampled "
        "every 50 ms in the extra first apply (and, for provision, one extra plan).",
        f"- Runs: {n_apply} for first and changed applies, {n_noop} for no-op apply, plan, "
        "status, logs, check and the floor (plus the first-apply rounds), tools interleaved round by round"
        + (
            "; Ansible: "
            + ", ".join(
                f"{len(r)} of {op} at {n} hosts"
                for n, f in sorted(figs.items())
                for (t, op), r in f.times.items()
                if t == "ansible"
                and op in ("first apply", "no-op apply")
                and len(r) < (n_apply if op == "first apply" else n_noop)
            )
            + " (--ansible-runs)."
            if any(
                t == "ansible" and len(r) < (n_apply if op == "first apply" else n_noop)
                for f in figs.values()
                for (t, op), r in f.times.items()
                if op in ("first apply", "no-op apply")
            )
            else "."
        ),
        "",
    ]
    for n, fig in sorted(figs.items()):
        lines += [
            f"## {n} hosts",
            "",
            f"Load average (1, 5, 15 min) at start of each phase: {'; '.join(fig.load)}. "
            f"TF_CONFIG byte-equal across the tools on every host: {'yes' if fig.tf_config_equal else 'NO'}.",
            "",
        ]
        lines += table(fig, tools)
        lines += [
            "",
            "CPU time behind those figures (the machine's cores are shared by the controller and "
            "all hosts, so this is what the wall times are made of under load):",
            "",
        ]
        lines += cpu_table(fig, tools)
        lines.append("")
    for n, why in sorted(skipped.items()):
        lines += [f"## {n} hosts", "", f"Not measured: {why}", ""]
    lines += ["## Targets", ""] + targets(figs, tools) + [""]
    if before:
        lines += before_after(before, figs)
    return "\n".join(lines)


def before_after(before: dict, figs: dict[int, Figures]) -> list[str]:
    """provision's figures from an earlier run (--provision-rev) next to this run's."""
    old = figures_from_raw(before)
    lines = [
        "## provision before and after",
        "",
        f"Before: {before['versions'].get('provision', '?')}, measured {before['started']} "
        f"(`python bench/compare.py {before.get('command', '')}`"
        f"; load at the start of each phase: {'; '.join(' / '.join(f.load) for f in old.values())}). "
        "After: this run. Seconds, median (min–max); CPU: controller + hosts.",
        "",
        "| hosts | figure | before | after | before / after | CPU before | CPU after |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in sorted(set(old) & set(figs)):
        for op in OPS:
            a, b = old[n].times.get(("provision", op)), figs[n].times.get(("provision", op))
            if not a or not b:
                continue
            cpu = lambda runs: (
                f"{statistics.median(r.cpu_seconds for r in runs):.2f} + "
                f"{statistics.median(r.host_cpu_seconds for r in runs):.2f}"
            )
            ma, mb = statistics.median(r.seconds for r in a), statistics.median(r.seconds for r in b)
            lines.append(
                f"| {n} | {op} | {fmt_s([r.seconds for r in a])} | {fmt_s([r.seconds for r in b])} | "
                f"{ma / mb:.2f}x | {cpu(a)} | {cpu(b)} |"
            )
        lines.append(f"| {n} | floor | {fmt_s(old[n].floor)} | {fmt_s(figs[n].floor)} | | | |")
    return lines + [""]


def raw(
    figs: dict[int, Figures], tools: tuple[str, ...], versions: dict, started: str, skipped: dict, command: str
) -> dict:
    """Every measurement, for whoever wants other statistics than the tables' (and --from-json)."""
    return {
        "started": started,
        "versions": versions,
        "tools": list(tools),
        "command": command,
        "skipped": {str(k): v for k, v in skipped.items()},
        "hosts": {
            str(n): {
                "floor_s": f.floor,
                "load": f.load,
                "tf_config_equal": f.tf_config_equal,
                "peak_pss_kib": f.pss,
                "launch_s": f.launch,
                "peak_threads_fds": f.procs,
                "runs": {f"{t} {op}": [r.__dict__ for r in runs] for (t, op), runs in f.times.items()},
            }
            for n, f in sorted(figs.items())
        },
    }


def figures_from_raw(d: dict) -> dict[int, Figures]:
    figs = {}
    for n, h in d["hosts"].items():
        f = Figures(
            int(n),
            floor=h["floor_s"],
            load=h["load"],
            tf_config_equal=h["tf_config_equal"],
            pss=h.get("peak_pss_kib", {}),
            launch=h.get("launch_s", {}),
            procs={k: tuple(v) for k, v in h.get("peak_threads_fds", {}).items()},
        )
        for key, runs in h["runs"].items():
            tool, op = key.split(" ", 1)
            f.times[(tool, op)] = [Run(**r) for r in runs]
        figs[int(n)] = f
    return figs


def update_readme(summary: str) -> None:
    path = REPO / "README.md"
    text = path.read_text()
    block = f"{README_BEGIN}\n{summary.rstrip()}\n{README_END}"
    if README_BEGIN in text and README_END in text:
        a, rest = text.split(README_BEGIN, 1)
        _, b = rest.split(README_END, 1)
        text = a + block + b
    else:
        text = text.rstrip("\n") + "\n\n## Benchmark\n\n" + block + "\n"
    path.write_text(text)


def readme_summary(figs: dict[int, Figures], results_path: Path, started: str) -> str:
    n_apply, n_noop = run_counts(figs)
    loads = [float(x.split()[0]) for f in figs.values() for x in f.load] or [0.0]
    try:
        rel = results_path.relative_to(REPO)
    except ValueError:
        rel = results_path
    lines = [
        f"Latest run ({started}; full tables, settings and load: [{rel}]({rel})). Run it yourself with `python bench/compare.py` "
        "(root and Docker; it starts its own sandboxes and removes them). Seconds, median of "
        f"{n_apply} (applies) or {n_noop} (no-op, plan, status) runs, all hosts at once for every tool, "
        "ratios of medians. The machine's 1-minute load average during the run: "
        f"{min(loads):.0f} to {max(loads):.0f} (2 cores; other work was running):",
        "",
        "| hosts | figure | provision | pyinfra | Ansible | provision / pyinfra | provision / Ansible | provision / floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, fig in sorted(figs.items()):
        floor = statistics.median(fig.floor)
        for op in OPS:
            p = fig.median("provision", op)
            if p is None:  # an older run without this figure
                continue
            py, an = fig.median("pyinfra", op), fig.median("ansible", op)
            lines.append(
                f"| {n} | {op} | {p:.2f} | {f'{py:.2f}' if py else '–'} | {f'{an:.2f}' if an else '–'} | "
                f"{f'{p / py:.2f}x' if py else '–'} | {f'{p / an:.2f}x' if an else '–'} | {p / floor:.2f}x |"
            )
        lines.append(f"| {n} | floor (connect + `true`) | {floor:.2f} | | | | | |")
    tools = tuple(t for t in TOOLS if any(t == k[0] for f in figs.values() for k in f.times))
    lines += [
        "",
        "Targets (at the largest host count: plan ≤ 1.25 × the floor, no-op apply ≤ 1.3 ×, "
        "first apply ≤ 2 ×, status ≤ 1.5 ×, `logs --tail 10` ≤ 2 ×, check ≤ 2 × plan; every apply "
        "≤ 0.3 × pyinfra's; 128 hosts ≤ 4.5 × 32 hosts; peak RSS ≤ 200 MiB):",
        "",
    ]
    lines += targets(figs, tools)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--hosts", default="8,32,128", help="host counts, comma-separated (default 8,32,128)")
    ap.add_argument("--runs", type=int, default=3, help="runs of first and changed apply (default 3)")
    ap.add_argument("--noop-runs", type=int, default=5, help="runs of no-op apply, plan, status (default 5)")
    ap.add_argument("--tools", default=",".join(TOOLS), help="subset of provision,pyinfra,ansible")
    ap.add_argument(
        "--ansible-runs",
        type=int,
        metavar="N",
        help="at most N runs of each figure for Ansible (about a second per host and run: "
        "at 128 hosts, --runs and --noop-runs would take it half an hour)",
    )
    ap.add_argument("--out", help="results file (default bench/results/<date>.md)")
    ap.add_argument("--readme", action="store_true", help="rewrite README.md's Benchmark block with the summary")
    ap.add_argument("--provision-rev", help="measure provision as of this git revision (e.g. for before/after)")
    ap.add_argument(
        "--from-json",
        metavar="JSON",
        help="measure nothing: write the report (and --readme) from the raw results of an earlier run",
    )
    ap.add_argument(
        "--before",
        metavar="JSON",
        help="raw results of an earlier provision-only run (--provision-rev) to show next to this one's",
    )
    args = ap.parse_args()
    before = json.loads(Path(args.before).read_text()) if args.before else None
    if args.from_json:
        d = json.loads(Path(args.from_json).read_text())
        figs = figures_from_raw(d)
        tools = tuple(t for t in TOOLS if any(t == k[0] for f in figs.values() for k in f.times))
        out = Path(args.out) if args.out else Path(args.from_json).with_suffix(".md")
        text = report(
            figs,
            tools,
            d["versions"],
            d["started"],
            {int(k): v for k, v in d.get("skipped", {}).items()},
            d.get("command", ""),
            before,
        )
        out.write_text(text)
        print(text)
        if args.readme:
            update_readme(readme_summary(figs, out.resolve(), d["started"]))
            log("README.md: Benchmark section updated")
        return 0
    args.tools = tuple(t for t in TOOLS if t in args.tools.split(","))
    if "provision" not in args.tools:
        ap.error("--tools must include provision")
    counts = [int(x) for x in args.hosts.split(",")]
    started = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    command = " ".join(sys.argv[1:])
    out = Path(args.out) if args.out else HERE / "results" / f"{dt.date.today().isoformat()}.md"

    bin_dir = ensure_venv() if set(args.tools) - {"provision"} else VENV / "bin"
    provision_bin = provision_command(args.provision_rev)
    warm_up(provision_bin)
    versions = tool_versions(bin_dir, provision_bin)
    if args.provision_rev:
        versions["provision"] += f" (source of {args.provision_rev})"
    else:
        git = ["git", "-C", str(REPO)]
        sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "src", "templates"], capture_output=True, text=True
        ).stdout.strip()
        if sha:
            versions["provision"] += f" (commit {sha}{', with uncommitted changes' if dirty else ''})"
    # Each systemd host takes inotify instances; the sandbox raises the limits too.
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),) * 2)

    figs: dict[int, Figures] = {}
    skipped: dict[int, str] = {}
    for n in counts:
        bench = Bench(n, args, bin_dir, provision_bin)
        try:
            bench.up()
        except Exception as e:  # noqa: BLE001 - e.g. 64 hosts do not boot on this machine
            skipped[n] = f"the sandbox did not start ({e})"
            log(f"{n} hosts: skipped: {e}")
            try:
                bench.sandbox.down(bench.name)
            except Exception:  # noqa: BLE001
                pass
            continue
        try:
            figs[n] = bench.run()
        finally:
            bench.down()
        text = report(figs, args.tools, versions, started, skipped, command, before)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)  # after each host count, so an interruption keeps what was measured
        raw_text = json.dumps(raw(figs, args.tools, versions, started, skipped, command), indent=1)
        out.with_suffix(".json").write_text(raw_text + "\n")
    text = report(figs, args.tools, versions, started, skipped, command, before)
    out.write_text(text)
    print(text)
    if args.readme and figs:
        update_readme(readme_summary(figs, out.resolve(), started))
        log("README.md: Benchmark section updated")
    log(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
