"""Framework layers: TensorFlow / PyTorch installed once on the controller, mounted into hosts.

Installing tensorflow-cpu into every host (or into the image) would cost minutes and 1.5 GB
per change; instead `pip install --target DIR` runs once on the controller into a cache dir
keyed by what is installed, and DIR is bind-mounted read-only at
/opt/provision-sandbox/frameworks/<name> on each host, where the image's .pth hook puts it on
every python3's sys.path. Debian bookworm's python3 is 3.11, like the controller's.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provision.core.errors import ProvisionError

from ._paths import frameworks_dir, logs_dir
from ._util import Progress, file_lock, no_progress, tail

# name -> pip requirements. CPU builds: there are no GPUs on sandbox hosts. torch 2.13.0's
# CPU wheel is found through pip's configured find-links on provision's machines. torch does
# not depend on numpy, but `Tensor.numpy()` (and so most training scripts) needs it; the
# version is the one tensorflow-cpu 2.21 brings, so both layers agree. cloudml-hypertune is
# how tuning trials report their metric (examples/tune_torch/train.py): one pure-Python
# module with no dependencies, published as an sdist only (pip builds it).
FRAMEWORKS: dict[str, tuple[str, ...]] = {
    "tensorflow": ("tensorflow-cpu==2.21.0",),
    "torch": ("torch==2.13.0", "numpy==2.4.6", "cloudml-hypertune==0.1.0.dev6"),
    # CPU jaxlib: what a TPU job's cluster detection reads can be checked without a TPU.
    "jax": ("jax==0.10.2", "jaxlib==0.10.2", "numpy==2.4.6"),
}
# Requirements with no wheel: pip refuses them under --only-binary, which a controller on
# another Python needs; being pure Python without dependencies, they are built on the
# controller in a second pip call with --no-deps (which pip allows with --python-version).
SDIST_ONLY = frozenset({"cloudml-hypertune==0.1.0.dev6"})
HOST_ROOT = "/opt/provision-sandbox/frameworks"
HOST_PYTHON = (3, 11)  # Debian bookworm's python3


def _key(name: str) -> str:
    h = hashlib.sha256()
    h.update(repr((FRAMEWORKS[name], HOST_PYTHON, platform.machine())).encode())
    return h.hexdigest()[:12]


def framework_path(name: str) -> Path:
    if name not in FRAMEWORKS:
        raise ProvisionError(f"unknown framework {name!r}: choose from {', '.join(sorted(FRAMEWORKS))}")
    return frameworks_dir() / f"{name}-{_key(name)}"


def host_mount_point(name: str) -> str:
    return f"{HOST_ROOT}/{name}"


def ensure_framework(name: str, progress: Progress = no_progress) -> Path:
    """The directory holding the framework's packages, installing it on first use."""
    final = framework_path(name)
    if final.is_dir():
        return final
    with file_lock(f"framework-{final.name}", progress, f"waiting for another process installing the {name} layer"):
        if final.is_dir():
            return final
        _install(name, final, progress)
    return final


def _pip_commands(target: Path, reqs: tuple[str, ...]) -> list[list[str]]:
    """The pip calls that install reqs into target: one, or on a controller that is not the
    hosts' Python, one for the wheels and one for the sdist-only pure-Python packages."""
    if not _cross():
        return [_pip_command(target, reqs)]
    wheels = tuple(r for r in reqs if r not in SDIST_ONLY)
    pure = tuple(r for r in reqs if r in SDIST_ONLY)
    cmds = [_pip_command(target, wheels)] if wheels else []
    return cmds + ([_pip_command(target, pure, sdists=True)] if pure else [])


def _cross() -> bool:
    return sys.version_info[:2] != HOST_PYTHON or platform.machine() != "x86_64"


def _pip_command(target: Path, reqs: tuple[str, ...], sdists: bool = False) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--target",
        str(target),
        "--disable-pip-version-check",
        "--no-input",
        "--no-warn-script-location",
        "--progress-bar",
        "off",
    ]
    if _cross():
        # A controller on another Python must fetch wheels for the hosts' 3.11.
        cmd += [
            "--python-version",
            "%d.%d" % HOST_PYTHON,
            "--implementation",
            "cp",
            "--platform",
            "manylinux_2_36_x86_64",
            # --no-deps: pure-Python sdists without dependencies (SDIST_ONLY), built here.
            "--no-deps" if sdists else "--only-binary=:all:",
        ]
    return cmd + list(reqs)


def _install(name: str, final: Path, progress: Progress) -> None:
    reqs = FRAMEWORKS[name]
    final.parent.mkdir(parents=True, exist_ok=True)
    logs_dir().mkdir(parents=True, exist_ok=True)
    log_path = logs_dir() / f"framework-{final.name}.log"
    # Install beside the final place and rename: a crash never leaves a half layer that
    # looks complete, and the rename is atomic on one filesystem.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    progress(f"installing the {name} layer ({' '.join(reqs)}) once into {final}; log: {log_path}")
    t0 = time.monotonic()
    try:
        rc = 0
        with open(log_path, "w") as log:
            for cmd in _pip_commands(tmp, reqs):
                log.write("$ " + " ".join(cmd) + "\n")
                log.flush()
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
                if rc != 0:
                    break
        if rc != 0:
            raise ProvisionError(
                f"installing the {name} layer failed: pip exited {rc} "
                f"(last lines: {tail(log_path, 3)}); full log: {log_path}"
            )
        os.chmod(tmp, 0o755)
        os.rename(tmp, final)
        progress(f"{name} layer ready in {time.monotonic() - t0:.0f} s")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
