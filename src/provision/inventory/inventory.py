"""Inventory file → validated `model.Inventory`.

Every problem is collected, not just the first, and each names its place:
`FILE:LINE: key.path: what is wrong, got X`. Placement (capacity) problems are checked
here too, so `provision validate` reports everything a later apply would trip on.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
from pathlib import Path
from typing import Any

from provision.core.encode import ENV_KEY, EXECUTABLE
from provision.core.envnames import RESERVED_ENV
from provision.core.errors import ProvisionError, ValidationError
from provision.core.model import (
    GRACE_PERIOD,
    HOST_KEY_POLICIES,
    MAX_GRACE_PERIOD,
    RESTART_POLICIES,
    ROLES,
    SUCCESS_POLICIES,
    Accelerators,
    FileSpec,
    Host,
    Inventory,
    Pool,
    RestartPolicy,
    Setup,
    SSHSettings,
    TFConfigOptions,
)
from provision.host import layout
from provision.inventory import placementspec
from provision.inventory import recoveryspec as rec
from provision.inventory import scheduling as sched
from provision.inventory.address import split as split_address
from provision.inventory.filespec import check_files
from provision.inventory.jobspec import job_spec_of
from provision.inventory.pushed import normalize_dest
from provision.inventory.statebackend import LOCAL
from provision.inventory.statebackend import problem as state_problem
from provision.inventory.tunespec import parse_tune
from provision.inventory.yamldoc import SYNTAX_ERRORS, Checker, KeyPath, compose, show_value, syntax_error
from provision.placement.tasks import PlacementError, place
from provision.placement.tpu import tpu_slices

DNS_LABEL = re.compile(r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$")  # DNS-1035, <= 40 chars
HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62})$")
# Host names / IPv4 / bracket-less IPv6: what may appear in host:port and in a URL.
ABS_PATH = re.compile(r"/[^\x00\n]*")
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62})?$")
IMAGE_REF = re.compile(r"^[a-z0-9][a-z0-9._/:@-]{0,254}$", re.IGNORECASE)
# ENV_KEY and EXECUTABLE (a command's first word, written unquoted in ExecStart=) are
# encode.py's: the validator accepts exactly what the encoder can write.
JUMP_HOST = re.compile(r"^(?:([A-Za-z0-9._-]+)@)?([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::(\d{1,5}))?$")

# Where provision keeps its own files; `files:` may not write there.
RESERVED_DIRS = layout.RESERVED_DIRS

TOP_KEYS = (
    "job",
    "ssh",
    "hosts",
    "pools",
    "env",
    "secret_env",
    "files",
    "tf_config",
    "success",
    "job_spec",
    "setup",
    "outputs",
    "state",
    "tune",
    *sched.KEYS,
    *placementspec.KEYS,
    *rec.KEYS,
)
SSH_KEYS = ("user", "port", "identity_file", "host_key_policy", "jump_host", "connect_timeout")
HOST_KEYS = ("name", "address", "cluster_address", "accelerators", "labels", "drain") + SSH_KEYS
POOL_KEYS = (
    "replicas",
    "accelerators",
    "command",
    "image",
    "args",
    "env",
    "hosts",
    "port",
    "restart",
    "setup",
    "grace_period",
    "elastic",
)


# --------------------------------------------------------------------------- YAML + lines


# --------------------------------------------------------------------------- checker


# --------------------------------------------------------------------------- sections


def _ssh(c: Checker, value: dict[str, Any], path: KeyPath, base: SSHSettings) -> SSHSettings:
    kw: dict[str, Any] = {}
    if "user" in value:
        kw["user"] = c.string(
            value["user"], path + ("user",), pattern=re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"), what="a user name"
        )
    if "port" in value:
        kw["port"] = c.integer(value["port"], path + ("port",), 1, 65535)
    if "identity_file" in value:
        kw["identity_file"] = c.string(value["identity_file"], path + ("identity_file",))
    if "host_key_policy" in value:
        policy = value["host_key_policy"]
        if policy is False:  # YAML 1.1 reads an unquoted `off` (or `no`) as false: that is "off"
            kw["host_key_policy"] = "off"
        elif isinstance(policy, bool):
            c.add(
                path + ("host_key_policy",),
                f"expected one of {', '.join(HOST_KEY_POLICIES)}, got {show_value(policy)} (YAML reads an unquoted on/yes/true as a boolean: quote it)",
            )
        else:
            kw["host_key_policy"] = c.choice(policy, path + ("host_key_policy",), HOST_KEY_POLICIES)
    if "jump_host" in value:
        jh = value["jump_host"]
        kw["jump_host"] = (
            None if jh is None else c.string(jh, path + ("jump_host",), pattern=JUMP_HOST, what="[user@]host[:port]")
        )
        m = JUMP_HOST.fullmatch(kw["jump_host"]) if kw["jump_host"] else None
        port = m.group(3) if m else None
        if port is not None and not 1 <= int(port) <= 65535:
            c.add(path + ("jump_host",), f"port must be from 1 to 65535, got {show_value(jh)}")
            kw["jump_host"] = None
    if "connect_timeout" in value:
        kw["connect_timeout"] = c.number(value["connect_timeout"], path + ("connect_timeout",), 0)
    # Leave defaults in place where a value was bad; the problem is already recorded.
    return SSHSettings(**{**base.__dict__, **{k: v for k, v in kw.items() if v is not None or k == "jump_host"}})


def _accelerators(c: Checker, value: Any, path: KeyPath) -> Accelerators | None:
    m = c.mapping(value, path)
    if not m:
        return None
    c.keys(m, path, ("type", "count"), required=("type", "count"))
    typ = c.string(
        m.get("type", ""),
        path + ("type",),
        pattern=re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        what="an accelerator type such as nvidia-h100 or tpu-v5e",
    )
    count = c.integer(m.get("count", 0), path + ("count",), 0, 1024)
    if typ is None or count is None:
        return None
    return Accelerators(typ, count)


def _labels(c: Checker, value: Any, path: KeyPath) -> tuple[tuple[str, str], ...]:
    m = c.mapping(value, path)
    if not m:
        return ()
    out = []
    for k, v in m.items():
        if not LABEL_VALUE.fullmatch(k):
            c.add(path + (k,), f"expected a label name (letters, digits, '.', '_', '-'), got {show_value(k)}")
            continue
        s = c.string(v, path + (k,), pattern=LABEL_VALUE, what="a label value (letters, digits, '.', '_', '-')")
        if s is not None:
            out.append((k, s))
    return tuple(out)


def _hosts(c: Checker, value: Any, base: SSHSettings) -> list[Host]:  # noqa: C901  one check per key of a host entry
    path: KeyPath = ("hosts",)
    if not isinstance(value, list) or not value:
        c.add(path, f"expected a non-empty list of hosts, got {show_value(value)}")
        return []
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    machines: dict[tuple[str, int], int] = {}  # (address, SSH port) -> the first hosts[i] there
    for i, raw in enumerate(value):
        hp = path + (i,)
        m = c.mapping(raw, hp)
        if m is None:
            continue
        c.keys(m, hp, HOST_KEYS, required=("name", "address"))
        name = (
            c.string(
                m.get("name"), hp + ("name",), pattern=HOST_NAME, what="a host name (letters, digits, '.', '_', '-')"
            )
            if "name" in m
            else None
        )
        address, address_port = _address(c, m["address"], hp + ("address",)) if "address" in m else (None, None)
        cluster = address
        if "cluster_address" in m:
            cluster, cluster_port = _address(c, m["cluster_address"], hp + ("cluster_address",))
            if cluster_port is not None:
                c.add(
                    hp + ("cluster_address",),
                    f"takes no port, got {show_value(m['cluster_address'])}: the tasks' ports are the pools' (pools.ROLE.port)",
                )
                cluster = None
        if name is not None:
            if name in seen:
                c.add(hp + ("name",), f"duplicate host name {name!r} (also hosts[{seen[name]}])")
            seen.setdefault(name, i)
        ssh = _ssh(c, m, hp, base)
        if address_port is not None:  # `address: HOST:PORT` is the SSH port, unless `port:` says another
            if "port" in m and m["port"] != address_port:
                c.add(
                    hp + ("port",),
                    f"{show_value(m['port'])} contradicts the port in address {show_value(m['address'])}",
                )
            ssh = dataclasses.replace(ssh, port=address_port)
        if address is not None:
            machine = (_same_address(address), ssh.port or 22)
            if machine in machines:
                # Two entries for one machine: its GPUs and ports would be handed out twice.
                c.add(
                    hp + ("address",),
                    f"{address} port {machine[1]} is hosts[{machines[machine]}] again: one entry per machine",
                )
            machines.setdefault(machine, i)
        acc = _accelerators(c, m["accelerators"], hp + ("accelerators",)) if "accelerators" in m else None
        labels = _labels(c, m.get("labels"), hp + ("labels",))
        drain = m.get("drain", False)
        if not isinstance(drain, bool):
            c.add(hp + ("drain",), f"expected true or false, got {show_value(drain)}")
        if name is not None and address is not None and cluster is not None:
            hosts.append(Host(name, address, ssh, cluster, acc, labels, drain is True))
    return hosts


def _same_address(address: str) -> str:
    """An address as compared with the others: an IP literal in its one form, a name lower-cased."""
    try:
        return str(ipaddress.ip_address(address.strip("[]")))
    except ValueError:
        return address.lower().rstrip(".")


def _address(c: Checker, value: Any, path: KeyPath) -> tuple[str | None, int | None]:
    """A host's address: a host name or an IP literal (inventory/address), with an optional port."""
    text = c.string(value, path)
    if text is None:
        return None, None
    try:
        return split_address(text)
    except ValueError as e:
        c.add(path, f"{e}, got {show_value(text)}")
        return None, None


def _restart(c: Checker, value: Any, path: KeyPath) -> RestartPolicy:
    m = c.mapping(value, path)
    if not m:
        return RestartPolicy()
    c.keys(m, path, ("policy", "limit"))
    policy = c.choice(m.get("policy", "Never"), path + ("policy",), RESTART_POLICIES) or "Never"
    default_limit = 0 if policy == "Never" else 3
    limit = c.integer(m.get("limit", default_limit), path + ("limit",), 0, 10000)
    return RestartPolicy(policy, default_limit if limit is None else limit)


def _command(c: Checker, value: Any, path: KeyPath) -> list[str] | None:
    command = c.strings(value, path)
    if command is None:
        return None
    if not command:
        c.add(path, "expected a non-empty list (the program and its arguments)")
    elif not EXECUTABLE.fullmatch(command[0]):
        c.add(
            path + (0,),
            f"expected an absolute program path or a program name (letters, digits, '/', '.', '_', '+', '-'; not starting with '-' or '+'; wrap anything fancier in a script), got {show_value(command[0])}",
        )
    return command


def _pool_hosts(
    c: Checker, value: Any, path: KeyPath, host_names: set[str], hosts: list[Host]
) -> tuple[tuple[str, ...] | None, tuple[tuple[str, str], ...] | None]:
    """A pool's `hosts:`: host names (each one known) or a label selector (some host has it)."""
    if isinstance(value, dict):
        selector = _labels(c, value, path)
        if selector and not any(all(h.label_map.get(k) == v for k, v in selector) for h in hosts):
            sel = ", ".join(f"{k}={v}" for k, v in selector)
            c.add(path, f"no host has the labels {sel}")
        return None, selector
    listed = c.strings(value, path)
    if listed is None:
        return None, None
    for i, n in enumerate(listed):
        if n not in host_names:
            hint = difflib.get_close_matches(n, sorted(host_names), n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            c.add(path + (i,), f"no host named {n!r} in hosts{extra}")
    return tuple(listed), None


def _pool(c: Checker, role: str, value: Any, host_names: set[str], hosts: list[Host]) -> Pool | None:
    path: KeyPath = ("pools", role)
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, POOL_KEYS, required=("replicas",))
    replicas = c.integer(m["replicas"], path + ("replicas",), 0, 100000) if "replicas" in m else None
    if replicas is not None and replicas > 1 and role in ("chief", "evaluator"):
        c.add(path + ("replicas",), f"a job has at most one {role}, got {replicas}")
    accelerators = c.integer(m.get("accelerators", 0), path + ("accelerators",), 0, 1024)

    command = _command(c, m["command"], path + ("command",)) if "command" in m else None
    image = (
        c.string(
            m["image"],
            path + ("image",),
            pattern=IMAGE_REF,
            what="an image reference such as registry.local/trainer:1.4",
        )
        if "image" in m
        else None
    )
    args = c.strings(m["args"], path + ("args",)) if "args" in m else []
    if "command" in m and "image" in m:
        c.add(path, "give either 'command' (run on the host) or 'image' (run in a container), not both")
    elif "command" not in m and "image" not in m:
        c.add(path, "missing 'command' or 'image': what should this pool run?")
    if "args" in m and "image" not in m:
        c.add(path + ("args",), "'args' goes with 'image'; with 'command', put the arguments in the command list")

    env = c.env(m.get("env"), path + ("env",)) or ()

    names, selector = _pool_hosts(c, m["hosts"], path + ("hosts",), host_names, hosts) if "hosts" in m else (None, None)
    port = c.integer(m["port"], path + ("port",), 1024, 65535) if "port" in m else None
    restart = _restart(c, m.get("restart"), path + ("restart",))
    setup = _setup(c, m.get("setup"), path + ("setup",))
    grace = c.integer(m.get("grace_period", GRACE_PERIOD), path + ("grace_period",), 1, MAX_GRACE_PERIOD)
    elastic = rec.elastic(c, m.get("elastic"), path, command if "image" not in m else None, replicas)
    if replicas is None or accelerators is None:
        return None
    return Pool(
        role=role,
        replicas=replicas,
        accelerators=accelerators,
        command=tuple(command or ()),
        image=image,
        args=tuple(args or ()),
        env=env,
        host_names=names,
        host_selector=selector,
        port=port,
        restart=restart,
        setup=setup,
        grace_period=grace if grace is not None else GRACE_PERIOD,
        elastic=elastic,
    )


def _setup(c: Checker, value: Any, path: KeyPath) -> Setup | None:
    """`setup: {commands: [shell lines], env: {K: V}, timeout: SECONDS}` (job-wide, or a pool's)."""
    if value is None:
        return None
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, ("commands", "env", "timeout", "inputs"), required=("commands",))
    commands = c.strings(m["commands"], path + ("commands",)) if "commands" in m else None
    if commands is not None:
        if not commands:
            c.add(path + ("commands",), "expected at least one shell line")
        for i, line in enumerate(commands):
            if not line.strip():
                c.add(path + ("commands", i), "expected a shell line, got an empty string")
    env = c.env(m.get("env"), path + ("env",)) or ()
    timeout = c.integer(m["timeout"], path + ("timeout",), 1, 7 * 24 * 3600) if "timeout" in m else None
    extra: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    if "inputs" in m:
        inputs = c.strings(m["inputs"], path + ("inputs",), pattern=ABS_PATH, what="an absolute path on the host")
        extra["inputs"] = tuple(inputs or ())
    return Setup(tuple(commands or ()), env, **extra) if commands else None


def _setup_inputs(c: Checker, setup: Setup | None, path: KeyPath, files: list[FileSpec]) -> None:
    """Each of setup.inputs is a pushed file or a directory holding some."""
    for i, want in enumerate(setup.inputs if setup else ()):
        w = want.rstrip("/")
        if not any(
            f.dest.rstrip("/") == w
            or f.dest.startswith(w + "/")
            or (f.is_dir and w.startswith(f.dest.rstrip("/") + "/"))
            for f in files
        ):
            c.add(path + ("inputs", i), f"{want!r} is not a files: destination (nor in or above one)")


def _pools(c: Checker, value: Any, hosts: list[Host]) -> list[Pool]:
    path: KeyPath = ("pools",)
    m = c.mapping(value, path)
    if m is None:
        return []
    c.keys(m, path, ROLES)
    if not m:
        c.add(path, f"no pools: name at least one of {', '.join(ROLES)}")
    names = {h.name for h in hosts}
    pools = [p for role in ROLES if role in m for p in [_pool(c, role, m[role], names, hosts)] if p is not None]
    by_role = {p.role: p for p in pools if p.replicas > 0}
    # A pool with its own errors is missing from `pools`; checks about which pools exist
    # would then only echo those errors ("this job has no worker"), so they wait.
    complete = len(pools) == len([r for r in ROLES if r in m])
    if "ps" in by_role and "reduction_server" in by_role:
        c.add(path, "ps and reduction_server both use workerpool2; a job has one or the other")
    if complete and "ps" in by_role and ("chief" not in by_role or "worker" not in by_role):
        missing = " and ".join(r for r in ("chief", "worker") if r not in by_role)
        c.add(
            path + ("ps",),
            f"parameter-server training needs a chief (coordinator) and workers; this job has no {missing}",
        )
    if complete and m and not by_role and pools:
        c.add(path, "every pool has 0 replicas: nothing to run")
    ports: dict[int, str] = {}
    for p in pools:
        if p.port is None:
            continue
        if p.port in ports:
            c.add(
                path + (p.role, "port"),
                f"port {p.port} is also pools.{ports[p.port]}.port; give each pool its own port or leave it unset",
            )
        ports.setdefault(p.port, p.role)
    return pools


# --------------------------------------------------------------------------- entry points


def parse(text: str, path: Path, display: str | None = None, *, files_here: bool = True) -> Inventory:  # noqa: C901  the inventory's sections checked one after another, all problems at once
    """Validate inventory text; raise ValidationError listing every problem. `files_here`
    False: `files:` sources that are not on this machine are left out (check_files), for
    the commands that push nothing (handed-over work: the service keeps its snapshot)."""
    display = display or str(path)
    yaml_problems: list[tuple[KeyPath, str, int | None]] = []
    try:
        doc = compose(text, yaml_problems)
    except SYNTAX_ERRORS as e:  # a RecursionError too: a document nested too deeply
        raise ValidationError([syntax_error(display, e)]) from None
    c = Checker(doc, display)
    for p, msg, line in yaml_problems:
        c.add(p, msg, line)
    top = doc.data
    if not isinstance(top, dict):
        c.add((), f"expected a mapping with job, hosts and pools, got {show_value(top)}")
        raise ValidationError([m for _, _, m in sorted(c.problems)])
    c.keys(top, (), TOP_KEYS, required=("job", "hosts", "pools"))

    job = (
        c.string(
            top.get("job"),
            ("job",),
            pattern=DNS_LABEL,
            what="a DNS-1035 label (a-z, 0-9, '-', starting with a letter, at most 40 characters)",
        )
        if "job" in top
        else None
    )
    ssh_map = c.mapping(top.get("ssh"), ("ssh",)) or {}
    c.keys(ssh_map, ("ssh",), SSH_KEYS)
    ssh = _ssh(c, ssh_map, ("ssh",), SSHSettings())
    hosts = _hosts(c, top.get("hosts"), ssh) if "hosts" in top else []
    pools = _pools(c, top.get("pools"), hosts) if "pools" in top else []
    env = c.env(top.get("env"), ("env",)) or ()
    secret_env: list[str] = []
    if top.get("secret_env") is not None:
        secret_env = (
            c.strings(top["secret_env"], ("secret_env",), pattern=ENV_KEY, what="an environment variable name") or []
        )
        for i, key in enumerate(secret_env):
            if key in RESERVED_ENV:
                c.add(("secret_env", i), f"{key} is set by provision for every task and cannot be a secret")
            if key in dict(env):
                c.add(("secret_env", i), f"{key} is also in env; a variable is either plain or secret")
    files = check_files(c, top.get("files"), path.parent, here=files_here)

    tf_map = c.mapping(top.get("tf_config"), ("tf_config",)) or {}
    c.keys(tf_map, ("tf_config",), ("chief_name", "trial"))
    chief_name = (
        c.choice(tf_map.get("chief_name", "chief"), ("tf_config", "chief_name"), ("chief", "master")) or "chief"
    )
    trial = tf_map.get("trial")
    if trial is not None:
        trial = c.string(
            trial, ("tf_config", "trial"), pattern=re.compile(r"^[A-Za-z0-9_.-]{1,64}$"), what="a trial id such as '1'"
        )

    success_map = c.mapping(top.get("success"), ("success",)) or {}
    c.keys(success_map, ("success",), ("policy",))
    success = c.choice(success_map.get("policy", "chief"), ("success", "policy"), SUCCESS_POLICIES) or "chief"
    job_spec = job_spec_of(c, top.get("job_spec"))
    outputs = _outputs(c, top.get("outputs"))
    setup = _setup(c, top.get("setup"), ("setup",))
    state = _state(c, top.get("state", LOCAL))
    tune, scheduling = parse_tune(c, top.get("tune"), job), sched.scheduling(c, top)
    progress, recovery = rec.progress(c, top.get("progress")), rec.recovery(c, top.get("recovery"))
    spares = rec.spares(c, top.get("spares"), hosts, pools)
    checkpoint = rec.checkpoint(c, top.get("checkpoint"), outputs, recovery)
    preference = placementspec.placement(c, top.get("placement"), hosts)
    for where, s in (
        [(("setup",), setup)] + [(("pools", p.role, "setup"), p.setup) for p in pools] if files_here else []
    ):
        _setup_inputs(c, s, where, files)  # what a setup names must be pushed: a pushing command's check
    roles = {p.role for p in pools if p.replicas > 0}
    # Only when every pool is valid: otherwise this would echo the pools' own errors.
    pools_map = top.get("pools")
    known = isinstance(pools_map, dict) and len(pools) == len([r for r in ROLES if r in pools_map])
    if known and success == "all_workers" and "worker" not in roles:
        c.add(("success", "policy"), "all_workers needs a worker pool with replicas")
    if known and success == "chief" and "chief" not in roles and "worker" not in roles and roles:
        c.add(("success", "policy"), "the job has neither a chief nor workers, so nothing can succeed")

    if c.problems:
        raise ValidationError([m for _, _, m in sorted(c.problems)])

    inv = Inventory(
        path=path,
        job=job or "",
        ssh=ssh,
        hosts=tuple(hosts),
        pools=tuple(pools),
        env=env,
        secret_env=tuple(secret_env),
        files=tuple(files),
        tf_config=TFConfigOptions(chief_name, trial),
        success=success,
        job_spec=job_spec,
        setup=setup,
        outputs=outputs,
        state=state,
        tune=tune,
        scheduling=scheduling,
        progress=progress,
        recovery=recovery,
        spares=spares,
        checkpoint=checkpoint,
        placement=preference,
    )
    _check_capacity(inv, c)
    if c.problems:
        raise ValidationError([m for _, _, m in sorted(c.problems)])
    return inv


OUTPUTS_PATH = re.compile(r"^(/[A-Za-z0-9._-]+)+/?$")


def _outputs(c: Checker, value: Any) -> str | None:
    """`outputs:` an absolute directory on the hosts (Vertex's baseOutputDirectory): plain
    characters only (it goes into the unit), not provision's own directories."""
    if value is None:
        return None
    s = c.string(value, ("outputs",), pattern=OUTPUTS_PATH, what="an absolute directory such as /data/runs")
    if s is None:
        return None
    norm = normalize_dest(s)
    if norm is None or norm == "/" or ".." in norm.split("/"):
        c.add(("outputs",), f"expected an absolute directory such as /data/runs, got {s!r}")
        return None
    for d in (*layout.RESERVED_DIRS, layout.VAR):
        if norm == d or norm.startswith(d + "/"):
            c.add(("outputs",), f"{norm} is inside {d}, where provision keeps its own files")
            return None
    return norm


def _state(c: Checker, value: Any) -> str:
    """`state:` local, or a PostgreSQL URL without a password (inventory/statebackend.py)."""
    why = state_problem(value)
    if why:
        c.add(("state",), why)
        return LOCAL
    return str(value)


def _check_capacity(inv: Inventory, c: Checker) -> None:
    """Demand vs. hosts, with messages that name the pool; then a real placement."""

    total_demand = 0
    for pool in inv.pools:
        if pool.replicas == 0:
            continue
        eligible = [h for h in inv.hosts if pool.eligible(h)]
        if not eligible:
            c.add(("pools", pool.role, "hosts"), "no host matches this pool's placement restriction")
            continue
        total_demand += pool.replicas * pool.accelerators
        if pool.accelerators:
            biggest = max(eligible, key=lambda h: h.accelerator_count)
            if biggest.accelerator_count < pool.accelerators:
                c.add(
                    ("pools", pool.role, "accelerators"),
                    f"{pool.accelerators} per replica (a replica is never split across hosts), but no eligible host has more than {biggest.accelerator_count} ({biggest.name})",
                )
    capacity = sum(h.accelerator_count for h in inv.hosts)
    if total_demand > capacity:
        c.add(
            ("pools",),
            f"the job asks for {total_demand} accelerator{'' if total_demand == 1 else 's'} in total, "
            f"the hosts have {capacity}",
        )
    if c.problems:
        return
    try:
        placement = place(inv)
    except PlacementError as e:
        c.add(("pools", e.role), e.reason)
        return
    try:  # a TPU slice JAX or libtpu could not take (placement/tpu.py)
        tpu_slices([*placement.by_role("chief"), *placement.by_role("worker")])
    except ProvisionError as e:
        c.add(("pools",), e.message)


def load(path: str | os.PathLike[str], *, files_here: bool = True) -> Inventory:
    """Read and validate an inventory file (`files_here`: parse's)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProvisionError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ProvisionError(f"{path}: is a directory, expected an inventory YAML file") from None
    except UnicodeDecodeError as e:
        raise ProvisionError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ProvisionError(f"{path}: cannot read: {e.strerror}") from None
    return parse(text, p.resolve(), display=str(path), files_here=files_here)
