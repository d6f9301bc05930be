"""Talking to the Docker engine, with one-line errors that say what to do."""

from __future__ import annotations

import os

import docker
import docker.errors

from provision.core.errors import ProvisionError

# Containers and networks of a sandbox carry this label, so `down` finds leftovers even
# when the sandbox's metadata on disk is gone.
LABEL = "provision.sandbox"
HOST_LABEL = "provision.sandbox.host"

_START_HINT = (
    "start one as root with `dockerd >/var/log/dockerd.log 2>&1 &` "
    "(or `systemctl start docker`); `apt-get install -y docker.io` installs it, "
    "and scripts/setup.sh in the provision repository does both"
)


def _where() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def explain(exc: BaseException) -> str:
    """Turn a docker SDK exception into one line that says what to do."""
    text = str(exc)
    low = text.lower()
    if isinstance(exc, PermissionError) or "permission denied" in low:
        return (
            f"no permission to use the Docker engine at {_where()}: run as root, or add your "
            "user to the 'docker' group (`sudo usermod -aG docker $USER`, then log in again)"
        )
    if (
        "filenotfounderror" in low
        or "no such file" in low
        or "connection refused" in low
        or "connection aborted" in low
        or "error while fetching server api version" in low
    ):
        return f"no Docker engine answers at {_where()}: {_START_HINT}"
    return f"Docker engine at {_where()}: {text.splitlines()[0] if text else type(exc).__name__}"


def client(max_pool_size: int = 64) -> docker.DockerClient:
    """A client for an engine that answered a ping; ProvisionError otherwise.

    The pool is large because `up` talks to the engine from one thread per host."""
    try:
        c = docker.from_env(max_pool_size=max_pool_size, timeout=120)
        c.ping()
        return c
    except docker.errors.DockerException as e:
        raise ProvisionError(explain(e)) from None
    except PermissionError as e:
        raise ProvisionError(explain(e)) from None
    except Exception as e:  # requests' ConnectionError and friends
        raise ProvisionError(explain(e)) from None


def check_engine() -> docker.DockerClient:
    """Public name: raise ProvisionError with a one-line hint when no engine answers."""
    return client()
