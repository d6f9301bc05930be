"""The sandbox host image: Debian bookworm with systemd, sshd and python3, built locally.

No image registry is reachable on the machines provision is developed on, so the image is
built from Debian's packages with debootstrap and loaded with `docker import`. Its tag is a
hash of the recipe (package list + every file under provision/hostimage/), so it is built
once and rebuilt only when the recipe changes.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors

from provision.core.errors import ProvisionError

from . import engine
from ._paths import build_dir, cache_root, logs_dir
from ._util import Progress, file_lock, no_progress, tail

SUITE = "bookworm"
IMAGE_REPO = "provision-sandbox-host"
RECIPE_LABEL = "provision.sandbox.recipe"
ASSETS = Path(__file__).resolve().parent.parent / "hostimage"
MIRROR_ENV = "PROVISION_DEBIAN_MIRROR"

# Debian release names and aliases: an apt source for any of them is served by an archive
# that also serves bookworm. Used to recognise the controller's Debian mirror.
_DEBIAN_SUITES = {
    "buster",
    "bullseye",
    "bookworm",
    "trixie",
    "forky",
    "duke",
    "sid",
    "oldoldstable",
    "oldstable",
    "stable",
    "testing",
    "unstable",
}


@dataclass(frozen=True)
class Recipe:
    suite: str
    packages: tuple[str, ...]
    files: tuple[tuple[str, bytes], ...]  # (path relative to hostimage/, content)

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        h.update(f"suite={self.suite}\n".encode())
        h.update(("packages=" + ",".join(self.packages) + "\n").encode())
        for rel, content in self.files:
            h.update(f"file={rel} {len(content)}\n".encode())
            h.update(content)
        return h.hexdigest()

    @property
    def tag(self) -> str:
        return f"{IMAGE_REPO}:{self.digest[:12]}"


def recipe(assets: Path = ASSETS) -> Recipe:
    """The recipe as it stands in the installed package."""
    pkgs = []
    for line in (assets / "packages.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pkgs.append(line)
    files = []
    for p in sorted(assets.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".md", ".pyc"):
            files.append((p.relative_to(assets).as_posix(), p.read_bytes()))
    return Recipe(SUITE, tuple(pkgs), tuple(files))


# --------------------------------------------------------------------------- mirror


@dataclass(frozen=True)
class AptSource:
    uri: str
    suites: tuple[str, ...]
    components: tuple[str, ...]
    origin: str  # file it came from


def _parse_list(text: str, origin: str) -> list[AptSource]:
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        line = re.sub(r"\[[^\]]*\]", " ", line)  # drop [arch=... signed-by=...] options
        parts = line.split()
        if len(parts) < 3 or parts[0] != "deb":
            continue
        out.append(AptSource(parts[1], (parts[2],), tuple(parts[3:]), origin))
    return out


def _parse_deb822(text: str, origin: str) -> list[AptSource]:
    out = []
    for para in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = None
        for raw in para.splitlines():
            if raw.lstrip().startswith("#"):
                continue
            if raw[:1] in (" ", "\t") and key:  # continuation line
                fields[key] += " " + raw.strip()
                continue
            k, sep, v = raw.partition(":")
            if sep:
                key = k.strip().lower()
                fields[key] = v.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in fields.get("types", "").split():
            continue
        for uri in fields.get("uris", "").split():
            out.append(
                AptSource(
                    uri, tuple(fields.get("suites", "").split()), tuple(fields.get("components", "").split()), origin
                )
            )
    return out


def apt_sources(root: Path = Path("/")) -> list[AptSource]:
    """The controller's apt sources, in apt's order (sources.list, then sources.list.d/)."""
    etc = root / "etc/apt"
    found: list[AptSource] = []
    main = etc / "sources.list"
    if main.is_file():
        found += _parse_list(main.read_text(errors="replace"), str(main))
    d = etc / "sources.list.d"
    if d.is_dir():
        for f in sorted(d.iterdir()):
            # apt itself reads only these two extensions (not *.disabled, *.save, ...).
            if f.suffix == ".list":
                found += _parse_list(f.read_text(errors="replace"), str(f))
            elif f.suffix == ".sources":
                found += _parse_deb822(f.read_text(errors="replace"), str(f))
    return found


def debian_mirror(root: Path = Path("/")) -> str:
    """The Debian archive the controller's apt uses, or $PROVISION_DEBIAN_MIRROR.

    Prefers a source for bookworm itself; else any Debian release's archive (the same
    archive serves bookworm). Security archives are skipped: they do not carry the base
    system. Schemes debootstrap cannot use (mirror+file:, cdrom:) are skipped too."""
    env = os.environ.get(MIRROR_ENV, "").strip()
    if env:
        return env.rstrip("/")
    candidates: list[tuple[int, int, str]] = []
    for src in apt_sources(root):
        if not re.match(r"^(https?|ftp|file):", src.uri):
            continue
        for suite in src.suites:
            base, _, pocket = suite.partition("-")
            if pocket == "security" or "/updates" in suite or "security" in src.uri:
                continue
            if base not in _DEBIAN_SUITES or (src.components and "main" not in src.components):
                continue
            rank = 0 if suite == SUITE else (1 if base == SUITE else 2)
            candidates.append((rank, len(candidates), src.uri.rstrip("/")))
    if not candidates:
        raise ProvisionError(
            "cannot tell which Debian mirror to build the sandbox host image from: no Debian "
            "archive in /etc/apt/sources.list or /etc/apt/sources.list.d/; set "
            f"{MIRROR_ENV}=<URL of a Debian archive>"
        )
    return min(candidates)[2]


# --------------------------------------------------------------------------- build


def image_exists(client: docker.DockerClient, tag: str) -> bool:
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def ensure_image(
    client: docker.DockerClient | None = None,
    progress: Progress = no_progress,
    *,
    rebuild: bool = False,
) -> str:
    """The tag of the host image for the current recipe, building it if it is missing."""
    client = client or engine.client()
    r = recipe()
    if not rebuild and image_exists(client, r.tag):
        return r.tag
    with file_lock("host-image", progress, "waiting for another process building the host image"):
        if not rebuild and image_exists(client, r.tag):  # built while we waited
            return r.tag
        _build(client, r, progress)
    _remove_old_images(client, r.tag)
    return r.tag


def _check_build_tools() -> None:
    if os.geteuid() != 0:
        raise ProvisionError(
            "building the sandbox host image needs root (debootstrap, chroot): run this once "
            "as root, e.g. `sudo provision sandbox image`"
        )
    for tool, pkg in (("debootstrap", "debootstrap"), ("chroot", "coreutils"), ("tar", "tar")):
        if not shutil.which(tool):
            raise ProvisionError(
                f"{tool} is not installed: `apt-get install -y {pkg}` (needed to build the sandbox host image)"
            )


def _build(client: docker.DockerClient, r: Recipe, progress: Progress) -> None:
    _check_build_tools()
    mirror = debian_mirror()
    logs_dir().mkdir(parents=True, exist_ok=True)
    build_dir().mkdir(parents=True, exist_ok=True)
    log_path = logs_dir() / f"host-image-{r.digest[:12]}.log"
    work = Path(tempfile.mkdtemp(prefix="host-image-", dir=build_dir()))
    rootfs = work / "rootfs"
    debs = cache_root() / "debootstrap-debs"  # reused if the recipe changes
    debs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    progress(
        f"building the sandbox host image {r.tag} from {mirror} (once per recipe, about 1-2 minutes); log: {log_path}"
    )
    try:
        with open(log_path, "w") as log:

            def run(cmd: list[str], what: str) -> None:
                log.write(f"\n$ {' '.join(cmd)}\n")
                log.flush()
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
                if rc != 0:
                    raise ProvisionError(
                        f"building the sandbox host image failed: {what} exited {rc} "
                        f"(last lines: {tail(log_path, 3)}); full log: {log_path}"
                    )

            run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(r.packages)}",
                    f"--cache-dir={debs}",
                    r.suite,
                    str(rootfs),
                    mirror,
                ],
                "debootstrap",
            )
            _umount_below(rootfs)
            shutil.copytree(ASSETS / "rootfs", rootfs, dirs_exist_ok=True, symlinks=True)
            shutil.copy(ASSETS / "customize.sh", rootfs / "tmp/provision-customize.sh")
            run(["chroot", str(rootfs), "/bin/sh", "/tmp/provision-customize.sh"], "customize.sh (in chroot)")
            (rootfs / "tmp/provision-customize.sh").unlink(missing_ok=True)
            progress("importing the host image into Docker")
            log.write("\n$ tar -c rootfs | docker import\n")
            log.flush()
            _import(client, rootfs, r, log_path)
        progress(f"host image {r.tag} built in {time.monotonic() - t0:.0f} s")
    finally:
        _remove_tree(work)


def _import(client: docker.DockerClient, rootfs: Path, r: Recipe, log_path: Path) -> None:
    # Stream the tar straight into the engine: no 350 MB temporary file.
    with open(log_path, "a") as log:
        tar = subprocess.Popen(
            ["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-c", "."],
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
        try:
            client.api.import_image(
                src=tar.stdout,
                repository=IMAGE_REPO,
                tag=r.tag.split(":", 1)[1],
                changes=[
                    'CMD ["/sbin/init"]',
                    "ENV container=docker",
                    f"LABEL {RECIPE_LABEL}={r.digest}",
                ],
                stream_src=True,
            )
        except docker.errors.DockerException as e:
            tar.kill()
            raise ProvisionError(
                "building the sandbox host image failed: docker import: "
                f"{getattr(e, 'explanation', None) or e}; log: {log_path}"
            ) from None
        finally:
            if tar.stdout is not None:
                tar.stdout.close()
            rc = tar.wait()
        if rc != 0:
            raise ProvisionError(f"building the sandbox host image failed: tar exited {rc}; log: {log_path}")
    if not image_exists(client, r.tag):
        raise ProvisionError(
            f"building the sandbox host image failed: {r.tag} missing after docker import; log: {log_path}"
        )


def _mounts_below(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            mnt = line.split()[1].replace("\\040", " ")
            if mnt.startswith(prefix):
                out.append(mnt)
    return sorted(out, key=len, reverse=True)


def _umount_below(path: Path) -> None:
    """debootstrap unmounts /proc and /sys of the new tree when it exits; a killed run may not."""
    for mnt in _mounts_below(path):
        subprocess.run(["umount", "-l", mnt], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _remove_tree(path: Path) -> None:
    if not path.exists():
        return
    _umount_below(path)
    if _mounts_below(path):  # never recurse into a mounted /proc or /sys of the host's
        return
    shutil.rmtree(path, ignore_errors=True)


def _remove_old_images(client: docker.DockerClient, keep: str) -> None:
    """Older recipes' images are 350 MB each: drop those no container uses."""
    try:
        for img in client.images.list(name=IMAGE_REPO):
            if keep in img.tags or img.id is None:  # (a listed image has its id)
                continue
            try:
                client.images.remove(img.id, noprune=False)
            except docker.errors.APIError:
                pass  # still used by a container; left for a later build
    except docker.errors.DockerException:
        pass
