"""Placement → every file each host must get, through the Jinja templates in templates/.

Pure: no network, no writes (`write_tree` is the one exception, for `provision render`).
Layout on a host, for job J:
    /etc/provision/J/                  0700, provision's own directory
    /etc/provision/J/<task>.env        0600, EnvironmentFile= of the task
    /etc/provision/J/manifest.json     0600, what provision manages here (read back by plan)
    /etc/systemd/system/provision-J-<task>.service
    /etc/systemd/system/provision-J.target
    + the inventory's `files:`
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import jinja2

from . import encode
from .clusterenv import JobCluster, job_cluster, task_env
from .errors import ProvisionError
from .model import LONG_LIVED, PHASE, FileSpec, Host, Inventory, Pool
from .placement import Placement, PlacedTask, Slot, place

MANIFEST_VERSION = 1
SKIP_NAMES = frozenset({"__pycache__", ".git", ".DS_Store"})
SECRET_MASK = "(sensitive value)"


def job_dir(job: str) -> str:
    return f"/etc/provision/{job}"


def state_dir(job: str) -> str:
    """Run-time records on the host (task exits); outlives reboots, removed by destroy."""
    return f"/var/lib/provision/{job}"


def manifest_path(job: str) -> str:
    return f"{job_dir(job)}/manifest.json"


def unit_name(job: str, task: str) -> str:
    return f"provision-{job}-{task}.service"


def target_name(job: str) -> str:
    return f"provision-{job}.target"


def container_name(job: str, task: str) -> str:
    return f"provision-{job}-{task}"


@dataclass(frozen=True)
class RenderedFile:
    path: str  # absolute path on the host
    sha256: str
    mode: int
    kind: str  # env | unit | target | manifest | file
    content: bytes | None = None  # None: read from `source` when needed
    source: Path | None = None
    secret: bool = False  # holds secret values: never shown in diffs

    def data(self) -> bytes:
        if self.content is not None:
            return self.content
        assert self.source is not None
        return self.source.read_bytes()


@dataclass(frozen=True)
class TaskUnit:
    task: PlacedTask
    unit: str
    unit_path: str
    env_path: str
    phase: int
    long_lived: bool
    inputs: str  # sha256 of everything whose change must restart the task


@dataclass(frozen=True)
class HostBundle:
    host: Host
    tasks: tuple[TaskUnit, ...]
    files: tuple[RenderedFile, ...]  # sorted by path, manifest included
    manifest: dict = field(hash=False, compare=False)

    def file_map(self) -> dict[str, RenderedFile]:
        return {f.path: f for f in self.files}


@dataclass(frozen=True)
class Rendered:
    inventory: Inventory
    placement: Placement
    hosts: dict[str, HostBundle] = field(hash=False)  # only hosts that run a task


# --------------------------------------------------------------------------- templates


def templates_dir() -> Path:
    """templates/ in a source checkout (editable install), else the copy in the wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent.parent / "templates", here / "templates"):
        if (candidate / "task.service.j2").is_file():
            return candidate
    raise ProvisionError(f"provision's templates are missing (looked in {here.parent.parent / 'templates'})")


@functools.lru_cache(maxsize=1)
def _jinja() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        autoescape=False,  # not HTML; values are encoded by encode.py before they get here
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- pushed files


@functools.lru_cache(maxsize=4096)
def _file_digest(path: Path, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pushed_files(specs: tuple[FileSpec, ...]) -> list[RenderedFile]:
    """The inventory's `files:` as RenderedFiles (content read lazily, hashed once)."""
    out: dict[str, RenderedFile] = {}
    for spec in specs:
        if spec.is_dir:
            pairs = []
            for root, dirs, files in os.walk(spec.src):
                dirs[:] = sorted(d for d in dirs if d not in SKIP_NAMES)
                for name in sorted(files):
                    if name in SKIP_NAMES or name.endswith(".pyc"):
                        continue
                    src = Path(root) / name
                    rel = src.relative_to(spec.src).as_posix()
                    pairs.append((src, f"{spec.dest.rstrip('/')}/{rel}"))
        else:
            pairs = [(spec.src, spec.dest)]
        for src, dest in pairs:
            try:
                st = src.stat()
            except OSError as e:
                raise ProvisionError(f"files: cannot read {src}: {e.strerror}") from None
            if not stat.S_ISREG(st.st_mode):
                continue
            mode = 0o755 if st.st_mode & 0o111 else 0o644
            digest = _file_digest(src, st.st_mtime_ns, st.st_size)
            out[dest] = RenderedFile(dest, digest, mode, "file", source=src)
    return list(out.values())


# --------------------------------------------------------------------------- rendering


def _restart(pool: Pool) -> dict:
    r = pool.restart
    if r.policy == "Never" or r.limit == 0:
        return {"restart": "no", "restart_prevent": "", "start_limit_burst": 0}
    # systemd counts every start against StartLimitBurst, the first one too.
    burst = r.limit + 1
    if r.policy == "Always":
        return {"restart": "always", "restart_prevent": "", "start_limit_burst": burst}
    prevent = " ".join(str(c) for c in range(1, 128)) if r.policy == "ExitCode" else ""
    return {"restart": "on-failure", "restart_prevent": prevent, "start_limit_burst": burst}


def _exec_start(inv: Inventory, pool: Pool, task: PlacedTask, env_keys: list[str]) -> str:
    if not pool.image:
        return encode.exec_line(pool.command)
    argv = ["/usr/bin/docker", "run", "--rm", "--name", container_name(inv.job, task.name), "--network", "host"]
    if task.accelerators and task.host.accelerators and task.host.accelerators.kind == "gpu":
        # docker's --gpus takes a CSV list; the inner quotes keep the commas together.
        argv += ["--gpus", '"device=' + ",".join(map(str, task.accelerators)) + '"']
    for key in env_keys:  # names only: docker takes each value from systemd's environment
        argv += ["-e", key]
    argv += [pool.image, *pool.args]
    return encode.exec_line(argv)


def _render_task(
    inv: Inventory,
    task: PlacedTask,
    jc: JobCluster,
    secrets: Mapping[str, str] | None,
    gpu_uuids: Mapping[str, list[str]] | None,
) -> tuple[str, str, list[str]]:
    pool = inv.pool(task.role)
    assert pool is not None
    env = task_env(inv, task, jc, secrets=secrets, gpu_uuids=gpu_uuids)
    j = _jinja()
    common = {"job": inv.job, "task": task.name, "host": task.host.name}
    env_text = j.get_template("task.env.j2").render(
        **common, assignments=[encode.env_assignment(k, v) for k, v in env]
    )
    unit_text = j.get_template("task.service.j2").render(
        **common,
        role=task.role,
        index=task.index,
        target=target_name(inv.job),
        env_path=f"{job_dir(inv.job)}/{task.name}.env",
        container=container_name(inv.job, task.name) if pool.image else "",
        exec_start=_exec_start(inv, pool, task, [k for k, _ in env]),
        accelerators=pool.accelerators,
        stop_timeout=30,
        syslog_identifier=f"provision-{inv.job}-{task.name}",
        state_dir=state_dir(inv.job),
        **_restart(pool),
    )
    secret_keys = [k for k in inv.secret_env if secrets and k in secrets]
    return env_text, unit_text, secret_keys


def render(
    inv: Inventory,
    *,
    previous: Mapping[str, Slot] | None = None,
    secrets: Mapping[str, str] | None = None,
    gpu_uuids: Mapping[str, list[str]] | None = None,
    placement: Placement | None = None,
) -> Rendered:
    """Everything each host must get. `secrets` None: secret_env values are left out."""
    placement = placement or place(inv, previous)
    jc = job_cluster(inv, placement)
    shared = pushed_files(inv.files)
    shared_digest = _sha("".join(f"{f.path}\0{f.sha256}\0{f.mode}\n" for f in shared).encode())
    j = _jinja()
    by_host: dict[str, list[PlacedTask]] = {}
    for t in placement.tasks:
        by_host.setdefault(t.host.name, []).append(t)
    jd = job_dir(inv.job)
    job_escaped = encode.env_escape(',"job":' + jc.job_json).encode()

    hosts: dict[str, HostBundle] = {}
    for host in inv.hosts:
        tasks = by_host.get(host.name)
        if not tasks:
            continue
        files: list[RenderedFile] = list(shared)
        units: list[TaskUnit] = []
        for t in tasks:
            env_text, unit_text, secret_keys = _render_task(inv, t, jc, secrets, gpu_uuids)
            env_b, unit_b = env_text.encode(), unit_text.encode()
            env_path = f"{jd}/{t.name}.env"
            unit = unit_name(inv.job, t.name)
            unit_path = f"/etc/systemd/system/{unit}"
            env_sha, unit_sha = _sha(env_b), _sha(unit_b)
            files.append(RenderedFile(env_path, env_sha, 0o600, "env", env_b, secret=bool(secret_keys)))
            files.append(RenderedFile(unit_path, unit_sha, 0o644, "unit", unit_b))
            # CLUSTER_SPEC's `job` (the whole job's description) is informational: a change
            # to another pool's command rewrites this file but does not restart this task.
            env_inputs = _sha(env_b.replace(job_escaped, b"")) if job_escaped else env_sha
            inputs = _sha(f"{env_inputs}\n{unit_sha}\n{shared_digest}".encode())
            units.append(TaskUnit(t, unit, unit_path, env_path, PHASE[t.role], t.role in LONG_LIVED, inputs))
        target_b = j.get_template("job.target.j2").render(
            job=inv.job, host=host.name, tasks=[t.name for t in tasks]
        ).encode()
        files.append(RenderedFile(f"/etc/systemd/system/{target_name(inv.job)}", _sha(target_b), 0o644, "target", target_b))
        manifest = {
            "provision": MANIFEST_VERSION,
            "job": inv.job,
            "host": host.name,
            "tasks": {
                u.task.name: {
                    "unit": u.unit,
                    "role": u.task.role,
                    "index": u.task.index,
                    "phase": u.phase,
                    "long_lived": u.long_lived,
                    "inputs": u.inputs,
                    "port": u.task.port,
                    "accelerators": list(u.task.accelerators),
                }
                for u in units
            },
            "files": {f.path: {"sha256": f.sha256, "mode": f.mode, "kind": f.kind} for f in sorted(files, key=lambda f: f.path)},
        }
        manifest_b = manifest_bytes(manifest)
        files.append(RenderedFile(manifest_path(inv.job), _sha(manifest_b), 0o600, "manifest", manifest_b))
        files.sort(key=lambda f: f.path)
        hosts[host.name] = HostBundle(host, tuple(units), tuple(files), manifest)
    return Rendered(inv, placement, hosts)


def manifest_bytes(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()


def write_tree(rendered: Rendered, out: Path) -> int:
    """`provision render -o DIR`: DIR/<host>/<absolute path>, modes kept. Returns file count."""
    count = 0
    for name, bundle in rendered.hosts.items():
        base = out / name
        made: set[Path] = set()
        for f in bundle.files:
            dest = base / f.path.lstrip("/")
            if dest.parent not in made:
                dest.parent.mkdir(parents=True, exist_ok=True)
                made.add(dest.parent)
            dest.write_bytes(f.data())
            os.chmod(dest, f.mode)
            count += 1
    return count
