"""The "docker" layer of the sandbox host image: Debian's docker.io on top of the host image.

`provision sandbox up --with docker` starts hosts from this image. It is built once from the
host image (`docker build`, apt from the controller's Debian mirror) and tagged by a hash of
the host image's tag and this layer's recipe, so it is rebuilt only when either changes, like
the framework layers. Hosts started from it need `--security-opt seccomp=unconfined`
(else runc fails: "unable to join session keyring") and /var/lib/docker on a volume (on the
container's overlay dockerd fails: "invalid cross-device link"); core.py adds both.

dockerd runs with the vfs storage driver and without its bridge network or iptables rules
(the host containers lack NET_ADMIN): containers on these hosts run with `--network host`,
as provision's container pools do.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time

import docker
import docker.errors

from provision.core.errors import ProvisionError

from ._paths import logs_dir
from ._util import Progress, file_lock, no_progress, tail
from .image import debian_mirror, image_exists

NAME = "docker"
IMAGE_REPO = "provision-sandbox-host-docker"
VOLUME_MOUNT = "/var/lib/docker"
SECURITY_OPT = ["seccomp=unconfined"]

DAEMON_JSON = {"storage-driver": "vfs", "bridge": "none", "iptables": False, "ip6tables": False}
PACKAGES = ("docker.io", "busybox-static")  # busybox: the rootfs of the tiny test image

_DOCKERFILE = """\
FROM {base}
RUN echo 'deb {mirror} bookworm main' > /etc/apt/sources.list \\
 && apt-get update -q \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends {packages} \\
 && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
COPY daemon.json /etc/docker/daemon.json
RUN systemctl enable docker.service containerd.service
CMD ["/sbin/init"]
"""


def _recipe(base: str) -> str:
    return _DOCKERFILE.format(base=base, mirror="MIRROR", packages=" ".join(PACKAGES)) + json.dumps(
        DAEMON_JSON, sort_keys=True
    )


def tag_for(base: str) -> str:
    """The layer's tag for a host image tag: a hash of both recipes (the mirror is not part
    of it: the same packages from another mirror make the same layer)."""
    return f"{IMAGE_REPO}:{hashlib.sha256(_recipe(base).encode()).hexdigest()[:12]}"


def _context(base: str, mirror: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, text in (
            ("Dockerfile", _DOCKERFILE.format(base=base, mirror=mirror, packages=" ".join(PACKAGES))),
            ("daemon.json", json.dumps(DAEMON_JSON, indent=2) + "\n"),
        ):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def ensure_docker_image(client: docker.DockerClient, base: str, progress: Progress = no_progress) -> str:
    """The tag of the docker layer on top of host image `base`, building it if missing."""
    tag = tag_for(base)
    if image_exists(client, tag):
        return tag
    with file_lock(
        f"docker-layer-{tag.split(':')[1]}", progress, "waiting for another process building the docker layer"
    ):
        if image_exists(client, tag):
            return tag
        _build(client, base, tag, progress)
    _remove_old(client, tag)
    return tag


def _build(client: docker.DockerClient, base: str, tag: str, progress: Progress) -> None:
    logs_dir().mkdir(parents=True, exist_ok=True)
    log_path = logs_dir() / f"docker-layer-{tag.split(':')[1]}.log"
    mirror = debian_mirror()
    progress(f"building the docker layer {tag} (docker.io from {mirror}, once); log: {log_path}")
    t0 = time.monotonic()
    error = ""
    with open(log_path, "w") as log:
        try:
            for chunk in client.api.build(
                fileobj=io.BytesIO(_context(base, mirror)),
                custom_context=True,
                tag=tag,
                network_mode="host",
                rm=True,
                forcerm=True,
                decode=True,
            ):
                if "stream" in chunk:
                    log.write(chunk["stream"])
                if "error" in chunk:
                    error = str(chunk["error"]).strip()
                    log.write(error + "\n")
                log.flush()
        except docker.errors.DockerException as e:
            error = str(getattr(e, "explanation", None) or e)
    if error or not image_exists(client, tag):
        raise ProvisionError(
            f"building the docker layer failed: {error or 'no image after the build'} "
            f"(last lines: {tail(log_path, 3)}); full log: {log_path}"
        )
    progress(f"docker layer {tag} built in {time.monotonic() - t0:.0f} s")


def _remove_old(client: docker.DockerClient, keep: str) -> None:
    """Layers of older host images: dropped when no container uses them."""
    try:
        for img in client.images.list(name=IMAGE_REPO):
            if keep not in img.tags and img.id is not None:  # (a listed image has its id)
                try:
                    client.images.remove(img.id)
                except docker.errors.APIError:
                    pass
    except docker.errors.DockerException:
        pass


# --------------------------------------------------------------------------- test image

TEST_IMAGE_REPO = "provision-sandbox-busybox"
_APPLETS = ("sh", "env", "cat", "echo", "sleep", "nc", "printf", "kill", "ls", "tr", "od", "base64", "true", "false")


def ensure_test_image(client: docker.DockerClient, layer: str, tag: str = "1") -> str:
    """A tiny image (busybox, about 2 MB) in the controller's engine, made with `docker
    import` of a rootfs holding the docker layer's static busybox: no registry needed.
    Different `tag`s give images with different IDs (a file /tag holds it)."""
    ref = f"{TEST_IMAGE_REPO}:{tag}"
    if image_exists(client, ref):
        return ref
    holder = client.containers.create(layer, ["true"], network_mode="none")
    try:  # the copy API, not the logs: the json-file log driver is not binary-safe
        stream, _ = holder.get_archive("/usr/bin/busybox")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as src:
            member = src.extractfile("busybox")
            assert member is not None
            out = member.read()
    finally:
        holder.remove(force=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add(name: str, data: bytes = b"", mode: int = 0o644, kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.linkname = kind, mode, link
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

        for d in ("bin", "tmp", "proc", "sys", "dev", "etc"):
            add(d, mode=0o1777 if d == "tmp" else 0o755, kind=tarfile.DIRTYPE)
        add("bin/busybox", out, 0o755)
        for applet in _APPLETS:
            add(f"bin/{applet}", kind=tarfile.SYMTYPE, link="busybox")
        add("tag", tag.encode() + b"\n")
    client.api.import_image_from_data(
        buf.getvalue(), repository=TEST_IMAGE_REPO, tag=tag, changes=["ENV PATH=/bin", 'CMD ["/bin/sh"]']
    )
    return ref
