"""`provision import`: a managed service's job description as an inventory.

    import_job("vertex", spec_path, ...) → Result(text, check_text, plan, warnings)

Readers (`vertex`, `gcloud`, `aiplatform`) turn the file into a `JobPlan`; `emit` writes
it as commented YAML. Nothing here touches the network or writes a file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from . import aipgcloud, aiplatform, gcloud, vertex
from .common import (
    JSON,
    JobPlan,
    SpecError,
    Where,
    accelerator_family,
    mapping,
    parse_structured,
    read_text,
)
from .emit import Emitted, Hosts, emit

__all__ = ["Hosts", "Result", "SpecError", "import_job", "load_hosts"]

SERVICES = ("vertex", "ai-platform")
TRIAL = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DNS_LABEL = re.compile(r"^[a-z]([a-z0-9-]{0,38}[a-z0-9])?$")


@dataclass(frozen=True)
class Result:
    text: str  # the inventory to write
    check_text: str  # the same with placeholder hosts in force: what to validate
    plan: JobPlan
    warnings: tuple[str, ...]  # also written into the file, beside their pool


def load_hosts(path: Path, display: str) -> Hosts:
    """A hosts file: `hosts:` (and `ssh:`) in the inventory's format. Other keys (a whole
    inventory given as the hosts file) are not used. The inventory's own validation checks
    every host once the output is written."""
    parsed = parse_structured(read_text(path, display), display)
    if parsed.error is not None:
        raise SpecError(parsed.error)
    top = Where(display)
    data = parsed.data
    if not isinstance(data, dict) or "hosts" not in data:
        top.fail("expected a mapping with hosts: (and optionally ssh:), as in an inventory")
    hosts = data["hosts"]
    if not isinstance(hosts, list) or not hosts:
        (top / "hosts").fail("expected a non-empty list of hosts ({name, address, ...} each)")
    for i, h in enumerate(hosts):
        mapping(h, top / "hosts" / i)
    ssh = mapping(data["ssh"], top / "ssh") if data.get("ssh") is not None else None
    return Hosts(display, tuple(hosts), ssh)


def import_job(
    service: str,
    spec_path: Path,
    display: str,
    *,
    hosts: Hosts | None,
    job: str | None,
    trial: str | None,
    out_dir: Path,
    command: str,
) -> Result:
    """Read SPEC (a file) for `service` and return the inventory text."""
    if job is not None and not DNS_LABEL.fullmatch(job):
        raise SpecError(
            f"--job: expected a DNS-1035 label (a-z, 0-9, '-', starting with a letter, at most 40 characters), got {job!r}"
        )
    if trial is not None and not TRIAL.fullmatch(trial):
        raise SpecError(f"--trial: expected a trial id such as '1' (letters, digits, '_', '.', '-'), got {trial!r}")
    text = read_text(spec_path, display)
    default_name = spec_path.stem
    parsed = parse_structured(text, display)
    if service == "ai-platform" and not isinstance(parsed.data, dict) and "gcloud" in text:
        plan = _from_aip_script(text, spec_path, display, job=job, trial=trial)
    elif service == "ai-platform":
        if parsed.error is not None:
            raise SpecError(parsed.error)
        plan = aiplatform.from_data(parsed.data, display, job=job, trial=trial, default_name=default_name)
    elif isinstance(parsed.data, dict):
        plan = vertex.from_data(parsed.data, display, job=job, trial=trial, default_name=default_name)
    else:
        plan = _from_script(text, parsed.data, parsed.error, spec_path, display, job=job, trial=trial)
    if plan.study is not None and trial is not None:
        alone = "its trialJobSpec alone (a CustomJobSpec)" if service == "vertex" else "it without hyperparameters"
        raise SpecError(
            f"--trial: {display} is a hyperparameter tuning job: its study becomes tune:, and `provision tune` "
            f"numbers each trial; for one trial as a plain job, import {alone} with --trial"
        )
    warnings = _check_accelerators(plan, hosts)
    emitted: Emitted = emit(plan, hosts, command=command, out_dir=out_dir, warnings=warnings)
    return Result(
        emitted.text, emitted.check_text, plan, tuple(f"pools.{role}: {w}" for role, ws in warnings.items() for w in ws)
    )


def _from_script(
    text: str, data: JSON, error: str | None, spec_path: Path, display: str, *, job: str | None, trial: str | None
) -> JobPlan:
    """Not a mapping: a shell script with the gcloud command, or a file that is neither."""
    here = spec_path.resolve().parent  # the script's $PWD and $(pwd)
    found = gcloud.find(text, display, here) if "custom-jobs" in text or "hp-tuning-jobs" in text else None
    if found is None and "jobs" in text and (aip := gcloud.find(text, display, here)) is not None:
        raise SpecError(
            f"{display}:{aip.line}: `{gcloud.command_text(aip.kind)}` submits an AI Platform Training job: "
            "use `provision import ai-platform`"
        )
    if found is None:
        if error is not None and "gcloud" not in text:  # a JSON or YAML file with a mistake: say where
            raise SpecError(error)
        raise SpecError(
            f"{display}: neither a CustomJob / CustomJobSpec (JSON or YAML with workerPoolSpecs) nor a shell "
            "script with a `gcloud ai custom-jobs create` command (or `hp-tuning-jobs create`)"
        )
    if found.kind == "hp-tuning-jobs":
        t = gcloud.parse_tuning(found, display, spec_path.resolve().parent)
        return vertex.from_tuning_job(
            t.data,
            Where(t.source),
            job=job,
            default_name=spec_path.stem,
            origin=f"a `gcloud ai hp-tuning-jobs create` command ({display}, line {t.line})",
            notes=t.notes,
            name_path="--display-name" if t.named_by_flag else "displayName",
        )
    g = gcloud.parse(found, display, spec_path.resolve().parent)
    src = vertex.Source(
        f"a `gcloud ai custom-jobs create` command ({display}, line {g.line})",
        g.display_name or None,
        trial,
        notes=g.notes,
        local=g.local,
        name_path="--display-name",
    )
    at = Where(g.spec_source)
    return vertex.from_spec(g.spec, at, src, job=job, default_name=spec_path.stem)


def _from_aip_script(text: str, spec_path: Path, display: str, *, job: str | None, trial: str | None) -> JobPlan:
    """A shell script with `gcloud ai-platform|ml-engine jobs submit training` (aipgcloud.py)."""
    found = gcloud.find(text, display, spec_path.resolve().parent)  # the script's $PWD and $(pwd)
    if found is not None and found.kind not in gcloud.AIP_GROUPS:
        raise SpecError(
            f"{display}:{found.line}: `{gcloud.command_text(found.kind)}` is a Vertex AI job: use `provision import vertex`"
        )
    if found is None:
        raise SpecError(
            f"{display}: neither a TrainingInput / job with trainingInput (JSON or YAML) nor a shell script "
            "with a `gcloud ai-platform jobs submit training` command (or `ml-engine jobs submit training`)"
        )
    cmd = aipgcloud.parse(found, display, spec_path.resolve().parent, spec_path.stem)
    return aipgcloud.to_plan(cmd, display, job=job, trial=trial, default_name=spec_path.stem)


def _check_accelerators(plan: JobPlan, hosts: Hosts | None) -> dict[str, list[str]]:
    """A pool's accelerator type against the types the hosts declare (when they declare any)."""
    if hosts is None:
        return {}
    declared: dict[str, list[str]] = {}
    for h in hosts.hosts:
        acc = h.get("accelerators")
        if isinstance(acc, dict) and isinstance(acc.get("type"), str):
            declared.setdefault(str(acc["type"]), []).append(str(h.get("name", "?")))
    out: dict[str, list[str]] = {}
    for p in plan.pools:
        if not p.accelerators or not p.accelerator_type or not declared:
            continue
        if any(accelerator_family(t) == accelerator_family(p.accelerator_type) for t in declared):
            continue
        have = ", ".join(
            f"{t} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" for t, names in declared.items()
        )
        out.setdefault(p.role, []).append(
            f"{plan.service} gave it {p.accelerator_type}; the hosts have {have}: check memory per GPU, batch sizes and NCCL settings"
        )
    return out
