"""Container pools on a real Docker engine: `provision sandbox up --with docker` hosts.

Each host runs Debian's dockerd (vfs storage, seccomp unconfined, /var/lib/docker on a
volume). The image the tasks run is a tiny busybox image made on this machine with
`docker import` (no registry is reachable): provision ships it to the hosts itself
(`docker save` into `docker load` over SSH) and, the image unchanged, never again.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time

import pytest

from clirun import cli, sh, wait_until
from provision import sandbox
from provision.host.taskenv import parse_env
from provision.sandbox import dockerlayer, engine

pytestmark = pytest.mark.integration

IMAGE_TAG = "1"
PORT = 24680
# Every character systemd, the shell or docker could take for syntax, and more than one line.
HOSTILE = "a \"b\" $c ${d} `e` \\f %g %% #h 'i' ; & | > <\nsecond line\ttab \u00e9\u4e2d \U0001f600 $$ end\\"

CHIEF = f"""
trap 'echo "chief got SIGTERM"; exit 143' TERM
echo "chief up"
while true; do
  echo hello-from-chief | nc -l -p {PORT} &
  wait $!
done
"""
WORKER = f"""
trap 'exit 143' TERM
for i in $(seq 1 60); do
  if echo ping | nc -w 2 "$PEER" {PORT} > /tmp/got 2>/dev/null && [ -s /tmp/got ]; then
    echo "worker got: $(cat /tmp/got)"; exit 0
  fi
  sleep 1
done
echo "worker: no answer from $PEER:{PORT}"; exit 3
"""


@pytest.fixture(scope="module")
def docker_hosts(sandbox_factory):
    sb = sandbox_factory(hosts=2, with_=("docker",))
    yield sb
    sandbox_factory.down(sb)


@pytest.fixture(scope="module")
def test_image(docker_hosts):
    return dockerlayer.ensure_test_image(engine.client(), docker_hosts.image, IMAGE_TAG)


def host_image_id(sb, host: str, ref: str) -> str:
    return sh(sb, host, f"docker image inspect --format '{{{{.Id}}}}' {ref} 2>/dev/null || echo missing").strip()


def container_environ(sb, host: str, container: str) -> dict[str, str]:
    """What the container's process sees: /proc/PID/environ, read from the host."""
    out = sh(
        sb, host, f"pid=$(docker inspect --format '{{{{.State.Pid}}}}' {container}); base64 -w0 /proc/$pid/environ"
    )
    if out.code != 0:  # not there yet (a restart replacing it): nothing to read, ask again
        return {}
    raw = base64.b64decode(out.strip())
    return dict(item.split("=", 1) for item in raw.decode("utf-8").split("\0") if item)


def test_docker_hosts_run_dockerd(docker_hosts):
    for h in docker_hosts.hosts:
        assert sh(docker_hosts, h.name, "systemctl is-active docker; docker info --format '{{.Driver}}'").split() == [
            "active",
            "vfs",
        ]


def test_container_job_on_a_real_engine(docker_hosts, test_image, tmp_path):
    """One job, walked through: ship, env, network, SIGTERM, leftover container, destroy."""
    sb = docker_hosts
    job = "ctr"
    h1, h2 = sb.hosts[0], sb.hosts[1]
    local_id = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", test_image], capture_output=True, text=True, check=True
    ).stdout.strip()
    for h in sb.hosts:
        sh(sb, h.name, f"docker image rm -f {test_image} >/dev/null 2>&1 || true")
    inv = sandbox.write_inventory(
        sb,
        tmp_path / "inv.yaml",
        job=job,
        pools={
            "chief": {"replicas": 1, "image": test_image, "args": ["sh", "-c", CHIEF], "env": {"HOSTILE": HOSTILE}},
            "worker": {"replicas": 1, "image": test_image, "args": ["sh", "-c", WORKER]},
        },
        env={"PEER": h1.cluster_address, "DOLLAR": "$$ $1 %% \\$ `x`", "EMPTY": ""},
    )
    # plan: the image is shipped to both hosts (the controller has it, they do not)
    p = cli("plan", inv, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count(f"+ image {test_image} (shipped from this machine, ") == 2, p.stdout
    t0 = time.monotonic()
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"apply with shipping: {time.monotonic() - t0:.1f} s\n{r.stderr}")
    assert f"shipped image {test_image}" in r.stderr
    for h in sb.hosts:
        assert host_image_id(sb, h.name, test_image) == local_id

    st = json.loads(cli("status", "--json", inv, cwd=tmp_path).stdout)
    where = {t["task"]: t["host"] for t in st["tasks"]}
    assert where == {"chief-0": h1.name, "worker-0": h2.name}  # one task a host: the network test crosses hosts
    chief_host = h1.name

    # env: what the container's process sees is what the inventory says, byte for byte
    chief_ctr = f"provision-{job}-chief-0"
    wait_until(lambda: "chief up" in cli("logs", inv, cwd=tmp_path).stdout, what="chief up")
    seen = container_environ(sb, chief_host, chief_ctr)
    env_file = dict(parse_env(sh(sb, chief_host, f"cat /etc/provision/{job}/chief-0.env")))
    assert seen["HOSTILE"] == HOSTILE
    assert seen["DOLLAR"] == "$$ $1 %% \\$ `x`" and seen["EMPTY"] == ""
    assert seen["PEER"] == h1.cluster_address
    for k, v in env_file.items():
        assert seen[k] == v, k

    # network: the worker reaches the chief through the chief host's address (--network host)
    def answered() -> str:
        out = cli("logs", inv, cwd=tmp_path).stdout
        return out if "worker got: hello-from-chief" in out else ""

    lg = wait_until(answered, what="the worker's answer")
    assert "worker got: hello-from-chief" in lg

    # a second apply ships nothing: the IDs match
    p2 = cli("plan", inv, cwd=tmp_path)
    assert "+ image" not in p2.stdout, p2.stdout

    # stop: SIGTERM reaches the container's process, its exit (143) is recorded
    sh(sb, chief_host, f"systemctl stop provision-{job}-chief-0.service")
    lg = cli("logs", inv, cwd=tmp_path).stdout
    assert "chief got SIGTERM" in lg, lg
    exit_rec = sh(sb, chief_host, f"docker ps -a --format '{{{{.Names}}}}' | grep -c {chief_ctr} || true").strip()
    assert exit_rec == "0"  # --rm: the container is gone
    st = cli("status", "--json", inv, cwd=tmp_path)
    chief = next(t for t in json.loads(st.stdout)["tasks"] if t["task"] == "chief-0")
    assert chief["exit_code"] == 143, chief  # the container's own exit status, through docker run

    # a leftover container of the same name does not block the restart
    sh(sb, chief_host, f"docker run -d --name {chief_ctr} --network none {test_image} sleep 600")
    r = cli("apply", "-y", "--replace", "chief-0", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "task chief-0: " in r.stdout, r.stdout
    try:
        wait_until(
            lambda: (
                sh(sb, chief_host, f"systemctl is-active provision-{job}-chief-0.service").strip() == "active"
                and container_environ(sb, chief_host, chief_ctr).get("HOSTILE") == HOSTILE
            ),
            what="the chief restarted in a new container",
        )
    except AssertionError:
        print(r.stdout, r.stderr, sh(sb, chief_host, f"systemctl status provision-{job}-chief-0; docker ps -a"))
        raise

    # destroy: no container left, the shipped image stays
    d = cli("destroy", "-y", inv, cwd=tmp_path)
    assert d.returncode == 0, d.stdout + d.stderr
    for h in sb.hosts:
        assert sh(sb, h.name, "docker ps -aq").strip() == "", sh(sb, h.name, "docker ps -a; journalctl -n 30")
        assert host_image_id(sb, h.name, test_image) == local_id


def test_destroy_remove_images_and_pull_when_the_controller_lacks_it(docker_hosts, test_image, tmp_path):
    """--remove-images removes the image; an image this machine lacks is pulled on the host
    (no registry here: the pull fails, the apply names it and starts nothing)."""
    sb = docker_hosts
    job = "ctr2"
    inv = sandbox.write_inventory(
        sb,
        tmp_path / "inv.yaml",
        job=job,
        pools={"chief": {"replicas": 1, "image": test_image, "args": ["sh", "-c", "echo ok"]}},
    )
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    d = cli("destroy", "-y", "--remove-images", inv, cwd=tmp_path)
    assert d.returncode == 0, d.stdout + d.stderr
    assert all(host_image_id(sb, h.name, test_image) == "missing" for h in sb.hosts[:1])

    missing = "127.0.0.1:9/provision-test/nothing:1"  # loopback: refused at once, no traffic out
    inv = sandbox.write_inventory(
        sb,
        tmp_path / "inv2.yaml",
        job=job,
        pools={"chief": {"replicas": 1, "image": missing, "args": ["sh", "-c", "echo ok"]}},
    )
    p = cli("plan", inv, cwd=tmp_path)
    assert f"+ image {missing} (pulled on the host" in p.stdout, p.stdout
    r = cli("apply", "-y", inv, cwd=tmp_path, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"image {missing}: this machine does not have it and `docker pull` on the host failed" in r.stderr
    for h in sb.hosts:
        assert sh(sb, h.name, f"ls /etc/systemd/system | grep -c provision-{job} || true").strip() == "0"


def test_an_image_rebuilt_here_is_shipped_again_and_restarts_its_task(docker_hosts, tmp_path):
    """The same name with another ID on this machine: shipped again (replacing the host's),
    and the task restarts in the new image."""
    sb = docker_hosts
    client = engine.client()
    one = dockerlayer.ensure_test_image(client, sb.image, "1")
    two = dockerlayer.ensure_test_image(client, sb.image, "2")
    ref = "provision-sandbox-busybox:moving"
    client.images.get(one).tag(ref)
    job = "ctr3"
    script = "echo \"image tag $(cat /tag)\"; trap 'exit 143' TERM; while true; do sleep 1 & wait $!; done"
    inv = sandbox.write_inventory(
        sb,
        tmp_path / "inv.yaml",
        job=job,
        pools={"chief": {"replicas": 1, "image": ref, "args": ["sh", "-c", script]}},
    )
    try:
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        wait_until(lambda: "image tag 1" in cli("logs", inv, cwd=tmp_path).stdout, what="the task in image 1")
        client.images.get(two).tag(ref)
        p = cli("plan", inv, cwd=tmp_path)
        assert f"+ image {ref} (shipped from this machine, 2 MB, replacing the host's older image)" in p.stdout, (
            p.stdout
        )
        assert "task chief-0: restart" in p.stdout, p.stdout
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        wait_until(lambda: "image tag 2" in cli("logs", inv, cwd=tmp_path).stdout, what="the task in image 2")
        assert "+ image" not in cli("plan", inv, cwd=tmp_path).stdout
        d = cli("destroy", "-y", "--remove-images", inv, cwd=tmp_path)
        assert d.returncode == 0, d.stdout + d.stderr
    finally:
        client.images.remove(ref)


def test_a_stopped_engine_is_named_by_plan_check_and_apply(docker_hosts, test_image, tmp_path):
    """item 14: with Docker stopped, check passed, plan showed "+ image shipped"
    and apply failed now and then as "Unreachable ... Socket is closed"."""
    sb = docker_hosts
    h = sb.hosts[0].name
    inv = sandbox.write_inventory(
        sb,
        tmp_path / "inv.yaml",
        job="ctrdown",
        pools={"chief": {"replicas": 1, "image": test_image, "args": ["sh", "-c", "echo ok"], "hosts": [h]}},
    )
    sh(sb, h, "systemctl stop docker.socket docker.service", check=True)
    try:
        why = "the Docker engine does not answer"
        p = cli("plan", inv, cwd=tmp_path)
        assert p.returncode == 1 and why in p.stderr and "+ image" not in p.stdout, p.stdout + p.stderr
        c = cli("check", "--skip-network", inv, cwd=tmp_path)
        assert c.returncode == 1 and why in c.stdout + c.stderr, c.stdout + c.stderr
        for _ in range(3):
            a = cli("apply", "-y", inv, cwd=tmp_path)
            assert a.returncode == 1 and why in a.stderr and "Unreachable" not in a.stderr, a.stdout + a.stderr
    finally:
        sh(sb, h, "systemctl start docker.socket docker.service", check=True)
        cli("destroy", "-y", inv, cwd=tmp_path)
