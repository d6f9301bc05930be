"""JobPlan → an inventory as commented YAML a person can read and edit.

Values are written by PyYAML (flow style, one line each), so any string -- quotes, colons,
`#`, non-ASCII -- reads back as it was; comments are kept to one printable line each.
Two texts come out: the file, and the same file with the placeholder hosts uncommented,
which is what `import` validates when no hosts were given (same lines, same numbers).
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .common import JSON, JobPlan, Note, PoolPlan, SpecLoader, StudyPlan, host_accelerator_type
from .study import as_mapping

ROLE_ORDER = ("chief", "worker", "ps", "reduction_server", "evaluator")
WIDTH = 96


@dataclass(frozen=True)
class Hosts:
    """`--hosts FILE`: the inventory's own `hosts:` (and `ssh:`), as written there."""

    source: str
    hosts: tuple[dict[str, JSON], ...] = field(hash=False, compare=False)
    ssh: dict[str, JSON] | None = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class Emitted:
    text: str  # the file
    check_text: str  # the file with placeholder hosts in force, for validation


def flow(value: JSON) -> str:
    """One value as one line of YAML (flow style) that reads back as it was."""
    if isinstance(value, list):
        return "[" + ", ".join(flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{flow(k)}: {flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and not value.isprintable():
        return _double_quoted(value)
    out = yaml.safe_dump([value], default_flow_style=True, width=1 << 30, allow_unicode=True, sort_keys=False)
    return out.strip()[1:-1]


def _double_quoted(s: str) -> str:
    """A YAML double-quoted scalar with every unprintable character escaped. PyYAML would
    write some raw (NEL, U+2028), and a YAML reader takes those for line breaks."""
    out = []
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        else:
            n = ord(c)
            out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
    return '"' + "".join(out) + '"'


def comment(text: str) -> str:
    """Text safe inside a `#` comment: one line, control characters shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _wrap(text: str, prefix: str, width: int = WIDTH) -> list[str]:
    return textwrap.wrap(comment(text), width=width - len(prefix), break_long_words=False, break_on_hyphens=False) or [
        ""
    ]


class _Lines:
    """Output lines; placeholder lines are commented in the file, live in the check text."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, bool]] = []

    def add(self, line: str = "", placeholder: bool = False) -> None:
        self.lines.append((line, placeholder))

    def comment(self, text: str, indent: str = "") -> None:
        for line in _wrap(text, indent + "# "):
            self.add(f"{indent}# {line}".rstrip())

    def render(self, live: bool) -> str:
        out = []
        for line, placeholder in self.lines:
            if placeholder and not live:
                stripped = line.lstrip(" ")
                line = line[: len(line) - len(stripped)] + "# " + stripped
            out.append(line)
        return "\n".join(out) + "\n"


def emit(plan: JobPlan, hosts: Hosts | None, *, command: str, out_dir: Path, warnings: dict[str, list[str]]) -> Emitted:
    out = _Lines()
    out.comment(f"{plan.service} job imported by `{command}`, from {plan.origin}.")
    out.comment(
        "Check the pools, and the notes at the end: what was not applied and why, and what was applied "
        f"only in part. Then: provision validate FILE && provision {'tune' if plan.study else 'apply'} FILE"
    )
    if plan.timeout:
        out.comment(
            f"{plan.service} stopped this job after {plan.timeout} s; provision does not: "
            f"`provision wait FILE --timeout {plan.timeout}` exits 124 after that long."
        )
    out.add()
    out.add(f"job: {flow(plan.job)}")
    out.add()
    _hosts(out, plan, hosts)
    out.add()
    out.add("pools:")
    for pool in sorted(plan.pools, key=lambda p: ROLE_ORDER.index(p.role)):
        _pool(out, pool, warnings.get(pool.role, []))
    _env_and_files(out, plan, out_dir)
    out.add()
    out.comment(plan.chief_why + ".")
    if plan.study is not None:
        # No trial here: `provision tune` runs each trial as a job of its own and numbers it.
        out.add(f"tf_config: {{chief_name: {plan.chief_name}}}")
        _tune(out, plan, plan.study)
    else:
        if plan.trial is not None:
            out.comment("trial: this is one trial of a hyperparameter tuning job; each trial is a job of its own.")
        out.add(
            f"tf_config: {{chief_name: {plan.chief_name}, trial: {flow(plan.trial) if plan.trial is not None else 'null'}}}"
        )
    if plan.setup:
        out.add()
        out.comment(
            "setup: installs the Python packages the service installed, once per host before the tasks. "
            "Commented out so that nothing runs before you have read it: uncomment it, and apply runs it on "
            "every host before the tasks start, and again only when it changes."
        )
        out.add("# setup:")
        out.add("#   commands:")
        for cmd in plan.setup:
            out.add(f"#     - {flow(cmd)}")
    _notes(out, "Not applied, and why:", plan.not_applied)
    _notes(out, "Applied in part:", plan.partly)
    _job_spec(out, plan)
    return Emitted(out.render(live=False), out.render(live=True))


def _tune(out: _Lines, plan: JobPlan, study: StudyPlan) -> None:
    """The study as `tune:`, one parameter a line (flow style, in the spec's order)."""
    out.add()
    out.comment(
        f"tune: the search of the tuning job ({study.origin}). `provision tune FILE` runs it: each trial is "
        "a job of its own, with TF_CONFIG's task.trial set and the trial's parameters given to every task "
        f"as --NAME=VALUE arguments, as {plan.service} gave them."
    )
    out.add("tune:")
    for key, value in as_mapping(study).items():
        if isinstance(value, dict) and key == "parameters":
            out.add(f"  {key}:")
            for name, spec in value.items():
                out.add(f"    {flow(name)}: {flow(spec)}")
        else:
            out.add(f"  {key}: {flow(value)}")


def _env_and_files(out: _Lines, plan: JobPlan, out_dir: Path) -> None:
    """The env every task had, and the local package gcloud built, as files: to push."""
    if plan.outputs:
        out.add()
        out.comment(
            "outputs: the base of AIP_MODEL_DIR, AIP_CHECKPOINT_DIR and AIP_TENSORBOARD_LOG_DIR on the hosts"
            + (" (trial N's: outputs/N/, as Vertex AI gives each trial its own)" if plan.study else "")
            + "; `provision fetch` brings it back."
        )
        out.add(f"outputs: {flow(plan.outputs)}")
    if plan.env:
        out.add()
        out.comment("Every task (as the service set them):")
        out.add("env:")
        for k, v in plan.env:
            out.add(f"  {k}: {flow(v)}")
    if plan.files:
        out.add()
        out.comment("The local code gcloud packaged for the service, pushed to every host that runs a task:")
        out.add("files:")
        for src, dest in plan.files:
            rel = os.path.relpath(src, out_dir)
            shown = src if rel.startswith("../../..") else rel
            slash = "/" if os.path.isdir(src) else ""  # a directory, or one file (a setup.py, a tarball)
            out.add(f"  - {{src: {flow(shown + slash)}, dest: {flow(dest + slash)}}}")


def _job_spec(out: _Lines, plan: JobPlan) -> None:
    """The service's own spec, kept whole: TF_CONFIG's and CLUSTER_SPEC's `job`."""
    out.add()
    out.comment(
        f"The spec as {plan.service} had it: every task's TF_CONFIG and CLUSTER_SPEC carry it as `job`, "
        "as the service set them, so code that reads it keeps working."
    )
    dumped = yaml.safe_dump(
        plan.job_spec, default_flow_style=False, sort_keys=False, allow_unicode=True, width=WIDTH, indent=2
    )
    if yaml.load(dumped, Loader=SpecLoader) != plan.job_spec:  # a string PyYAML folds (NEL, U+2028)
        out.add(f"job_spec: {flow(plan.job_spec)}")
    else:
        out.add("job_spec:")
        for line in dumped.rstrip("\n").split("\n"):
            out.add(f"  {line}")


def _hosts(out: _Lines, plan: JobPlan, hosts: Hosts | None) -> None:
    if hosts is not None:
        out.comment(f"From {hosts.source}.")
        if hosts.ssh:
            out.add(f"ssh: {flow(hosts.ssh)}")
        out.add("hosts:")
        for h in hosts.hosts:
            out.add(f"  - {flow(h)}")
        return
    gpu: list[tuple[int, str]] = []
    cpu = 0
    for p in plan.pools:
        if p.accelerators:
            kind = host_accelerator_type(p.accelerator_type or "") or "nvidia-gpu"
            gpu += [(p.accelerators, kind)] * p.replicas
        else:
            cpu += p.replicas
    shapes: dict[tuple[int, str], int] = {}
    for count, kind in gpu:
        shapes[(count, kind)] = shapes.get((count, kind), 0) + 1
    said = [f"{n} machine{'s' * (n > 1)} with {count} x {kind}" for (count, kind), n in shapes.items()]
    if cpu:
        said.append(f"{cpu} machine{'s' * (cpu > 1)} without accelerators")
    out.comment(
        f"Your hosts, in the inventory's format (or import again with --hosts FILE). {plan.service} ran this "
        f"job on {_join(said)}; tasks without accelerators may share a host (each gets its own port). "
        "The lines below are an example of that shape: replace them."
    )
    out.add("hosts:")
    n = 0
    for count, kind in gpu:
        n += 1
        out.add(
            f"  - {{name: gpu-{n}, address: {_address(n)}, accelerators: {{type: {flow(kind)}, count: {count}}}}}", True
        )
    for j in range(1, min(cpu, 32) + 1):
        n += 1
        out.add(f"  - {{name: cpu-{j}, address: {_address(n)}}}", True)


def _address(n: int) -> str:
    # Documentation addresses (RFC 5737) while they last.
    return f"192.0.2.{n}" if n < 255 else f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _pool(out: _Lines, pool: PoolPlan, warnings: list[str]) -> None:
    for text in pool.comments:
        out.comment(text, "  ")
    for text in warnings:
        out.comment("CHECK: " + text, "  ")
    out.add(f"  {pool.role}:")
    out.add(f"    replicas: {pool.replicas}")
    if pool.accelerators:
        suffix = f"  # {comment(pool.accelerator_type)}" if pool.accelerator_type else ""
        out.add(f"    accelerators: {pool.accelerators}{suffix}")
    if pool.image is not None:
        out.add(f"    image: {flow(pool.image)}")
        if pool.args:
            _words(out, "args", pool.args)
    else:
        _words(out, "command", pool.command)
    if pool.env:
        out.add("    env:")
        for k, v in pool.env:
            out.add(f"      {k}: {flow(v)}")
    if pool.restart:
        out.add(f"    restart: {{policy: {pool.restart}, limit: 3}}")


def _words(out: _Lines, key: str, words: tuple[str, ...]) -> None:
    """A command or args: one line when it fits, else one word a line."""
    line = f"    {key}: {flow(list(words))}"
    if len(line) <= WIDTH:
        out.add(line)
        return
    out.add(f"    {key}:")
    for w in words:
        out.add(f"      - {flow(w)}")


def _notes(out: _Lines, title: str, notes: tuple[Note, ...]) -> None:
    if not notes:
        return
    out.add()
    out.add(f"# {title}")
    for n in notes:
        head = f"#   - {comment(n.path)}: {comment(n.value)}"
        out.add(head if len(head) <= WIDTH else head[: WIDTH - 3] + "...")
        for line in _wrap(n.why, "#       "):
            out.add(f"#       {line}")
