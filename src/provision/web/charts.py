"""The dashboard's charts as SVG drawn here (no JavaScript library: clusters are often
air-gapped, and a page's charts then need nothing but the page). Pure: JSON in, markup out;
every text from the data is escaped.

A study's trials are the `trials` of `provision tune --status --json`; its parameters the
"space" (rules/studyview.space_json); each trial's reports are a StudyCurves. Pruned
(stopped early) trials are orange squares, cancelled ones grey squares, running ones hollow,
failed ones red crosses along the bottom (they have no value). A number is shown to 4
significant digits; its tooltip has it whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

from provision.core.tuning import TrialJson, TrialState, Value
from provision.rules.studyview import CANCELLED, ParamJson, StudyCurves, StudyDoc, shown_state

W, H = 640, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 16, 40
LOG_RATIO = 30.0  # as the study's PNG (cli/tuneview.log_scale): a log axis past this ratio
# Trials a chart draws at most: 10,000 trials' marks and lines were ~10 MB of SVG per page
# ; a 640-pixel chart shows no more than this many apart.
CHART_TRIALS = 1000

# The trial states of `tune --status --json` (core/tuning.TrialState's values).
SUCCEEDED, PRUNED = TrialState.SUCCEEDED.value, TrialState.STOPPED_EARLY.value
RUNNING, FAILED = TrialState.RUNNING.value, TrialState.FAILED.value
COLOR = {SUCCEEDED: "#1f77b4", PRUNED: "#ff7f0e", RUNNING: "#7f7f7f", FAILED: "#d62728", CANCELLED: "#8c8c8c"}
CLASS = {SUCCEEDED: "succeeded", PRUNED: "pruned", RUNNING: "running", FAILED: "failed", CANCELLED: "cancelled"}


@dataclass(frozen=True)
class Axis:
    lo: float
    hi: float
    p0: float  # pixel of lo
    p1: float  # pixel of hi
    log: bool = False

    @classmethod
    def of(cls, values: Sequence[float], p0: float, p1: float, *, log: bool = False) -> Axis:
        vs = [v for v in values if math.isfinite(v) and (v > 0 or not log)]
        if not vs:
            return cls(0.0, 1.0, p0, p1, False)
        lo, hi = min(vs), max(vs)
        if log:
            lo, hi = math.log10(lo), math.log10(hi)
        if hi == lo:
            lo, hi = lo - 0.5, hi + 0.5
        pad = (hi - lo) * 0.05
        return cls(lo - pad, hi + pad, p0, p1, log)

    def __call__(self, v: float) -> float:
        x = math.log10(v) if self.log else v
        return self.p0 + (x - self.lo) / (self.hi - self.lo) * (self.p1 - self.p0)

    def ticks(self, n: int = 5) -> list[float]:
        """About `n` round values within the axis (1, 2 or 5 times a power of ten apart): a
        tick reads 0.002, never the padding's -2.87e-05; a log axis: its powers of ten."""
        if self.log:
            powers = [10.0**e for e in range(math.ceil(self.lo), math.floor(self.hi) + 1)]
            if len(powers) >= 3:
                return powers
            # Less than two decades: 1, 2 and 5 times each power within it.
            got = [m * 10.0**e for e in range(math.floor(self.lo), math.ceil(self.hi) + 1) for m in (1, 2, 5)]
            return [float(f"{t:.12g}") for t in got if self.lo <= math.log10(t) <= self.hi] or [10**self.lo]
        raw = (self.hi - self.lo) / max(1, n - 1)
        if not math.isfinite(raw) or raw <= 0:
            return [self.lo]
        mag = 10.0 ** math.floor(math.log10(raw))
        step = next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw * 0.999)
        first = math.ceil(self.lo / step - 1e-9)
        out = [float(f"{k * step:.12g}") for k in range(first, math.floor(self.hi / step + 1e-9) + 1)]
        return out or [self.lo]


def log_wanted(values: Sequence[float]) -> bool:
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) >= LOG_RATIO * min(finite)


def num(v: float) -> str:
    return f"{v:.3g}"


def _svg(body: list[str], title: str, w: int = W, h: int = H) -> Markup:
    head = f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {w} {h}" role="img" aria-label="{escape(title)}">'
    return Markup(head + f"<title>{escape(title)}</title>" + "".join(body) + "</svg>")


def _frame(x: Axis, y: Axis, xlabel: str, ylabel: str, xticks: list[tuple[float, str]] | None = None) -> list[str]:
    out = [f'<rect x="{LEFT}" y="{TOP}" width="{W - LEFT - RIGHT}" height="{H - TOP - BOTTOM}" class="frame"/>']
    for t in y.ticks():
        py = y(t)
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py:.1f}" y2="{py:.1f}" class="grid"/>')
        out.append(f'<text x="{LEFT - 4}" y="{py + 4:.1f}" text-anchor="end">{escape(num(t))}</text>')
    for t, label in xticks if xticks is not None else [(t, num(t)) for t in x.ticks()]:
        px = x(t)
        out.append(f'<text x="{px:.1f}" y="{H - BOTTOM + 14}" text-anchor="middle">{escape(label)}</text>')
    out.append(
        f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 6}" text-anchor="middle" class="label">{escape(xlabel)}</text>'
    )
    out.append(
        f'<text x="12" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" class="label" '
        f'transform="rotate(-90 12 {(TOP + H - BOTTOM) / 2})">{escape(ylabel)}</text>'
    )
    return out


def _mark(px: float, py: float, state: str, tip: str) -> str:
    c = COLOR.get(state, "#333")
    t = f"<title>{escape(tip)}</title>"
    if state in (PRUNED, CANCELLED):
        return (
            f'<rect x="{px - 4:.1f}" y="{py - 4:.1f}" width="8" height="8" fill="{c}" class="{CLASS[state]}">{t}</rect>'
        )
    if state == FAILED:
        return f'<path d="M{px - 4:.1f},{py - 4:.1f}l8,8m0,-8l-8,8" stroke="{c}" stroke-width="2" class="failed">{t}</path>'
    fill = "none" if state == RUNNING else c
    return f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{fill}" stroke="{c}" class="{CLASS.get(state, "other")}">{t}</circle>'


def _valued(trials: Sequence[TrialJson]) -> list[tuple[TrialJson, float]]:
    return [(t, float(v)) for t in trials if isinstance(v := t.get("value"), int | float) and math.isfinite(v)]


def _tip(t: TrialJson, metric: str) -> str:
    params = ", ".join(f"{k}={v}" for k, v in (t.get("params") or {}).items())
    return f"trial {t['number']} ({shown_state(t)}): {metric}={t.get('value')} {params}"


def better(goal: str, a: float, b: float) -> bool:
    return a > b if goal == "maximize" else a < b


def best_so_far(trials: Sequence[TrialJson], goal: str) -> list[tuple[int, float]]:
    """Where the best succeeded value changes, in trial order."""
    out: list[tuple[int, float]] = []
    for t, v in sorted(_valued(trials), key=lambda tv: tv[0]["number"]):
        if t["state"] == SUCCEEDED and (not out or better(goal, v, out[-1][1])):
            out.append((t["number"], v))
    return out


def chart_trials(study: StudyDoc, limit: int = CHART_TRIALS) -> list[TrialJson]:
    """The trials the charts draw, in the study's order: all of them up to `limit`; past it,
    `limit` of them: the running ones, where the best so far changed, the best tenth, the
    extremes (the first and last trial, the lowest and highest value and parameter), then an
    even sample of the rest over trial order (pruned and failed trials keep their share)."""
    trials = study["trials"]
    if len(trials) <= limit:
        return list(trials)
    goal = study["metric"]["goal"]
    valued = [(i, v) for i, t in enumerate(trials) if (v := _value_of(t)) is not None]
    steps = {n for n, _ in best_so_far(trials, goal)}
    ranked = sorted((iv for iv in valued if trials[iv[0]]["state"] == SUCCEEDED), key=lambda iv: iv[1])
    if goal == "maximize":
        ranked.reverse()
    # The trials' indexes in the order they were chosen (a dict keeps it, once each).
    picked: dict[int, None] = dict.fromkeys(i for i, t in enumerate(trials) if t["state"] == RUNNING)
    picked.update(dict.fromkeys(i for i, t in enumerate(trials) if t["state"] == SUCCEEDED and t["number"] in steps))
    picked.update(dict.fromkeys(i for i, _ in ranked[: limit // 10]))
    picked.update(dict.fromkeys(_extremes(trials, valued, study.get("space") or [])))
    chosen = list(picked)[:limit]
    rest = [i for i in range(len(trials)) if i not in picked]
    room = min(limit - len(chosen), len(rest))
    chosen += [rest[int(k * len(rest) / room)] for k in range(room)] if room > 0 else []
    return [trials[i] for i in sorted(chosen)]


def drawn(study: StudyDoc) -> StudyDoc:
    """The study as its charts draw it: its trials thinned (chart_trials)."""
    return {**study, "trials": chart_trials(study)}


def _extremes(trials: Sequence[TrialJson], valued: list[tuple[int, float]], space: list[ParamJson]) -> list[int]:
    """The first and last trial, the lowest and highest value and each numeric parameter's
    lowest and highest (of the valued trials): a thinned chart keeps its axes."""
    out = [0, len(trials) - 1]
    keys: list[Callable[[tuple[int, float]], float | None]] = [lambda iv: iv[1]]
    for key in keys + [_param_key(p["name"], trials) for p in space]:
        got = [(i, k) for i, v in valued if (k := key((i, v))) is not None]
        if got:
            out += [min(got, key=lambda ik: ik[1])[0], max(got, key=lambda ik: ik[1])[0]]
    return out


def _param_key(name: str, trials: Sequence[TrialJson]) -> Callable[[tuple[int, float]], float | None]:
    def key(iv: tuple[int, float]) -> float | None:
        p = (trials[iv[0]].get("params") or {}).get(name)
        return float(p) if isinstance(p, int | float) and not isinstance(p, bool) and math.isfinite(p) else None

    return key


def _value_of(t: TrialJson) -> float | None:
    v = t.get("value")
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def objective_svg(study: StudyDoc, shown: Sequence[TrialJson] | None = None) -> Markup:
    """The objective over trials (those `shown`: chart_trials), the best so far (over every
    trial) as a step line."""
    trials, metric, goal = study["trials"], study["metric"]["name"], study["metric"]["goal"]
    if not trials:
        return _svg([f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no trials yet</text>'], "no trials yet")
    marked = trials if shown is None else shown
    valued = _valued(marked)
    x = Axis.of([float(t["number"]) for t in trials], LEFT, W - RIGHT)
    y = Axis.of([v for _, v in valued], H - BOTTOM, TOP, log=log_wanted([v for _, v in valued]))
    numbers = sorted(t["number"] for t in trials)
    every = max(1, math.ceil((numbers[-1] - numbers[0] + 1) / 8))  # whole trial numbers, at most ~8
    ticks = [(float(n), str(n)) for n in range(numbers[0], numbers[-1] + 1, every)]
    body = _frame(x, y, "trial", metric + (" (log)" if y.log else ""), ticks)
    steps = best_so_far(trials, goal)
    if steps:
        last = max(t["number"] for t in trials)
        pts = []
        for i, (n, v) in enumerate(steps):
            if i:
                pts.append(f"{x(n):.1f},{y(steps[i - 1][1]):.1f}")
            pts.append(f"{x(n):.1f},{y(v):.1f}")
        pts.append(f"{x(last):.1f},{y(steps[-1][1]):.1f}")
        body.append(
            f'<polyline points="{" ".join(pts)}" class="best" fill="none"><title>best so far</title></polyline>'
        )
    for t, v in valued:
        if v > 0 or not y.log:
            body.append(_mark(x(t["number"]), y(v), shown_state(t), _tip(t, metric)))
    for t in marked:
        if t["state"] == FAILED:
            body.append(_mark(x(t["number"]), H - BOTTOM - 6, FAILED, _tip(t, metric)))
    return _svg(body, f"{metric} over trials")


def param_axis(param: ParamJson, values: Sequence[Value], p0: float, p1: float) -> ParamAxis:
    """A parameter's axis as its type asks: categories (and a discrete parameter's values, in
    increasing order) at whole positions, each labelled; an integer's whole numbers only; a
    double's a scale (log for a log-scaled one)."""
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if param["type"] in ("categorical", "discrete") or not numeric:
        declared = list(param.get("values") or [])
        if param["type"] == "discrete" and numeric and all(isinstance(v, int | float) for v in declared):
            nums = sorted({float(v) for v in [*declared, *values] if isinstance(v, int | float)})
            keys, labels = [_key(v) for v in nums], [num_text(v) for v in nums]
        else:
            keys = [str(v) for v in declared]
            keys += sorted({str(v) for v in values} - set(keys))
            labels = keys
        where = {k: float(i) for i, k in enumerate(keys)}
        ax = Axis(-0.5, max(len(keys) - 0.5, 0.5), p0, p1)
        return ParamAxis(ax, where, [(float(i), c) for i, c in enumerate(labels)], param["name"])
    nums = [float(v) for v in values if isinstance(v, int | float)]
    log = param.get("scale") == "log" and bool(nums) and min(nums) > 0
    ax = Axis.of(nums, p0, p1, log=log)
    label = param["name"] + (" (log)" if log else "")
    if param["type"] == "integer" and not log:
        lo, hi = math.ceil(ax.lo), math.floor(ax.hi)
        every = max(1, math.ceil((hi - lo + 1) / 6))
        return ParamAxis(ax, None, [(float(k), str(k)) for k in range(lo, hi + 1, every)], label)
    return ParamAxis(ax, None, None, label)


def _key(v: Value) -> str:
    """A value's place on a category axis: a number by its value (8 and 8.0 alike)."""
    return repr(float(v)) if isinstance(v, int | float) and not isinstance(v, bool) else str(v)


@dataclass(frozen=True)
class ParamAxis:
    axis: Axis
    at: dict[str, float] | None  # a value's position (_key) on a category axis; None: the value itself
    ticks: list[tuple[float, str]] | None  # (position, label); None: the axis's own
    label: str

    def pos(self, v: Value) -> float:
        if self.at is None:
            return float(v)
        return self.at.get(_key(v), self.at.get(str(v), 0.0))


def num_text(v: Value) -> str:
    """A value as a page shows it: 4 significant digits (the full one is in its tooltip)."""
    if isinstance(v, bool) or isinstance(v, str):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


def param_svg(study: StudyDoc, param: ParamJson) -> Markup:
    """The objective against one parameter, on the axis its type asks for (param_axis)."""
    name, metric = param["name"], study["metric"]["name"]
    pts = [(t, t["params"][name], v) for t, v in _valued(study["trials"]) if name in (t.get("params") or {})]
    ys = [v for _, _, v in pts]
    y = Axis.of(ys, H - BOTTOM, TOP, log=log_wanted(ys))
    pa = param_axis(param, [p for _, p, _ in pts], LEFT, W - RIGHT)
    body = _frame(pa.axis, y, pa.label, metric, pa.ticks)
    for t, p, v in pts:
        if v > 0 or not y.log:
            body.append(_mark(pa.axis(pa.pos(p)), y(v), shown_state(t), _tip(t, metric)))
    return _svg(body, f"{metric} against {name}")


def parallel_svg(study: StudyDoc) -> Markup:
    """Parallel coordinates: an axis per parameter (as its type asks: param_axis) and the
    objective; a line per trial with a value (stopped early and cancelled ones dashed)."""
    space, metric = study.get("space") or [], study["metric"]["name"]
    valued = _valued(study["trials"])
    names = [p["name"] for p in space] + [metric]
    if not valued or len(names) < 2:
        return _svg(
            [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no values yet</text>'], "parallel coordinates"
        )
    gap = (W - LEFT - RIGHT) / (len(names) - 1)
    axes = [
        param_axis(
            p, [v for t, _ in valued if (v := (t.get("params") or {}).get(p["name"])) is not None], H - BOTTOM, TOP
        )
        for p in space
    ]
    ys = [v for _, v in valued]
    value_axis = Axis.of(ys, H - BOTTOM, TOP, log=log_wanted(ys))
    body = []
    for i, n in enumerate(names):
        px = LEFT + i * gap
        body.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{H - BOTTOM}" class="axis"/>')
        body.append(f'<text x="{px:.1f}" y="{H - BOTTOM + 14}" text-anchor="middle">{escape(n)}</text>')
        if i < len(axes) and axes[i].ticks is not None and len(axes[i].ticks or ()) <= 12:
            for pos, label in axes[i].ticks or ():
                py = axes[i].axis(pos)
                body.append(f'<text x="{px + 3:.1f}" y="{py + 3:.1f}" class="tick">{escape(label)}</text>')
    for t, v in valued:
        pts = []
        for i, pa in enumerate(axes):
            raw = (t.get("params") or {}).get(names[i])
            if raw is None:
                continue
            pos = pa.pos(raw)
            if pa.axis.log and pos <= 0:
                continue
            pts.append(f"{LEFT + i * gap:.1f},{pa.axis(pos):.1f}")
        if v > 0 or not value_axis.log:
            pts.append(f"{LEFT + len(axes) * gap:.1f},{value_axis(v):.1f}")
        state = shown_state(t)
        dash = ' stroke-dasharray="4 3"' if state in (PRUNED, CANCELLED) else ""
        color = COLOR.get(state, "#333")
        body.append(
            f'<polyline points="{" ".join(pts)}" fill="none" stroke="{color}"{dash} class="trial">'
            f"<title>{escape(_tip(t, metric))}</title></polyline>"
        )
    return _svg(body, "parallel coordinates")


CURVES_DRAWN = 200  # trials whose learning curves a chart draws at most (chart_trials picks them)


def curves_svg(study: StudyDoc, curves: StudyCurves, limit: int = CURVES_DRAWN) -> Markup:
    """Each trial's reports over its steps (its learning curve, as Optuna Dashboard's
    intermediate values): a line per trial in its state's colour, a trial stopped early (or
    cancelled, or failed) marked where it stopped. At most `limit` trials (chart_trials)."""
    metric = study["metric"]["name"]
    picked = [t for t in chart_trials(study, limit) if curves.curves.get(t["number"])]
    if not picked:
        return _svg([f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no reports yet</text>'], "learning curves")
    points = [(t, [(float(s), v) for s, v in curves.curves[t["number"]] if math.isfinite(v)]) for t in picked]
    xs = [s for _, ps in points for s, _ in ps]
    ys = [v for _, ps in points for _, v in ps]
    x = Axis.of(xs, LEFT, W - RIGHT)
    y = Axis.of(ys, H - BOTTOM, TOP, log=log_wanted(ys))
    lo, hi = math.ceil(x.lo), math.floor(x.hi)
    every = max(1, math.ceil((hi - lo + 1) / 8))
    body = _frame(
        x, y, "step", metric + (" (log)" if y.log else ""), [(float(k), str(k)) for k in range(lo, hi + 1, every)]
    )
    for t, ps in points:
        ps = [(s, v) for s, v in ps if v > 0 or not y.log]
        if not ps:
            continue
        state = shown_state(t)
        color = COLOR.get(state, "#333")
        tip = escape(_tip(t, metric) + f"; last report {ps[-1][1]} at step {ps[-1][0]:g}")
        line = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in ps)
        body.append(
            f'<polyline points="{line}" fill="none" stroke="{color}" class="curve {CLASS.get(state, "other")}" '
            f'data-curve="{t["number"]}"><title>{tip}</title></polyline>'
        )
        if state in (PRUNED, CANCELLED, FAILED):  # where it stopped
            body.append(_mark(x(ps[-1][0]), y(ps[-1][1]), state, _tip(t, metric) + f" (stopped at step {ps[-1][0]:g})"))
    return _svg(body, "learning curves")


def importance_svg(importance: Mapping[str, float]) -> Markup:
    """Each parameter's importance (Optuna's evaluator: its share of the value's variation),
    the largest first, as bars."""
    if not importance:
        return _svg(
            [f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">too few succeeded trials to weigh</text>'],
            "parameter importance",
        )
    rows = sorted(importance.items(), key=lambda kv: (-kv[1], kv[0]))
    h = TOP + BOTTOM + 22 * len(rows)
    left, right = 140, W - RIGHT - 60
    body = []
    for i, (name, share) in enumerate(rows):
        py = TOP + 22 * i
        width = max(0.0, min(1.0, share)) * (right - left)
        body.append(f'<text x="{left - 6}" y="{py + 14}" text-anchor="end">{escape(name)}</text>')
        body.append(
            f'<rect x="{left}" y="{py + 3}" width="{width:.1f}" height="14" class="importance">'
            f"<title>{escape(name)}: {share:.4f}</title></rect>"
        )
        body.append(f'<text x="{left + width + 4:.1f}" y="{py + 14}">{100 * share:.1f} %</text>')
    return _svg(body, "parameter importance", h=h)


def series_svg(points: Sequence[tuple[float, float]], *, label: str, top: float = 100.0) -> Markup:
    """A value over time (GPU utilization, %): points are (epoch seconds, value)."""
    if not points:
        return _svg([f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no samples</text>'], label)
    t0 = points[0][0]
    x = Axis.of([t - t0 for t, _ in points], LEFT, W - RIGHT)
    y = Axis(0.0, top, H - BOTTOM, TOP)
    body = _frame(x, y, "seconds", label)
    pts = " ".join(f"{x(t - t0):.1f},{y(min(v, top)):.1f}" for t, v in points)
    body.append(f'<polyline points="{pts}" fill="none" class="series"/>')
    return _svg(body, label)


def spark_svg(points: Sequence[tuple[float, float]], *, label: str, span: float = 3600.0, top: float = 100.0) -> Markup:
    """A small line of a value over the last `span` seconds (a host's mean GPU utilization on
    the Cluster page: one of these a host, not a chart a GPU), no axes; the newest at the right."""
    w, h = 120, 24
    if not points:
        return Markup("")
    end = points[-1][0]
    pts = " ".join(
        f"{w * max(0.0, 1 - (end - t) / span):.0f},{h - 1 - (h - 2) * min(max(v, 0.0), top) / top:.0f}"
        for t, v in points
    )
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" class="spark" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        f'role="img" aria-label="{escape(label)}"><title>{escape(label)}</title>'
        f'<polyline points="{pts}" fill="none"/></svg>'
    )
