"""The dashboard's charts over time, as SVG drawn here (web/charts.py's way: no JavaScript,
every text from the data escaped): GPU-hours by owner per day (the History page), a job's
timeline (its runs, preemptions, restarts and recovery incidents: its page) and a trial's
reports. Pure."""

from __future__ import annotations

import calendar
import math
import time
from collections.abc import Mapping, Sequence

from markupsafe import Markup, escape

from provision.core.events import EventJson
from provision.core.recovery import GoodputJson, Incident, RecoveryJson, Stage, goodput_words, incident_words
from provision.rules.historyview import HistoryRowJson
from provision.web.charts import BOTTOM, LEFT, RIGHT, TOP, Axis, H, W, _frame, _svg, log_wanted

# One colour per owner drawn (the rest are "others", grey), and per way a run ended.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
OTHERS = "#bbbbbb"
ENDED = {
    "succeeded": "#2ca02c",
    "failed": "#d62728",
    "preempted": "#ff7f0e",
    "stopped": "#7f7f7f",
    "stopped early": "#ff7f0e",
    "cancelled": "#8c8c8c",
    "destroyed": "#7f7f7f",
    "running": "#1f77b4",
    "waiting": "#dddddd",
}
MARKS = {
    "job.preempted": "preempted",
    "job.resumed": "resumed",
    "task.failed": "task failed",
    "job.recovered": "recovered",
    "job.scaled": "scaled up",
}


# An incident on the timeline: from when it broke to running again (its outage), the work
# it redid before it (its newest checkpoint to when it broke), and a tick at each step.
OUTAGE = "#d62728"
REDONE = "#f4b183"
STEPS = (("at", "broke"), ("detected", "seen"), ("stopped", "stopped"), ("running", "running again"))


def incidents_of(recovery: RecoveryJson | None) -> list[Incident]:
    """The incidents a job's state keeps (its document's `recovery`), those it can read."""
    got = (Incident.from_json(d) for d in (recovery.get("incidents") or [] if recovery else []))
    return [i for i in got if i is not None]


def incident_lines(recovery: RecoveryJson | None, now: float) -> list[str]:
    """Each incident as `status` says it (core/recovery.incident_words), the newest first."""
    return [incident_words(i, now) for i in reversed(incidents_of(recovery))]


def goodput_line(g: GoodputJson | None) -> str:
    """The job's goodput as `status` says it, or nothing."""
    return (goodput_words(g) or "") if g else ""


def _incident_spans(incidents: Sequence[Incident], now: float) -> list[tuple[Incident, float, float, float | None]]:
    """Each incident that says when it broke: its outage (broke to running again; to now
    while it is not, to when it was seen if given up) and where its redone work began."""
    out = []
    for i in incidents:
        if i.at is None:
            continue
        end = i.running if i.running is not None else (i.detected or i.at if i.stage is Stage.GAVE_UP else now)
        redo = i.checkpoint if i.checkpoint is not None and i.checkpoint <= i.at else None
        out.append((i, i.at, max(end, i.at), redo))
    return out


def _incident_marks(
    spans: Sequence[tuple[Incident, float, float, float | None]], x: Axis, t0: float, now: float
) -> list[str]:
    body = []
    lane = 60
    for i, at, end, redo in spans:
        line = incident_words(i, now)
        if redo is not None:
            x0, x1 = x(redo - t0), x(at - t0)
            body.append(
                f'<rect x="{x0:.1f}" y="{lane}" width="{max(1.0, x1 - x0):.1f}" height="14" fill="{REDONE}" '
                f'class="redone"><title>{escape(f"incident {i.n}: {at - redo:.0f} s of work redone")}</title></rect>'
            )
        x0, x1 = x(at - t0), x(end - t0)
        body.append(
            f'<rect x="{x0:.1f}" y="{lane}" width="{max(2.0, x1 - x0):.1f}" height="14" fill="{OUTAGE}" '
            f'class="incident {i.stage.value.replace(" ", "-")}"><title>{escape(line)}</title></rect>'
        )
        for field, word in STEPS:
            t = getattr(i, field)
            if t is not None:
                px = x(t - t0)
                body.append(
                    f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{lane - 3}" y2="{lane + 17}" class="step {field}">'
                    f"<title>{escape(f'incident {i.n}: {word} at ' + time.strftime('%H:%M:%S', time.gmtime(t)))}"
                    "</title></line>"
                )
    return body


def _epoch(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        return float(calendar.timegm(time.strptime(iso, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


def hours_svg(days: Sequence[str], series: Mapping[str, Sequence[float]]) -> Markup:
    """GPU-hours per day, a bar a day stacked by owner (rules/historyview.by_owner_over_days:
    the owners with the most, then "others"), with a legend."""
    if not days or not series:
        return _svg(
            [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no GPU-hours yet</text>'], "GPU-hours by owner"
        )
    totals = [sum(s[i] for s in series.values()) for i in range(len(days))]
    y = Axis(0.0, max(max(totals), 1e-9) * 1.05, H - BOTTOM, TOP)
    x = Axis(-0.5, len(days) - 0.5, LEFT, W - RIGHT - 120)
    every = max(1, math.ceil(len(days) / 7))
    ticks = [(float(i), d[5:]) for i, d in enumerate(days) if i % every == 0]
    body = _frame(x, y, "day (UTC)", "GPU-hours", ticks)
    width = max(2.0, (x(1) - x(0)) * 0.7) if len(days) > 1 else 40.0
    colours = {o: (OTHERS if o == "others" else PALETTE[i % len(PALETTE)]) for i, o in enumerate(series)}
    for i, day in enumerate(days):
        base = 0.0
        for owner, values in series.items():
            h = values[i]
            if h <= 0:
                continue
            top, bottom = y(base + h), y(base)
            body.append(
                f'<rect x="{x(i) - width / 2:.1f}" y="{top:.1f}" width="{width:.1f}" height="{max(0.5, bottom - top):.1f}" '
                f'fill="{colours[owner]}" class="hours"><title>{escape(day)} {escape(owner)}: {h:.1f} GPU-hours</title></rect>'
            )
            base += h
    for k, owner in enumerate(series):
        py = TOP + 14 * k
        body.append(f'<rect x="{W - RIGHT - 112}" y="{py}" width="10" height="10" fill="{colours[owner]}"/>')
        body.append(f'<text x="{W - RIGHT - 98}" y="{py + 9}" class="legend">{escape(owner[:22])}</text>')
    return _svg(body, "GPU-hours by owner, per day")


# Steps a time axis ticks at, in seconds: whole seconds, minutes, hours and days, as a
# clock's face has them (not 2,000 s).
TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800)


def time_ticks(t0: float, span: float, most: int = 5) -> list[float]:
    """Offsets from t0 of the ticks of a time axis over [t0, t0 + span]: multiples of the
    smallest clock step that gives at most `most` of them, each a distinct second."""
    step = next((s for s in TIME_STEPS if span / s <= most - 1), TIME_STEPS[-1])
    first = math.ceil(t0 / step) * step
    out = [first - t0 + k * step for k in range(int((t0 + span - first) // step) + 1)]
    return out or [0.0]


def timeline_svg(
    runs: Sequence[HistoryRowJson], events: Sequence[EventJson], now: float, incidents: Sequence[Incident] = ()
) -> Markup:
    """A job's runs (and waits) as bars over time, coloured by how each ended, what happened
    between (a preemption, a resume, a task that failed and restarted) marked, and its
    recovery incidents (incidents_of) in a lane of their own: each outage from when it broke
    to running again, ticked where it was seen and stopped, after the work it redid."""
    spans: list[tuple[HistoryRowJson, float, float]] = []
    for r in runs:
        start = _epoch(r["started"])
        if start is not None:
            spans.append((r, start, _epoch(r["ended"]) or now))
    marks: list[tuple[EventJson, float]] = []
    for ev in events:
        at = _epoch(ev["time"])
        if ev["kind"] in MARKS and at is not None:
            marks.append((ev, at))
    broke = _incident_spans(incidents, now)
    times = [t for _, s, e in spans for t in (s, e)] + [t for _, t in marks]
    times += [t for _, s, e, r in broke for t in (s, e, r) if t is not None]
    if not times:
        return _svg([f'<text x="{W / 2}" y="40" text-anchor="middle">nothing recorded yet</text>'], "timeline", h=80)
    t0 = min(times)
    h = 140 if broke else 120
    x = Axis.of([t - t0 for t in times], LEFT, W - RIGHT)
    body = [f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{h - 30}" y2="{h - 30}" class="axis"/>']
    span = max(times) - t0
    shape = "%H:%M:%S" if span < 3600 else "%m-%d %H:%M" if span < 3 * 86400 else "%Y-%m-%d"
    for t in time_ticks(t0, span):
        label = time.strftime(shape, time.gmtime(t0 + t))
        body.append(f'<text x="{x(t):.1f}" y="{h - 14}" text-anchor="middle">{escape(label)}</text>')
    body.append(f'<text x="{W - RIGHT}" y="{h - 2}" text-anchor="end" class="label">UTC</text>')
    for r, s, e in spans:
        lane = 40 if r["kind"] == "wait" else 20
        x0, x1 = x(s - t0), x(e - t0)
        colour = ENDED.get(r["state"], "#999")
        tip = f"{r['kind']} {r['started']} - {r['ended'] or 'now'}: {r['state']}" + (
            f" ({r['how']})" if r["how"] else ""
        )
        body.append(
            f'<rect x="{x0:.1f}" y="{lane}" width="{max(2.0, x1 - x0):.1f}" height="14" fill="{colour}" '
            f'class="run {escape(r["state"]).replace(" ", "-")}"><title>{escape(tip)}</title></rect>'
        )
    for ev, at in marks:
        px = x(at - t0)
        body.append(
            f'<path d="M{px:.1f},{h - 34}l-4,-8h8z" class="mark {ev["kind"].replace(".", "-")}">'
            f"<title>{escape(MARKS[ev['kind']] + ': ' + ev['words'])}</title></path>"
        )
    body.append(f'<text x="{LEFT - 4}" y="31" text-anchor="end">runs</text>')
    body.append(f'<text x="{LEFT - 4}" y="51" text-anchor="end">waits</text>')
    if broke:
        body += _incident_marks(broke, x, t0, now)
        body.append(f'<text x="{LEFT - 4}" y="71" text-anchor="end">incidents</text>')
    return _svg(body, "timeline: runs, waits, preemptions, restarts, incidents", h=h)


def reports_svg(reports: Sequence[Sequence[float]], metric: str) -> Markup:
    """A trial's reports over its steps (its learning curve)."""
    pts = [(float(s), float(v)) for s, v in reports if math.isfinite(float(v))]
    if not pts:
        return _svg([f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no reports</text>'], "reports")
    ys = [v for _, v in pts]
    x = Axis.of([s for s, _ in pts], LEFT, W - RIGHT)
    y = Axis.of(ys, H - BOTTOM, TOP, log=log_wanted(ys))
    lo, hi = math.ceil(x.lo), math.floor(x.hi)
    every = max(1, math.ceil((hi - lo + 1) / 8))
    steps = [(float(k), str(k)) for k in range(lo, hi + 1, every)]  # steps are whole
    body = _frame(x, y, "step", metric + (" (log)" if y.log else ""), steps)
    line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in pts if v > 0 or not y.log)
    body.append(f'<polyline points="{line}" fill="none" class="series"/>')
    for s, v in pts:
        if v > 0 or not y.log:
            body.append(
                f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" class="report"><title>step {s:g}: {metric} = {v}</title></circle>'
            )
    return _svg(body, f"{metric} over steps ({len(pts)} reports)")
