"""Placement → every file each host must get, through the Jinja templates in templates/.

Pure: no network, no writes (`write_tree` is the one exception, for `provision render`).
Where each file goes on a host is host/layout.py's; what it holds is decided here and in
the templates (which get every path and name as a value, never spell one).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import jinja2

from provision.core import encode
from provision.core.errors import ProvisionError
from provision.core.lifecycle import LONG_LIVED, boot_gate, restart_budget, start_phase, systemd_restart
from provision.core.model import FileSpec, Host, Inventory, Pool
from provision.host import layout, outdirs
from provision.inventory.pushed import walk_spec
from provision.placement.tasks import PlacedTask, Placement, Slot, place
from provision.render.clusterenv import JobCluster, job_cluster, output_dirs, resumable, task_env

MANIFEST_VERSION = 1
SECRET_MASK = "(sensitive value)"


class FileKind(StrEnum):
    ENV = "env"
    UNIT = "unit"
    TARGET = "target"
    MANIFEST = "manifest"
    SETUP = "setup"  # the setup's script and env file
    FILE = "file"  # the inventory's files:


@dataclass(frozen=True)
class RenderedFile:
    path: str  # absolute path on the host
    sha256: str
    mode: int
    kind: FileKind
    content: bytes | None = None  # None: read from `source` when needed
    source: Path | None = None
    secret: bool = False  # holds secret values: never shown in diffs
    replace: bool = False  # may take the place of a host file provision does not manage

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
    restart_limit: int | None = None  # the pool's budget (lifecycle.restart_budget): when a task is Failed
    # The same inputs as an earlier provision rendered them: a host that recorded one of
    # these runs what this version would; its files are rewritten without a restart (an
    # upgrade must not restart training: tests/integration/test_upgrade.py).
    accepted: tuple[str, ...] = ()


@dataclass(frozen=True)
class SetupUnit:
    unit: str
    key: str  # what it is: sha256 of its commands, env, user, timeout and inputs (setup_key)
    timeout: int = 3600  # seconds (the unit's TimeoutStartSec=)
    # The key a release up to 1a5e7ca gave it, run per job: a host that recorded it for
    # this job has done this setup (an upgrade neither runs it again nor restarts tasks).
    legacy_key: str | None = None

    @property
    def log_identifier(self) -> str:
        return layout.setup_log_identifier(self.key)

    @property
    def done_path(self) -> str:
        return layout.setup_done_path(self.key)


@dataclass(frozen=True)
class HostBundle:
    host: Host
    tasks: tuple[TaskUnit, ...]
    files: tuple[RenderedFile, ...]  # sorted by path, manifest included
    manifest: dict[str, Any] = field(hash=False, compare=False)
    setup: SetupUnit | None = None

    def file_map(self) -> dict[str, RenderedFile]:
        return {f.path: f for f in self.files}


@dataclass(frozen=True)
class Rendered:
    inventory: Inventory
    placement: Placement
    hosts: dict[str, HostBundle] = field(hash=False)  # only hosts that run a task
    secret_values: tuple[str, ...] = field(default=(), repr=False)  # masked wherever shown


# --------------------------------------------------------------------------- templates


def templates_dir() -> Path:
    """templates/ in a source checkout (editable install), else the copy in the wheel."""
    package = Path(__file__).resolve().parent.parent  # src/provision, or provision/ in a wheel
    for candidate in (package.parent.parent / "templates", package / "templates"):
        if (candidate / "task.service.j2").is_file():
            return candidate
    raise ProvisionError(f"provision's templates are missing (looked in {package.parent.parent / 'templates'})")


class _CompiledTemplates(jinja2.FileSystemBytecodeCache):
    """Templates compiled once and kept between runs (compiling them is ~20 ms of every
    command's start). Best effort: a cache that cannot be read or written is skipped.
    Jinja keys each entry by the template's name and a checksum of its source."""

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except (OSError, ValueError, EOFError):
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


def _template_cache() -> jinja2.BytecodeCache | None:
    """~/.cache/provision/templates (XDG_CACHE_HOME), private to the user; None if it
    cannot be made."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "provision", "templates")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError:
        return None
    if st.st_uid != os.getuid() or st.st_mode & 0o022:  # compiled code only from a directory of our own
        return None
    return _CompiledTemplates(path)


@functools.lru_cache(maxsize=1)
def _jinja() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        bytecode_cache=_template_cache(),
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
    """The inventory's `files:` as RenderedFiles (content read lazily, hashed once).

    The walk and the modes are pushed.walk_spec's, the walk validation made: links stay
    inside a pushed directory, modes are the sources' own (never widened)."""
    out: dict[str, RenderedFile] = {}
    for spec in specs:
        entries, problems = walk_spec(spec.src, spec.dest, spec.is_dir)
        if problems:  # the tree changed since the inventory was validated
            raise ProvisionError(f"files: {problems[0].message}")
        for e in entries:
            digest = _file_digest(e.src, e.mtime_ns, e.size)
            out[e.dest] = RenderedFile(e.dest, digest, e.mode, FileKind.FILE, source=e.src, replace=spec.replace)
    return list(out.values())


# --------------------------------------------------------------------------- rendering


def _exec_start(inv: Inventory, pool: Pool, task: PlacedTask, env_keys: list[str]) -> str:
    if not pool.image:
        return encode.exec_line(pool.command)
    argv = ["/usr/bin/docker", "run", "--rm", "--name", layout.container_name(inv.job, task.name), "--network", "host"]
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
    socket_ifname: str | None = None,
) -> tuple[str, str, list[str]]:
    pool = inv.pool(task.role)
    assert pool is not None
    env = task_env(inv, task, jc, secrets=secrets, gpu_uuids=gpu_uuids, socket_ifname=socket_ifname)
    preempt = resumable(inv)
    j = _jinja()
    common = {"job": inv.job, "task": task.name, "host": task.host.name}
    env_text = j.get_template("task.env.j2").render(**common, assignments=[encode.env_assignment(k, v) for k, v in env])
    unit_text = j.get_template("task.service.j2").render(
        **common,
        role=task.role,
        index=task.index,
        target=layout.target_name(inv.job),
        env_path=layout.env_path(inv.job, task.name),
        container=layout.container_name(inv.job, task.name) if pool.image else "",
        exec_start=_exec_start(inv, pool, task, [k for k, _ in env] + (["PROVISION_RESUME"] if preempt else [])),
        exec_condition=layout.exec_condition_command(inv.job, task.name, **boot_gate(pool.restart)),
        exec_stop=layout.exec_stop_command(inv.job, task.name),
        exec_stop_post=layout.exec_stop_post_command(inv.job, task.name),
        accelerators=pool.accelerators,
        # A preemptible (or recovered) job's stop is its preemption (host/preempt.py): systemd sends the
        # preemption's signal and kills what is left after its grace (any stop of it).
        stop_timeout=max(1, inv.scheduling.grace_s) if preempt else pool.grace_period,  # 0 means none to systemd
        kill_signal=inv.scheduling.signal.value if preempt and inv.scheduling.signal.value != "SIGTERM" else "",
        resume_env=layout.resume_env_path(inv.job) if preempt else "",
        output_guard=outdirs.unit_command(output_dirs(inv)) if inv.outputs else "",
        syslog_identifier=layout.log_identifier(inv.job, task.name),
        **systemd_restart(pool.restart),
    )
    secret_keys = [k for k in inv.secret_env if secrets and k in secrets]
    return env_text, unit_text, secret_keys


# provision before the outputs guard made them with mkdir: that unit's lines.
_OUTPUTS_GUARD = (
    "# `outputs:` Vertex's output directories, made before the task writes into them, each\n"
    "# directory on the way checked (root's, no link, only root may write: host/outdirs.py).\n"
    "ExecStartPre={guard}\n"
)
_OUTPUTS_MKDIR = (
    "# `outputs:` Vertex's output directories, made before the task writes into them.\n"
    "ExecStartPre=/bin/mkdir -p -- {dirs}\n"
)


def earlier_units(inv: Inventory, unit_text: str) -> list[str]:
    """The task's unit as earlier versions of provision rendered it, where they differ."""
    if not inv.outputs:
        return []
    dirs = output_dirs(inv)
    new = _OUTPUTS_GUARD.format(guard=outdirs.unit_command(dirs))
    return [unit_text.replace(new, _OUTPUTS_MKDIR.format(dirs=" ".join(dirs)))] if new in unit_text else []


def _task_unit(inv: Inventory, t: PlacedTask, inputs: str, accepted: tuple[str, ...] = ()) -> TaskUnit:
    pool = inv.pool(t.role)
    budget = restart_budget(pool.restart) if pool is not None else None
    unit, unit_path, env_path = (
        layout.unit_name(inv.job, t.name),
        layout.unit_path(inv.job, t.name),
        layout.env_path(inv.job, t.name),
    )
    return TaskUnit(t, unit, unit_path, env_path, start_phase(t.role), t.role in LONG_LIVED, inputs, budget, accepted)


def render(
    inv: Inventory,
    *,
    previous: Mapping[str, Slot] | None = None,
    secrets: Mapping[str, str] | None = None,
    gpu_uuids: Mapping[str, list[str]] | None = None,
    placement: Placement | None = None,
    socket_ifnames: Mapping[str, str] | None = None,
) -> Rendered:
    """Everything each host must get. `secrets` None: secret_env values are left out.
    `socket_ifnames`: host → the interface holding its cluster address, as the host reports
    it (plan finds it; offline there is none): NCCL's and Gloo's, in its tasks' env."""
    placement = placement or place(inv, previous)
    jc = job_cluster(inv, placement)
    shared = pushed_files(inv.files)
    shared_digest = _sha("".join(f"{f.path}\0{f.sha256}\0{f.mode}\n" for f in shared).encode())
    j = _jinja()
    by_host: dict[str, list[PlacedTask]] = {}
    for t in placement.tasks:
        by_host.setdefault(t.host.name, []).append(t)
    job_escaped = encode.env_escape(',"job":' + jc.job_json).encode()

    hosts: dict[str, HostBundle] = {}
    for host in inv.hosts:
        tasks = by_host.get(host.name)
        if not tasks:
            continue
        files: list[RenderedFile] = list(shared)
        units: list[TaskUnit] = []
        setup, setup_files = _render_setup(inv, host, tasks, shared)
        files += setup_files
        for t in tasks:
            env_text, unit_text, secret_keys = _render_task(
                inv, t, jc, secrets, gpu_uuids, (socket_ifnames or {}).get(host.name)
            )
            env_b, unit_b = env_text.encode(), unit_text.encode()
            env_path = layout.env_path(inv.job, t.name)
            unit_path = layout.unit_path(inv.job, t.name)
            env_sha, unit_sha = _sha(env_b), _sha(unit_b)
            earlier = [_sha(u.encode()) for u in earlier_units(inv, unit_text)]
            files.append(RenderedFile(env_path, env_sha, 0o600, FileKind.ENV, env_b, secret=bool(secret_keys)))
            files.append(RenderedFile(unit_path, unit_sha, 0o644, FileKind.UNIT, unit_b))
            # CLUSTER_SPEC's `job` (the whole job's description) is informational: a change
            # to another pool's command rewrites this file but does not restart this task.
            env_inputs = _sha(env_b.replace(job_escaped, b"")) if job_escaped else env_sha
            digests = [_sha(f"{env_inputs}\n{sha}\n{shared_digest}".encode()) for sha in (unit_sha, *earlier)]
            if setup is not None:  # a changed setup restarts the host's tasks
                keys = (setup.key, setup.legacy_key) if setup.legacy_key else (setup.key,)
                digests = [_sha(f"{d}\n{k}".encode()) for k in keys for d in digests]
            units.append(_task_unit(inv, t, digests[0], tuple(digests[1:])))
        target_b = _target(j, inv.job, host.name, tasks, units)
        files.append(RenderedFile(layout.target_path(inv.job), _sha(target_b), 0o644, FileKind.TARGET, target_b))
        manifest = _manifest(inv.job, host.name, units, files, setup)
        manifest_b = manifest_bytes(manifest)
        files.append(
            RenderedFile(layout.manifest_path(inv.job), _sha(manifest_b), 0o600, FileKind.MANIFEST, manifest_b)
        )
        files.sort(key=lambda f: f.path)
        hosts[host.name] = HostBundle(host, tuple(units), tuple(files), manifest, setup)
    return Rendered(inv, placement, hosts, tuple(v for v in (secrets or {}).values() if v))


def _target(j: jinja2.Environment, job: str, host: str, tasks: list[PlacedTask], units: list[TaskUnit]) -> bytes:
    """The job's systemd target on one host: its tasks' units, wanted at boot."""
    return (
        j.get_template("job.target.j2")
        .render(
            job=job,
            host=host,
            tasks=[t.name for t in tasks],
            units=[u.unit for u in units],
            boot_target=layout.BOOT_TARGET,
        )
        .encode()
    )


def _manifest(
    job: str, host: str, units: list[TaskUnit], files: list[RenderedFile], setup: SetupUnit | None
) -> dict[str, Any]:
    """Everything provision manages on the host, with checksums (the host keeps it)."""
    manifest: dict[str, Any] = {
        "provision": MANIFEST_VERSION,
        "job": job,
        "host": host,
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
        "files": {
            f.path: {"sha256": f.sha256, "mode": f.mode, "kind": f.kind.value}
            for f in sorted(files, key=lambda f: f.path)
        },
    }
    if setup is not None:
        manifest["setup"] = {"unit": setup.unit, "key": setup.key}
    return manifest


def _render_setup(
    inv: Inventory, host: Host, tasks: list[PlacedTask], shared: list[RenderedFile]
) -> tuple[SetupUnit | None, list[RenderedFile]]:
    """The job's setup, then the setups of the pools with a task on this host, as one
    script, its env file and a oneshot unit, keyed by what they run: their commands, env,
    user, timeout and the contents of the pushed files they name as `inputs` (not the job:
    every job with the same setup shares it on the host, host/layout.py)."""
    roles = {t.role for t in tasks}
    setups = [inv.setup] + [p.setup for p in inv.pools if p.role in roles]
    chosen = [x for x in setups if x is not None]
    if not chosen:
        return None, []
    commands = "".join(line + "\n" for x in chosen for line in x.commands)
    env: dict[str, str] = {}
    for x in chosen:
        env.update(x.env)
    assignments = "".join(encode.env_assignment(k, v) + "\n" for k, v in env.items())
    user = host.ssh.user if host.ssh.user and host.ssh.user != "root" else ""
    timeout = sum(x.timeout for x in chosen)  # they run as one script
    # Keyed by the pushed files it names as inputs, not by every pushed file: an edit of
    # the training code must not run a `pip install` again.
    wanted = [w.rstrip("/") for x in chosen for w in x.inputs]
    named = [f for f in shared if any(f.path == w or f.path.startswith(w + "/") for w in wanted)]
    inputs_digest = _sha("".join(f"{f.path}\0{f.sha256}\0{f.mode}\n" for f in named).encode())
    key = setup_key(commands, assignments, user, timeout, inputs_digest)
    head = f"# Managed by provision: setup {layout.setup_short(key)}, shared by the jobs that need it; run with /bin/sh -e.\n"
    script, env_b = (head + commands).encode(), (head + assignments).encode()
    unit_b = (
        _jinja()
        .get_template("setup-shared.service.j2")
        .render(
            short=layout.setup_short(key),
            env_path=layout.setup_env_path(key),
            script_path=layout.setup_script_path(key),
            user=user,
            syslog_identifier=layout.setup_log_identifier(key),
            timeout=timeout,
        )
        .encode()
    )
    files = [
        RenderedFile(layout.setup_script_path(key), _sha(script), 0o700, FileKind.SETUP, script),
        RenderedFile(layout.setup_env_path(key), _sha(env_b), 0o600, FileKind.SETUP, env_b),
        RenderedFile(layout.setup_unit_path(key), _sha(unit_b), 0o644, FileKind.UNIT, unit_b),
    ]
    legacy = _legacy_setup_key(inv.job, host.name, commands, assignments, user, timeout, inputs_digest)
    return SetupUnit(layout.setup_unit(key), key, timeout, legacy), files


def setup_key(commands: str, assignments: str, user: str, timeout: int, inputs_digest: str) -> str:
    """What a setup is: two setups with the same key run the same (host/layout.py)."""
    parts = ["provision-setup/1", commands, assignments, user, str(timeout), inputs_digest]
    return _sha(json.dumps(parts).encode())


def _legacy_setup_key(
    job: str, host: str, commands: str, assignments: str, user: str, timeout: int, inputs_digest: str
) -> str:
    """The key releases up to 1a5e7ca gave the same setup, run per job (their script, env
    and unit, with the job's paths in them): a host that recorded it has run this setup."""
    head = f"# Managed by provision: job {job}, setup on {host}; run with /bin/sh -e.\n"
    unit_b = (
        _jinja()
        .get_template("setup.service.j2")
        .render(
            job=job,
            host=host,
            env_path=layout.legacy_setup_env_path(job),
            script_path=layout.legacy_setup_script_path(job),
            user=user,
            syslog_identifier=layout.legacy_setup_log_identifier(job),
            timeout=timeout,
        )
        .encode()
    )
    parts = [(head + commands).encode(), (head + assignments).encode(), unit_b, inputs_digest.encode()]
    return _sha(b"\0".join(parts))


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
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
