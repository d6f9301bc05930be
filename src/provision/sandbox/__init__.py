"""Disposable local test hosts: Debian containers with systemd as PID 1, journald and sshd.

Used by the test suite (tests/conftest.py fixtures), the benchmarks and `provision sandbox`.

    from provision import sandbox
    sb = sandbox.up("demo", hosts=3, gpus_per_host=2, with_=("torch",))
    sandbox.write_inventory(sb, "inventory.yaml", job="mnist", pools={...})
    with sb.connection("host-1") as c:
        c.run("nvidia-smi -L")
    sandbox.reboot("demo", "host-2")   # a real systemd boot, same SSH port
    sandbox.down("demo")
"""

from .core import down, list_sandboxes, load, reboot, up
from .engine import LABEL, check_engine
from .frameworks import FRAMEWORKS, ensure_framework, framework_path
from .hosts import (
    ACCELERATOR_TYPE,
    DEFAULT_NAME,
    DownResult,
    Sandbox,
    SandboxHost,
    SandboxSummary,
    container_name,
    network_name,
    validate_name,
)
from .image import debian_mirror, ensure_image, recipe
from .inventory import example_pools, inventory_dict, write_inventory

__all__ = [
    "ACCELERATOR_TYPE",
    "DEFAULT_NAME",
    "DownResult",
    "FRAMEWORKS",
    "LABEL",
    "Sandbox",
    "SandboxHost",
    "SandboxSummary",
    "check_engine",
    "container_name",
    "debian_mirror",
    "down",
    "ensure_framework",
    "ensure_image",
    "example_pools",
    "framework_path",
    "inventory_dict",
    "list_sandboxes",
    "load",
    "network_name",
    "reboot",
    "recipe",
    "up",
    "validate_name",
    "write_inventory",
]
