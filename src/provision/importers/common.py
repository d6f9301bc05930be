"""What every importer shares: the error, key paths, value checks and the job plan.

An importer reads a service's job (Vertex AI, AI Platform Training) and returns a
`JobPlan`: the pools as provision runs them, plus every field that was not applied or was
applied only in part, each with its reason. `emit.py` turns a plan into commented YAML.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import yaml

from provision.core.encode import ENV_KEY  # what a name in an env file may be

# Variables provision sets itself; a spec may not set them.
from provision.core.envnames import RESERVED_ENV
from provision.core.errors import ProvisionError
from provision.core.tuning import Tune
from provision.inventory.yamldoc import SYNTAX_ERRORS, syntax_error
from provision.inventory.yamldoc import show_value as show

JSON = object  # a value decoded from JSON or YAML


class SpecError(ProvisionError):
    """A spec the importer cannot read; the message names the file and the key path."""


@dataclass(frozen=True)
class Where:
    """A place in a spec: `file: jobSpec.workerPoolSpecs[1].replicaCount`."""

    source: str  # the file as the user named it, with ":LINE" where a line is known
    path: str = ""

    def __truediv__(self, part: str | int) -> Where:
        if isinstance(part, int):
            return Where(self.source, f"{self.path}[{part}]")
        part = part if part.isprintable() else repr(part)  # a message stays one line
        return Where(self.source, f"{self.path}.{part}" if self.path else part)

    def fail(self, what: str) -> NoReturn:
        raise SpecError(f"{self.source}: {self.path or '(top level)'}: {what}")


# --------------------------------------------------------------------------- value checks


def mapping(value: JSON, at: Where) -> dict[str, JSON]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        at.fail(f"expected a mapping, got {show(value)}")
    return value


def items(value: JSON, at: Where) -> list[JSON]:
    if value is None:
        return []
    if not isinstance(value, list):
        at.fail(f"expected a list, got {show(value)}")
    return value


def string(value: JSON, at: Where) -> str:
    # Numbers are accepted as their text: YAML reads an unquoted `3` as a number.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        at.fail(f"expected a string, got {show(value)}")
    s = str(value)
    if "\x00" in s:
        at.fail(f"NUL bytes are not allowed, got {show(s)}")
    return s


def strings(value: JSON, at: Where) -> tuple[str, ...]:
    return tuple(string(v, at / i) for i, v in enumerate(items(value, at)))


def integer(value: JSON, at: Where, lo: int = 0) -> int:
    """An int, or its decimal text: the APIs' JSON writes int64 fields as strings ("4")."""
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,9}\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        at.fail(f"expected an integer, got {show(value)}")
    if value < lo:
        at.fail(f"expected an integer >= {lo}, got {value}")
    return value


def boolean(value: JSON, at: Where) -> bool:
    if not isinstance(value, bool):
        at.fail(f"expected true or false, got {show(value)}")
    return value


def duration(value: JSON, at: Where) -> int:
    """Protobuf Duration JSON ("7200s", "1.5s") as whole seconds, rounded up."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)s", value) if isinstance(value, str) else None
    if m is None:
        at.fail(f"expected a duration such as '7200s', got {show(value)}")
    return math.ceil(float(m.group(1)))


def env_list(value: JSON, at: Where) -> tuple[tuple[str, str], ...]:
    """The APIs' `env: [{name, value}]` as pairs, each name usable in an env file."""
    out: list[tuple[str, str]] = []
    for i, raw in enumerate(items(value, at)):
        m = mapping(raw, at / i)
        unknown = sorted(set(m) - {"name", "value"})
        if unknown:
            (at / i / unknown[0]).fail("unknown key (an env entry has name and value)")
        if "name" not in m:
            (at / i).fail("missing 'name'")
        out.append((env_name(m["name"], at / i / "name"), string(m.get("value", ""), at / i / "value")))
    return tuple(out)


def env_name(value: JSON, at: Where) -> str:
    name = string(value, at)
    if not ENV_KEY.fullmatch(name):
        at.fail(
            f"not a valid environment variable name (letters, digits, '_', not starting with a digit), got {show(name)}"
        )
    if name in RESERVED_ENV:
        at.fail(f"{name} is set by provision for every task (as the services set it) and cannot be given")
    return name


MAX_DEPTH = 64


def check_json(value: JSON, at: Where) -> None:
    """The spec becomes TF_CONFIG's `job`: JSON values only (no YAML binary, NaN, ...), and
    at most MAX_DEPTH levels deep (the YAML writer and reader recurse; real specs have ~6)."""
    stack: list[tuple[Where, JSON, int]] = [(at, value, 0)]
    while stack:
        where, v, depth = stack.pop()
        if depth > MAX_DEPTH and isinstance(v, (dict, list)):
            where.fail(f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(v, dict):
            for k in v:
                if not isinstance(k, str):
                    (where / str(k)).fail(f"keys must be strings, got {show(k)}")
            stack += [(where / k, x, depth + 1) for k, x in reversed(list(v.items()))]
        elif isinstance(v, list):
            stack += [(where / i, x, depth + 1) for i, x in reversed(list(enumerate(v)))]
        elif isinstance(v, float) and not math.isfinite(v):
            where.fail(f"expected a finite number, got {v}")
        elif not (v is None or isinstance(v, (str, bool, int, float))):
            where.fail(f"expected a JSON value (string, number, true/false, null, list or mapping), got {show(v)}")


def camel(key: str) -> str:
    head, *rest = key.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def check_keys(m: dict[str, JSON], at: Where, known: frozenset[str]) -> list[str]:
    """Keys the importer does not know (listed as not applied); snake_case ones are errors:
    the REST API and gcloud's --config take camelCase, so `replica_count` is a typo there."""
    unknown = [k for k in m if k not in known]
    for k in unknown:
        if isinstance(k, str) and "_" in k and camel(k) in known:
            (at / k).fail(f"write the key in camelCase, '{camel(k)}', as the API and gcloud --config do")
    return unknown


# --------------------------------------------------------------------------- reading files


class SpecLoader(yaml.SafeLoader):
    """SafeLoader without timestamps: the APIs write times as strings, and so must `job`."""


SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


# A job spec is a few KB; past these, refuse before the work grows with the input (a 50 MB
# spec took 81 s and 795 MB; a YAML alias bomb ran on past 120 s when its values were walked).
MAX_SPEC_BYTES = 4 * 1024 * 1024
MAX_SPEC_VALUES = 200_000  # after alias expansion


def read_text(path: Path, display: str) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_SPEC_BYTES and path.is_file():
            raise SpecError(f"{display}: {size} bytes; a job spec is at most {MAX_SPEC_BYTES} bytes: refused")
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{display}: no such file") from None
    except IsADirectoryError:
        raise SpecError(f"{display}: is a directory, expected a file") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{display}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise SpecError(f"{display}: cannot read: {e.strerror}") from None


@dataclass(frozen=True)
class Parsed:
    data: JSON  # None when the text is neither JSON nor YAML
    error: str | None = None  # why not, with the line


def parse_structured(text: str, display: str) -> Parsed:
    """JSON when the text starts like JSON (so its errors read as JSON errors), else YAML."""
    if len(text) > MAX_SPEC_BYTES:
        return Parsed(None, f"{display}: {len(text)} characters; a job spec is at most {MAX_SPEC_BYTES}: refused")
    if text.lstrip().startswith(("{", "[")):
        try:
            return Parsed(json.loads(text))
        except SYNTAX_ERRORS as e:
            return Parsed(None, syntax_error(display, e, "JSON"))
    loader = SpecLoader(text)  # a SafeLoader (without timestamps)
    try:
        node = loader.get_single_node()
        if node is not None and _values(node, MAX_SPEC_VALUES) > MAX_SPEC_VALUES:
            return Parsed(
                None,
                f"{display}: more than {MAX_SPEC_VALUES} values once its aliases are expanded (an alias bomb?): refused",
            )
        return Parsed(loader.construct_document(node) if node is not None else None)
    except SYNTAX_ERRORS as e:
        return Parsed(None, syntax_error(display, e))
    finally:
        loader.dispose()


def _values(node: yaml.Node, limit: int) -> int:
    """How many values the document has with every alias expanded, counted up to limit + 1
    (an alias is the same node again: the count stops before the expansion explodes)."""
    count, stack = 0, [node]
    while stack and count <= limit:
        n = stack.pop()
        count += 1
        if isinstance(n, yaml.MappingNode):
            stack.extend(v for kv in n.value for v in kv)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)
    return count


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Note:
    """A field of the spec that provision did not apply, or applied in part."""

    path: str  # key path in the spec
    value: str  # what it held, shortened
    why: str


@dataclass(frozen=True)
class PoolPlan:
    role: str  # provision's pool: chief, worker, ps, reduction_server, evaluator
    origin: str  # where in the spec: "workerPoolSpecs[1]", "workerConfig"
    replicas: int
    accelerators: int = 0
    accelerator_type: str | None = None  # the service's name, e.g. NVIDIA_TESLA_V100
    image: str | None = None
    command: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    restart: str | None = None  # a restart policy, when the spec implies one
    comments: tuple[str, ...] = ()  # written above the pool: what it was, what to check


@dataclass(frozen=True)
class StudyPlan:
    """A hyperparameter study as the inventory's `tune:` (study.py reads it, emit.py writes it)."""

    tune: Tune
    origin: str  # where in the spec: "studySpec", "trainingInput.hyperparameters"
    # False when the service was left to decide how many failed trials end the study (0):
    # `tune:` leaves max_failed_trials out and provision's default applies.
    max_failed_given: bool = True


@dataclass(frozen=True)
class JobPlan:
    service: str  # "Vertex AI" | "AI Platform Training"
    origin: str  # what was read, for the header: "a CustomJob", "a gcloud command (line 3)"
    job: str  # DNS-1035 job name
    pools: tuple[PoolPlan, ...]
    # The spec as the service had it: TF_CONFIG's and CLUSTER_SPEC's `job`.
    job_spec: dict[str, JSON] = field(hash=False, compare=False)
    chief_name: str = "chief"
    chief_why: str = ""
    trial: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # every task
    outputs: str | None = None  # `outputs:` (baseOutputDirectory as a directory on the hosts)
    files: tuple[tuple[str, str], ...] = ()  # (local path, absolute host path)
    setup: tuple[str, ...] = ()  # commands for the (commented) setup block
    not_applied: tuple[Note, ...] = ()
    partly: tuple[Note, ...] = ()
    timeout: int | None = None  # the service's time limit, seconds: a `wait --timeout` hint
    study: StudyPlan | None = None  # a tuning job's search: the inventory's `tune:`


# --------------------------------------------------------------------------- shared mappings

DNS_LABEL = re.compile(r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$")


def job_name(name: str) -> str:
    """A display name or job id as a DNS-1035 label: 'BERT_large v2' -> 'bert-large-v2'."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower())
    s = re.sub(r"^[^a-z]+", "", s)[:40].strip("-")
    return s or "imported"


def value_text(value: JSON) -> str:
    """A spec value for a note: compact JSON, cut short."""
    s = (
        value
        if isinstance(value, str)
        else json.dumps(value, separators=(", ", ": "), ensure_ascii=False, default=repr)
    )
    return s if len(s) <= 70 else s[:67] + "..."


def accelerator_family(name: str) -> str:
    """Compare a service's accelerator type with a host's: NVIDIA_TESLA_V100 and nvidia-v100
    are both 'v100', NVIDIA_H100_80GB and nvidia-h100 'h100', TPU_V5_LITEPOD and tpu-v5e
    'tpu-v5e'. Memory sizes and marketing words are left out."""
    out: list[str] = []
    for w in re.split(r"[-_\s]+", name.lower()):
        if not w or w in ("nvidia", "tesla", "mega", "pod") or re.fullmatch(r"\d+gb", w):
            continue
        if w == "litepod" and out:  # Cloud's "lite pod" TPUs are the v5e/v6e
            out[-1] += "e"
            continue
        out.append(w)
    return "-".join(out)


def host_accelerator_type(service_type: str) -> str:
    """The service's type as a host's `accelerators.type` in this repo's style: nvidia-v100."""
    family = accelerator_family(service_type)
    return family if family.startswith("tpu") or not family else f"nvidia-{family}"


# Pre-built training images (Vertex executorImageUri) name their framework and version:
# .../tf-cpu.2-12.py310, .../pytorch-gpu.1-13.py310, .../sklearn-cpu.1-0, .../xgboost-cpu.1-1
_PREBUILT = re.compile(r"/(tf|tf2|pytorch|sklearn|xgboost)-(?:cpu|gpu)\.(\d+)-(\d+)")
_PIP_NAME = {
    "tf": "tensorflow",
    "tf2": "tensorflow",
    "pytorch": "torch",
    "sklearn": "scikit-learn",
    "xgboost": "xgboost",
}


def framework_requirement(image: str) -> str | None:
    """'tensorflow~=2.12.0' for a pre-built training image, None for any other image."""
    m = _PREBUILT.search(image)
    return f"{_PIP_NAME[m.group(1)]}~={m.group(2)}.{m.group(3)}.0" if m else None


def venv(job: str) -> str:
    """Where the setup block puts the job's Python packages on every host."""
    return f"/opt/venvs/{job}"


def module_command(job: str, module: str, args: tuple[str, ...]) -> tuple[str, ...]:
    """`python -m MODULE ARGS` with the job's venv (the setup block makes it): how a pool
    the service ran as a Python package runs here."""
    return (f"{venv(job)}/bin/python", "-m", module, *args)


def hosts_python(job: str) -> str:
    """The pool comment's second half for such a pool: where it runs here."""
    return f"here the hosts' Python runs it in {venv(job)}, made by the setup block below"


def install_commands(job: str, packages: tuple[str, ...], requirements: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Setup commands: a venv, then the packages the service installed (gs:// ones copied first)."""
    v = venv(job)
    cmds = [f"python3 -m venv {v}"]
    local: list[str] = []
    for uri in packages:
        if uri.startswith("gs://"):
            cmds.append(f"gcloud storage cp {uri} {v}/packages/")
            local.append(f"{v}/packages/{uri.rsplit('/', 1)[-1]}")
        else:
            local.append(uri)
    if requirements:
        cmds.append(f"{v}/bin/pip install " + " ".join(_shell_word(r) for r in requirements))
    if local:
        cmds.append(f"{v}/bin/pip install " + " ".join(_shell_word(p) for p in local))
    return tuple(cmds)


def _shell_word(s: str) -> str:
    return s if re.fullmatch(r"[A-Za-z0-9_./:=@+-]+", s) else "'" + s.replace("'", "'\\''") + "'"


def merge_setup(*groups: tuple[str, ...]) -> tuple[str, ...]:
    """Commands of several pools, once each, in first-seen order."""
    return tuple(dict.fromkeys(c for g in groups for c in g))


# Why a field means nothing on hosts you own; used by both importers.
WHY = {
    "machineType": "the hosts you list are the machines: pick them for the CPUs and memory this type had",
    "diskSpec": "tasks use the hosts' own disks",
    "diskConfig": "tasks use the hosts' own disks",
    "serviceAccount": "no Google Cloud identity on your hosts: pass credentials with secret_env",
    "network": "tasks reach each other at the hosts' cluster_address; no VPC peering",
    "reservedIpRanges": "tasks reach each other at the hosts' cluster_address",
    "pscInterfaceConfig": "tasks reach each other at the hosts' cluster_address",
    "region": "your hosts are where they are",
    "labels": "Google Cloud resource labels",
    "encryptionSpec": "Google Cloud key management (CMEK) for the service's resources",
    "encryptionConfig": "Google Cloud key management (CMEK) for the service's resources",
    "tensorboard": "Vertex AI TensorBoard: run TensorBoard yourself on the logs",
    "enableWebAccess": "interactive shell of the service: use `provision ssh`",
    "enableDashboardAccess": "the service's dashboard access",
    "experiment": "Vertex AI Experiments",
    "experimentRun": "Vertex AI Experiments",
    "models": "Vertex AI Model Registry",
    "persistentResourceId": "a Vertex AI persistent resource: the hosts are yours",
    "protectedArtifactLocationId": "where Vertex AI keeps artifacts",
    "nfsMounts": "mount NFS on the hosts yourself",
    "reservationAffinity": "Compute Engine reservations",
    "tpuTopology": "TPU slice topology is the hosts' own",
    "tpuTfVersion": "the TPU software is the hosts' own",
    "output": "written by the service (read-only)",
}
OUTPUT_FIELDS = frozenset(
    {
        "name",
        "state",
        "createTime",
        "startTime",
        "endTime",
        "updateTime",
        "error",
        "webAccessUris",
        "satisfiesPzs",
        "satisfiesPzi",
        "etag",
        "trainingOutput",
        "predictionOutput",
        "errorMessage",
        "jobPosition",
        "trials",  # a tuning job's trials so far
    }
)


def why(key: str) -> str:
    if key in OUTPUT_FIELDS:
        return "written by the service, not part of the request"
    return WHY.get(key, "not known to provision import")


def note(at: Where, value: JSON, reason: str | None = None) -> Note:
    key = at.path.rsplit(".", 1)[-1].split("[", 1)[0]
    return Note(at.path, value_text(value), reason or why(key))


def accelerators(spec: dict[str, JSON], at: Where, count_key: str, type_key: str) -> tuple[int, str | None]:
    """A pool's accelerators, (count, the service's type name or None), from the keys that
    hold them (AI Platform's acceleratorConfig: count, type; Vertex's machineSpec:
    acceleratorCount, acceleratorType): an unspecified type is none; a type needs a count."""
    kind = string(spec[type_key], at / type_key) if type_key in spec else None
    if kind == "ACCELERATOR_TYPE_UNSPECIFIED":
        kind = None
    count = integer(spec[count_key], at / count_key) if count_key in spec else 0
    if kind and not count:
        (at / count_key).fail(f"missing or 0, but {type_key} is {kind}")
    return count, kind


def entry_note(at: Where, entry: tuple[str, ...], service: str) -> Note:
    """A container's own command (AI Platform's containerCommand, Vertex's command): what
    provision makes of it (args, first)."""
    return note(
        at,
        list(entry),
        "put first in args: provision runs `docker run IMAGE ARGS`, which replaces the image's CMD; "
        f"{service} replaced its ENTRYPOINT too (the same when the image has none)",
    )


def read_yaml_file(path: Path, display: str) -> JSON:
    """A structured file (gcloud --config): JSON or YAML, its errors as one line."""
    parsed = parse_structured(read_text(path, display), display)
    if parsed.error is not None:
        raise SpecError(parsed.error)
    return parsed.data
