"""Inventory file → validated `model.Inventory`.

Every problem is collected, not just the first, and each names its place:
`FILE:LINE: key.path: what is wrong, got X`. Placement (capacity) problems are checked
here too, so `provision validate` reports everything a later apply would trip on.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from provision.core.encode import ENV_KEY, EXECUTABLE
from provision.core.errors import ProvisionError, ValidationError
from provision.core.model import (
    HOST_KEY_POLICIES,
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
from provision.spec.placement import PlacementError, place
from provision.spec.pushed import into_directory, normalize_dest, walk_spec

DNS_LABEL = re.compile(r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$")  # DNS-1035, <= 40 chars
HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62})$")
# Host names / IPv4 / bracket-less IPv6: what may appear in host:port and in a URL.
NETWORK_ADDRESS = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9.-]{0,252})|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)$")
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62})?$")
IMAGE_REF = re.compile(r"^[a-z0-9][a-z0-9._/:@-]{0,254}$", re.IGNORECASE)
# ENV_KEY and EXECUTABLE (a command's first word, written unquoted in ExecStart=) are
# encode.py's: the validator accepts exactly what the encoder can write.
JUMP_HOST = re.compile(r"^(?:([A-Za-z0-9._-]+)@)?([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::(\d{1,5}))?$")

# Variables provision itself sets for every task; an inventory may not override them,
# or tasks would disagree about the cluster.
RESERVED_ENV = frozenset(
    {
        "TF_CONFIG",
        "CLUSTER_SPEC",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "PET_NNODES",
        "PET_NODE_RANK",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
        "PET_NPROC_PER_NODE",
        "JAX_COORDINATOR_ADDRESS",
        "JAX_NUM_PROCESSES",
        "JAX_PROCESS_ID",
        "DMLC_ROLE",
        "DMLC_PS_ROOT_URI",
        "DMLC_PS_ROOT_PORT",
        "DMLC_NUM_WORKER",
        "DMLC_NUM_SERVER",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "TPU_VISIBLE_CHIPS",
        "PROVISION_JOB",
        "PROVISION_TASK",
        "PROVISION_TASK_TYPE",
        "PROVISION_TASK_INDEX",
    }
)
# Where provision keeps its own files; `files:` may not write there.
RESERVED_DIRS = layout.RESERVED_DIRS

TOP_KEYS = ("job", "ssh", "hosts", "pools", "env", "secret_env", "files", "tf_config", "success", "job_spec", "setup")
SSH_KEYS = ("user", "port", "identity_file", "host_key_policy", "jump_host", "connect_timeout")
HOST_KEYS = ("name", "address", "cluster_address", "accelerators", "labels", "drain") + SSH_KEYS
POOL_KEYS = ("replicas", "accelerators", "command", "image", "args", "env", "hosts", "port", "restart", "setup")


# --------------------------------------------------------------------------- YAML + lines

Path_ = tuple  # a key path such as ("pools", "worker", "replicas")


class _Doc:
    """Plain Python data from YAML plus the line of every key path (1-based)."""

    def __init__(self, data: Any, lines: dict[Path_, int]):
        self.data = data
        self.lines = lines


MAX_NODES = 1_000_000  # YAML values after alias expansion; a 1,000-host inventory has ~20,000


def _compose(text: str, problems: list[tuple[Path_, str, int | None]]) -> _Doc:
    # The C loader when PyYAML has it: a 1,000-host inventory must load in well under a second.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    lines: dict[Path_, int] = {}
    # Aliases make the node graph a DAG (or a cycle, `&a [*a]`): refuse cycles and
    # exponential expansion as YAML errors instead of a RecursionError or a hang.
    active: set[int] = set()
    budget = [MAX_NODES]

    def build(n: yaml.Node, path: Path_) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise yaml.MarkedYAMLError(
                problem=f"more than {MAX_NODES:,} values once aliases are expanded", problem_mark=n.start_mark
            )
        if not isinstance(n, yaml.CollectionNode):
            return build_node(n, path)
        if id(n) in active:
            raise yaml.MarkedYAMLError(
                problem="recursive alias (an anchor used inside itself)", problem_mark=n.start_mark
            )
        active.add(id(n))
        try:
            return build_node(n, path)
        finally:
            active.discard(id(n))

    def build_node(n: yaml.Node, path: Path_) -> Any:
        lines.setdefault(path, n.start_mark.line + 1)
        if isinstance(n, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for k_node, v_node in n.value:
                if k_node.tag == "tag:yaml.org,2002:merge":
                    problems.append((path, "YAML merge keys ('<<') are not supported", k_node.start_mark.line + 1))
                    continue
                key = build(k_node, path + ("<key>",))
                if not isinstance(key, (str, int)):
                    problems.append((path, f"keys must be strings, got {show_value(key)}", k_node.start_mark.line + 1))
                    continue
                key = str(key)
                if key in out:
                    problems.append(
                        (path + (key,), "duplicate key (YAML keeps only the last one)", k_node.start_mark.line + 1)
                    )
                lines[path + (key,)] = k_node.start_mark.line + 1
                out[key] = build(v_node, path + (key,))
            return out
        if isinstance(n, yaml.SequenceNode):
            return [build(item, path + (i,)) for i, item in enumerate(n.value)]
        return loader.construct_object(n)  # scalars: typed as YAML says

    try:
        node = loader.get_single_node()
        data = build(node, ()) if node is not None else None
    finally:
        loader.dispose()
    return _Doc(data, lines)


def show_value(value: Any) -> str:
    """`got X` rendering: short, quoted for strings, never multi-line (the importers' too)."""
    if isinstance(value, dict):
        s = "a mapping"
    elif isinstance(value, list):
        s = "a list" if value else "an empty list"
    elif value is None:
        s = "nothing (null)"
    else:
        s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _dotted(path: Path_) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            # A key with a newline or other control character must not break the line.
            s = str(part) if str(part).isprintable() else repr(str(part))
            out += ("." if out else "") + s
    return out or "(top level)"


# --------------------------------------------------------------------------- checker


class _Checker:
    """Type checks against the document that record problems instead of raising."""

    def __init__(self, doc: _Doc, display: str):
        self.doc = doc
        self.display = display
        self.problems: list[tuple[int, int, str]] = []  # (line, seq, message) for stable order

    def add(self, path: Path_, message: str, line: int | None = None) -> None:
        if line is None:
            line = self._line(path)
        where = f"{self.display}:{line}" if line else self.display
        self.problems.append((line or 0, len(self.problems), f"{where}: {_dotted(path)}: {message}"))

    def _line(self, path: Path_) -> int | None:
        while True:
            if path in self.doc.lines:
                return self.doc.lines[path]
            if not path:
                return None
            path = path[:-1]

    def keys(self, value: dict, path: Path_, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
        for key in value:
            if key not in allowed:
                hint = difflib.get_close_matches(key, allowed, n=1)
                extra = f" (did you mean '{hint[0]}'?)" if hint else f" (allowed: {', '.join(allowed)})"
                self.add(path + (key,), f"unknown key{extra}")
        for key in required:
            if key not in value:
                self.add(path, f"missing required key '{key}'")

    def mapping(self, value: Any, path: Path_) -> dict | None:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.add(path, f"expected a mapping, got {show_value(value)}")
            return None
        return value

    def string(self, value: Any, path: Path_, *, pattern: re.Pattern | None = None, what: str = "") -> str | None:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            self.add(path, f"expected a string, got {show_value(value)}")
            return None
        s = str(value)
        if "\x00" in s:
            self.add(path, f"NUL bytes are not allowed, got {show_value(s)}")
            return None
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            self.add(path, f"not valid Unicode text (lone surrogate escape), got {show_value(s)}")
            return None
        if pattern is not None and not pattern.match(s):
            self.add(path, f"expected {what}, got {show_value(s)}")
            return None
        return s

    def integer(self, value: Any, path: Path_, lo: int, hi: int | None = None) -> int | None:
        bound = f"an integer >= {lo}" if hi is None else f"an integer from {lo} to {hi}"
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            self.add(path, f"expected {bound}, got {show_value(value)}")
            return None
        return value

    def number(self, value: Any, path: Path_, lo: float) -> float | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= lo:
            self.add(path, f"expected a number > {lo:g}, got {show_value(value)}")
            return None
        return float(value)

    def choice(self, value: Any, path: Path_, choices: tuple[str, ...]) -> str | None:
        if value not in choices:
            hint = difflib.get_close_matches(str(value), choices, n=1) if isinstance(value, str) else []
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            self.add(path, f"expected one of {', '.join(choices)}, got {show_value(value)}{extra}")
            return None
        return value

    def strings(
        self, value: Any, path: Path_, *, pattern: re.Pattern | None = None, what: str = ""
    ) -> list[str] | None:
        if not isinstance(value, list):
            self.add(path, f"expected a list of strings, got {show_value(value)}")
            return None
        out = [self.string(v, path + (i,), pattern=pattern, what=what) for i, v in enumerate(value)]
        return None if any(v is None for v in out) else out  # type: ignore[return-value]

    def env(self, value: Any, path: Path_) -> tuple[tuple[str, str], ...] | None:
        m = self.mapping(value, path)
        if m is None:
            return None
        out = []
        for key, val in m.items():
            ok = True
            if not ENV_KEY.match(key):
                self.add(
                    path + (key,),
                    f"not a valid environment variable name (letters, digits, '_', not starting with a digit), got {show_value(key)}",
                )
                ok = False
            elif key in RESERVED_ENV:
                self.add(path + (key,), "is set by provision for every task (see cluster-env) and cannot be overridden")
                ok = False
            s = self.string(val, path + (key,))
            if ok and s is not None:
                out.append((key, s))
        return tuple(out)


# --------------------------------------------------------------------------- sections


def _ssh(c: _Checker, value: dict, path: Path_, base: SSHSettings) -> SSHSettings:
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
        m = JUMP_HOST.match(kw["jump_host"]) if kw["jump_host"] else None
        port = m.group(3) if m else None
        if port is not None and not 1 <= int(port) <= 65535:
            c.add(path + ("jump_host",), f"port must be from 1 to 65535, got {show_value(jh)}")
            kw["jump_host"] = None
    if "connect_timeout" in value:
        kw["connect_timeout"] = c.number(value["connect_timeout"], path + ("connect_timeout",), 0)
    # Leave defaults in place where a value was bad; the problem is already recorded.
    return SSHSettings(**{**base.__dict__, **{k: v for k, v in kw.items() if v is not None or k == "jump_host"}})


def _accelerators(c: _Checker, value: Any, path: Path_) -> Accelerators | None:
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


def _labels(c: _Checker, value: Any, path: Path_) -> tuple[tuple[str, str], ...]:
    m = c.mapping(value, path)
    if not m:
        return ()
    out = []
    for k, v in m.items():
        if not LABEL_VALUE.match(k):
            c.add(path + (k,), f"expected a label name (letters, digits, '.', '_', '-'), got {show_value(k)}")
            continue
        s = c.string(v, path + (k,), pattern=LABEL_VALUE, what="a label value (letters, digits, '.', '_', '-')")
        if s is not None:
            out.append((k, s))
    return tuple(out)


def _hosts(c: _Checker, value: Any, base: SSHSettings) -> list[Host]:
    path: Path_ = ("hosts",)
    if not isinstance(value, list) or not value:
        c.add(path, f"expected a non-empty list of hosts, got {show_value(value)}")
        return []
    hosts: list[Host] = []
    seen: dict[str, int] = {}
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
        address = (
            c.string(m.get("address"), hp + ("address",), pattern=NETWORK_ADDRESS, what="a host name or IP address")
            if "address" in m
            else None
        )
        cluster = m.get("cluster_address", address)
        cluster = (
            c.string(cluster, hp + ("cluster_address",), pattern=NETWORK_ADDRESS, what="a host name or IP address")
            if cluster is not None
            else None
        )
        if name is not None:
            if name in seen:
                c.add(hp + ("name",), f"duplicate host name {name!r} (also hosts[{seen[name]}])")
            seen.setdefault(name, i)
        ssh = _ssh(c, m, hp, base)
        acc = _accelerators(c, m["accelerators"], hp + ("accelerators",)) if "accelerators" in m else None
        labels = _labels(c, m.get("labels"), hp + ("labels",))
        drain = m.get("drain", False)
        if not isinstance(drain, bool):
            c.add(hp + ("drain",), f"expected true or false, got {show_value(drain)}")
        if name is not None and address is not None and cluster is not None:
            hosts.append(Host(name, address, ssh, cluster, acc, labels, drain is True))
    return hosts


def _restart(c: _Checker, value: Any, path: Path_) -> RestartPolicy:
    m = c.mapping(value, path)
    if not m:
        return RestartPolicy()
    c.keys(m, path, ("policy", "limit"))
    policy = c.choice(m.get("policy", "Never"), path + ("policy",), RESTART_POLICIES) or "Never"
    default_limit = 0 if policy == "Never" else 3
    limit = c.integer(m.get("limit", default_limit), path + ("limit",), 0, 10000)
    return RestartPolicy(policy, default_limit if limit is None else limit)


def _pool(c: _Checker, role: str, value: Any, host_names: set[str], hosts: list[Host]) -> Pool | None:
    path: Path_ = ("pools", role)
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, POOL_KEYS, required=("replicas",))
    replicas = c.integer(m["replicas"], path + ("replicas",), 0, 100000) if "replicas" in m else None
    if replicas is not None and replicas > 1 and role in ("chief", "evaluator"):
        c.add(path + ("replicas",), f"a job has at most one {role}, got {replicas}")
    accelerators = c.integer(m.get("accelerators", 0), path + ("accelerators",), 0, 1024)

    command: list[str] | None = None
    if "command" in m:
        command = c.strings(m["command"], path + ("command",))
        if command is not None:
            if not command:
                c.add(path + ("command",), "expected a non-empty list (the program and its arguments)")
            elif not EXECUTABLE.match(command[0]):
                c.add(
                    path + ("command", 0),
                    f"expected an absolute program path or a program name (letters, digits, '/', '.', '_', '+', '-'; not starting with '-' or '+'; wrap anything fancier in a script), got {show_value(command[0])}",
                )
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

    names: tuple[str, ...] | None = None
    selector: tuple[tuple[str, str], ...] | None = None
    if "hosts" in m:
        hv = m["hosts"]
        if isinstance(hv, dict):
            selector = _labels(c, hv, path + ("hosts",))
            if selector and not any(all(h.label_map.get(k) == v for k, v in selector) for h in hosts):
                sel = ", ".join(f"{k}={v}" for k, v in selector)
                c.add(path + ("hosts",), f"no host has the labels {sel}")
        else:
            listed = c.strings(hv, path + ("hosts",))
            if listed is not None:
                for i, n in enumerate(listed):
                    if n not in host_names:
                        hint = difflib.get_close_matches(n, sorted(host_names), n=1)
                        extra = f" (did you mean '{hint[0]}'?)" if hint else ""
                        c.add(path + ("hosts", i), f"no host named {n!r} in hosts{extra}")
                names = tuple(listed)
    port = c.integer(m["port"], path + ("port",), 1024, 65535) if "port" in m else None
    restart = _restart(c, m.get("restart"), path + ("restart",))
    setup = _setup(c, m.get("setup"), path + ("setup",))
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
    )


def _setup(c: _Checker, value: Any, path: Path_) -> Setup | None:
    """`setup: {commands: [shell lines], env: {K: V}}` (job-wide, or a pool's)."""
    if value is None:
        return None
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, ("commands", "env"), required=("commands",))
    commands = c.strings(m["commands"], path + ("commands",)) if "commands" in m else None
    if commands is not None:
        if not commands:
            c.add(path + ("commands",), "expected at least one shell line")
        for i, line in enumerate(commands):
            if not line.strip():
                c.add(path + ("commands", i), "expected a shell line, got an empty string")
    env = c.env(m.get("env"), path + ("env",)) or ()
    return Setup(tuple(commands or ()), env) if commands else None


def _pools(c: _Checker, value: Any, hosts: list[Host]) -> list[Pool]:
    path: Path_ = ("pools",)
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


def _reserved(dest: str) -> str | None:
    """The reserved directory `dest` (normalised) is in or is, if any."""
    return next((d for d in RESERVED_DIRS if dest == d or dest.startswith(d + "/")), None)


MAX_TREE_PROBLEMS = 10  # per files: entry; the rest are counted


def _files(c: _Checker, value: Any, base_dir: Path) -> list[FileSpec]:
    """`files:` entries. Destinations are normalised (`//`, `/./`, `..`, a trailing `/`)
    before any check; a directory's tree is walked (pushed.walk_spec, as render walks it)
    so that links out of it, dangling links and loops are reported here, not at apply."""

    path: Path_ = ("files",)
    if value is None:
        return []
    if not isinstance(value, list):
        c.add(path, f"expected a list of {{src, dest}} entries, got {show_value(value)}")
        return []
    out: list[FileSpec] = []
    owners: dict[str, int] = {}  # destination file -> the entry that writes it
    parents: dict[str, int] = {}  # directory a destination file needs -> the entry
    for i, raw in enumerate(value):
        fp = path + (i,)
        m = c.mapping(raw, fp)
        if m is None:
            continue
        c.keys(m, fp, ("src", "dest", "replace"), required=("src", "dest"))
        replace = m.get("replace", False)
        if not isinstance(replace, bool):
            c.add(fp + ("replace",), f"expected true or false, got {show_value(replace)}")
        src = c.string(m.get("src"), fp + ("src",)) if "src" in m else None
        dest = c.string(m.get("dest"), fp + ("dest",)) if "dest" in m else None
        # The src itself may be a link to anywhere (the user named that file); only links
        # found inside a pushed directory must stay inside it.
        src_path: Path | None = None
        is_dir = False
        if src is not None:
            given = base_dir / os.path.expanduser(src)
            try:
                src_path = given.resolve()
                os.stat(src_path)
                is_dir = src_path.is_dir()
            except FileNotFoundError:
                c.add(fp + ("src",), f"no such file or directory: {src_path or given}")
                src_path = None
            except (OSError, RuntimeError) as e:  # RuntimeError: a link loop, from resolve()
                reason = getattr(e, "strerror", None) or "too many levels of symbolic links"
                c.add(fp + ("src",), f"cannot read {given}: {reason}")
                src_path = None
        norm: str | None = None
        if dest is not None:
            if not dest.startswith("/") or "\n" in dest:
                c.add(fp + ("dest",), f"expected an absolute path on the host, got {show_value(dest)}")
            elif (norm := normalize_dest(dest)) is None:
                c.add(fp + ("dest",), f"climbs above / with '..', got {show_value(dest)}")
            elif norm == "/":
                c.add(fp + ("dest",), f"is the root directory /; name a directory below it, got {show_value(dest)}")
                norm = None
            elif src_path is not None and not is_dir and into_directory(dest):
                # `dest: /opt/job/` for a file: into that directory, under the file's name.
                norm = f"{norm}/{os.path.basename(os.path.normpath(base_dir / os.path.expanduser(src or '')))}"
            if norm is not None and _reserved(norm) is not None:
                shown = "" if dest == norm else f", got {show_value(dest)}"
                c.add(fp + ("dest",), f"{norm} is reserved for provision's own files{shown}")
                norm = None
        if src_path is None or norm is None:
            continue
        # A directory pushed above a reserved one (dest: /etc) must not reach into it.
        hits = [d for d in RESERVED_DIRS if d.startswith(norm + "/") and (src_path / os.path.relpath(d, norm)).exists()]
        if is_dir and hits:
            c.add(
                fp + ("src",),
                f"{src_path / os.path.relpath(hits[0], norm)} would be pushed into {hits[0]}, which is reserved for provision's own files",
            )
            continue
        entries, problems = walk_spec(src_path, norm, is_dir)
        for problem in problems[:MAX_TREE_PROBLEMS]:
            c.add(fp + ("src",), problem.message)
        if len(problems) > MAX_TREE_PROBLEMS:
            c.add(fp + ("src",), f"{len(problems) - MAX_TREE_PROBLEMS} more problems like these in {src_path}")
        if problems:
            continue
        # Two entries may not write the same file, nor one a file where another needs a directory.
        clashes: dict[int, tuple[str, int]] = {}  # other entry -> (first message, count)
        for pf in entries:
            found: list[tuple[int, str]] = []
            if pf.dest in owners:
                found.append(
                    (
                        owners[pf.dest],
                        f"{pf.dest} is also written by files[{owners[pf.dest]}]; a file on the host has one source",
                    )
                )
            elif pf.dest in parents:
                found.append(
                    (
                        parents[pf.dest],
                        f"{pf.dest} is a directory that files[{parents[pf.dest]}] writes into; it cannot also be a file",
                    )
                )
            found += [
                (owners[a], f"{pf.dest} needs {a} to be a directory, but files[{owners[a]}] writes a file there")
                for a in _ancestors(pf.dest)
                if a in owners
            ]
            for j, message in found:
                first, count = clashes.get(j, (message, 0))
                clashes[j] = (first, count + 1)
        for j, (message, count) in sorted(clashes.items()):
            more = (
                f" ({count - 1} more {'file clashes' if count == 2 else 'files clash'} with files[{j}])"
                if count > 1
                else ""
            )
            c.add(fp + ("dest",), message + more)
        if clashes:
            continue
        for pf in entries:
            owners[pf.dest] = i
            for a in _ancestors(pf.dest):
                parents.setdefault(a, i)
        out.append(FileSpec(src_path, norm, is_dir, replace is True))
    return out


def _ancestors(dest: str) -> list[str]:
    """/a/b/c -> [/a/b, /a] (not /)."""
    out: list[str] = []
    while dest := dest.rsplit("/", 1)[0]:
        out.append(dest)
    return out


# --------------------------------------------------------------------------- entry points


def parse(text: str, path: Path, display: str | None = None) -> Inventory:
    """Validate inventory text; raise ValidationError listing every problem."""
    display = display or str(path)
    yaml_problems: list[tuple[Path_, str, int | None]] = []
    try:
        doc = _compose(text, yaml_problems)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{display}:{mark.line + 1}" if mark else display
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValidationError([f"{where}: invalid YAML: {problem}"]) from None
    c = _Checker(doc, display)
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
    files = _files(c, top.get("files"), path.parent)

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
    job_spec = _job_spec(c, top.get("job_spec"))
    setup = _setup(c, top.get("setup"), ("setup",))
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
    )
    _check_capacity(inv, c)
    if c.problems:
        raise ValidationError([m for _, _, m in sorted(c.problems)])
    return inv


def _job_spec(c: _Checker, value: Any) -> dict[str, object] | None:
    """`job_spec:` the service's job description, any mapping of JSON values.

    It is written as TF_CONFIG's and CLUSTER_SPEC's `job`, so it must be JSON: YAML's
    dates, binary values and NaN are refused with their key path.
    """
    path: Path_ = ("job_spec",)
    if value is None:
        return None
    if not isinstance(value, dict):
        c.add(
            path,
            f"expected a mapping (the service's job description, such as a CustomJobSpec), got {show_value(value)}",
        )
        return None
    stack: list[tuple[Path_, Any]] = [(path, value)]
    while stack:  # not recursive: a deeply nested spec must not hit the recursion limit
        where, v = stack.pop()
        if isinstance(v, dict):
            stack += [(where + (k,), x) for k, x in reversed(list(v.items()))]
        elif isinstance(v, list):
            stack += [(where + (i,), x) for i, x in reversed(list(enumerate(v)))]
        elif not (v is None or isinstance(v, (str, bool, int)) or (isinstance(v, float) and math.isfinite(v))):
            c.add(
                where, f"expected a JSON value (string, number, true/false, null, list or mapping), got {show_value(v)}"
            )
            return None
    return value


def _check_capacity(inv: Inventory, c: _Checker) -> None:
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
        place(inv)
    except PlacementError as e:
        c.add(("pools", e.role), e.reason)


def load(path: str | os.PathLike[str]) -> Inventory:
    """Read and validate an inventory file."""
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
    return parse(text, p.resolve(), display=str(path))
