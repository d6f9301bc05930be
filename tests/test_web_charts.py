"""The dashboard's pure parts: the SVG charts (log axes, best so far, pruned trials marked,
text escaped), the views (filters, pages, hosts by label) and the log cursor's round trip."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from provision.rules.studyview import space_json, study_json
from provision.web import charts
from provision.web.inventories import _cursors, _token
from provision.web.source import SECRET_MASK, masked_env
from provision.web.views import (
    BadFilter,
    cluster_groups,
    cluster_page,
    host_spark,
    job_filter,
    page_of,
    pager,
    sorted_trials,
    trial_order,
)
from test_tuneview import ROWS, TUNE  # a study's rows and tune: (tests/ is on the path)

SVG = "{http://www.w3.org/2000/svg}"


def _study(trials, space=()):
    return {"metric": {"name": "loss", "goal": "minimize"}, "trials": trials, "space": list(space)}


def _t(n, value, state="succeeded", **params):
    return {"number": n, "value": value, "state": state, "params": params}


TRIALS = [
    _t(1, 3.0, lr=0.1),
    _t(2, 1.0, lr=0.01),
    _t(3, 2.0, "stopped early", lr=0.001),
    _t(4, None, "failed", lr=0.5),
    _t(5, 0.5, lr=0.0001),
]
LR = {"name": "lr", "type": "double", "scale": "log", "min": 1e-4, "max": 1.0, "values": []}


def test_best_so_far_follows_the_goal():
    assert charts.best_so_far(TRIALS, "minimize") == [(1, 3.0), (2, 1.0), (5, 0.5)]
    assert charts.best_so_far(TRIALS, "maximize") == [(1, 3.0)]


def test_objective_chart_marks_pruned_and_failed_trials():
    svg = ET.fromstring(str(charts.objective_svg(_study(TRIALS))))
    assert svg.findall(f".//{SVG}rect[@class='pruned']")  # trial 3
    assert svg.findall(f".//{SVG}path[@class='failed']")  # trial 4, no value
    assert len(svg.findall(f".//{SVG}polyline[@class='best']")) == 1


def test_a_log_scaled_parameter_gets_a_log_axis():
    svg = str(charts.param_svg(_study(TRIALS, [LR]), LR))
    assert "lr (log)" in svg
    ET.fromstring(svg)
    linear = {**LR, "scale": "linear"}
    assert "lr (log)" not in str(charts.param_svg(_study(TRIALS, [linear]), linear))


def test_parallel_coordinates_and_hostile_names_stay_text():
    evil = {"name": "<script>x</script>", "type": "categorical", "scale": "linear", "values": ["<b>"]}
    trials = [{**_t(1, 1.0), "params": {"<script>x</script>": "<b>"}}]
    svg = str(charts.parallel_svg(_study(trials, [evil])))
    assert "<script>" not in svg and "&lt;script&gt;" in svg
    ET.fromstring(svg)
    assert "no trials yet" in str(charts.objective_svg(_study([])))


def test_series_chart():
    svg = str(charts.series_svg([(0.0, 10.0), (10.0, 90.0)], label="GPU %"))
    assert "polyline" in svg
    ET.fromstring(svg)


def test_filters_and_pages():
    assert job_filter({"owner": "ana", "q": "bert"}).matches({"job": "bert-2", "owner": "ana", "state": "running"})
    with pytest.raises(BadFilter, match="^phase:"):
        job_filter({"phase": "nope"})
    with pytest.raises(BadFilter, match="^page:"):
        job_filter({"page": "0"})
    items, pages = page_of(list(range(120)), 3)
    assert items == list(range(100, 120)) and pages == 3


def test_hosts_grouped_by_label_with_each_gpu():
    doc = {
        "jobs": [{"job": "a", "owner": "ana"}],
        "hosts": {
            "h2": {"gpus": 1, "free_gpus": [0], "held": {}, "drain": True},
            "h1": {"gpus": 2, "free_gpus": [1], "held": {"a": {"gpus": [0]}}, "labels": {"rack": "r1"}},
            "h3": {"gpus": 1, "error": "refused"},
        },
    }
    groups = dict(cluster_groups(doc))
    assert list(groups) == ["rack=r1", "no labels"]
    h1 = groups["rack=r1"][0]
    assert [(g.state, g.job, g.owner) for g in h1.gpus] == [("held", "a", "ana"), ("free", None, None)]
    assert [g.state for h in groups["no labels"] for g in h.gpus] == ["drained", "unreachable"]


def test_a_large_cluster_is_counted_by_group_and_shown_a_page_of_hosts_at_a_time():
    hosts = {
        f"h{i:02d}": {
            "gpus": 2,
            "labels": {"rack": f"r{i % 2}"},
            "free_gpus": [1],
            "held": {f"j{i}": {"gpus": [0]}},
            "gpu_use": {"0": {"utilization": 90}, "1": {"utilization": 0}},
            "gpu_history": {"0": [[0.0, 80.0], [30.0, 90.0]], "1": [[30.0, 0.0]]},
        }
        for i in range(10)
    }
    hosts["h03"] = {"gpus": 2, "labels": {"rack": "r1"}, "error": "refused"}
    view = cluster_page({"jobs": [], "hosts": hosts}, page=2, size=4)
    assert [(g.label, g.hosts, g.unreachable, g.gpus, g.held, g.free, g.page) for g in view.groups] == [
        ("rack=r0", 5, 0, 10, 5, 5, 1),
        ("rack=r1", 5, 1, 10, 4, 4, 2),
    ]
    assert view.groups[0].utilization == 45.0
    assert (view.page, view.pages, view.hosts) == (2, 3, 10)
    # Page 2: the last of rack=r0 (h08), the first three of rack=r1.
    assert [(label, [h.name for h in rows]) for label, rows in view.shown] == [
        ("rack=r0", ["h08"]),
        ("rack=r1", ["h01", "h03", "h05"]),
    ]
    assert view.sparks["h08"] == ((30.0, 45.0),) and view.sparks["h03"] == ()
    assert host_spark({"gpu_history": {"0": [[0.0, 10.0], [30.0, 20.0]], "1": [[0.0, 30.0], [30.0, 40.0]]}}) == (
        (0.0, 20.0),
        (30.0, 30.0),
    )


def test_secrets_masked_and_the_log_cursor_round_trips():
    assert masked_env([("A", "1"), ("KEY", "v")], ("KEY", "TOKEN")) == {
        "A": "1",
        "KEY": SECRET_MASK,
        "TOKEN": SECRET_MASK,
    }
    cursors = {"host-1": {"chief-0": "s=abc;i=1"}}
    assert _cursors(_token(cursors)) == cursors
    assert _cursors("not base64 !!") == {} and _cursors(None) == {}


def test_charts_read_the_real_study_json():
    """The shapes the charts read are rules/studyview's, as `tune --status --json` prints them."""
    doc = {**study_json("mnist", TUNE, ROWS, ended=None, picture=None), "space": space_json(TUNE)}
    assert charts.best_so_far(doc["trials"], doc["metric"]["goal"])
    ET.fromstring(str(charts.objective_svg(doc)))
    lr = next(p for p in doc["space"] if p["name"] == "learning_rate")
    assert "learning_rate (log)" in str(charts.param_svg(doc, lr))
    ET.fromstring(str(charts.parallel_svg(doc)))


def _many(n):
    """n trials: every fifth stopped early, every 50th failed, the last two running."""
    out = []
    for k in range(1, n + 1):
        state = "failed" if k % 50 == 0 else "stopped early" if k % 5 == 0 else "succeeded"
        state = "running" if k > n - 2 else state
        value = None if state == "failed" else 1.0 + ((k * 7919) % 1000) / 100.0
        out.append(_t(k, value, state, lr=10 ** -(1 + (k * 31) % 40 / 10), opt=("a", "b")[k % 2]))
    out[4321]["value"] = 0.01  # the best, a succeeded one
    out[4321]["state"] = "succeeded"
    out[777]["params"]["lr"] = 1e-9  # a parameter's extreme
    return out


def test_a_chart_draws_at_most_its_share_of_trials_keeping_what_matters():
    trials = _many(10_000)
    study = _study(trials, [LR])
    shown = charts.chart_trials(study, limit=1000)
    numbers = [t["number"] for t in shown]
    assert len(shown) == 1000 and numbers == sorted(numbers)
    assert {1, 10_000, 9_999, 4322, 778} <= set(numbers)  # the ends, the running, the best, an extreme lr
    steps = {n for n, _ in charts.best_so_far(trials, "minimize")}
    assert steps <= set(numbers)
    pruned = sum(t["state"] == "stopped early" for t in shown)
    assert 100 <= pruned <= 250  # about their share (a fifth of the rest)
    assert any(t["state"] == "failed" for t in shown)
    assert charts.chart_trials(_study(trials[:50]), limit=1000) == trials[:50]  # few: all of them
    # The charts of a thinned study draw their marks; the best-so-far line is every trial's.
    d = charts.drawn(study)
    svg = str(charts.objective_svg(study, d["trials"]))
    ET.fromstring(svg)
    assert svg.count("<circle") + svg.count('class="pruned"') + svg.count('class="failed"') <= 1000
    assert len(svg) < 300_000
    ET.fromstring(str(charts.parallel_svg(d)))


def test_the_trials_table_sorted_on_the_server_and_paged():
    trials = [_t(1, 3.0, lr=0.1), _t(2, None, "failed", lr=0.5), _t(3, 1.0, opt="b"), _t(4, 2.0, opt="a")]
    by = lambda s, desc=False: [t["number"] for t in sorted_trials(trials, s, desc)]  # noqa: E731
    assert by("number") == [1, 2, 3, 4] and by("number", True) == [4, 3, 2, 1]
    assert by("value") == [3, 4, 1, 2] and by("value", True) == [1, 4, 3, 2]  # the empty value last either way
    assert by("param.opt") == [4, 3, 1, 2] and by("param.opt", True) == [3, 4, 1, 2]
    assert by("param.lr") == [1, 2, 3, 4]
    assert trial_order({"sort": "param.lr", "order": "desc", "page": "3"}, ["lr"]).page == 3
    for q, word in (({"sort": "nope"}, "sort"), ({"order": "up"}, "order"), ({"page": "0"}, "page")):
        with pytest.raises(BadFilter, match=f"^{word}:"):
            trial_order(q, ["lr"])
    o = trial_order({"sort": "value"}, [])
    assert o.toggled("value") == "sort=value&order=desc&page=1" and o.toggled("state") == "sort=state&order=asc&page=1"
    assert pager(1, 1) == [1] and pager(50, 100) == [1, None, 48, 49, 50, 51, 52, None, 100]
    assert pager(2, 4) == [1, 2, 3, 4]


# --------------------------------------------------------------------------- the axes a type asks for


def _texts(svg) -> list[str]:
    return [t.text or "" for t in ET.fromstring(str(svg)).iter(f"{SVG}text")]


def test_a_discrete_axis_is_its_values_and_an_integer_axis_whole_numbers():
    discrete = {"name": "batch", "type": "discrete", "scale": "linear", "min": None, "max": None, "values": [8, 16, 32]}
    trials = [_t(1, 0.5, batch=8), _t(2, 0.4, batch=8)]
    svg = charts.param_svg(_study(trials, [discrete]), discrete)
    shown = _texts(svg)
    assert {"8", "16", "32"} <= set(shown) and not any(s in shown for s in ("7.45", "8.55", "7.5"))
    integer = {"name": "layers", "type": "integer", "scale": "linear", "min": 1, "max": 12, "values": []}
    svg = charts.param_svg(_study([_t(1, 0.5, layers=3), _t(2, 0.4, layers=9)], [integer]), integer)
    ticks = [s for s in _texts(svg)[5:] if s and s[0].isdigit()]  # past the value axis' five
    assert ticks and all(s.isdigit() for s in ticks), ticks
    axis = charts.param_axis(integer, [8], 0, 100)
    assert axis.ticks == [(8.0, "8")]  # one value: one whole tick, not 7.45 .. 8.55


def test_a_cancelled_trial_is_called_so_and_drawn_grey():
    t = {**_t(1, 0.5), "state": "stopped early", "why": "cancelled by ana"}
    svg = str(charts.objective_svg(_study([t, _t(2, 0.4)])))
    assert 'class="cancelled"' in svg and "(cancelled)" in svg and "stopped early" not in svg


def test_learning_curves_mark_where_the_stopped_ones_stopped():
    from provision.rules.studyview import StudyCurves

    trials = [_t(1, 0.5), {**_t(2, 1.5), "state": "stopped early", "why": "median rule"}, _t(3, None, "failed")]
    curves = StudyCurves({1: ((1, 2.0), (2, 1.0), (3, 0.5)), 2: ((1, 2.5), (2, 1.5)), 3: ((1, 3.0),)})
    svg = charts.curves_svg({**_study(trials), "space": []}, curves)  # type: ignore[typeddict-item]
    root = ET.fromstring(str(svg))
    lines = {p.get("data-curve"): p for p in root.iter(f"{SVG}polyline")}
    assert set(lines) == {"1", "2", "3"} and len(lines["1"].get("points", "").split()) == 3
    marks = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "pruned"]
    assert len(marks) == 1 and "stopped at step 2" in (marks[0].findtext(f"{SVG}title") or "")
    assert any(p.get("class") == "failed" for p in root.iter(f"{SVG}path"))
    assert "no reports yet" in str(charts.curves_svg(_study([_t(1, 0.5)]), StudyCurves()))  # type: ignore[arg-type]


def test_importance_bars_largest_first():
    svg = charts.importance_svg({"lr": 0.2, "layers": 0.75, "opt": 0.05})
    names = [t for t in _texts(svg) if t in ("lr", "layers", "opt")]
    assert names == ["layers", "lr", "opt"] and "75.0 %" in _texts(svg)
    assert "too few" in str(charts.importance_svg({}))
