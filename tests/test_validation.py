"""Every validation error a user can hit, each with the exact message, in one place.

This file is the single source of docs/validation-errors.md: each `Case` is a valid base
inventory (BASE) plus a small edit, and the exact lines `provision validate` prints for
it. `test_case` proves each message; `test_docs_up_to_date` regenerates the markdown
from the cases and fails when the committed file differs. After adding or changing a
case, rewrite the doc with

    UPDATE_DOCS=1 pytest tests/test_validation.py -k docs

Message shape: `FILE:LINE: key.path: what is wrong[, got X]` (LINE left out only where
no line is known, e.g. an empty file); every problem of a file is reported at once, in
line order, one line each.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from provision.core.errors import ProvisionError, ValidationError
from provision.importers.common import parse_structured
from provision.inventory.inventory import load, parse

DOC = Path(__file__).resolve().parent.parent / "docs" / "validation-errors.md"
NAME = "inventory.yaml"  # how the file is named in every message below
DIR = "/home/me/mnist"  # the inventory's directory, as shown in messages about files:

BASE = """\
job: mnist
ssh:
  user: root
  port: 22
  host_key_policy: accept-new
hosts:
  - name: gpu-1
    address: 192.0.2.11
    accelerators: {type: nvidia-h100, count: 8}
    labels: {rack: r1}
  - name: gpu-2
    address: 192.0.2.12
    accelerators: {type: nvidia-h100, count: 8}
    labels: {rack: r2}
  - name: cpu-1
    address: 192.0.2.21
pools:
  chief:
    replicas: 1
    accelerators: 8
    command: [/opt/venv/bin/python, /opt/job/train.py]
  worker:
    replicas: 1
    accelerators: 8
    command: [/opt/venv/bin/python, /opt/job/train.py]
  ps:
    replicas: 1
    command: [/opt/venv/bin/python, /opt/job/train.py]
env: {NCCL_DEBUG: WARN}
files:
  - {src: train.py, dest: /opt/job/train.py}
tf_config: {chief_name: chief}
success: {policy: chief}
"""

CMD = "command: [/opt/venv/bin/python, /opt/job/train.py]"


@dataclass(frozen=True)
class Case:
    id: str
    problem: str  # the row's title in the doc
    expect: tuple[str, ...]  # every line validate prints, in order
    edits: tuple[tuple[str, str], ...] = ()  # (old, new) on BASE; each old occurs exactly once
    text: str | None = None  # the whole file instead of BASE + edits
    raw: bytes | None = None  # the file's bytes (for encoding problems); loaded with load()
    fix: str = ""
    shown: str | None = None  # what the doc shows as "you wrote" (default: the new text)
    tree: tuple[tuple[str, str], ...] = ()  # extra files beside the inventory: (path, content)
    links: tuple[tuple[str, str], ...] = ()  # symbolic links beside the inventory: (path, target)

    def source(self) -> str:
        if self.text is not None:
            return self.text
        out = BASE
        for old, new in self.edits:
            assert out.count(old) == 1, f"{self.id}: {old!r} occurs {out.count(old)} times"
            out = out.replace(old, new)
        return out

    def you_wrote(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.text is not None:
            return self.text.rstrip("\n")
        shown = "\n".join(textwrap.dedent(new.strip("\n")) for _, new in self.edits if new.strip())
        return shown or "(removed) " + ", ".join(old.strip().splitlines()[0] for old, _ in self.edits)


def E(*lines: str) -> tuple[str, ...]:
    return tuple(f"{NAME}:{line}" if not line.startswith(NAME) else line for line in lines)


CASES: list[Case] = [
    # ------------------------------------------------------------------ the file itself
    Case(
        "yaml-syntax",
        "Invalid YAML",
        E("30: invalid YAML: did not find expected ',' or '}'"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: {NCCL_DEBUG: WARN\n"),),
        fix="Fix the YAML syntax at that line (here: the missing `}`). The line is where the parser noticed, which can be the line after the mistake.",
    ),
    Case(
        "yaml-tab",
        "Invalid YAML: tab indentation",
        E("3: invalid YAML: found character that cannot start any token"),
        edits=(("  user: root\n", "\tuser: root\n"),),
        shown="<TAB>user: root",
        fix="Indent with spaces; YAML does not allow tabs for indentation.",
    ),
    Case(
        "yaml-multi-doc",
        "More than one YAML document",
        E("34: invalid YAML: but found another document"),
        edits=(("success: {policy: chief}\n", "success: {policy: chief}\n---\njob: other\n"),),
        fix="One inventory per file: remove the `---` and what follows, or split it into two files.",
    ),
    Case(
        "yaml-recursive-alias",
        "Recursive YAML alias",
        E("29: invalid YAML: recursive alias (an anchor used inside itself)"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: &e {NCCL_DEBUG: *e}\n"),),
        fix="An alias (`*e`) may not refer to the mapping or list that contains it.",
    ),
    Case(
        "yaml-merge-key",
        "YAML merge key",
        E(
            "22: pools.worker: missing 'command' or 'image': what should this pool run?",
            "25: pools.worker: YAML merge keys ('<<') are not supported",
        ),
        edits=(
            ("  chief:\n    replicas: 1", "  chief: &pool\n    replicas: 1"),
            (
                "  worker:\n    replicas: 1\n    accelerators: 8\n    " + CMD + "\n",
                "  worker:\n    replicas: 1\n    accelerators: 8\n    <<: *pool\n",
            ),
        ),
        shown="chief: &pool ...\nworker:\n  <<: *pool",
        fix="Write the keys out in each pool (merge keys are not part of YAML 1.2 and hide what a pool really gets).",
    ),
    Case(
        "not-a-mapping",
        "The file is not a mapping",
        E("1: (top level): expected a mapping with job, hosts and pools, got a list"),
        text="- job: mnist\n- hosts: []\n",
        fix="The top level is a mapping (`job:`, `hosts:`, `pools:`, ...), not a list.",
    ),
    Case(
        "empty-file",
        "The file is empty",
        E(f"{NAME}: (top level): expected a mapping with job, hosts and pools, got nothing (null)"),
        text="# nothing here yet\n",
        fix="Write an inventory: at least `job`, `hosts` and `pools` (see inventories/ for examples).",
    ),
    Case(
        "not-utf8",
        "The file is not UTF-8 text",
        E(f"{NAME}: not UTF-8 text (invalid start byte at byte 10)"),
        raw=b"job: mnist\xff\n",
        shown="job: mnist\\xff   (a Latin-1 byte)",
        fix="Save the file as UTF-8.",
    ),
    Case(
        "missing-file",
        "The file does not exist",
        E(f"{NAME}: no such file"),
        shown="provision validate inventory.yaml   (no such file)",
        fix="Check the path.",
    ),
    Case(
        "directory",
        "The path is a directory",
        E(f"{NAME}: is a directory, expected an inventory YAML file"),
        shown="provision validate inventory.yaml   (a directory)",
        fix="Name the YAML file inside the directory.",
    ),
    # ------------------------------------------------------------------ keys
    Case(
        "unknown-key-did-you-mean",
        "Unknown key (a typo)",
        E(
            "22: pools.worker: missing required key 'replicas'",
            "23: pools.worker.replica: unknown key (did you mean 'replicas'?)",
        ),
        edits=(("  worker:\n    replicas: 1", "  worker:\n    replica: 1"),),
        fix="Use the key it suggests. Unknown keys are errors, never silently ignored.",
    ),
    Case(
        "unknown-key-top",
        "Unknown key (no close match)",
        E(
            "34: nodes: unknown key (allowed: job, ssh, hosts, pools, env, secret_env, files, tf_config, success, job_spec, setup, outputs, state, tune, priority, preemptible, preemption, placement, progress, recovery, spares, checkpoint)"
        ),
        edits=(("success: {policy: chief}\n", "success: {policy: chief}\nnodes: 3\n"),),
        fix="Remove it, or use one of the allowed keys.",
    ),
    Case(
        "unknown-key-host",
        "Unknown key in a host",
        E(
            "9: hosts[0].gpus: unknown key (allowed: name, address, cluster_address, accelerators, labels, drain, user, port, identity_file, host_key_policy, jump_host, connect_timeout)"
        ),
        edits=(
            (
                "    accelerators: {type: nvidia-h100, count: 8}\n    labels: {rack: r1}",
                "    gpus: 8\n    labels: {rack: r1}",
            ),
        ),
        shown="- name: gpu-1\n  gpus: 8",
        fix="A host's GPUs are `accelerators: {type: nvidia-h100, count: 8}`.",
    ),
    Case(
        "missing-job",
        "Missing required key",
        E("1: (top level): missing required key 'job'"),
        edits=(("job: mnist\n", ""),),
        fix="Every inventory needs `job`, `hosts` and `pools`.",
    ),
    Case(
        "missing-host-address",
        "Host without an address",
        E("15: hosts[2]: missing required key 'address'"),
        edits=(("  - name: cpu-1\n    address: 192.0.2.21\n", "  - name: cpu-1\n"),),
        fix="Every host needs `name` and `address` (where SSH connects).",
    ),
    Case(
        "duplicate-yaml-key",
        "Duplicate YAML key",
        E("25: pools.worker.replicas: duplicate key (YAML keeps only the last one)"),
        edits=(
            (
                "  worker:\n    replicas: 1\n    accelerators: 8\n",
                "  worker:\n    replicas: 1\n    accelerators: 8\n    replicas: 2\n",
            ),
        ),
        shown="worker:\n  replicas: 1\n  accelerators: 8\n  replicas: 2",
        fix="Keep one of them. (Plain YAML loaders silently keep the last; provision refuses to guess.)",
    ),
    Case(
        "non-string-key",
        "A key that is not a string",
        E("29: env: keys must be strings, got a list"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: {NCCL_DEBUG: WARN, [1, 2]: x}\n"),),
        fix="Keys are names.",
    ),
    Case(
        "control-char-key",
        "A key with a newline or control character",
        E(
            "29: env.'A\\nB': not a valid environment variable name (letters, digits, '_', not starting with a digit), got 'A\\nB'"
        ),
        edits=(("env: {NCCL_DEBUG: WARN}\n", 'env: {NCCL_DEBUG: WARN, "A\\nB": x}\n'),),
        fix="Messages show such keys quoted so that every problem stays on one line.",
    ),
    # ------------------------------------------------------------------ types
    Case(
        "wrong-type-int",
        "Wrong type: an integer expected",
        E("23: pools.worker.replicas: expected an integer from 0 to 100000, got 'three'"),
        edits=(("  worker:\n    replicas: 1", "  worker:\n    replicas: three"),),
        fix="Write a number: `replicas: 3`.",
    ),
    Case(
        "wrong-type-quoted-int",
        "Wrong type: a quoted number",
        E("4: ssh.port: expected an integer from 1 to 65535, got '22'"),
        edits=(("  port: 22\n", '  port: "22"\n'),),
        fix="Leave numbers unquoted.",
    ),
    Case(
        "wrong-type-bool",
        "Wrong type: a boolean where a number is expected",
        E("20: pools.chief.accelerators: expected an integer from 0 to 1024, got True"),
        edits=(("  chief:\n    replicas: 1\n    accelerators: 8", "  chief:\n    replicas: 1\n    accelerators: yes"),),
        fix="`yes`/`no`/`true`/`false` are booleans in YAML; give the number of accelerators per replica.",
    ),
    Case(
        "wrong-type-list",
        "Wrong type: a list expected",
        E("28: pools.ps.command: expected a list of strings, got '/opt/venv/bin/python /opt/job/train.py'"),
        edits=(
            (
                "  ps:\n    replicas: 1\n    " + CMD,
                "  ps:\n    replicas: 1\n    command: /opt/venv/bin/python /opt/job/train.py",
            ),
        ),
        fix="A command is a list, one item per argument: `command: [/opt/venv/bin/python, /opt/job/train.py]`. No shell parses it.",
    ),
    Case(
        "wrong-type-mapping",
        "Wrong type: a mapping expected",
        E("29: env: expected a mapping, got a list"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: [NCCL_DEBUG=WARN]\n"),),
        fix="`env` maps names to values: `env: {NCCL_DEBUG: WARN}`.",
    ),
    Case(
        "wrong-type-string",
        "Wrong type: a string expected",
        E("29: env.OPTS: expected a string, got a list"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: {NCCL_DEBUG: WARN, OPTS: [a, b]}\n"),),
        fix="Environment values are strings; quote them if YAML would read them otherwise.",
    ),
    Case(
        "pool-not-mapping",
        "A pool that is not a mapping",
        E("26: pools.ps: expected a mapping, got 2"),
        edits=(("  ps:\n    replicas: 1\n    " + CMD + "\n", "  ps: 2\n"),),
        fix="A pool is a mapping: `ps: {replicas: 2, command: [...]}`.",
    ),
    Case(
        "hosts-empty",
        "No hosts",
        E(
            "6: hosts: expected a non-empty list of hosts, got an empty list",
        ),
        edits=((BASE[BASE.index("hosts:\n") : BASE.index("pools:\n")], "hosts: []\n"),),
        fix="List at least one host.",
    ),
    # ------------------------------------------------------------------ names and addresses
    Case(
        "job-name",
        "Job name is not a DNS label",
        E(
            "1: job: expected a DNS-1035 label (a-z, 0-9, '-', starting with a letter, at most 40 characters), got 'MNIST_run'"
        ),
        edits=(("job: mnist\n", "job: MNIST_run\n"),),
        fix="Lower-case letters, digits and `-`, starting with a letter, at most 40 characters: `mnist-run`. The name becomes part of unit names and paths.",
    ),
    Case(
        "job-name-long",
        "Job name too long",
        E(
            "1: job: expected a DNS-1035 label (a-z, 0-9, '-', starting with a letter, at most 40 characters), got 'a-very-long-job-name-that-goes-on-and-on-and-on'"
        ),
        edits=(("job: mnist\n", "job: a-very-long-job-name-that-goes-on-and-on-and-on\n"),),
        fix="At most 40 characters.",
    ),
    Case(
        "duplicate-host",
        "Duplicate host names",
        E("11: hosts[1].name: duplicate host name 'gpu-1' (also hosts[0])"),
        edits=(("  - name: gpu-2\n", "  - name: gpu-1\n"),),
        fix="Host names are unique; they name the host in every message and in `--target`.",
    ),
    Case(
        "same-machine",
        "Two host entries for one machine",
        E("16: hosts[2].address: 192.0.2.11 port 22 is hosts[0] again: one entry per machine"),
        edits=(("    address: 192.0.2.21\n", "    address: 192.0.2.11:22\n"),),
        fix="One entry per machine (its address and SSH port, however written): two entries would hand its GPUs and ports out twice.",
    ),
    Case(
        "host-name",
        "Host name with invalid characters",
        E("15: hosts[2].name: expected a host name (letters, digits, '.', '_', '-'), got 'cpu 1'"),
        edits=(("  - name: cpu-1\n", "  - name: cpu 1\n"),),
        fix="Letters, digits, `.`, `_`, `-`; at most 63 characters.",
    ),
    Case(
        "host-address",
        "Bad host address",
        E(
            "16: hosts[2].address: expected a host name or an IP address, with :PORT if not 22 ([IPv6]:PORT), got 'http://192.0.2.21'"
        ),
        edits=(("    address: 192.0.2.21\n", "    address: http://192.0.2.21\n"),),
        fix="A host name or an IP address, no scheme or path; a port as `HOST:PORT` (`[IPv6]:PORT`) or with `port:`.",
    ),
    Case(
        "setup-timeout",
        "A setup's timeout that is not a number of seconds",
        E("34: setup.timeout: expected an integer from 1 to 604800, got '1h'"),
        edits=(
            (
                "success: {policy: chief}\n",
                "success: {policy: chief}\nsetup: {commands: [apt-get update], timeout: 1h}\n",
            ),
        ),
        fix="Whole seconds, at most a week: `timeout: 3600` (the default). systemd stops a setup that runs longer, and it has failed.",
    ),
    Case(
        "setup-inputs",
        "A setup input that is not a pushed file",
        E("34: setup.inputs[0]: '/opt/job/requirements.txt' is not a files: destination (nor in or above one)"),
        edits=(
            (
                "success: {policy: chief}\n",
                "success: {policy: chief}\nsetup: {commands: [pip install -r /opt/job/requirements.txt], inputs: [/opt/job/requirements.txt]}\n",
            ),
        ),
        fix="Name files that `files:` pushes (their destination on the host), or a directory of them: setup runs again when they change.",
    ),
    Case(
        "host-address-port",
        "Bad port in a host address",
        E("16: hosts[2].address: port '70000' is not a number from 1 to 65535, got '192.0.2.21:70000'"),
        edits=(("    address: 192.0.2.21\n", "    address: 192.0.2.21:70000\n"),),
        fix="The SSH port after the colon, from 1 to 65535.",
    ),
    Case(
        "host-address-two-ports",
        "Two different SSH ports for one host",
        E("17: hosts[2].port: 2202 contradicts the port in address '192.0.2.21:2201'"),
        edits=(("    address: 192.0.2.21\n", "    address: 192.0.2.21:2201\n    port: 2202\n"),),
        fix="Give the port once: in `address` (`HOST:PORT`) or as `port:`.",
    ),
    Case(
        "cluster-address",
        "Bad cluster_address",
        E(
            "17: hosts[2].cluster_address: takes no port, got 'cpu-1.ib:2222': the tasks' ports are the pools' (pools.ROLE.port)"
        ),
        edits=(("    address: 192.0.2.21\n", "    address: 192.0.2.21\n    cluster_address: cpu-1.ib:2222\n"),),
        fix="Only the address; task ports come from the pools.",
    ),
    Case(
        "host-accelerators",
        "Bad host accelerators",
        E(
            "9: hosts[0].accelerators.type: expected an accelerator type such as nvidia-h100 or tpu-v5e, got 'nvidia h100'",
            "9: hosts[0].accelerators.count: expected an integer from 0 to 1024, got -8",
        ),
        edits=(
            (
                "    accelerators: {type: nvidia-h100, count: 8}\n    labels: {rack: r1}",
                "    accelerators: {type: nvidia h100, count: -8}\n    labels: {rack: r1}",
            ),
        ),
        fix="`accelerators: {type: nvidia-h100, count: 8}`; a type starting with `tpu` makes a TPU host.",
    ),
    Case(
        "host-labels",
        "Bad host label",
        E("10: hosts[0].labels.rack: expected a label value (letters, digits, '.', '_', '-'), got 'row 1'"),
        edits=(("    labels: {rack: r1}\n", "    labels: {rack: row 1}\n"),),
        fix="Label names and values: letters, digits, `.`, `_`, `-`.",
    ),
    # ------------------------------------------------------------------ ssh
    Case(
        "host-key-policy",
        "Bad host_key_policy",
        E(
            "5: ssh.host_key_policy: expected one of strict, accept-new, off, got 'accept_new' (did you mean 'accept-new'?)"
        ),
        edits=(("  host_key_policy: accept-new\n", "  host_key_policy: accept_new\n"),),
        fix="`strict` (known hosts only), `accept-new` (learn unknown keys, refuse changed ones) or `off`.",
    ),
    Case(
        "host-key-policy-bool",
        "host_key_policy read as a boolean",
        E(
            "5: ssh.host_key_policy: expected one of strict, accept-new, off, got True (YAML reads an unquoted on/yes/true as a boolean: quote it)"
        ),
        edits=(("  host_key_policy: accept-new\n", "  host_key_policy: yes\n"),),
        fix='YAML 1.1 reads unquoted `yes`/`on`/`true` as true and `no`/`off`/`false` as false. An unquoted `off` (or any false) is taken as `off`; anything else, quote: `host_key_policy: "strict"`.',
    ),
    Case(
        "jump-host",
        "Bad jump_host",
        E("6: ssh.jump_host: expected [user@]host[:port], got 'ssh://ops@bastion'"),
        edits=(("  host_key_policy: accept-new\n", "  host_key_policy: accept-new\n  jump_host: ssh://ops@bastion\n"),),
        fix="Like OpenSSH ProxyJump: `ops@bastion:22`.",
    ),
    Case(
        "jump-host-port",
        "jump_host port out of range",
        E("6: ssh.jump_host: port must be from 1 to 65535, got 'ops@bastion:99999'"),
        edits=(("  host_key_policy: accept-new\n", "  host_key_policy: accept-new\n  jump_host: ops@bastion:99999\n"),),
        fix="A TCP port from 1 to 65535.",
    ),
    Case(
        "ssh-port",
        "Bad SSH port",
        E("17: hosts[2].port: expected an integer from 1 to 65535, got 70000"),
        edits=(("    address: 192.0.2.21\n", "    address: 192.0.2.21\n    port: 70000\n"),),
        fix="A TCP port from 1 to 65535.",
    ),
    Case(
        "ssh-user",
        "Bad SSH user",
        E("3: ssh.user: expected a user name, got 'root;id'"),
        edits=(("  user: root\n", "  user: root;id\n"),),
        fix="A plain user name.",
    ),
    Case(
        "connect-timeout",
        "Bad connect_timeout",
        E("6: ssh.connect_timeout: expected a number > 0, got 0"),
        edits=(("  host_key_policy: accept-new\n", "  host_key_policy: accept-new\n  connect_timeout: 0\n"),),
        fix="Seconds, more than 0.",
    ),
    # ------------------------------------------------------------------ pools: shape
    Case(
        "pool-unknown",
        "Unknown pool",
        E("26: pools.server: unknown key (allowed: chief, worker, ps, reduction_server, evaluator)"),
        edits=(("  ps:\n    replicas: 1\n", "  server:\n    replicas: 1\n"),),
        fix="Pools are chief, worker, ps, reduction_server and evaluator (Vertex workerpool0-3).",
    ),
    Case(
        "no-pools",
        "No pools",
        E("17: pools: no pools: name at least one of chief, worker, ps, reduction_server, evaluator"),
        edits=((BASE[BASE.index("pools:\n") : BASE.index("env:")], "pools: {}\n"),),
        fix="Name what the job runs.",
    ),
    Case(
        "all-zero",
        "Every pool has 0 replicas",
        E("17: pools: every pool has 0 replicas: nothing to run"),
        edits=(
            ("  chief:\n    replicas: 1", "  chief:\n    replicas: 0"),
            ("  worker:\n    replicas: 1", "  worker:\n    replicas: 0"),
            ("  ps:\n    replicas: 1", "  ps:\n    replicas: 0"),
        ),
        shown="chief: {replicas: 0, ...}\nworker: {replicas: 0, ...}\nps: {replicas: 0, ...}",
        fix="Give at least one pool replicas (to stop a job, use `provision destroy`).",
    ),
    Case(
        "two-chiefs",
        "More than one chief",
        E("19: pools.chief.replicas: a job has at most one chief, got 2"),
        edits=(("  chief:\n    replicas: 1", "  chief:\n    replicas: 2"),),
        fix="One chief (workerpool0 has exactly one replica); add workers instead.",
    ),
    Case(
        "two-evaluators",
        "More than one evaluator",
        E("29: pools.evaluator.replicas: a job has at most one evaluator, got 2"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "  evaluator: {replicas: 2, " + CMD + "}\nenv: {NCCL_DEBUG: WARN}\n"),),
        shown="pools:\n  evaluator: {replicas: 2, command: [...]}",
        fix="At most one evaluator.",
    ),
    Case(
        "ps-and-reduction",
        "ps together with reduction_server",
        E("17: pools: ps and reduction_server both use workerpool2; a job has one or the other"),
        edits=(
            ("env: {NCCL_DEBUG: WARN}\n", "  reduction_server: {replicas: 1, " + CMD + "}\nenv: {NCCL_DEBUG: WARN}\n"),
        ),
        shown="pools:\n  ps: {replicas: 1, ...}\n  reduction_server: {replicas: 1, command: [...]}",
        fix="Parameter servers (TF ParameterServerStrategy) or reduction servers (all-reduce), not both.",
    ),
    Case(
        "ps-without-worker",
        "ps without a chief or without workers",
        E("26: pools.ps: parameter-server training needs a chief (coordinator) and workers; this job has no worker"),
        edits=(("  worker:\n    replicas: 1", "  worker:\n    replicas: 0"),),
        fix="ParameterServerStrategy needs a chief (the coordinator) and at least one worker.",
    ),
    Case(
        "ps-without-chief",
        "ps without a chief",
        E("22: pools.ps: parameter-server training needs a chief (coordinator) and workers; this job has no chief"),
        edits=(("  chief:\n    replicas: 1\n    accelerators: 8\n    " + CMD + "\n", ""),),
        fix="Add a chief pool with one replica.",
    ),
    Case(
        "command-and-image",
        "Both command and image",
        E("26: pools.ps: give either 'command' (run on the host) or 'image' (run in a container), not both"),
        edits=(("  ps:\n    replicas: 1\n", "  ps:\n    replicas: 1\n    image: registry.local/trainer:1.4\n"),),
        fix="`command:` runs a program on the host; `image:` (+ `args:`) runs a container. Pick one.",
    ),
    Case(
        "neither-command-nor-image",
        "Neither command nor image",
        E("26: pools.ps: missing 'command' or 'image': what should this pool run?"),
        edits=(("  ps:\n    replicas: 1\n    " + CMD + "\n", "  ps:\n    replicas: 1\n"),),
        fix="Add `command: [...]` or `image: ...`.",
    ),
    Case(
        "args-without-image",
        "args without image",
        E("29: pools.ps.args: 'args' goes with 'image'; with 'command', put the arguments in the command list"),
        edits=(
            (
                "  ps:\n    replicas: 1\n    " + CMD + "\n",
                "  ps:\n    replicas: 1\n    " + CMD + "\n    args: [--epochs, '3']\n",
            ),
        ),
        fix="Append the arguments to `command`.",
    ),
    Case(
        "command-empty",
        "Empty command",
        E("28: pools.ps.command: expected a non-empty list (the program and its arguments)"),
        edits=(("  ps:\n    replicas: 1\n    " + CMD, "  ps:\n    replicas: 1\n    command: []"),),
        fix="The program first, then its arguments.",
    ),
    Case(
        "command-program",
        "Program is not a plain path",
        E(
            "28: pools.ps.command[0]: expected an absolute program path or a program name (letters, digits, '/', '.', '_', '+', '-'; not starting with '-' or '+'; wrap anything fancier in a script), got 'python3 train.py'"
        ),
        edits=(("  ps:\n    replicas: 1\n    " + CMD, "  ps:\n    replicas: 1\n    command: [python3 train.py]"),),
        fix="One list item per argument: `[python3, train.py]`. Arguments may hold anything; the program must be a plain path.",
    ),
    Case(
        "command-relative",
        "Program path that is relative or not normalized",
        E(
            "28: pools.ps.command[0]: expected an absolute program path or a program name (letters, digits, '/', '.', '_', '+', '-'; not starting with '-' or '+'; wrap anything fancier in a script), got 'venv/bin/python'"
        ),
        edits=(
            ("  ps:\n    replicas: 1\n    " + CMD, "  ps:\n    replicas: 1\n    command: [venv/bin/python, train.py]"),
        ),
        fix="systemd runs `/absolute/paths` (without `.` or `..` parts) or bare names looked up in PATH (`python3`); tasks do not start in the inventory's directory.",
    ),
    Case(
        "command-prefix",
        "Program starting with '-' or '+'",
        E(
            "28: pools.ps.command[0]: expected an absolute program path or a program name (letters, digits, '/', '.', '_', '+', '-'; not starting with '-' or '+'; wrap anything fancier in a script), got '-/opt/job/run'"
        ),
        edits=(("  ps:\n    replicas: 1\n    " + CMD, "  ps:\n    replicas: 1\n    command: [-/opt/job/run]"),),
        fix="In ExecStart= a leading `-` would mean 'ignore failures' (the job would succeed when the task fails) and `+` 'full privileges'; provision does not pass such prefixes through.",
    ),
    Case(
        "image-ref",
        "Bad image reference",
        E("28: pools.ps.image: expected an image reference such as registry.local/trainer:1.4, got 'trainer image'"),
        edits=(("  ps:\n    replicas: 1\n    " + CMD, "  ps:\n    replicas: 1\n    image: trainer image"),),
        fix="`registry/name:tag` or `name@sha256:...`.",
    ),
    # ------------------------------------------------------------------ placement restrictions
    Case(
        "pool-host-unknown",
        "A pool names a host that does not exist",
        E("28: pools.ps.hosts[0]: no host named 'cpu1' in hosts (did you mean 'cpu-1'?)"),
        edits=(("  ps:\n    replicas: 1\n", "  ps:\n    replicas: 1\n    hosts: [cpu1]\n"),),
        fix="Use a name from `hosts:`.",
    ),
    Case(
        "pool-selector-none",
        "A label selector that matches no host",
        E("28: pools.ps.hosts: no host has the labels rack=r9"),
        edits=(("  ps:\n    replicas: 1\n", "  ps:\n    replicas: 1\n    hosts: {rack: r9}\n"),),
        fix="A selector matches hosts that have all its labels; check `labels:` of the hosts.",
    ),
    Case(
        "pool-selector-together",
        "Labels that no single host has together",
        E("24: pools.worker.hosts: no host has the labels rack=r1, zone=b"),
        edits=(
            ("    labels: {rack: r2}\n", "    labels: {rack: r2, zone: b}\n"),
            ("  worker:\n    replicas: 1\n", "  worker:\n    replicas: 1\n    hosts: {rack: r1, zone: b}\n"),
        ),
        shown="worker:\n  hosts: {rack: r1, zone: b}   (gpu-1 has rack=r1, gpu-2 has zone=b)",
        fix="All labels of a selector must be on the same host.",
    ),
    Case(
        "pool-hosts-empty",
        "An empty host list",
        E("28: pools.ps.hosts: no host matches this pool's placement restriction"),
        edits=(("  ps:\n    replicas: 1\n", "  ps:\n    replicas: 1\n    hosts: []\n"),),
        fix="Name at least one host, or leave `hosts:` out to allow every host.",
    ),
    # ------------------------------------------------------------------ capacity and placement
    Case(
        "accelerators-per-replica",
        "More accelerators per replica than any host has",
        E(
            "17: pools: the job asks for 24 accelerators in total, the hosts have 16",
            "24: pools.worker.accelerators: 16 per replica (a replica is never split across hosts), but no eligible host has more than 8 (gpu-1)",
        ),
        edits=(
            ("  worker:\n    replicas: 1\n    accelerators: 8", "  worker:\n    replicas: 1\n    accelerators: 16"),
        ),
        fix="A replica runs on one host; ask for at most what the biggest eligible host has, and use more replicas.",
    ),
    Case(
        "accelerators-restricted",
        "More accelerators than the pool's eligible hosts have",
        E(
            "25: pools.worker.accelerators: 4 per replica (a replica is never split across hosts), but no eligible host has more than 0 (cpu-1)"
        ),
        edits=(
            (
                "  worker:\n    replicas: 1\n    accelerators: 8",
                "  worker:\n    replicas: 1\n    hosts: [cpu-1]\n    accelerators: 4",
            ),
        ),
        fix="Allow hosts that have accelerators, or ask for none.",
    ),
    Case(
        "total-demand",
        "Total demand above the cluster's capacity",
        E("17: pools: the job asks for 24 accelerators in total, the hosts have 16"),
        edits=(("  worker:\n    replicas: 1", "  worker:\n    replicas: 2"),),
        fix="Fewer replicas or accelerators per replica, or more hosts.",
    ),
    Case(
        "does-not-fit",
        "Placement does not fit (fragmentation)",
        E(
            "22: pools.worker: replica 1 does not fit: it needs 5 accelerators on one host; free on eligible hosts: gpu-1 2, gpu-2 3, cpu-1 0"
        ),
        edits=(
            ("  chief:\n    replicas: 1\n    accelerators: 8", "  chief:\n    replicas: 1\n    accelerators: 6"),
            ("  worker:\n    replicas: 1\n    accelerators: 8", "  worker:\n    replicas: 2\n    accelerators: 5"),
        ),
        shown="chief:  {replicas: 1, accelerators: 6, ...}\nworker: {replicas: 2, accelerators: 5, ...}   (hosts: 2 x 8 GPUs)",
        fix="The total fits (16 of 16) but not in whole replicas per host: 6+5 > 8. Choose per-replica counts that divide the hosts' accelerators.",
    ),
    # ------------------------------------------------------------------ ports
    Case(
        "port-range",
        "Bad task port",
        E("28: pools.ps.port: expected an integer from 1024 to 65535, got 80"),
        edits=(("  ps:\n    replicas: 1\n", "  ps:\n    replicas: 1\n    port: 80\n"),),
        fix="Task ports are 1024-65535 (tasks do not run with the privilege to bind below 1024).",
    ),
    Case(
        "port-clash",
        "Two pools with the same port",
        E("29: pools.ps.port: port 2222 is also pools.chief.port; give each pool its own port or leave it unset"),
        edits=(
            ("  chief:\n    replicas: 1\n", "  chief:\n    replicas: 1\n    port: 2222\n"),
            ("  ps:\n    replicas: 1\n", "  ps:\n    replicas: 1\n    port: 2222\n"),
        ),
        shown="chief: {port: 2222, ...}\nps:    {port: 2222, ...}",
        fix="Leave `port` unset (tasks sharing a host get the next free port) or give each pool its own.",
    ),
    Case(
        "port-exhausted",
        "No free port left on a host",
        E("26: pools.ps: replica 1: no free port left on cpu-1"),
        edits=(("  ps:\n    replicas: 1\n", "  ps:\n    replicas: 2\n    port: 65535\n"),),
        fix="Tasks on one host use consecutive ports from the pool's port; start lower.",
    ),
    # ------------------------------------------------------------------ environment
    Case(
        "env-key",
        "Environment variable name that is not valid",
        E(
            "29: env.NCCL-DEBUG: not a valid environment variable name (letters, digits, '_', not starting with a digit), got 'NCCL-DEBUG'"
        ),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: {NCCL-DEBUG: WARN}\n"),),
        fix="Letters, digits and `_`, not starting with a digit.",
    ),
    Case(
        "env-reserved",
        "Environment variable that provision sets",
        E("29: env.TF_CONFIG: is set by provision for every task (see cluster-env) and cannot be overridden"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: {NCCL_DEBUG: WARN, TF_CONFIG: '{}'}\n"),),
        fix="TF_CONFIG, CLUSTER_SPEC, MASTER_ADDR, RANK, CUDA_VISIBLE_DEVICES and the other cluster variables come from the placement, so that every task agrees.",
    ),
    Case(
        "pool-env-reserved",
        "Pool environment variable that provision sets",
        E(
            "29: pools.ps.env.CUDA_VISIBLE_DEVICES: is set by provision for every task (see cluster-env) and cannot be overridden"
        ),
        edits=(
            (
                "  ps:\n    replicas: 1\n    " + CMD + "\n",
                "  ps:\n    replicas: 1\n    " + CMD + "\n    env: {CUDA_VISIBLE_DEVICES: '0'}\n",
            ),
        ),
        fix='Accelerators are given to tasks by `accelerators:`; a task without any gets `CUDA_VISIBLE_DEVICES=""`.',
    ),
    Case(
        "env-nul",
        "A value with a NUL byte",
        E("29: env.GREETING: NUL bytes are not allowed, got 'hi\\x00there'"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", 'env: {NCCL_DEBUG: WARN, GREETING: "hi\\0there"}\n'),),
        fix="No program can receive a NUL byte in an environment variable or argument.",
    ),
    Case(
        "arg-nul",
        "A command argument with a NUL byte",
        E("28: pools.ps.command[1]: NUL bytes are not allowed, got 'a\\x00b'"),
        edits=(
            (
                "  ps:\n    replicas: 1\n    " + CMD,
                '  ps:\n    replicas: 1\n    command: [/opt/venv/bin/python, "a\\0b"]',
            ),
        ),
        fix="Remove the NUL.",
    ),
    Case(
        "secret-env-type",
        "secret_env is not a list",
        E("30: secret_env: expected a list of strings, got 'WANDB_API_KEY'"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: {NCCL_DEBUG: WARN}\nsecret_env: WANDB_API_KEY\n"),),
        fix="A list of variable names: `secret_env: [WANDB_API_KEY]`.",
    ),
    Case(
        "secret-env-name",
        "secret_env name that is not valid",
        E("30: secret_env[0]: expected an environment variable name, got 'wandb-key'"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: {NCCL_DEBUG: WARN}\nsecret_env: [wandb-key]\n"),),
        fix="Names only; the values come from the controller's environment at apply time.",
    ),
    Case(
        "secret-env-reserved",
        "secret_env names a variable provision sets",
        E("30: secret_env[0]: RANK is set by provision for every task and cannot be a secret"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: {NCCL_DEBUG: WARN}\nsecret_env: [RANK]\n"),),
        fix="Remove it.",
    ),
    Case(
        "secret-env-also-env",
        "A variable both in env and secret_env",
        E("30: secret_env[0]: NCCL_DEBUG is also in env; a variable is either plain or secret"),
        edits=(("env: {NCCL_DEBUG: WARN}\n", "env: {NCCL_DEBUG: WARN}\nsecret_env: [NCCL_DEBUG]\n"),),
        fix="Keep it in one of them.",
    ),
    # ------------------------------------------------------------------ files
    Case(
        "files-src-missing",
        "files: src does not exist",
        E(f"31: files[0].src: no such file or directory: {DIR}/trian.py"),
        edits=(("  - {src: train.py,", "  - {src: trian.py,"),),
        fix="`src` is relative to the inventory's directory (or absolute, or `~/...`).",
    ),
    Case(
        "files-dest-relative",
        "files: dest is relative",
        E("31: files[0].dest: expected an absolute path on the host, got 'opt/job/train.py'"),
        edits=(("dest: /opt/job/train.py}", "dest: opt/job/train.py}"),),
        fix="Absolute paths only: `/opt/job/train.py`.",
    ),
    Case(
        "files-dest-dotdot",
        "files: dest climbs above / with ..",
        E("31: files[0].dest: climbs above / with '..', got '/opt/../../etc/cron.d/x'"),
        edits=(("dest: /opt/job/train.py}", "dest: /opt/../../etc/cron.d/x}"),),
        fix="Every `dest` is normalised before it is checked: `//`, `/./` and `..` are resolved as the host reads the path (`/opt/job/../lib/x` is `/opt/lib/x`) and a trailing `/` is dropped; `..` may not climb above `/`. Write the real path.",
    ),
    Case(
        "files-dest-root",
        "files: dest is /",
        E("31: files[0].dest: is the root directory /; name a directory below it, got '/./'"),
        edits=(("  - {src: train.py, dest: /opt/job/train.py}", "  - {src: job/, dest: /./}"),),
        tree=(("job/train.py", "print('train')\n"),),
        fix="Push a directory into its own place, such as `/opt/job/`.",
    ),
    Case(
        "files-dest-reserved",
        "files: dest inside provision's own directories",
        E("31: files[0].dest: /etc/systemd/system/train.service is reserved for provision's own files"),
        edits=(("dest: /opt/job/train.py}", "dest: /etc/systemd/system/train.service}"),),
        fix="/etc/provision and /etc/systemd/system are provision's; push your files elsewhere.",
    ),
    Case(
        "files-dest-reserved-normalised",
        "files: dest that normalises into provision's own directories",
        E(
            "31: files[0].dest: /etc/provision/mnist/chief-0.env is reserved for provision's own files, got '//etc/provision/mnist/chief-0.env'"
        ),
        edits=(("dest: /opt/job/train.py}", "dest: //etc/provision/mnist/chief-0.env}"),),
        fix="The check is made on the normalised path (`//etc/...`, `/etc/./provision/...` and `/opt/../etc/provision/...` are all `/etc/provision/...`); push your files elsewhere.",
    ),
    Case(
        "files-dir-into-reserved",
        "files: a directory that reaches into provision's directories",
        E(
            f"31: files[0].src: {DIR}/overlay/systemd/system would be pushed into /etc/systemd/system, which is reserved for provision's own files"
        ),
        edits=(("  - {src: train.py, dest: /opt/job/train.py}", "  - {src: overlay/, dest: /etc/}"),),
        tree=(("overlay/systemd/system/extra.service", "[Service]\n"),),
        shown="- {src: overlay/, dest: /etc/}   (overlay/systemd/system/extra.service exists)",
        fix="Units and env files under /etc/systemd/system and /etc/provision are written by provision (and removed by destroy); push the directory's other content to its own place.",
    ),
    Case(
        "files-dest-duplicate",
        "files: two entries write the same file",
        E("32: files[1].dest: /opt/job/train.py is also written by files[0]; a file on the host has one source"),
        edits=(
            (
                "  - {src: train.py, dest: /opt/job/train.py}\n",
                "  - {src: train.py, dest: /opt/job/train.py}\n  - {src: train.py, dest: /opt//job/./train.py}\n",
            ),
        ),
        fix="Give each file one entry. Destinations are compared once normalised, and a directory's files count one by one (two directories may fill the same place as long as no file is in both).",
    ),
    Case(
        "files-dest-file-and-dir",
        "files: a file where another entry needs a directory",
        E("32: files[1].dest: /opt/job/train.py needs /opt/job to be a directory, but files[0] writes a file there"),
        edits=(
            (
                "  - {src: train.py, dest: /opt/job/train.py}\n",
                "  - {src: train.py, dest: /opt/job}\n  - {src: job/, dest: /opt/job/}\n",
            ),
        ),
        tree=(("job/train.py", "print('train')\n"),),
        fix="A file (`src` not a directory) goes to `dest` itself; end `dest` with `/` to put it into that directory: `dest: /opt/job/` pushes `/opt/job/train.py`.",
    ),
    Case(
        "files-link-outside",
        "files: a link in a pushed directory points out of it",
        E(
            f"31: files[0].src: {DIR}/job/key is a symbolic link to {DIR}/secret.key, outside the pushed directory {DIR}/job"
        ),
        edits=(("  - {src: train.py, dest: /opt/job/train.py}", "  - {src: job/, dest: /opt/job/}"),),
        tree=(("job/train.py", "print('train')\n"), ("secret.key", "k\n")),
        links=(("job/key", "../secret.key"),),
        shown="- {src: job/, dest: /opt/job/}   (job/key -> ../secret.key)",
        fix="Links inside a pushed directory must stay inside it: a link to a file there is pushed as that file (with its mode), a link to a directory there is walked. Copy what you need into the directory, or push it with its own entry. (The `src` of an entry may itself be a link to anywhere: that is the file you named.)",
    ),
    Case(
        "files-link-dangling",
        "files: a dangling link in a pushed directory",
        E(f"31: files[0].src: {DIR}/job/model.bin is a symbolic link to checkpoints/last.bin, which does not exist"),
        edits=(("  - {src: train.py, dest: /opt/job/train.py}", "  - {src: job/, dest: /opt/job/}"),),
        tree=(("job/train.py", "print('train')\n"),),
        links=(("job/model.bin", "checkpoints/last.bin"),),
        shown="- {src: job/, dest: /opt/job/}   (job/model.bin -> checkpoints/last.bin, missing)",
        fix="Remove the link or create what it points to.",
    ),
    Case(
        "files-link-loop",
        "files: a link to a directory that contains it",
        E(f"31: files[0].src: {DIR}/job/self is a symbolic link to {DIR}/job, a directory that contains it (a loop)"),
        edits=(("  - {src: train.py, dest: /opt/job/train.py}", "  - {src: job/, dest: /opt/job/}"),),
        tree=(("job/train.py", "print('train')\n"),),
        links=(("job/self", "."),),
        shown="- {src: job/, dest: /opt/job/}   (job/self -> .)",
        fix="Walking it would never end: remove the link. (Links to other directories in the tree are fine.)",
    ),
    Case(
        "files-keys",
        "files: entry without dest",
        E("31: files[0]: missing required key 'dest'"),
        edits=(("  - {src: train.py, dest: /opt/job/train.py}", "  - {src: train.py}"),),
        fix="Each entry has `src` (on this machine) and `dest` (on the hosts).",
    ),
    # ------------------------------------------------------------------ restart, success, tf_config
    Case(
        "restart-policy",
        "Bad restart policy",
        E(
            "24: pools.worker.restart.policy: expected one of Never, OnFailure, Always, ExitCode, got 'OnFail' (did you mean 'OnFailure'?)"
        ),
        edits=(
            ("  worker:\n    replicas: 1\n", "  worker:\n    replicas: 1\n    restart: {policy: OnFail, limit: 3}\n"),
        ),
        fix="`Never`, `OnFailure`, `Always` or `ExitCode` (1-127 permanent, 128 and up retried), as in TFJob.",
    ),
    Case(
        "restart-limit",
        "Bad restart limit",
        E("24: pools.worker.restart.limit: expected an integer from 0 to 10000, got -1"),
        edits=(
            (
                "  worker:\n    replicas: 1\n",
                "  worker:\n    replicas: 1\n    restart: {policy: OnFailure, limit: -1}\n",
            ),
        ),
        fix="How many restarts a task gets before the job fails: 0 to 10000.",
    ),
    Case(
        "success-policy",
        "Bad success policy",
        E("33: success.policy: expected one of chief, all_workers, got 'all'"),
        edits=(("success: {policy: chief}\n", "success: {policy: all}\n"),),
        fix="`chief` (the chief exits 0; worker 0 when there is no chief) or `all_workers`.",
    ),
    Case(
        "success-all-workers",
        "all_workers without workers",
        E("30: success.policy: all_workers needs a worker pool with replicas"),
        edits=(
            ("  worker:\n    replicas: 1", "  worker:\n    replicas: 0"),
            ("  ps:\n    replicas: 1\n    " + CMD + "\n", ""),
            ("success: {policy: chief}\n", "success: {policy: all_workers}\n"),
        ),
        shown="worker: {replicas: 0, ...}   (and no ps pool)\nsuccess: {policy: all_workers}",
        fix="Use `chief`, or give the worker pool replicas.",
    ),
    Case(
        "success-nothing",
        "Nothing that can succeed",
        E("23: success.policy: the job has neither a chief nor workers, so nothing can succeed"),
        edits=(
            (BASE[BASE.index("pools:\n") : BASE.index("env:")], "pools:\n  evaluator: {replicas: 1, " + CMD + "}\n"),
        ),
        fix="The job succeeds when its chief (or worker 0) exits 0; an evaluator alone never ends the job.",
    ),
    Case(
        "state-scheme",
        "state: neither local nor a PostgreSQL URL",
        E(
            "34: state: expected local or a postgresql:// URL (postgresql://USER@HOST:PORT/DATABASE), got a mysql:// URL"
        ),
        edits=(
            ("success: {policy: chief}\n", "success: {policy: chief}\nstate: mysql://provision@db.internal/jobs\n"),
        ),
        fix="`local` (the default: a file beside the inventory) or a PostgreSQL URL the team shares.",
    ),
    Case(
        "state-password",
        "A password in the state URL",
        E(
            "34: state: a password in the URL is not accepted (it would be kept in clear): give it in PGPASSWORD "
            "or ~/.pgpass, as for psql"
        ),
        edits=(
            (
                "success: {policy: chief}\n",
                "success: {policy: chief}\nstate: postgresql://provision:s3cret@db.internal/jobs\n",
            ),
        ),
        fix="Leave the password out of the URL: export PGPASSWORD, or add `db.internal:5432:jobs:provision:PASSWORD` "
        "to ~/.pgpass (mode 0600). The URL is recorded on the hosts as the job's owner.",
    ),
    Case(
        "priority",
        "priority: not a number or a class name",
        E(
            "34: priority: expected an integer from -1000000 to 1000000 or a class name (low, normal, high, or one "
            "of the team's policy), got 'Very High'"
        ),
        edits=(("success: {policy: chief}\n", "success: {policy: chief}\npriority: Very High\n"),),
        fix="An integer (higher runs first) or a class of the team's policy: `low`, `normal` (the default), `high`.",
    ),
    Case(
        "preemptible",
        "preemptible: not true or false",
        E("34: preemptible: expected true or false, got 'sometimes'"),
        edits=(("success: {policy: chief}\n", "success: {policy: chief}\npreemptible: sometimes\n"),),
        fix="`true` lets higher-priority work preempt the job (the default for a study's trials), `false` opts out.",
    ),
    Case(
        "preemption",
        "Bad preemption grace or signal",
        E(
            "34: preemption.grace: expected a duration up to 24h (120, 120s, 2m, 1h), got 'soon'",
            "34: preemption.signal: expected one of SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, got 'SIGKILL'",
        ),
        edits=(
            ("success: {policy: chief}\n", "success: {policy: chief}\npreemption: {grace: soon, signal: SIGKILL}\n"),
        ),
        fix="`grace`: how long the tasks have between the signal and being killed (default 120s); `signal`: what "
        "they are asked to stop with (default SIGTERM; SIGKILL would lose the checkpoint).",
    ),
    Case(
        "placement-label",
        "placement.prefer_same names a label no host has, or one twice",
        E(
            "34: placement.prefer_same[0]: no host has the label 'switch'",
            "34: placement.prefer_same[2]: 'rack' is listed twice",
        ),
        edits=(
            (
                "success: {policy: chief}\n",
                "success: {policy: chief}\nplacement: {prefer_same: [switch, rack, rack]}\n",
            ),
        ),
        fix="List host labels (`labels:` of the hosts, or those `provision facts` suggests: `nvlink_domain`, "
        "`ib_subnet`), each once; the first counts most.",
    ),
    Case(
        "placement-key",
        "Unknown placement key",
        E("34: placement.spread: unknown key (allowed: prefer_same)"),
        edits=(("success: {policy: chief}\n", "success: {policy: chief}\nplacement: {spread: [rack]}\n"),),
        fix="`placement:` has one key, `prefer_same`: a list of host labels.",
    ),
    Case(
        "spares-unknown",
        "A spare that is not one of the hosts",
        E("34: spares[0]: no host named 'gpu-9' in hosts: a spare is one of the inventory's hosts"),
        edits=(("success: {policy: chief}\n", "success: {policy: chief}\nspares: [gpu-9]\n"),),
        fix="Name a host of `hosts:` (add the spare machine there, then list its name in `spares:`).",
    ),
    Case(
        "spares-used-by-pool",
        "A spare that a pool names",
        E(
            "35: spares[0]: cpu-1 is named by pools.ps.hosts: a spare waits for a replica that needs one, "
            "no pool is placed on it by name"
        ),
        edits=(
            (
                "    replicas: 1\n    command: [/opt/venv/bin/python, /opt/job/train.py]\nenv:",
                "    replicas: 1\n    hosts: [cpu-1]\n    command: [/opt/venv/bin/python, /opt/job/train.py]\nenv:",
            ),
            ("success: {policy: chief}\n", "success: {policy: chief}\nspares: [cpu-1]\n"),
        ),
        fix="Take the host out of the pool's `hosts:` list, or out of `spares:`: a spare is kept free until a "
        "recovery needs it.",
    ),
    Case(
        "progress-timeout-short",
        "A progress bound shorter than the service's round",
        E(
            "34: progress.timeout: '5s' is shorter than the service's round (10 s): a job would be judged hung "
            "between two looks; give at least 10s, or auto"
        ),
        edits=(("success: {policy: chief}\n", "success: {policy: chief}\nprogress: {timeout: 5s}\n"),),
        fix="Give a bound of at least one round (`10m` is a good start for a job that logs or checkpoints every "
        "minute), or `auto` to learn it from the job's own intervals.",
    ),
    Case(
        "elastic-not-torchrun",
        "An elastic pool that is not PyTorch's",
        E(
            "25: pools.worker.elastic: runs under PyTorch's elastic engine (torchrun's c10d rendezvous), so the "
            "pool's command must be torchrun (or python -m torch.distributed.run), got '/opt/venv/bin/python'"
        ),
        edits=(
            (
                "    accelerators: 8\n    command: [/opt/venv/bin/python, /opt/job/train.py]\n  ps:",
                "    accelerators: 8\n    elastic: {min: 1, max: 2}\n    command: [/opt/venv/bin/python, /opt/job/train.py]\n  ps:",
            ),
        ),
        fix="Run the pool's program under torchrun: `command: [/opt/venv/bin/torchrun, /opt/job/train.py]` "
        "(provision adds `--nnodes=MIN:MAX` and the rendezvous), or leave `elastic` out.",
    ),
    Case(
        "elastic-min-max",
        "An elastic pool whose min is more than its max",
        E("25: pools.worker.elastic: min 3 is more than max 2"),
        edits=(
            (
                "    accelerators: 8\n    command: [/opt/venv/bin/python, /opt/job/train.py]\n  ps:",
                "    accelerators: 8\n    elastic: {min: 3, max: 2}\n    command: [/opt/venv/bin/torchrun, /opt/job/train.py]\n  ps:",
            ),
        ),
        fix="`min` is the fewest nodes the job trains on, `max` the most; min <= replicas <= max.",
    ),
    Case(
        "tf-config-chief-name",
        "Bad tf_config.chief_name",
        E("32: tf_config.chief_name: expected one of chief, master, got 'leader'"),
        edits=(("tf_config: {chief_name: chief}\n", "tf_config: {chief_name: leader}\n"),),
        fix="`chief` (TF2) or `master` (TF1 Estimator only).",
    ),
    Case(
        "tf-config-trial",
        "Bad tf_config.trial",
        E("32: tf_config.trial: expected a trial id such as '1', got 'trial 1'"),
        edits=(("tf_config: {chief_name: chief}\n", "tf_config: {chief_name: chief, trial: trial 1}\n"),),
        fix="A short id (letters, digits, `_`, `.`, `-`), or leave it out.",
    ),
    Case(
        "tf-config-key",
        "Unknown tf_config key",
        E("32: tf_config.environment: unknown key (allowed: chief_name, trial)"),
        edits=(("tf_config: {chief_name: chief}\n", "tf_config: {chief_name: chief, environment: google}\n"),),
        fix="TF_CONFIG's `environment` is always `cloud` (with `google`, TF skips starting its server).",
    ),
]


# --------------------------------------------------------------------------- running a case


def problems_of(case: Case, tmp: Path) -> list[str]:
    """The lines `provision validate` prints for this case (without the 'Error: ' prefix)."""
    (tmp / "train.py").write_text("print('train')\n")
    for rel, content in case.tree:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(content)
    for rel, target in case.links:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, tmp / rel)
    inv = tmp / NAME
    if case.id == "directory":
        inv.mkdir()
    elif case.raw is not None:
        inv.write_bytes(case.raw)
    elif case.id != "missing-file":
        inv.write_text(case.source())
    cwd = os.getcwd()
    os.chdir(tmp)  # messages name the file as given: inventory.yaml
    try:
        load(NAME)
    except ValidationError as e:
        lines = e.problems
    except ProvisionError as e:
        lines = [e.message, *e.details]
    else:
        lines = []
    finally:
        os.chdir(cwd)
    return [line.replace(str(tmp.resolve()), DIR) for line in lines]


LINE = re.compile(rf"^{re.escape(NAME)}(:\d+)?: \S.*$")


def test_base_is_valid(tmp_path):
    assert problems_of(Case("base", "", ()), tmp_path) == []
    inv = parse(BASE, tmp_path / NAME)  # train.py was written by problems_of
    assert [p.role for p in inv.pools] == ["chief", "worker", "ps"]


def test_case_ids_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("written", ["off", "no", "false", '"off"'])
def test_host_key_policy_off_unquoted(written: str, tmp_path: Path) -> None:
    """YAML 1.1 reads an unquoted `off` as false: the only sensible reading is "off"."""
    (tmp_path / "train.py").write_text("print('train')\n")
    text = BASE.replace("  host_key_policy: accept-new\n", f"  host_key_policy: {written}\n")
    text = text.replace("    labels: {rack: r2}\n", f"    labels: {{rack: r2}}\n    host_key_policy: {written}\n")
    inv = parse(text, tmp_path / NAME)
    assert inv.ssh.host_key_policy == "off"
    assert inv.host("gpu-2").ssh.host_key_policy == "off"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(case: Case, tmp_path):
    got = problems_of(case, tmp_path)
    assert got == list(case.expect)
    for line in got:
        assert LINE.match(line), f"not FILE[:LINE]: ...: {line!r}"
        assert "\n" not in line and "\r" not in line


def test_every_problem_reported_at_once(tmp_path):
    """Several independent mistakes → one line each, in line order, nothing stops early."""
    case = Case(
        "many",
        "",
        (),
        edits=(
            ("job: mnist\n", "job: MNIST\n"),
            ("  host_key_policy: accept-new\n", "  host_key_policy: maybe\n"),
            ("  worker:\n    replicas: 1", "  worker:\n    replicas: many"),
            ("env: {NCCL_DEBUG: WARN}\n", "env: {NCCL_DEBUG: WARN, TF_CONFIG: x}\n"),
            ("success: {policy: chief}\n", "success: {policy: some}\n"),
        ),
    )
    got = problems_of(case, tmp_path)
    assert [int(line.split(":")[1]) for line in got] == [1, 5, 23, 29, 33]
    assert len(got) == 5


# --------------------------------------------------------------------------- the doc


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def _code(text: str) -> str:
    """Inline code for a table cell, one span per line; '(removed) ...' stays prose."""
    if text.startswith("(removed) "):
        return "(removed) " + _code(text[len("(removed) ") :])
    return "<br>".join(f"`{_cell(p)}`" for p in text.split("\n") if p)


def render_doc() -> str:
    out = [
        "# Validation errors",
        "",
        "<!-- Generated from tests/test_validation.py: do not edit by hand. After changing the",
        "     cases there, run `UPDATE_DOCS=1 pytest tests/test_validation.py -k docs`. -->",
        "",
        "`provision validate INVENTORY` (and every command that reads an inventory) checks the",
        "whole file before anything touches the network, and reports **every** problem at once,",
        "one line each, in line order, then exits with status 1:",
        "",
        "```",
        "Error: FILE:LINE: key.path: what is wrong, got VALUE",
        "```",
        "",
        "`LINE` is the line of the offending key (left out only where there is none, e.g. an",
        "empty file); `key.path` names the key (`pools.worker.replicas`, `hosts[2].address`).",
        "Capacity and placement are checked only once everything else is valid.",
        "",
        "Each row below is a test case in `tests/test_validation.py`: the base inventory",
        "shown at the end, with the change in the second column, prints exactly the lines of",
        "the third column (the file is named `inventory.yaml` and lives in",
        f"`{DIR}`).",
        "",
        "| # | Problem | You wrote | `provision validate` prints | How to fix it |",
        "|---|---|---|---|---|",
    ]
    for i, c in enumerate(CASES, 1):
        printed = "<br>".join(f"`{_cell(line)}`" for line in c.expect)
        out.append(f"| {i} | {_cell(c.problem)} | {_code(c.you_wrote())} | {printed} | {_cell(c.fix)} |")
    out += [
        "",
        "## The base inventory",
        "",
        "Every case starts from this valid file (with `train.py` beside it):",
        "",
        "```yaml",
        BASE.rstrip("\n"),
        "```",
        "",
    ]
    return "\n".join(out)


def test_docs_up_to_date():
    want = render_doc()
    if os.environ.get("UPDATE_DOCS"):
        DOC.parent.mkdir(parents=True, exist_ok=True)
        DOC.write_text(want)
    have = DOC.read_text() if DOC.exists() else ""
    assert have == want, (
        "docs/validation-errors.md is out of date with tests/test_validation.py; "
        "run `UPDATE_DOCS=1 pytest tests/test_validation.py -k docs`"
    )


# --------------------------------------------------------------------------- a trailing newline


def _edited(path: tuple, value: str) -> str:
    """BASE with the string at `path` (keys and list indexes) set to `value`."""
    import yaml

    doc = yaml.safe_load(BASE)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return yaml.safe_dump(doc, sort_keys=False)


# Every validated string of the inventory, as (key path, a valid value): with "\n" added, each
# must be refused, naming its key path. (`re.match` with `^...$` took a final newline: a
# command whose first word ended in one split ExecStart= and never ran.)
VALIDATED_STRINGS = [
    (("job",), "mnist"),
    (("ssh", "user"), "root"),
    (("ssh", "host_key_policy"), "accept-new"),
    (("ssh", "jump_host"), "ops@bastion:22"),
    (("hosts", 0, "name"), "gpu-1"),
    (("hosts", 0, "address"), "192.0.2.11"),
    (("hosts", 0, "cluster_address"), "gpu-1.ib"),
    (("hosts", 0, "labels", "rack"), "r1"),
    (("hosts", 0, "accelerators", "type"), "nvidia-h100"),
    (("pools", "chief", "command", 0), "/opt/venv/bin/python"),
    (("tf_config", "chief_name"), "chief"),
    (("success", "policy"), "chief"),
]


@pytest.mark.parametrize(
    ("path", "value"), VALIDATED_STRINGS, ids=[".".join(map(str, p)) for p, _ in VALIDATED_STRINGS]
)
def test_a_trailing_newline_is_refused(tmp_path: Path, path: tuple, value: str) -> None:
    (tmp_path / "train.py").write_text("print('train')\n")
    parse(_edited(path, value), tmp_path / NAME)  # the value itself is fine
    with pytest.raises(ValidationError) as e:
        parse(_edited(path, value + "\n"), tmp_path / NAME)
    shown = ".".join(str(p) for p in path if not isinstance(p, int))
    lines = [e.value.message, *e.value.details]
    assert any(path[0] in line and shown.split(".")[-1] in line for line in lines), lines


@pytest.mark.parametrize("key", ["GOOD_KEY\n", "A\nB"])
def test_env_names_with_a_newline_are_refused(tmp_path: Path, key: str) -> None:
    import yaml

    (tmp_path / "train.py").write_text("print('train')\n")
    doc = yaml.safe_load(BASE)
    doc["env"] = {key: "x"}
    with pytest.raises(ValidationError):
        parse(yaml.safe_dump(doc), tmp_path / NAME)
    doc = yaml.safe_load(BASE)
    doc["secret_env"] = [key]
    with pytest.raises(ValidationError):
        parse(yaml.safe_dump(doc), tmp_path / NAME)


def test_yaml_nested_too_deeply_is_a_yaml_error_not_a_traceback(tmp_path):
    """The inventory's reader and the importers' say it in the same words (yamldoc.syntax_error)."""
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(ValidationError) as e:
        parse(f"job: x\nhosts: {deep}\n", tmp_path / "inv.yaml", "inv.yaml")
    assert e.value.problems == ["inv.yaml: invalid YAML: nested too deeply"]
    assert parse_structured(f"a: {deep}\n", "spec.yaml").error == "spec.yaml: invalid YAML: nested too deeply"
    assert parse_structured(deep, "spec.json").error == "spec.json: invalid JSON: nested too deeply"
