"""render.py: what each host gets, read back the way systemd reads it.

Env files are read with test_encode's port of systemd's EnvironmentFile= parser and must
give exactly `clusterenv.task_env`; ExecStart= lines are read with its port of the
ExecStart= parser and must give exactly the pool's command (or the docker command line).
Plus: modes, manifest, restart policies, secrets, pushed files, restart inputs, determinism.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import yaml

from provision.host import layout
from provision.inventory.inventory import parse
from provision.render.clusterenv import job_cluster, task_env
from provision.render.files import earlier_units, render, write_tree

_spec = importlib.util.spec_from_file_location("_provision_test_encode", Path(__file__).with_name("test_encode.py"))
_ports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ports)  # type: ignore[union-attr]
parse_env_file, parse_exec, HOSTILE = _ports.parse_env_file, _ports.parse_exec, _ports.HOSTILE

BASE = """
job: rtest
hosts:
  - {name: gpu-1, address: 192.0.2.11, accelerators: {type: nvidia-h100, count: 4}}
  - {name: gpu-2, address: 192.0.2.12, accelerators: {type: nvidia-h100, count: 4}}
  - {name: cpu-1, address: 192.0.2.21}
  - {name: idle, address: 192.0.2.99, labels: {spare: "yes"}}
pools:
  chief: {replicas: 1, accelerators: 2, command: [/opt/venv/bin/python, /opt/job/train.py], restart: {policy: OnFailure, limit: 3}}
  worker: {replicas: 2, accelerators: 2, command: [/opt/venv/bin/python, /opt/job/train.py], restart: {policy: ExitCode, limit: 2}}
  ps: {replicas: 1, hosts: [cpu-1], command: [/opt/venv/bin/python, /opt/job/train.py], restart: {policy: Always, limit: 5}}
  evaluator: {replicas: 1, hosts: [cpu-1], command: [/opt/venv/bin/python, /opt/job/train.py]}
env: {NCCL_DEBUG: WARN}
secret_env: [API_TOKEN]
"""


def inv_from(text: str, tmp_path: Path):
    p = tmp_path / "inventory.yaml"
    p.write_text(text)
    return parse(text, p)


def yaml_str(s: str) -> str:
    """A YAML double-quoted scalar holding exactly `s`."""
    out = yaml.safe_dump(s, default_style='"', width=1 << 30, allow_unicode=True)
    return out.removesuffix("\n").removesuffix("\n...")


def files_of(rendered, host: str) -> dict[str, object]:
    return {f.path: f for f in rendered.hosts[host].files}


def exec_start(unit_text: str) -> list[str]:
    (line,) = [ln for ln in unit_text.splitlines() if ln.startswith("ExecStart=")]
    return parse_exec(line[len("ExecStart=") :])


def directives(unit_text: str) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in unit_text.splitlines() if "=" in ln and not ln.startswith("#"))


# --------------------------------------------------------------------------- values read back


def test_env_files_read_back_exactly(tmp_path):
    env = "\n".join(f"  H{i}: {yaml_str(v)}" for i, v in enumerate(HOSTILE))
    text = BASE.replace("env: {NCCL_DEBUG: WARN}", "env:\n" + env)
    inv = inv_from(text, tmp_path)
    secrets = {"API_TOKEN": 'tok"en$\n`x`\\'}
    r = render(inv, secrets=secrets)
    jc = job_cluster(inv, r.placement)
    seen = 0
    for bundle in r.hosts.values():
        for u in bundle.tasks:
            f = files_of(r, bundle.host.name)[u.env_path]
            got = parse_env_file(f.data().decode())
            want = task_env(inv, u.task, jc, secrets=secrets)
            assert got == want, u.task.name
            assert f.secret
            seen += 1
    assert seen == len(r.placement.tasks) == 5


def test_exec_start_reads_back_exactly(tmp_path):
    args = [a for a in HOSTILE] + [";", "%h", "$HOME", ""]
    cmd = "[/opt/venv/bin/python, " + ", ".join(yaml_str(a) for a in args) + "]"
    inv = inv_from(
        BASE.replace(
            "chief: {replicas: 1, accelerators: 2, command: [/opt/venv/bin/python, /opt/job/train.py]",
            f"chief: {{replicas: 1, accelerators: 2, command: {cmd}",
        ),
        tmp_path,
    )
    r = render(inv)
    unit = files_of(r, "gpu-1")["/etc/systemd/system/provision-rtest-chief-0.service"].data().decode()
    assert exec_start(unit) == ["/opt/venv/bin/python", *args]
    # no argument may add a line (a directive) to the unit
    assert sum(1 for ln in unit.splitlines() if ln.startswith("ExecStart=")) == 1


def test_image_pool_runs_docker_with_env_names_only(tmp_path):
    inv = inv_from(
        BASE.replace(
            "worker: {replicas: 2, accelerators: 2, command: [/opt/venv/bin/python, /opt/job/train.py],",
            "worker: {replicas: 2, accelerators: 2, image: registry.local/trainer:1.4, args: [--epochs, '3', '$X y'],",
        ),
        tmp_path,
    )
    r = render(inv, secrets={"API_TOKEN": "t"})
    jc = job_cluster(inv, r.placement)
    w = r.placement.task("worker-0")
    unit = files_of(r, w.host.name)["/etc/systemd/system/provision-rtest-worker-0.service"].data().decode()
    argv = exec_start(unit)
    names = [k for k, _ in task_env(inv, w, jc, secrets={"API_TOKEN": "t"})]
    want = [
        "/usr/bin/docker",
        "run",
        "--rm",
        "--name",
        "provision-rtest-worker-0",
        "--network",
        "host",
        "--gpus",
        '"device=' + ",".join(map(str, w.accelerators)) + '"',
    ]
    for k in names:
        want += ["-e", k]
    want += ["registry.local/trainer:1.4", "--epochs", "3", "$X y"]
    assert argv == want
    assert "t" not in argv  # values never on the command line (they would show in ps)
    assert "ExecStartPre=-/usr/bin/docker rm -f provision-rtest-worker-0" in unit


# --------------------------------------------------------------------------- units, modes, manifest


def test_restart_policies(tmp_path):
    r = render(inv_from(BASE, tmp_path))
    units = {}
    for b in r.hosts.values():
        for u in b.tasks:
            units[u.task.role] = directives(files_of(r, b.host.name)[u.unit_path].data().decode())
    assert (units["chief"]["Restart"], units["chief"]["StartLimitBurst"]) == ("on-failure", "4")
    assert "RestartPreventExitStatus" not in units["chief"]
    assert units["worker"]["Restart"] == "on-failure"
    assert units["worker"]["RestartPreventExitStatus"].split() == [str(i) for i in range(1, 128)]
    assert (units["ps"]["Restart"], units["ps"]["StartLimitBurst"]) == ("always", "6")
    assert units["evaluator"]["Restart"] == "no" and units["evaluator"]["StartLimitIntervalSec"] == "0"
    assert units["chief"]["LimitMEMLOCK"] == "infinity" and "LimitMEMLOCK" not in units["ps"]
    for d in units.values():
        assert d["EnvironmentFile"].startswith("/etc/provision/rtest/")
        assert d["PartOf"] == d["WantedBy"] == "provision-rtest.target"
        assert d["Type"] == "exec"


def test_layout_modes_and_manifest(tmp_path):
    r = render(inv_from(BASE, tmp_path))
    assert "idle" not in r.hosts  # a host without tasks gets nothing
    for name, b in r.hosts.items():
        files = files_of(r, name)
        for path, f in files.items():
            want_mode = {"env": 0o600, "manifest": 0o600, "unit": 0o644, "target": 0o644}[f.kind]
            assert f.mode == want_mode, path
        target = files["/etc/systemd/system/provision-rtest.target"].data().decode()
        assert b.tasks and all(t.task.name in target for t in b.tasks)
        manifest = json.loads(files["/etc/provision/rtest/manifest.json"].data())
        assert manifest["job"] == "rtest" and manifest["host"] == name
        assert set(manifest["tasks"]) == {u.task.name for u in b.tasks}
        # the manifest lists every other file with its digest and mode
        assert set(manifest["files"]) == set(files) - {"/etc/provision/rtest/manifest.json"}
        for path, meta in manifest["files"].items():
            assert (meta["sha256"], meta["mode"]) == (files[path].sha256, files[path].mode)


def test_deterministic(tmp_path):
    a = render(inv_from(BASE, tmp_path))
    b = render(inv_from(BASE, tmp_path))
    assert {h: [(f.path, f.data()) for f in x.files] for h, x in a.hosts.items()} == {
        h: [(f.path, f.data()) for f in x.files] for h, x in b.hosts.items()
    }


def test_secrets_left_out_offline(tmp_path):
    r = render(inv_from(BASE, tmp_path))
    for b in r.hosts.values():
        for f in b.files:
            if f.kind == "env":
                assert "API_TOKEN" not in f.data().decode()
                assert not f.secret


# --------------------------------------------------------------------------- pushed files, restart inputs


def test_pushed_files(tmp_path):
    src = tmp_path / "job"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / "train.py").write_text("print(1)\n")
    (src / "pkg" / "m.py").write_text("x = 1\n")
    (src / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0")
    (src / "pkg" / "stale.pyc").write_bytes(b"\0")
    (src / ".git" / "HEAD").write_text("ref\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o755)
    (tmp_path / "cfg.json").write_text("{}")
    inv = inv_from(
        BASE + "files:\n  - {src: job/, dest: /opt/job/}\n  - {src: cfg.json, dest: /etc/rtest.json}\n", tmp_path
    )
    r = render(inv)
    for name in r.hosts:
        pushed = {p: f for p, f in files_of(r, name).items() if f.kind == "file"}
        assert {p: f.mode for p, f in pushed.items()} == {
            "/opt/job/train.py": 0o644,
            "/opt/job/pkg/m.py": 0o644,
            "/opt/job/run.sh": 0o755,
            "/etc/rtest.json": 0o644,
        }
        assert pushed["/opt/job/pkg/m.py"].data() == b"x = 1\n"
    out = tmp_path / "out"
    count = write_tree(r, out)
    assert count == sum(len(b.files) for b in r.hosts.values())
    assert (out / "cpu-1/opt/job/run.sh").stat().st_mode & 0o777 == 0o755
    assert (out / "cpu-1/etc/provision/rtest/ps-0.env").stat().st_mode & 0o777 == 0o600


def _inputs(r) -> dict[str, str]:
    return {u.task.name: u.inputs for b in r.hosts.values() for u in b.tasks}


def test_restart_inputs(tmp_path):
    """`inputs` decides restarts: it changes for exactly the tasks whose own environment,
    unit or pushed files change."""
    (tmp_path / "train.py").write_text("v1\n")
    files = "files:\n  - {src: train.py, dest: /opt/job/train.py}\n"
    base = _inputs(render(inv_from(BASE + files, tmp_path)))
    assert _inputs(render(inv_from(BASE + files, tmp_path))) == base

    # a pool's env: that pool's tasks only
    pool_env = BASE.replace("ps: {replicas: 1,", "ps: {replicas: 1, env: {PS_ONLY: '1'},")
    changed = _inputs(render(inv_from(pool_env + files, tmp_path)))
    assert {k for k in base if base[k] != changed[k]} == {"ps-0"}

    # the job's env: every task
    job_env = BASE.replace("NCCL_DEBUG: WARN", "NCCL_DEBUG: INFO")
    changed = _inputs(render(inv_from(job_env + files, tmp_path)))
    assert base and all(base[k] != changed[k] for k in base)

    # a pushed file's content: every task
    (tmp_path / "train.py").write_text("v2\n")
    os.utime(tmp_path / "train.py", ns=(1, 1))
    changed = _inputs(render(inv_from(BASE + files, tmp_path)))
    assert base and all(base[k] != changed[k] for k in base)


def test_render_with_previous_keeps_slots(tmp_path):
    inv = inv_from(BASE, tmp_path)
    first = render(inv)
    grown = inv_from(
        BASE.replace("worker: {replicas: 2,", "worker: {replicas: 3,").replace(
            "count: 4}}\n  - {name: cpu-1", "count: 8}}\n  - {name: cpu-1"
        ),
        tmp_path,
    )
    second = render(grown, previous=first.placement.slots())
    now = second.placement.slots()
    before = first.placement.slots()
    assert before and all(now[k] == v for k, v in before.items())


def test_unit_has_no_unescaped_specifiers_or_variables(tmp_path):
    """Outside ExecStart's words, everything in the unit comes from validated names; any
    '%' or '$' that systemd would expand must be doubled (or be a deliberate ${VAR})."""
    r = render(inv_from(BASE, tmp_path))
    for b in r.hosts.values():
        for f in b.files:
            if f.kind != "unit":
                continue
            for ln in f.data().decode().splitlines():
                if ln.startswith("#") or "=" not in ln:
                    continue
                value = ln.split("=", 1)[1]
                stripped = value.replace("%%", "").replace("$$", "")
                assert "%" not in stripped, ln
                assert not re.search(r"\$(?!\{?[A-Z_]+\}?)", stripped), ln


def test_an_address_with_a_port_is_the_ssh_port_never_part_of_the_cluster_spec(tmp_path):
    """`address: HOST:PORT` was taken for an IPv6 literal and the task
    addresses became `[HOST:PORT]:TASKPORT`."""
    text = BASE.replace("address: 192.0.2.11,", "address: '192.0.2.11:2201',").replace(
        "address: 192.0.2.12,", "address: '[2001:db8::12]:2202',"
    )
    inv = inv_from(text, tmp_path)
    hosts = {h.name: h for h in inv.hosts}
    assert (hosts["gpu-1"].address, hosts["gpu-1"].ssh.port, hosts["gpu-1"].cluster_address) == (
        "192.0.2.11",
        2201,
        "192.0.2.11",
    )
    assert (hosts["gpu-2"].address, hosts["gpu-2"].ssh.port) == ("2001:db8::12", 2202)
    addresses = [a for role in job_cluster(inv, render(inv).placement).tf_cluster.values() for a in role]
    assert any(a.startswith("192.0.2.11:") for a in addresses)
    assert any(a.startswith("[2001:db8::12]:") for a in addresses)
    assert not any("2201" in a.split(":")[0] or a.count("[") > 1 for a in addresses)


def test_a_setup_is_bounded_by_its_timeout(tmp_path):
    """item 16: the setup unit had TimeoutStartSec=infinity."""
    text = BASE + "setup: {commands: [apt-get update], timeout: 600}\n"
    r = render(inv_from(text, tmp_path))
    units = [f for b in r.hosts.values() for f in b.files if layout.is_setup_unit(f.path.rsplit("/", 1)[-1])]
    assert units and all(b"TimeoutStartSec=600\n" in f.data() for f in units)
    setups = [b.setup for b in r.hosts.values() if b.setup]
    assert setups and all(s.timeout == 600 for s in setups)
    default = render(inv_from(BASE + "setup: {commands: [apt-get update]}\n", tmp_path))
    setups = [b.setup for b in default.hosts.values() if b.setup]
    assert setups and all(s.timeout == 3600 for s in setups)


def test_a_setup_runs_again_for_its_inputs_not_for_the_code(tmp_path):
    """item 4: any edit to train.py ran setup again (`~ setup: run (changed)`)."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "train.py").write_text("print(1)\n")
    (tmp_path / "job" / "requirements.txt").write_text("numpy\n")
    text = (
        BASE
        + "files:\n  - {src: job/, dest: /opt/job/}\n"
        + "setup: {commands: [pip install -r /opt/job/requirements.txt], inputs: [/opt/job/requirements.txt]}\n"
    )

    def key() -> dict[str, str]:
        keys = {h: b.setup.key for h, b in render(inv_from(text, tmp_path)).hosts.items() if b.setup}
        assert keys
        return keys

    first = key()
    (tmp_path / "job" / "train.py").write_text("print(2)\n")
    assert key() == first  # the code changed: setup does not run again
    (tmp_path / "job" / "requirements.txt").write_text("numpy\ntorch\n")
    assert all(key()[h] != first[h] for h in first)  # its input changed: it does


def test_a_unit_as_the_previous_release_rendered_it_is_accepted(tmp_path):
    """the outputs guard changed the task unit's text; a host whose manifest
    recorded the previous release's inputs runs the same task, so it is not restarted."""
    text = BASE + "outputs: /data/run\n"
    r = render(inv_from(text, tmp_path))
    units = [u for b in r.hosts.values() for u in b.tasks]
    assert units and all(len(u.accepted) == 1 and u.accepted[0] != u.inputs for u in units)
    unit = next(f for b in r.hosts.values() for f in b.files if f.path == units[0].unit_path)
    earlier = earlier_units(inv_from(text, tmp_path), unit.data().decode())
    assert "ExecStartPre=/bin/mkdir -p -- /data/run/model /data/run/checkpoints /data/run/logs\n" in earlier[0]
    assert all(not b.tasks[0].accepted for b in render(inv_from(BASE, tmp_path)).hosts.values())
