"""Container images without a registry: shipped from the controller over SSH, or pulled.

For every host that runs a task of a container pool (`image:`), plan asks the host's Docker
engine for the ID of each image (`docker image inspect`) and compares it with the
controller's. An image the controller has and the host lacks (or has with another ID) is
shipped: `docker save` on the controller streamed over the SSH channel into `docker load` on
the host, once per host, all hosts in parallel. An image the controller does not have is
pulled on the host, before the task starts, so that a slow pull never runs into the unit's
start timeout. Both happen in the SHIP step, before any file is written.

A host whose `docker` answers the inspect with nothing (not an engine: a stand-in that
records its arguments) is left alone.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from provision.core.errors import ProvisionError
from provision.core.imagechange import ImageChange, human
from provision.core.model import Inventory
from provision.core.target import HostError, Target
from provision.io.ssh import Session
from provision.io.steps import GroupResult, Step, run_step

Progress = Callable[[str], None]
_CHUNK = 1 << 20
MISSING = "-"
ENGINE = "@engine"  # host_check_command: docker itself did not answer


def images_by_host(inv: Inventory, host_tasks: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    """Host -> the images of the container pools whose tasks it runs (roles per host in)."""
    out: dict[str, list[str]] = {}
    for host, roles in host_tasks.items():
        refs: list[str] = []
        for role in roles:
            pool = inv.pool(role)
            if pool is not None and pool.image and pool.image not in refs:
                refs.append(pool.image)
        if refs:
            out[host] = refs
    return out


# --------------------------------------------------------------------------- controller


def _docker() -> str | None:
    return shutil.which("docker")


def local_images(refs: Iterable[str]) -> dict[str, tuple[str, int]]:
    """ref -> (ID, size) for the images this machine's Docker engine has; none without one."""
    docker = _docker()
    out: dict[str, tuple[str, int]] = {}
    if docker is None:
        return out
    for ref in dict.fromkeys(refs):
        r = subprocess.run(
            [docker, "image", "inspect", "--format", "{{.Id}} {{.Size}}", ref],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode == 0 and r.stdout.split():
            iid, _, size = r.stdout.strip().partition(" ")
            out[ref] = (iid, int(size) if size.isdigit() else 0)
    return out


# --------------------------------------------------------------------------- hosts


def host_check_command(refs: list[str]) -> str:
    """Prints one line per ref: its image ID, '-' when the host lacks it (docker says "No
    such image" and exits 1), or '@engine WHY' when docker itself cannot answer (no engine
    running, no docker at all)."""
    quoted = " ".join(shlex.quote(r) for r in refs)
    return (
        f"for r in {quoted}; do if id=$(docker image inspect --format '{{{{.Id}}}}' \"$r\" 2>&1); "
        f'then echo "$id"; else case "$id" in *"No such image"*|*"No such object"*) echo {MISSING};; '
        f'*) echo "{ENGINE} $(printf %s "$id" | tail -n 1)";; esac; fi; done'
    )


def host_images(
    session: Session, wanted: dict[str, list[str]], targets: dict[str, Target]
) -> GroupResult[dict[str, str]]:
    """host -> {ref: ID or '-'}; a ref whose line is empty (no real engine) is left out; a
    host whose docker does not answer is that host's error, naming it."""

    def one(t: Target) -> dict[str, str]:
        refs = wanted[t.name]
        res = session.run(t, host_check_command(refs), timeout=120)
        lines = res.stdout.decode("utf-8", "replace").splitlines()
        down = next((line[len(ENGINE) :].strip() for line in lines if line.startswith(ENGINE + " ")), None)
        if down is not None:
            raise HostError(
                t, f"the Docker engine does not answer ({down}): its container pools need it (systemctl start docker)"
            )
        return {ref: line.strip() for ref, line in zip(refs, lines) if line.strip()}

    return run_step(session, Step.PROBE, one, [targets[n] for n in wanted if n in targets])


def plan_images(
    session: Session, inv: Inventory, host_roles: dict[str, list[str]], targets: dict[str, Target]
) -> tuple[dict[str, list[ImageChange]], dict[str, HostError]]:
    """host -> [ImageChange] for the hosts that need an image; host -> HostError for those
    whose check failed."""
    wanted = images_by_host(inv, host_roles)
    if not wanted:
        return {}, {}
    local = local_images(r for refs in wanted.values() for r in refs)
    found = host_images(session, wanted, targets)
    changes: dict[str, list[ImageChange]] = {}
    for host, have in found.ok.items():
        todo = []
        for ref in wanted[host]:
            hid = have.get(ref)
            if hid is None:  # no answer for it: not a real engine
                continue
            if ref in local:
                iid, size = local[ref]
                if hid != iid:
                    todo.append(ImageChange(ref, "ship", size, iid, "" if hid == MISSING else hid))
            elif hid == MISSING:
                todo.append(ImageChange(ref, "pull"))
        if todo:
            changes[host] = todo
    return changes, found.errors


# --------------------------------------------------------------------------- ship


class _Saved:
    """`docker save REF` once into a temporary file, shared by every host it ships to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, tuple[str, threading.Lock]] = {}
        self.dir = tempfile.mkdtemp(prefix="provision-images-")

    def path(self, ref: str) -> str:
        with self._lock:
            if ref not in self._files:
                self._files[ref] = (os.path.join(self.dir, f"{len(self._files)}.tar"), threading.Lock())
            path, lock = self._files[ref]
        with lock:
            if not os.path.exists(path):
                docker = _docker()
                if docker is None:
                    raise ProvisionError(f"image {ref}: no docker on this machine to save it")
                part = path + ".part"
                with open(part, "wb") as f:
                    r = subprocess.run([docker, "save", ref], stdout=f, stderr=subprocess.PIPE, timeout=3600)
                if r.returncode != 0:
                    raise ProvisionError(f"docker save {ref} failed: {r.stderr.decode(errors='replace').strip()}")
                os.rename(part, path)
        return path

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _stream_into(session: Session, t: Target, command: str, path: str, on_bytes: Callable[[int], None]) -> None:
    """Run `command` on the host with the file at `path` as its stdin, in chunks."""
    conn = session.connect(t)
    if not session.is_root(t):
        command = "sudo -n " + command
    chan = None
    try:
        chan = conn.client.get_transport().open_session(timeout=t.connect_timeout)
        chan.settimeout(3600)
        chan.exec_command(command)
        sent = 0
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                chan.sendall(chunk)
                sent += len(chunk)
                on_bytes(sent)
        chan.shutdown_write()
        out = chan.makefile("rb").read()
        err = chan.makefile_stderr("rb").read()
        status = chan.recv_exit_status()
        chan.close()
    except (OSError, EOFError) as e:
        # docker load that ended early (no engine, a full disk) closes the channel under us:
        # its own words, when the host is still there to say them, not "unreachable".
        if chan is not None and chan.exit_status_ready():
            err = b"".join(iter(lambda: chan.recv_stderr(65536) if chan.recv_stderr_ready() else b"", b""))
            last = err.decode("utf-8", "replace").strip().splitlines()
            raise HostError(
                t, f"docker load exited {chan.recv_exit_status()}: {last[-1] if last else 'no output'}"
            ) from None
        raise HostError(
            t, f"connection lost while shipping an image: {e or type(e).__name__}", unreachable=True
        ) from None
    if status != 0:
        last = (err or out).decode("utf-8", "replace").strip().splitlines()
        raise HostError(t, f"docker load exited {status}: {last[-1] if last else 'no output'}")


class _Quarters:
    """A progress line at every quarter of a transfer."""

    def __init__(self, progress: Progress, what: str, total: int):
        self.progress, self.what, self.total, self.shown = progress, what, total, 0

    def __call__(self, n: int) -> None:
        quarter = n * 4 // max(self.total, 1)
        if quarter > self.shown and n < self.total:
            self.shown = quarter
            self.progress(f"{self.what} {human(n)} / {human(self.total)}")


def ship(
    session: Session,
    changes: Mapping[str, Sequence[ImageChange]],
    targets: dict[str, Target],
    progress: Progress = lambda s: None,
) -> GroupResult[None]:
    """Ship or pull each host's images; all hosts in parallel, progress every ~25%."""
    saved = _Saved()

    def one(t: Target) -> None:
        for ch in changes[t.name]:
            t0 = time.monotonic()
            if ch.how == "pull":
                progress(f"{t.name}: pulling image {ch.ref}")
                r = session.run(t, f"docker pull {shlex.quote(ch.ref)}", timeout=3600)
                if r.exit_status != 0:
                    last = r.stderr.decode("utf-8", "replace").strip().splitlines()
                    raise HostError(
                        t,
                        f"image {ch.ref}: this machine does not have it and `docker pull` on the host failed: "
                        f"{last[-1] if last else 'exit ' + str(r.exit_status)}",
                    )
                progress(f"{t.name}: pulled image {ch.ref} in {time.monotonic() - t0:.1f} s")
                continue
            try:
                path = saved.path(ch.ref)
            except ProvisionError as e:
                raise HostError(t, str(e)) from None
            total = os.path.getsize(path)
            progress(f"{t.name}: shipping image {ch.ref} ({human(total)})")
            _stream_into(session, t, "docker load -q", path, _Quarters(progress, f"{t.name}: image {ch.ref}", total))
            dt = time.monotonic() - t0
            progress(f"{t.name}: shipped image {ch.ref} ({human(total)}) in {dt:.1f} s")

    try:
        return run_step(session, Step.SHIP, one, [targets[n] for n in changes])
    finally:
        saved.close()


def remove_command(refs: list[str]) -> str:
    return "docker image rm " + " ".join(shlex.quote(r) for r in refs) + " >/dev/null 2>&1 || true"
