"""Start, find and remove sandboxes: N Debian hosts as Docker containers (systemd + sshd).

Each host is a container named `<sandbox>-host-<i>` on the sandbox's own user-defined
network, so that name is the host's cluster address (the other hosts resolve it through
Docker's DNS). Its sshd is published on 127.0.0.1 only, at a fixed port chosen free when the
host is created, so the host keeps its address across restarts (`reboot`). Metadata and
the sandbox's SSH key live in `~/.cache/provision/sandboxes/<name>/`; containers and the
network also carry the label `provision.sandbox=<name>`, so `down` finds leftovers even when
the metadata is gone.
"""

from __future__ import annotations

import io
import json
import secrets
import shutil
import socket
import tarfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import docker.types
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from docker.models.containers import Container
from docker.models.networks import Network

from provision.core.errors import ProvisionError
from provision.sandbox.boot import wait_ready
from provision.sandbox.hosts import (
    DEFAULT_NAME,
    GPU_LABEL,
    DownResult,
    Sandbox,
    SandboxHost,
    SandboxSummary,
    container_name,
    network_name,
    validate_name,
)

from . import dockerlayer, engine
from ._paths import sandbox_dir, sandboxes_dir
from ._util import Progress, no_progress, raise_sysctls, write_private
from .engine import HOST_LABEL, LABEL
from .frameworks import FRAMEWORKS, ensure_framework, host_mount_point
from .image import ensure_image
from .neighbours import raise_neighbour_limits

# Flags under which systemd boots as PID 1 here (see shared/spec/test-hosts.md);
# --privileged does not work on these machines.
_CGROUP_MOUNT = {"/sys/fs/cgroup": {"bind": "/sys/fs/cgroup", "mode": "rw"}}
_TMPFS = {"/run": "", "/run/lock": "", "/tmp": ""}
_INOTIFY = {"max_user_instances": 8192, "max_user_watches": 1048576}
_INOTIFY_NEEDED_PAST = 12  # hosts; each systemd uses a handful of inotify instances

T = TypeVar("T")


# --------------------------------------------------------------------------- data


# --------------------------------------------------------------------------- helpers


def _keypair(comment: str) -> tuple[bytes, bytes]:
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private, public + f" {comment}\n".encode()


def _host_files(pubkey: bytes, gpus: int) -> bytes:
    """A tar, unpacked at / before the container starts: root's key and the GPU count."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, mode, data in (
            ("root/.ssh", 0o700, None),
            ("root/.ssh/authorized_keys", 0o600, pubkey),
            ("etc/provision-sandbox", 0o755, None),
            ("etc/provision-sandbox/gpus", 0o644, f"{gpus}\n".encode()),
        ):
            info = tarfile.TarInfo(path)
            info.mode, info.mtime = mode, int(time.time())
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _labelled(client: docker.DockerClient, name: str | None = None) -> tuple[list[Container], list[Network]]:
    flt: dict[str, str | list[str] | bool] = {"label": f"{LABEL}={name}" if name else LABEL}
    return (client.containers.list(all=True, filters=flt), client.networks.list(filters=flt))


def _raise_inotify_limits(client: docker.DockerClient, new_hosts: int, progress: Progress) -> None:
    """Past about 20 systemd containers new ones die at boot under the default inotify limits."""
    running = len(client.containers.list(filters={"label": LABEL}))
    total = running + new_hosts
    if total > _INOTIFY_NEEDED_PAST:
        raise_sysctls(Path("/proc/sys/fs/inotify"), "fs.inotify", _INOTIFY, f"{total} systemd hosts", progress)


def _network_error(network: str, e: docker.errors.APIError) -> ProvisionError:
    text = str(getattr(e, "explanation", None) or e)
    if "address pool" in text.lower():
        return ProvisionError(
            f"network {network}: Docker has no free address range left for another network; "
            "remove unused ones (`provision sandbox list`, `provision sandbox down --name "
            "NAME`, `docker network prune`), or start dockerd with a larger "
            "--default-address-pool"
        )
    return ProvisionError(f"network {network}: Docker refused to create it: {text.splitlines()[0]}")


def _docker_error(container: str, e: docker.errors.APIError, port: int | None) -> ProvisionError:
    text = str(getattr(e, "explanation", None) or e)
    low = text.lower()
    if "port is already allocated" in low or "address already in use" in low:
        where = f"127.0.0.1:{port}" if port else "a published port"
        return ProvisionError(
            f"{container}: {where} is in use: choose another --ssh-port, or leave it out to get free ports"
        )
    if "is already in use" in low and "name" in low:
        return ProvisionError(
            f"a container named {container} already exists: `provision sandbox down --name "
            f"{container.rsplit('-host-', 1)[0]}` removes a sandbox's leftovers, or pick "
            "another --name"
        )
    return ProvisionError(f"{container}: Docker refused to start it: {text.splitlines()[0]}")


# --------------------------------------------------------------------------- up


def up(
    name: str | None = None,
    hosts: int = 3,
    gpus_per_host: int = 0,
    with_: tuple[str, ...] | list[str] = (),
    *,
    ssh_port: int | None = None,
    timeout: float = 180.0,
    progress: Progress = no_progress,
    client: docker.DockerClient | None = None,
) -> Sandbox:
    """Start a sandbox of `hosts` hosts and wait until every one is usable.

    Usable: `systemctl is-system-running` says running (or degraded) and root logs in over
    SSH with the sandbox's key. `ssh_port`, when given, is host-1's published port and the
    others follow it; by default each host gets a port free at its creation, kept for its
    life (restarts included). On any error or Ctrl-C everything
    started so far is removed again."""
    name = validate_name(name or DEFAULT_NAME)
    with_ = _checked(hosts, gpus_per_host, with_)
    client = client or engine.client()
    image = ensure_image(client, progress)
    if dockerlayer.NAME in with_:  # hosts with a Docker engine: the cached docker layer
        image = dockerlayer.ensure_docker_image(client, image, progress)
    layers = {fw: ensure_framework(fw, progress) for fw in with_ if fw != dockerlayer.NAME}
    _raise_inotify_limits(client, hosts, progress)
    raise_neighbour_limits(len(client.containers.list(filters={"label": LABEL})) + hosts, progress)

    _claim(client, name)
    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=hosts, thread_name_prefix=f"sandbox-{name}")
    try:
        return _up(client, name, hosts, gpus_per_host, image, layers, ssh_port, timeout, progress, pool, cancel)
    except BaseException:
        cancel.set()
        pool.shutdown(wait=True, cancel_futures=True)  # no container appears after down()
        try:
            down(name, client=client)
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass
        raise
    finally:
        pool.shutdown(wait=False)


def _checked(hosts: int, gpus_per_host: int, with_: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The request's numbers in range and its layers known; the layers, once each."""
    if not isinstance(hosts, int) or not 1 <= hosts <= 128:
        raise ProvisionError(f"--hosts {hosts!r}: expected a number from 1 to 128")
    if not isinstance(gpus_per_host, int) or not 0 <= gpus_per_host <= 16:
        raise ProvisionError(f"--gpus-per-host {gpus_per_host!r}: expected a number from 0 to 16")
    layers = tuple(dict.fromkeys(with_))
    for fw in layers:
        if fw not in FRAMEWORKS and fw != dockerlayer.NAME:
            raise ProvisionError(
                f"--with {fw!r}: unknown layer; choose from {', '.join(sorted([*FRAMEWORKS, dockerlayer.NAME]))}"
            )
    return layers


def _claim(client: docker.DockerClient, name: str) -> None:
    """Claim the name: mkdir is atomic, so of two processes starting the same sandbox one
    gets an error here, and up's cleanup never removes another process's hosts."""
    sdir = sandbox_dir(name)
    sdir.parent.mkdir(parents=True, exist_ok=True)
    containers, networks = _labelled(client, name)
    if not containers:
        networks = [n for n in networks if not _leftover_removed(n)]
    try:
        if containers or networks:
            raise FileExistsError
        sdir.mkdir(mode=0o700)
    except FileExistsError:
        raise ProvisionError(
            f"sandbox {name!r} already exists ({len(containers)} containers): "
            f"`provision sandbox down --name {name}` first, or pick another --name"
        ) from None


def _new_sandbox(name: str, hosts: int, gpus_per_host: int, image: str, layers: dict[str, Path]) -> Sandbox:
    sdir = sandbox_dir(name)
    return Sandbox(
        name=name,
        network=network_name(name),
        key_path=sdir / "id_ed25519",
        known_hosts_path=sdir / "known_hosts",
        image=image,
        frameworks=tuple(layers) + ((dockerlayer.NAME,) if _layer_options(image) else ()),
        created=time.time(),
        status="starting",
        hosts=[
            SandboxHost(
                name=f"host-{i}",
                container=container_name(name, i),
                ssh_port=0,
                cluster_address=container_name(name, i),
                gpus=gpus_per_host,
            )
            for i in range(1, hosts + 1)
        ],
    )


def _up(
    client: docker.DockerClient,
    name: str,
    hosts: int,
    gpus_per_host: int,
    image: str,
    layers: dict[str, Path],
    ssh_port: int | None,
    timeout: float,
    progress: Progress,
    pool: ThreadPoolExecutor,
    cancel: threading.Event,
) -> Sandbox:
    sdir = sandbox_dir(name)
    private, public = _keypair(f"provision-sandbox-{name}")
    write_private(sdir / "id_ed25519", private)
    write_private(sdir / "id_ed25519.pub", public, 0o644)
    sb = _new_sandbox(name, hosts, gpus_per_host, image, layers)
    if any(n.name == sb.network for n in client.networks.list(names=[sb.network])):
        # A network an earlier `down` could not remove (DownResult.stale_networks).
        sb.network = f"{sb.network}-{secrets.token_hex(3)}"
    sb.save()  # from here on `down` finds the key dir even if this process dies
    t0 = time.monotonic()
    try:
        client.networks.create(sb.network, driver="bridge", labels={LABEL: name}, check_duplicate=True)
    except docker.errors.APIError as e:
        raise _network_error(sb.network, e) from None
    volumes = dict(_CGROUP_MOUNT)
    for fw, path in layers.items():
        volumes[str(path)] = {"bind": host_mount_point(fw), "mode": "ro"}
    progress(f"starting {hosts} host{'s' if hosts != 1 else ''} of sandbox {name!r}")
    deadline = time.monotonic() + timeout

    def start_and_wait(i: int, h: SandboxHost) -> str:
        # One thread per host: a host's boot overlaps the other containers' creation.
        _start_host(client, sb, h, image, volumes, public, ssh_port + i if ssh_port else None, cancel)
        return wait_ready(client, sb, h, deadline, cancel, progress)

    host_keys = _gather([pool.submit(start_and_wait, i, h) for i, h in enumerate(sb.hosts)])
    write_private(sb.known_hosts_path, "".join(host_keys), 0o644)
    sb.status = "ready"
    sb.save()
    progress(f"sandbox {name!r}: {hosts} host{'s' if hosts != 1 else ''} ready in {time.monotonic() - t0:.1f} s")
    return sb


def _gather(futures: list[Future[T]]) -> list[T]:
    """Results in submission order; the first failure is raised at once."""
    for f in as_completed(futures):
        f.result()
    return [f.result() for f in futures]


_PORTS_LOCK = threading.Lock()
_PORTS_GIVEN: set[int] = set()
_PORT_TRIES = 5


def _free_port() -> int:
    """A loopback port nothing listens on now and that this process has not handed out
    (hosts starting side by side must not pick the same one)."""
    with _PORTS_LOCK:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _PORTS_GIVEN:
                _PORTS_GIVEN.add(port)
                return port
    raise ProvisionError("no free port on 127.0.0.1 for a sandbox host's SSH")


def _port_taken(e: docker.errors.APIError) -> bool:
    low = str(getattr(e, "explanation", None) or e).lower()
    return "port is already allocated" in low or "address already in use" in low


def _layer_options(image: str) -> dict[str, Any]:
    """Container options the host image's layers need (the docker layer: dockerd's)."""
    if not image.startswith(dockerlayer.IMAGE_REPO + ":"):
        return {}
    return {
        "security_opt": list(dockerlayer.SECURITY_OPT),
        # An anonymous volume: removed with the container (`down` removes with v=True).
        "mounts": [docker.types.Mount(target=dockerlayer.VOLUME_MOUNT, source=None, type="volume")],
    }


def _start_host(
    client: docker.DockerClient,
    sb: Sandbox,
    h: SandboxHost,
    image: str,
    volumes: dict[str, dict[str, str]],
    pubkey: bytes,
    port: int | None,
    cancel: threading.Event,
) -> None:
    """Create and start a host's container. Its SSH port is published at a fixed port
    (`port`, or one chosen free here: taken meanwhile, another is tried), never one Docker
    picks at each start: a restarted host keeps its address."""
    for attempt in range(1, _PORT_TRIES + 1):
        if cancel.is_set():
            return
        chosen = port or _free_port()
        try:
            c = client.containers.create(
                image,
                name=h.container,
                hostname=h.container,
                detach=True,
                labels={LABEL: sb.name, HOST_LABEL: h.name, GPU_LABEL: str(h.gpus)},
                network=sb.network,
                ports={"22/tcp": ("127.0.0.1", chosen)},
                cap_add=["SYS_ADMIN", "NET_ADMIN"],  # NET_ADMIN: tests drop traffic with iptables
                cgroupns="host",
                volumes=volumes,
                tmpfs=_TMPFS,
                **_layer_options(image),
                stop_signal="SIGRTMIN+3",  # systemd shuts down cleanly on it, not on SIGTERM
            )
            c.put_archive("/", _host_files(pubkey, h.gpus))
            c.start()
            c.reload()
            bound = c.ports["22/tcp"]
            if not bound:  # published above: Docker lists it once the container runs
                raise ProvisionError(f"{h.container}: Docker did not publish its SSH port")
            h.ssh_port = int(bound[0]["HostPort"])
            return
        except docker.errors.APIError as e:
            if port is None and _port_taken(e) and attempt < _PORT_TRIES:
                try:  # taken between the choice and the start: another port, a new container
                    client.containers.get(h.container).remove(force=True, v=True)
                except docker.errors.NotFound:
                    pass
                continue
            raise _docker_error(h.container, e, port) from None


# --------------------------------------------------------------------------- reboot


def _host_of(sb: Sandbox, host: str | int) -> SandboxHost:
    try:
        return sb.host(int(host) if isinstance(host, str) and host.isdigit() else host)
    except KeyError:
        hosts = ", ".join(x.name for x in sb.hosts)
        raise ProvisionError(f"sandbox {sb.name!r} has no host {host!r} (hosts: {hosts})") from None


def reboot(
    name: str | None,
    host: str | int,
    *,
    client: docker.DockerClient | None = None,
    timeout: float = 120.0,
    stop_timeout: int = 30,
    progress: Progress = no_progress,
) -> SandboxHost:
    """Restart one host of a sandbox: a real systemd boot (`docker restart`: systemd shuts
    down on the container's stop signal, then /sbin/init boots again), at the same SSH port.

    Returns once root logs in and `systemctl is-system-running` says running (or degraded);
    ProvisionError after `timeout` seconds, or when the host's SSH key is not the one the
    sandbox recorded (the keys live in the container's filesystem and survive a restart).
    `host`: "host-2", the container name, or 2. `stop_timeout`: seconds the shutdown may take
    before Docker kills what is left (as a power cut would)."""
    sb = load(name)
    h = _host_of(sb, host)
    client = client or engine.client()
    try:
        c = client.containers.get(h.container)
    except docker.errors.NotFound:
        raise ProvisionError(
            f"{h.container}: no such container (see `provision sandbox list`; "
            f"`provision sandbox down --name {sb.name}` removes what is left)"
        ) from None
    old_port = h.ssh_port
    progress(f"{h.container}: restarting")
    t0 = time.monotonic()
    try:
        c.restart(timeout=stop_timeout)
        c.reload()
    except docker.errors.APIError as e:
        raise _docker_error(h.container, e, old_port) from None
    bound = (c.ports or {}).get("22/tcp") or []
    if c.status != "running" or not bound:
        raise ProvisionError(f"{h.container}: did not start again (status {c.status})")
    h.ssh_port = int(bound[0]["HostPort"])
    line = wait_ready(client, sb, h, time.monotonic() + timeout, threading.Event(), progress)
    addr, _, key = line.strip().partition(" ")
    old_addr = f"[{h.ssh_host}]:{old_port}"
    known = sb.known_hosts_path.read_text().splitlines() if sb.known_hosts_path.is_file() else []
    before = [ln.partition(" ")[2] for ln in known if ln.partition(" ")[0] == old_addr]
    if before and key not in before:
        raise ProvisionError(f"{h.container}: its SSH host key changed across the restart ({key.split()[0]})")
    if h.ssh_port != old_port:
        # A sandbox made before hosts had fixed ports: Docker picked another one.
        progress(
            f"{h.container}: its SSH port changed from {old_port} to {h.ssh_port} (a sandbox made "
            "before fixed ports); update the inventory's port, or start the sandbox again"
        )
        kept = [ln for ln in known if ln.partition(" ")[0] != old_addr]
        write_private(sb.known_hosts_path, "\n".join([*kept, f"{addr} {key}"]) + "\n", 0o644)
        sb.save()
    progress(f"{h.container}: back at 127.0.0.1:{h.ssh_port} in {time.monotonic() - t0:.1f} s")
    return h


# --------------------------------------------------------------------------- down / load / list


def down(  # noqa: C901  containers, then networks, then the key dir, each with the Docker errors it may give
    name: str | None = None, *, client: docker.DockerClient | None = None, progress: Progress = no_progress
) -> DownResult:
    """Remove a sandbox's containers, network and key dir; found by label and metadata."""
    name = validate_name(name or DEFAULT_NAME)
    result = DownResult(name)
    client = client or engine.client()
    containers, _ = _labelled(client, name)

    def remove(c: Container) -> None:
        try:
            c.remove(force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                result.errors.append(f"{c.name}: {e}")

    if containers:
        progress(f"removing {len(containers)} container{'s' if len(containers) != 1 else ''} of sandbox {name!r}")
        with ThreadPoolExecutor(max_workers=min(len(containers), 16)) as ex:
            list(ex.map(remove, containers))
    result.containers = len(containers)
    _, networks = _labelled(client, name)
    for n in networks:
        try:
            _remove_network(n)
            result.networks += 1
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if _stale(e):
                result.stale_networks.append(n.name or n.short_id)  # listed networks have names
            else:
                result.errors.append(f"network {n.name}: {e}")
    sdir = sandbox_dir(name)
    if sdir.exists():
        shutil.rmtree(sdir, ignore_errors=True)
        result.state_removed = True
    if result.errors:
        raise ProvisionError(f"sandbox {name!r}: could not remove everything: " + "; ".join(result.errors))
    return result


def _stale(e: docker.errors.APIError) -> bool:
    """Docker refused to remove a network for endpoints it still lists (see _remove_network)."""
    return "active endpoints" in str(e)


def _leftover_removed(n: Network) -> bool:
    """A network of a sandbox with no containers left: removed now, or stale (see below)."""
    try:
        _remove_network(n, wait=0)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        return _stale(e)
    return True


def _remove_network(n: Network, wait: float = 5.0) -> None:
    """Remove a network whose containers were just removed. The engine can still list their
    endpoints for a moment ("has active endpoints", seen with 32 containers at once): those
    are disconnected and the removal tried again, for up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            n.remove()
            return
        except docker.errors.APIError as e:
            if not _stale(e) or time.monotonic() > deadline:
                raise
        n.reload()
        for endpoint in n.attrs.get("Containers") or {}:
            try:
                n.disconnect(endpoint, force=True)
            except docker.errors.APIError:
                pass  # gone meanwhile
        time.sleep(0.25)


def load(name: str | None = None) -> Sandbox:
    """The sandbox `up` started, possibly from another process (from its metadata)."""
    name = name or DEFAULT_NAME
    path = sandbox_dir(name) / "sandbox.json"
    try:
        return Sandbox.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ProvisionError(
            f"no sandbox named {name!r} (see `provision sandbox list`; start one with "
            f"`provision sandbox up --name {name}`)"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ProvisionError(
            f"{path}: unreadable sandbox metadata ({e}); `provision sandbox down --name {name}` removes it"
        ) from None


def list_sandboxes(client: docker.DockerClient | None = None) -> list[SandboxSummary]:
    """Every sandbox with metadata on disk or labelled containers/networks on the engine."""
    client = client or engine.client()
    found: dict[str, SandboxSummary] = {}
    containers, networks = _labelled(client)
    for obj in [*containers, *networks]:
        n = (obj.attrs.get("Labels") or obj.attrs.get("Config", {}).get("Labels") or {}).get(LABEL)
        if n:
            found.setdefault(n, SandboxSummary(n, 0, 0, 0))
    for c in containers:
        s = found[c.labels[LABEL]]
        s.containers += 1
        s.running += c.status == "running"
    if sandboxes_dir().is_dir():
        for d in sorted(sandboxes_dir().iterdir()):
            if (d / "sandbox.json").is_file():
                try:
                    sb = load(d.name)
                except ProvisionError:
                    continue
                s = found.setdefault(sb.name, SandboxSummary(sb.name, 0, 0, 0))
                s.hosts, s.gpus_per_host, s.frameworks = len(sb.hosts), sb.gpus_per_host, sb.frameworks
                s.created, s.metadata, s.status = sb.created, True, sb.status
    return [found[k] for k in sorted(found)]
