"""The sandbox: real Debian hosts (systemd, journald, sshd) as Docker containers.

The first block needs no Docker (recipe, mirror, nvidia-smi stand-in, inventory, errors);
the rest starts real hosts.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from provision import sandbox
from provision.cli.app import main
from provision.core.errors import ProvisionError
from provision.sandbox import core, image

NVIDIA_SMI = (
    Path(sandbox.__file__).resolve().parent.parent / "hostimage/rootfs/usr/lib/provision-sandbox/nvidia-smi-standin"
)
QUERY = ["--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]
CSV_LINE = re.compile(
    r"^(?P<index>\d+), GPU-(?P<uuid>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}),"
    r" NVIDIA H100 80GB HBM3, 81559$"
)


def _gpus_from_csv(text: str) -> list[tuple[int, str]]:
    lines = text.rstrip("\n").split("\n")
    out = []
    for line in lines:
        m = CSV_LINE.match(line)
        assert m, f"not nvidia-smi's CSV format: {line!r}"
        assert uuid.UUID(m["uuid"]).version == 5  # uuid5 of the host and index, as written by hand there
        out.append((int(m["index"]), f"GPU-{m['uuid']}"))
    return out


# ----------------------------------------------------------------------------- no Docker


def _run_standin(args, gpus, host="h1"):
    env = dict(os.environ, PROVISION_SANDBOX_GPUS=str(gpus), PROVISION_SANDBOX_HOSTNAME=host)
    return subprocess.run([sys.executable, str(NVIDIA_SMI), *args], env=env, capture_output=True, text=True)


def test_nvidia_smi_standin_prints_the_real_csv_format():
    r = _run_standin(QUERY, 2)
    assert r.returncode == 0, r.stdout + r.stderr
    gpus = _gpus_from_csv(r.stdout)
    assert [i for i, _ in gpus] == [0, 1]
    assert _gpus_from_csv(_run_standin(QUERY, 2).stdout) == gpus  # stable per host
    assert _gpus_from_csv(_run_standin(QUERY, 2, host="h2").stdout) != gpus  # differ by host
    listing = _run_standin(["-L"], 2).stdout.splitlines()
    assert listing == [f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: {u})" for i, u in gpus]
    with_header = _run_standin(["--query-gpu=index,memory.total", "--format=csv"], 1).stdout
    assert with_header == "index, memory.total [MiB]\n0, 81559 MiB\n"


def test_nvidia_smi_standin_without_gpus_says_no_devices():
    r = _run_standin(QUERY, 0)
    assert (r.returncode, r.stdout) == (9, "No devices were found\n")


def test_recipe_hash_follows_the_assets(tmp_path):
    import shutil

    copy = tmp_path / "hostimage"
    shutil.copytree(image.ASSETS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert image.recipe(copy).tag == image.recipe().tag
    with open(copy / "packages.txt", "a") as f:
        f.write("less\n")
    assert image.recipe(copy).tag != image.recipe().tag
    assert image.recipe(copy).packages[-1] == "less"


def test_debian_mirror_comes_from_apt_configuration(tmp_path, monkeypatch):
    monkeypatch.delenv(image.MIRROR_ENV, raising=False)
    apt = tmp_path / "etc/apt"
    (apt / "sources.list.d").mkdir(parents=True)
    (apt / "sources.list.d/debian.sources").write_text(
        "Types: deb\n# URIs: http://commented.invalid/debian\nURIs: http://mirror.invalid/debian/\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://security.invalid/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n"
    )
    (apt / "sources.list.d/other.list").write_text("deb [arch=amd64] https://x.invalid/apt nodistro main\n")
    (apt / "sources.list.d/off.list.disabled").write_text("deb http://disabled.invalid/debian bookworm main\n")
    assert image.debian_mirror(tmp_path) == "http://mirror.invalid/debian"
    # A controller on another Debian release: its archive serves bookworm too.
    (apt / "sources.list.d/debian.sources").unlink()
    (apt / "sources.list").write_text("deb http://trixie-mirror.invalid/debian trixie main\n")
    assert image.debian_mirror(tmp_path) == "http://trixie-mirror.invalid/debian"
    monkeypatch.setenv(image.MIRROR_ENV, "http://override.invalid/debian/")
    assert image.debian_mirror(tmp_path) == "http://override.invalid/debian"
    monkeypatch.delenv(image.MIRROR_ENV)
    (apt / "sources.list").unlink()
    with pytest.raises(ProvisionError, match=image.MIRROR_ENV):
        image.debian_mirror(tmp_path)


def _fake_sandbox(tmp_path, gpus=2, hosts=3) -> sandbox.Sandbox:
    return sandbox.Sandbox(
        name="fake",
        network="provision-sandbox-fake",
        key_path=tmp_path / "id_ed25519",
        known_hosts_path=tmp_path / "known_hosts",
        hosts=[
            sandbox.SandboxHost(f"host-{i}", f"fake-host-{i}", 40000 + i, f"fake-host-{i}", gpus)
            for i in range(1, hosts + 1)
        ],
    )


def test_inventory_for_a_sandbox_validates(tmp_path):
    sb = _fake_sandbox(tmp_path)
    (tmp_path / "id_ed25519").write_text("not a real key\n")
    inv = sandbox.inventory_dict(sb, job="t1", pools=sandbox.example_pools(sb), env={"A": "1"})
    assert inv["ssh"] == {
        "user": "root",
        "identity_file": str(sb.key_path),
        "host_key_policy": "accept-new",
        "connect_timeout": 10,
    }
    assert inv["hosts"][1] == {
        "name": "host-2",
        "address": "127.0.0.1",
        "port": 40002,
        "cluster_address": "fake-host-2",
        "accelerators": {"type": "nvidia-h100", "count": 2},
    }
    assert inv["pools"]["worker"]["replicas"] == 2 and inv["env"] == {"A": "1"}
    assert "accelerators" not in sandbox.inventory_dict(_fake_sandbox(tmp_path, gpus=0))["hosts"][0]
    path = sandbox.write_inventory(sb, tmp_path / "inv.yaml", job="t1", pools=sandbox.example_pools(sb))
    assert yaml.safe_load(path.read_text())["hosts"] == inv["hosts"]
    r = CliRunner().invoke(main, ["validate", str(path)])
    assert r.exit_code == 0, r.output


def test_cli_errors_are_one_line_without_docker(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/provision-test.sock")
    r = CliRunner().invoke(main, ["sandbox", "list"])
    assert r.exit_code == 1
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert r.output.startswith("Error: no Docker engine answers at unix:///nonexistent/"), r.output
    from provision.sandbox.engine import explain

    denied = (
        "Error while fetching server API version: ('Connection aborted.', PermissionError(13, 'Permission denied'))"
    )
    assert explain(Exception(denied)).startswith("no permission to use the Docker engine")
    r = CliRunner().invoke(main, ["sandbox", "up", "--name", "Bad_Name"])
    assert r.exit_code == 1 and r.output.startswith("Error: sandbox name 'Bad_Name'"), r.output
    assert "Traceback" not in r.output


# ----------------------------------------------------------------------------- real hosts


@pytest.mark.integration
def test_image_build_failure_names_its_log(docker_engine, tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("building the host image needs root")
    monkeypatch.setenv("PROVISION_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(image.MIRROR_ENV, f"file://{tmp_path}/no-mirror-here")
    with pytest.raises(ProvisionError) as err:
        sandbox.ensure_image(docker_engine, rebuild=True)
    msg = err.value.message
    assert msg.startswith("building the sandbox host image failed: debootstrap exited")
    log = Path(msg.rsplit("full log: ", 1)[1])
    assert log.is_file() and log.parent == tmp_path / "logs"
    assert not list((tmp_path / "build").iterdir())  # the half-built tree is gone


@pytest.mark.integration
def test_fabric_runs_a_command_on_every_host(sandbox3):
    for h in sandbox3.hosts:
        with sandbox3.connection(h) as c:
            r = c.run("hostname; systemctl is-system-running; ps -p 1 -o comm=", hide=True, warn=True)
        name, state, pid1 = r.stdout.split()
        assert name == h.container
        assert state in ("running", "degraded")
        assert pid1 == "systemd"


@pytest.mark.integration
def test_host_reaches_another_by_its_cluster_address(sandbox3):
    h2 = sandbox3.host("host-2")
    probe = (
        "import socket; s = socket.create_connection(('%s', 22), timeout=5); "
        "print(s.recv(64).decode().strip())" % h2.cluster_address
    )
    with sandbox3.connection("host-1") as c:
        assert h2.cluster_address in c.run(f"getent hosts {h2.cluster_address}", hide=True).stdout
        banner = c.run(f'python3 -c "{probe}"', hide=True).stdout
    assert banner.startswith("SSH-2.0-OpenSSH")


@pytest.mark.integration
def test_transient_unit_output_lands_in_journald(sandbox3):
    unit = f"provision-test-{uuid.uuid4().hex[:8]}"
    marker = f"hello from {unit}"
    with sandbox3.connection("host-3") as c:
        c.run(f"systemd-run --unit={unit} --wait --quiet /bin/sh -c 'echo \"{marker}\"'", hide=True)
        out = c.run(f"journalctl -u {unit} -o cat --no-pager", hide=True).stdout
    assert marker in out.splitlines()


@pytest.mark.integration
def test_each_host_has_its_own_identity(sandbox3):
    keys = [line.split()[2] for line in sandbox3.known_hosts_path.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 3
    ids = {sandbox3.docker_exec(h, "cat /etc/machine-id")[1].strip() for h in sandbox3.hosts}
    assert len(ids) == 3


@pytest.mark.integration
def test_host_without_gpus_has_no_devices(sandbox3):
    with sandbox3.connection("host-1") as c:
        r = c.run("nvidia-smi " + " ".join(QUERY), hide=True, warn=True)
    assert (r.exited, r.stdout) == (9, "No devices were found\n")


@pytest.mark.integration
def test_fake_gpus_match_the_real_nvidia_smi_format(sandbox4):
    seen = set()
    for h in sandbox4.hosts:
        with sandbox4.connection(h) as c:
            out = c.run("nvidia-smi " + " ".join(QUERY), hide=True).stdout
            again = c.run("nvidia-smi " + " ".join(QUERY), hide=True).stdout
        gpus = _gpus_from_csv(out)
        assert [i for i, _ in gpus] == [0, 1]
        assert again == out
        seen.update(u for _, u in gpus)
    assert len(seen) == 2 * len(sandbox4.hosts)  # UUIDs are unique across hosts


@pytest.mark.integration
def test_nvidia_smi_replays_an_answer_only_while_no_fault_is_newer(sandbox4):
    """The front end (usr/bin/nvidia-smi) replays the program's last answer; a fault written,
    changed in place or removed right after a call is seen by the next call, never hidden."""
    h = sandbox4.hosts[0]
    ecc = ["--query-gpu=index,ecc.errors.uncorrected.volatile.total", "--format=csv,noheader,nounits"]

    def ask(*setup: str) -> str:
        script = "; ".join((*setup, "nvidia-smi " + " ".join(ecc)))
        code, out = sandbox4.docker_exec(h, ["sh", "-c", script])
        assert code == 0, out
        return out

    try:
        first = ask("rm -rf /run/provision-sandbox")
        assert first == "0, 0\n1, 0\n"
        assert sandbox4.docker_exec(h, ["ls", "/run/provision-sandbox/nvidia-smi"])[1].strip(), "no answer kept"
        # A replay: the program is made to fail, the kept answer still comes back.
        code, out = sandbox4.docker_exec(
            h, ["sh", "-c", "chmod -x /usr/lib/provision-sandbox/nvidia-smi-standin; nvidia-smi " + " ".join(ecc)]
        )
        assert (code, out) == (0, first)
        sandbox4.docker_exec(h, ["chmod", "+x", "/usr/lib/provision-sandbox/nvidia-smi-standin"])
        assert ask("echo 1 3 > /etc/provision-sandbox/ecc-errors") == "0, 0\n1, 3\n"  # a new file
        assert ask("echo 0 > /etc/provision-sandbox/ecc-errors") == "0, 1\n1, 0\n"  # changed in place
        assert ask("rm /etc/provision-sandbox/ecc-errors") == first  # removed
        # The environment's overrides are the program's to answer, never replayed.
        assert ask("export PROVISION_SANDBOX_GPUS=1") == "0, 0\n"
        # DCGM absent: a missing command's answer, from the front end alone.
        code, out = sandbox4.docker_exec(h, ["sh", "-c", "dcgmi health -c; echo exit $?"])
        assert "exit 127" in out.splitlines() and "sh: 1: dcgmi: not found" in out.splitlines(), out
    finally:
        sandbox4.docker_exec(
            h,
            [
                "sh",
                "-c",
                "chmod +x /usr/lib/provision-sandbox/nvidia-smi-standin; rm -f /etc/provision-sandbox/ecc-errors",
            ],
        )


@pytest.mark.integration
def test_inventory_fixture_describes_the_hosts(sandbox4, sandbox_inventory, tmp_path):
    inv = sandbox_inventory(
        sandbox4, job="t1", pools={"chief": {"replicas": 1, "command": ["true"]}}, path=tmp_path / "inv.yaml"
    )
    assert [h["port"] for h in inv["hosts"]] == [h.ssh_port for h in sandbox4.hosts]
    assert all(h["accelerators"] == {"type": "nvidia-h100", "count": 2} for h in inv["hosts"])
    assert yaml.safe_load((tmp_path / "inv.yaml").read_text()) == inv
    assert sandbox.load(sandbox4.name).to_dict() == sandbox4.to_dict()  # from metadata on disk


def _leftovers(client, name):
    containers = client.containers.list(all=True, filters={"label": f"{sandbox.LABEL}={name}"})
    networks = client.networks.list(filters={"label": f"{sandbox.LABEL}={name}"})
    from provision.sandbox._paths import sandbox_dir

    return len(containers), len(networks), sandbox_dir(name).exists()


@pytest.mark.integration
def test_cli_up_then_down_leaves_nothing_behind(sandbox_factory, docker_engine, tmp_path):
    name = sandbox_factory.unique_name()
    inv_path = tmp_path / "inv.yaml"
    runner = CliRunner()
    try:
        r = runner.invoke(main, ["sandbox", "up", "--hosts", "3", "--name", name, "-o", str(inv_path)])
        assert r.exit_code == 0, r.output
        inv = yaml.safe_load(inv_path.read_text())
        assert [h["cluster_address"] for h in inv["hosts"]] == [f"{name}-host-{i}" for i in (1, 2, 3)]
        assert inv["pools"]["chief"]["command"] == ["/bin/sh", "-c", "echo $TF_CONFIG; sleep 5"]
        assert _leftovers(docker_engine, name) == (3, 1, True)
        key = Path(inv["ssh"]["identity_file"])
        assert key.exists()
        r = runner.invoke(main, ["sandbox", "list"])
        assert r.exit_code == 0 and name in r.output
        # A key an earlier sandbox left for the same address must not make apply refuse.
        from provision.cli.sandboxcmd import _refresh_known_hosts

        kh = tmp_path / ".provision/known_hosts"
        kh.parent.mkdir()
        port = inv["hosts"][0]["port"]
        kh.write_text(f"[127.0.0.1]:{port} ssh-ed25519 AAAAstale\nother.example ssh-ed25519 AAAAkeep\n")
        _refresh_known_hosts(inv_path, sandbox.load(name))
        text = kh.read_text()
        assert "AAAAstale" not in text and "other.example ssh-ed25519 AAAAkeep" in text
        assert text.count("[127.0.0.1]:") == 3
        r = runner.invoke(main, ["sandbox", "down", "--name", name])
        assert r.exit_code == 0, r.output
        assert _leftovers(docker_engine, name) == (0, 0, False)
        assert not key.exists()
    finally:
        sandbox.down(name, client=docker_engine)


@pytest.mark.integration
def test_up_cleans_up_when_the_port_is_taken(sandbox_factory, docker_engine):
    name = sandbox_factory.unique_name()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ProvisionError, match=f"127.0.0.1:{port} is in use"):
            sandbox.up(name, hosts=2, ssh_port=port, client=docker_engine)
    assert _leftovers(docker_engine, name) == (0, 0, False)


@pytest.mark.integration
def test_up_cleans_up_when_interrupted(sandbox_factory, docker_engine, monkeypatch):
    name = sandbox_factory.unique_name()

    def interrupted(*args, **kwargs):
        assert _leftovers(docker_engine, name)[0] >= 1  # a container exists by now
        raise KeyboardInterrupt

    monkeypatch.setattr(core, "wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sandbox.up(name, hosts=2, client=docker_engine)
    assert _leftovers(docker_engine, name) == (0, 0, False)


@pytest.mark.integration
def test_torch_layer_is_importable_on_the_host(sandbox_frameworks):
    with sandbox_frameworks.connection("host-1") as c:
        out = c.run('python3 -c "import torch; print(torch.__version__)"', hide=True).stdout
    assert out.strip().startswith("2.13.0")


@pytest.mark.integration
@pytest.mark.timeout(1200)  # first run installs tensorflow-cpu (274 MB) into the cache
def test_tensorflow_layer_is_importable_on_the_host(sandbox_frameworks):
    # One host, one import: TensorFlow is slow to import, so this runs once per session.
    with sandbox_frameworks.connection("host-1") as c:
        out = c.run('python3 -c "import tensorflow as tf; print(tf.__version__)"', hide=True).stdout
    assert out.strip().splitlines()[-1] == "2.21.0"


def test_the_demo_never_removes_a_sandbox_it_did_not_make(sandbox_factory, tmp_path):
    """item 13: scripts/demo.sh removed any sandbox called `demo`, another user's
    included. It removes only one it made (its marker in its directory), else refuses."""
    sb = sandbox_factory(hosts=1)
    demo = Path(__file__).resolve().parents[2] / "scripts" / "demo.sh"
    env = {**os.environ, "PROVISION_DEMO_NAME": sb.name, "PROVISION_DEMO_DIR": str(tmp_path / "demo")}
    r = subprocess.run(["bash", str(demo)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"a sandbox named '{sb.name}' exists and this demo did not make it" in r.stderr
    assert (
        sb.name
        in subprocess.run([sys.executable, "-m", "provision", "sandbox", "list"], capture_output=True, text=True).stdout
    )  # still there
    sandbox_factory.down(sb)
