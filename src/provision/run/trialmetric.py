"""A trial's metric as its worker reads it from the host (run/trialrun.py): the hypertune
file of the task whose metric counts (bounded, never through a link: rules/metrics.py), or
with `metric.regex` its log lines since the last read (a journal cursor).

A paused trial (its job preempted) keeps its reader: a resumed program rewrites
the hypertune file with its own reports only (cloudml-hypertune keeps them in memory), so
the reports before the pause are kept and the new ones go after them."""

from __future__ import annotations

from dataclasses import dataclass

from provision.core.model import Inventory
from provision.core.target import Target
from provision.core.tuning import Report, Tune
from provision.host import layout
from provision.io.journal import host_lines_after
from provision.rules.metrics import (
    METRIC_FILE_CAP,
    metric_read_command,
    metric_read_problem,
    parse_log_lines,
    parse_metric_file,
)
from provision.run.context import Context


def metric_task(inv: Inventory) -> str:
    """Whose metric counts: the chief's, else the first worker's (Vertex's workerpool0)."""
    roles = [p.role for p in inv.pools if p.replicas > 0]
    return "chief-0" if "chief" in roles else f"{roles[0]}-0" if roles else "chief-0"


class MetricRefused(Exception):
    """The trial's metric file is not believed (a link, too large, ...): the trial fails."""


@dataclass
class MetricReader:
    """The metric so far, one round trip to the task's host per read: its hypertune file
    (bounded, never through a link: rules/metrics.py), or with `metric.regex` its log lines
    since the last read (a journal cursor)."""

    tune: Tune
    task: str
    cursor: str | None = None
    found: tuple[Report, ...] = ()  # the regex's reports so far
    last: tuple[Report, ...] = ()  # the file's, as last read
    kept: tuple[Report, ...] = ()  # the file's before the trial's pauses

    def pause(self) -> None:
        """The trial was preempted: its resumed run's file starts anew; these go first."""
        self.kept = self.last

    def read(self, ctx: Context) -> tuple[Report, ...]:
        placed = {t.name: t for t in ctx.rendered.placement.tasks}
        t = placed.get(self.task)
        if t is None:
            return ()
        target: Target = ctx.targets[t.host.name]
        if self.tune.metric.regex:
            lines, self.cursor = host_lines_after(ctx.session, target, ctx.inventory.job, self.task, self.cursor)
            self.found += parse_log_lines(lines, self.tune.metric.regex, before=len(self.found))
            return self.found
        path = layout.metric_file(ctx.inventory.job, self.task)
        got = bytearray()

        def sink(data: bytes) -> None:
            got.extend(data)
            if len(got) > METRIC_FILE_CAP:
                raise MetricRefused(f"the host sent more than {METRIC_FILE_CAP} bytes")

        res = ctx.session.download(target, metric_read_command(path), sink, timeout=60)
        problem = metric_read_problem(res.exit_status, res.stderr, len(got))
        if problem is not None:
            raise MetricRefused(f"{self.task}'s metric file on {t.host.name} ({path}) is {problem}")
        self.last = after(self.kept, parse_metric_file(bytes(got), self.tune.metric.name))
        return self.last


def after(kept: tuple[Report, ...], new: tuple[Report, ...]) -> tuple[Report, ...]:
    """The reports before a pause (`kept`) that the resumed run's file (`new`) does not
    report again (steps before its first), then its own."""
    if not kept:
        return new
    if not new:
        return kept
    return tuple(r for r in kept if r.step < new[0].step) + new
