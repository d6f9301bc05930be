"""A dev session as a job of its own: the team inventory's hosts, ssh, state and env, with
one pool of one replica holding the GPUs asked for, whose task is the session program
(host/devsession.py, pushed with `files:`): a private sshd on the host's loopback that
hands every login the task's environment (CUDA_VISIBLE_DEVICES and the rest), inside the
image when one is given. The team job's pools, files and setup are not the session's
(a setup may take minutes; a session starts in seconds). Pure.

The session is preemptible at the team policy's dev priority: beyond its owner's
guarantee it is borrowed like any preemptible work, and a preemption gives it the usual
grace (its program warns the logged-in terminals and waits for them within it).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from provision.core.model import FileSpec, Inventory, Pool
from provision.core.scheduling import Scheduling
from provision.host import bundle

# The session program on the host: one file per version of it (two versions' sessions on
# one host each keep their own; every session of a version shares it: shared files).
PROGRAM_DIR = "/opt/provision-dev"
ROLE = "chief"
TASK = "chief-0"  # the session's one task


def program_text() -> str:
    """The session's program as the host runs it: host/logins.py, then host/devsession.py
    (whose import of the first is for the package: alone on the host, the names are above)."""
    first = bundle.source("logins")
    second = bundle.source("devsession").replace("from __future__ import annotations\n", "", 1)
    return first + "\n\n# ---- host/devsession.py\n" + second


def program_dest(text: str) -> str:
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"{PROGRAM_DIR}/session-{digest}.py"


@dataclasses.dataclass(frozen=True)
class SessionSpec:
    job: str
    name: str
    owner: str
    gpus: int
    priority: int | str
    user: str = ""  # the login user on the host ("": ssh's default)
    image: str = ""
    jupyter: bool = False


def session_env(spec: SessionSpec) -> tuple[tuple[str, str], ...]:
    """What the session's task (and so every login) gets beside provision's variables."""
    env = [
        ("PROVISION_DEV", spec.name),
        ("PROVISION_DEV_OWNER", spec.owner),
        ("PROVISION_DEV_USER", spec.user),
    ]
    if spec.image:
        env.append(("PROVISION_DEV_IMAGE", spec.image))
    if spec.jupyter:
        env.append(("PROVISION_DEV_JUPYTER", "1"))
    return tuple(env)


def session_inventory(inv: Inventory, spec: SessionSpec, program: Path) -> Inventory:
    """The session's job on the team inventory's hosts; `program` a file holding
    program_text() (pushed to the host)."""
    dest = program_dest(program.read_text())
    pool = Pool(
        role=ROLE,
        replicas=1,
        accelerators=spec.gpus,
        command=("/usr/bin/env", "python3", "-S", dest),
        env=session_env(spec),
    )
    pushed = FileSpec(program, dest, False)
    return dataclasses.replace(
        inv,
        job=spec.job,
        pools=(pool,),
        files=(pushed,),
        secret_env=(),
        setup=None,
        outputs=None,
        tune=None,
        job_spec=None,
        success="chief",
        scheduling=Scheduling(priority=spec.priority, preemptible=True, grace_s=inv.scheduling.grace_s),
    )
