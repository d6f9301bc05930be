"""Shared fixtures: real test hosts (Docker containers with systemd and sshd) for integration tests.

    def test_something(sandbox4, sandbox_inventory, tmp_path):
        inv = sandbox_inventory(sandbox4, job="t1", pools={"chief": {...}}, path=tmp_path / "inv.yaml")
        with sandbox4.connection("host-1") as c:
            c.run("nvidia-smi -L")

    def test_other(sandbox_factory):
        sb = sandbox_factory(hosts=2, gpus_per_host=0, with_=("torch",))

Any test that uses these fixtures (or carries the `integration` marker) needs a Docker engine:
without one it is skipped with the reason, except when $CI is set, where it fails instead,
because integration tests must never be skipped in CI. Every sandbox the fixtures start is
removed at the end of the session; sandboxes left by killed earlier runs are removed at the
start.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import pytest

SANDBOX_FIXTURES = {"docker_engine", "sandbox_factory", "sandbox4", "sandbox3", "sandbox_frameworks"}
_TEST_NAME = re.compile(r"^pt(\d+)-")
# The host tests of the second xdist lane: modules that start their own sandboxes (or
# sandbox3, started again in that worker) and assert no tight timings, so they may run
# beside the first lane's. The first lane held ~30 of the ~35 minutes of host tests (CI, 2
# cores) while the other worker idled after the ~4.5 minutes of tests without hosts; the dev
# sessions', dashboards' and health's modules (~11 minutes, their own hosts) moved here.
SECOND_LANE = {
    "test_check",
    "test_containers",
    "test_dashboard",
    "test_dashboard_history",
    "test_dev",
    "test_health",
    "test_docs_examples",
    "test_hostile",
    "test_probe",
    "test_provenance",
    "test_setup_shared",
    "test_tpu",
    "test_trust",
    "test_tune_example",
    "test_upgrade",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads xdist_group to group the tests
def pytest_collection_modifyitems(config, items):
    # Tests that get real hosts are integration tests even without the explicit marker, so
    # `-m "not integration"` leaves them out.
    # Under xdist (scripts/test.sh: -n 2 --dist loadgroup) they run in two lanes, one per
    # worker, each lane's modules one after another as without xdist (they share hosts and
    # load the machine): SECOND_LANE beside the rest of the suite, the others in the first.
    for item in items:
        if SANDBOX_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("integration"):
            lane = "hosts-b" if item.module.__name__.rsplit(".", 1)[-1] in SECOND_LANE else "hosts"
            item.add_marker(pytest.mark.xdist_group(lane))


@pytest.fixture(scope="session")
def docker_engine():
    """A docker SDK client for an engine that answers; skip (fail under CI) otherwise."""
    from provision import sandbox
    from provision.core.errors import ProvisionError

    try:
        return sandbox.check_engine()
    except ProvisionError as e:
        reason = f"needs a Docker engine: {e.message}"
        if in_ci():
            pytest.fail(f"{reason} (CI is set: integration tests must run, not skip)", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _integration_needs_docker(request):
    if request.node.get_closest_marker("integration"):
        request.getfixturevalue("docker_engine")


class SandboxFactory:
    """Starts sandboxes with names unique to this process (and xdist worker)."""

    def __init__(self, client):
        self.client = client
        self.started: list[str] = []
        self._n = itertools.count(1)

    def unique_name(self) -> str:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "m").lower()
        return f"pt{os.getpid()}-{worker}-{next(self._n)}"

    def __call__(self, hosts: int = 3, gpus_per_host: int = 0, with_=(), *, name=None, **kwargs):
        from provision import sandbox

        name = name or self.unique_name()
        self.started.append(name)  # up() removes a half-started sandbox itself
        return sandbox.up(
            name, hosts=hosts, gpus_per_host=gpus_per_host, with_=tuple(with_), client=self.client, **kwargs
        )

    def down(self, sb_or_name) -> None:
        from provision import sandbox

        name = getattr(sb_or_name, "name", sb_or_name)
        sandbox.down(name, client=self.client)
        if name in self.started:
            self.started.remove(name)

    def down_all(self) -> None:
        from provision import sandbox

        for name in reversed(self.started):
            try:
                sandbox.down(name, client=self.client)
            except Exception as e:  # noqa: BLE001 - clean up the others all the same
                print(f"sandbox {name}: teardown failed: {e}")
        self.started.clear()


def _reap_stale_test_sandboxes(client) -> None:
    """Sandboxes named pt<pid>-... whose process is gone were left by a killed test run."""
    from provision import sandbox

    for s in sandbox.list_sandboxes(client):
        m = _TEST_NAME.match(s.name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            sandbox.down(s.name, client=client)
        except PermissionError:
            pass  # alive, someone else's


@pytest.fixture(scope="session")
def sandbox_factory(docker_engine):
    """`sandbox_factory(hosts=N, gpus_per_host=G, with_=())` -> provision.sandbox.Sandbox."""
    _reap_stale_test_sandboxes(docker_engine)
    factory = SandboxFactory(docker_engine)
    yield factory
    factory.down_all()


@pytest.fixture(scope="session")
def sandbox4(sandbox_factory):
    """4 hosts with 2 fake GPUs each, shared by the whole session: use your own job name."""
    return sandbox_factory(hosts=4, gpus_per_host=2)


@pytest.fixture(scope="session")
def sandbox3(sandbox_factory):
    """3 hosts without GPUs, shared by the whole session, as sandbox4: use job names of your
    own, destroy your jobs and put back what you change on a host: one start and removal
    instead of one per module that uses it. Fewer hosts:
    `dataclasses.replace(sandbox3, hosts=sandbox3.hosts[:2])` (inventories list those)."""
    return sandbox_factory(hosts=3)


@pytest.fixture(scope="session")
def sandbox_frameworks(sandbox_factory):
    """3 hosts without GPUs, with the tensorflow and torch layers, shared by the session:
    test_jobs.py's example jobs and test_sandbox.py's imports (one start instead of three)."""
    return sandbox_factory(hosts=3, with_=("tensorflow", "torch"))


@pytest.fixture(scope="session")
def sandbox_inventory():
    """`sandbox_inventory(sb, job="t1", pools={...}, path=None, **extra)` -> inventory dict.

    With `path`, the inventory is also written there as YAML. `extra` adds top-level keys
    (env, files, tf_config, success, ...); `hosts=[names]` limits the hosts listed."""
    from provision import sandbox

    def make(sb, job: str = "t", pools: dict | None = None, path: str | Path | None = None, **extra):
        inv = sandbox.inventory_dict(sb, job=job, pools=pools, **extra)
        if path is not None:
            from provision.sandbox.inventory import dump

            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(dump(inv, sb))
        return inv

    return make


@pytest.fixture
def job_name(request) -> str:
    """A job name (DNS-1035 label, <= 40 chars) unique to the test: for tests sharing sandbox4."""
    base = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")
    base = re.sub(r"^[^a-z]+", "", base.removeprefix("test-")) or "job"
    suffix = f"-{os.getpid() % 100000}"
    return base[: 40 - len(suffix)].rstrip("-") + suffix


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server on loopback for the session (tests/pgserver.py): skipped
    without Debian's postgresql, except under CI, where it fails (scripts/setup.sh installs it)."""
    from pgserver import bindir, start_server

    if bindir() is None:
        reason = "needs Debian's postgresql (scripts/setup.sh installs it)"
        if in_ci():
            pytest.fail(f"{reason} (CI is set: these tests must run)", pytrace=False)
        pytest.skip(reason)
    server = start_server()
    yield server
    server.cleanup()
