"""The dashboard: an ASGI app (Starlette) over a Source. Pages (jinja2, autoescaped: every
string a host sent is shown as text), the JSON API under /api/v1/ (the CLI's --json shapes)
and /metrics. It decides nothing and asks no host: the Source answers (web/source.py). In front
of it, web/guard.py checks each request's Host, Origin and body.

    app = make_app(InventorySource(["a.yaml"]), auth=Auth.loopback(), site=Site.listening("127.0.0.1", 8470))
    uvicorn.run(app, host="127.0.0.1", port=8470)
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import jinja2
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp

from provision.core.answers import ActionAnswer
from provision.core.errors import ProvisionError
from provision.core.events import parse_kinds
from provision.core.tuning import TrialJson
from provision.rules.historyview import KINDS as HISTORY_KINDS
from provision.rules.historyview import SHOWN_STATES, by_owner_over_days
from provision.rules.jobsdoc import JobsDoc
from provision.rules.studyview import StudyCurves, StudyDoc, shown_counts, shown_state
from provision.web import charts, timecharts
from provision.web.auth import CSRF_COOKIE, CSRF_FIELD, TOKEN_COOKIE, Auth, Denied, Mode, Viewer, check_csrf, new_csrf
from provision.web.guard import Bounds, Guard, Site
from provision.web.metrics import CONTENT_TYPE, exposition
from provision.web.source import NotFound, Source, Unavailable
from provision.web.views import (
    ACTIONS,
    HISTORY_PAGE,
    HOSTS_PAGE,
    KINDS,
    PHASES,
    SINCE,
    TRIALS_PAGE,
    BadFilter,
    TrialOrder,
    cluster_page,
    history_filter,
    hours,
    job_filter,
    job_sections,
    page_number,
    page_of,
    pager,
    sig,
    sorted_trials,
    took,
    trial_order,
    whole_number,
)

HERE = Path(__file__).parent
Handler = Callable[[Request, Viewer], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]
SAID_KEEP, SAID_SECONDS = 256, 600.0  # what an action said: the last this many, for this long
USAGE_DAYS = 14  # the days the History page's chart spans (the Usage page's: serve/source.USAGE_DAYS)


def make_app(source: Source, *, auth: Auth, site: Site | None = None, bounds: Bounds = Bounds()) -> ASGIApp:
    """The dashboard; `site`: the Hosts it answers as (none: the loopback names, for an app
    run by hand)."""
    site = site or Site.loopback()
    d = Dashboard(source, auth, site)
    page, api = d.guarded, d.guarded_api
    routes = [
        Route("/", page(d.cluster)),
        Route("/jobs", page(d.jobs)),
        Route("/jobs/{name}", page(d.job)),
        Route("/jobs/{name}/{action}", page(d.act_page), methods=["POST"]),
        Route("/studies/{name}", page(d.study)),
        Route("/studies/{name}/{action}", page(d.act_page), methods=["POST"]),
        Route("/usage", page(d.usage)),
        Route("/history", page(d.history)),
        Route("/quotas", page(d.quotas)),
        Route("/health", page(d.health)),
        Route("/login", d.login, methods=["GET", "POST"]),
        Route("/api/v1/hosts", api(d.api_hosts)),
        Route("/api/v1/jobs", api(d.api_jobs)),
        Route("/api/v1/jobs/{name}", api(d.api_job)),
        Route("/api/v1/jobs/{name}/logs", api(d.api_logs)),
        Route("/api/v1/jobs/{name}/{action}", api(d.act_api), methods=["POST"]),
        Route("/api/v1/studies/{name}", api(d.api_study)),
        Route("/api/v1/studies/{name}/{action}", api(d.act_api), methods=["POST"]),
        Route("/api/v1/usage", api(d.api_usage)),
        Route("/api/v1/history", api(d.api_history)),
        Route("/api/v1/quotas", api(d.api_quotas)),
        Route("/api/v1/health", api(d.api_health)),
        Route("/api/v1/events", api(d.api_events)),
        Route("/metrics", api(d.metrics)),
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Guard(Starlette(routes=routes), site, bounds)


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    return await run_in_threadpool(fn, *args)  # the Source asks hosts or a database: blocking


async def form_of(request: Request) -> dict[str, str]:
    """An urlencoded form's fields (the only kind the pages send: no multipart parser needed)."""
    body = (await request.body()).decode("utf-8", "replace")
    return {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}


def refusal(status: int, message: str, api: bool) -> Response:
    if api:
        return JSONResponse({"error": message}, status_code=status)
    return PlainTextResponse(message + "\n", status_code=status)


class Dashboard:
    def __init__(self, source: Source, auth: Auth, site: Site | None = None):
        self.source, self.auth = source, auth
        self.site = site or Site.loopback()  # site.public_url: where people reach the pages
        # What each action said, shown once on the job's page it redirects to: by a random id
        # (the URL carries the id, never the words: a link another site made shows nothing).
        self._said: OrderedDict[str, tuple[float, str, str]] = OrderedDict()  # id -> (monotonic, job, words)
        env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
        env.globals.update(charts=charts, timecharts=timecharts, shown_state=shown_state, shown_counts=shown_counts)
        env.filters.update(sig=sig, took=took, hours=hours)
        self.templates = Jinja2Templates(env=env)
        # What a study's document made, kept while the Source gives the same document (it
        # gives a new one when the study changed): the page's charts and its trials in each
        # order asked, the API's JSON, by study. A Source that makes a new document each time
        # keeps nothing.
        self._made: dict[str, tuple[StudyDoc, Markup, dict[tuple[str, bool], list[TrialJson]]]] = {}
        self._encoded: dict[str, tuple[StudyDoc, bytes]] = {}
        self._hosts_encoded: tuple[JobsDoc, bytes] | None = None  # (the hosts' document, its JSON)
        self._cluster: tuple[JobsDoc, dict[int, Markup]] | None = None  # (the hosts' document, page -> body)
        self._metrics: tuple[tuple[int, ...], Any, str] | None = None  # (the documents' ids, them, the text)

    def render(self, request: Request, viewer: Viewer | None, template: str, status: int = 200, **ctx: Any) -> Response:
        """The page, with this session's CSRF token (a cookie, set on the first page)."""
        csrf = request.cookies.get(CSRF_COOKIE) or new_csrf()
        ctx.update(viewer=viewer, csrf=csrf, csrf_field=CSRF_FIELD)
        resp = self.templates.TemplateResponse(request, template, ctx, status_code=status)
        if request.cookies.get(CSRF_COOKIE) != csrf:
            resp.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite="strict")
        return resp

    def guarded(self, fn: Handler) -> Endpoint:
        return self._guard(fn, api=False)

    def guarded_api(self, fn: Handler) -> Endpoint:
        return self._guard(fn, api=True)

    def _guard(self, fn: Handler, *, api: bool) -> Endpoint:
        """Who asks first (401/403 as one line), then the handler; the Source's NotFound is a
        404 that says what exists, Unavailable a 503 that says the data is out of reach."""

        async def endpoint(request: Request) -> Response:
            try:
                viewer = self.auth.viewer(request)
            except Denied as e:
                if not api and e.status == 401 and self.auth.mode is Mode.TOKEN and request.method == "GET":
                    return RedirectResponse("/login", status_code=303)
                return refusal(e.status, e.message, api)
            except ProvisionError as e:  # the tokens' database is away: say so; the next request asks again
                return self._failed(request, None, Unavailable(e.message), api)
            try:
                return await fn(request, viewer)
            except (Denied, BadFilter, NotFound, Unavailable, ProvisionError) as e:
                return self._failed(request, viewer, e, api)

        return endpoint

    def _failed(self, request: Request, viewer: Viewer | None, e: Exception, api: bool) -> Response:
        if isinstance(e, Denied):
            return refusal(e.status, e.message, api)
        if isinstance(e, BadFilter):
            return refusal(400, str(e), api)
        if isinstance(e, NotFound):
            if api:
                return JSONResponse({"error": f"no {e.what}", "known": e.known}, status_code=404)
            return self.render(request, viewer, "notfound.html", 404, what=e.what, known=e.known)
        if isinstance(e, Unavailable):
            if api:
                return JSONResponse({"error": str(e)}, status_code=503)
            return self.render(request, viewer, "unavailable.html", 503, why=str(e))
        assert isinstance(e, ProvisionError)  # what the CLI says in one line: another apply holds the lock...
        if request.method == "GET":  # a database or the hosts out of reach: the page says so, a reload asks again
            return self._failed(request, viewer, Unavailable(e.message), api)
        return refusal(409, e.message, api)

    # ------------------------------------------------------------------ pages

    async def cluster(self, request: Request, viewer: Viewer) -> Response:
        page = page_number(request.query_params)
        doc = self._current(await call(self.source.hosts))
        return self.render(request, viewer, "cluster.html", body=await call(self._cluster_body, doc, page))

    def _current(self, doc: JobsDoc) -> JobsDoc:
        """The hosts' document now: what was made from an older one goes (each held a document
        of 8,000 GPUs alive until its own page was asked again: the service's memory)."""
        if self._cluster is not None and self._cluster[0] is not doc:
            self._cluster = None
        if self._hosts_encoded is not None and self._hosts_encoded[0] is not doc:
            self._hosts_encoded = None
        return doc

    def _cluster_body(self, doc: JobsDoc, page: int) -> Markup:
        """The Cluster page's content, made once per hosts' document and page (a round's
        1,000 hosts grouped and a page of 256 GPUs' rows and charts: ~50 ms each request)."""
        got = self._cluster
        if got is None or got[0] is not doc:
            got = self._cluster = (doc, {})
        body = got[1].get(page)
        if body is None:
            view = cluster_page(doc, page)
            shown = {h.name for _, hosts in view.shown for h in hosts}
            jobs = [j for j in doc.get("jobs") or [] if view.pages == 1 or shown & set(j.get("hosts") or ())]
            ctx = {"view": view, "jobs": jobs, "pager": pager(view.page, view.pages), "page_size": HOSTS_PAGE}
            body = got[1][page] = Markup(self.templates.env.get_template("cluster_body.html").render(**ctx))
        return body

    async def jobs(self, request: Request, viewer: Viewer) -> Response:
        """Queued and running work from the hosts (with the service's numbers: rules/jobrows),
        finished work from the history, newest first (without one: the hosts' ended jobs)."""
        flt = job_filter(request.query_params)
        doc = await call(self.source.jobs)
        everyone = doc.get("jobs") or []
        picked = [j for j in everyone if flt.matches(j)]
        hq = flt.finished(time.time(), HISTORY_PAGE)
        finished = await call(self.source.history, hq) if hq is not None else None
        if finished is not None and finished["total"]:  # the history's: the ledgers' ended ones are in it
            picked = [j for j in picked if j["state"] != "ended"]
        shown, pages = page_of(picked, flt.page)
        owners = sorted({o for j in everyone if (o := j.get("owner"))} | ({flt.owner} if flt.owner else set()))
        sections = job_sections(shown)
        fpages = max(1, -(-finished["total"] // HISTORY_PAGE)) if finished is not None else 1
        total = len(picked) + (finished["total"] if finished is not None else 0)
        return self.render(
            request, viewer, "jobs.html", sections=sections, flt=flt, pages=pages, owners=owners, total=total,
            finished=finished, fpages=fpages, phases=PHASES, kinds=KINDS, since=list(SINCE),
        )  # fmt: skip

    async def job(self, request: Request, viewer: Viewer) -> Response:
        doc = await call(self.source.job, request.path_params["name"])
        may = viewer.may_act_on(doc.get("owner"))
        allowed = [a for a in doc.get("actions") or [] if a in ACTIONS] if may else []
        done = self._said_on(request.path_params["name"], request.query_params.get("done"))
        return self.render(request, viewer, "job.html", job=doc, allowed=allowed, done=done, now=time.time())

    def _say(self, name: str, words: str) -> str:
        """Keep what an action on job `name` said; the id its page shows it by."""
        now = time.monotonic()
        while self._said and (len(self._said) >= SAID_KEEP or next(iter(self._said.values()))[0] < now - SAID_SECONDS):
            self._said.popitem(last=False)
        key = secrets.token_urlsafe(12)
        self._said[key] = (now, name, words)
        return key

    def _said_on(self, name: str, key: str | None) -> str | None:
        got = self._said.get(key or "")
        if got is None or got[1] != name or got[0] < time.monotonic() - SAID_SECONDS:
            return None  # unknown, forged, for another job, or old: nothing
        return got[2]

    async def study(self, request: Request, viewer: Viewer) -> Response:
        name = request.path_params["name"]
        doc = await call(self.source.study, name)
        order = trial_order(request.query_params, [p["name"] for p in doc.get("space") or []])
        # Whether the Promote buttons show: the owner as the hosts were last seen (a POST
        # checks it again, fresh); the page never waits for a probe of the hosts.
        owner = await call(self.source.owner, name, True)
        may = viewer.may_act_on(owner)
        curves = await call(self.source.curves, name)
        drawn, trials = await call(self._study_made, name, doc, order, curves)
        rows, pages = page_of(trials, order.page, TRIALS_PAGE)
        return self.render(
            request,
            viewer,
            "study.html",
            study=doc,
            may_promote=may,
            charts_body=drawn,
            rows=rows,
            order=order,
            pages=pages,
            pager=pager(order.page, pages),
            page_size=TRIALS_PAGE,
        )

    def _study_made(
        self, name: str, doc: StudyDoc, order: TrialOrder, curves: StudyCurves
    ) -> tuple[Markup, list[TrialJson]]:
        """The study's charts and its trials in `order`'s sort, made once per document (the
        curves are read from the same snapshot: they change with it)."""
        got = self._made.get(name)
        if got is None or got[0] is not doc:  # the study changed (or was never shown)
            body = Markup(self.templates.env.get_template("study_charts.html").render(study=doc, curves=curves))
            got = self._made[name] = (doc, body, {})
        key = (order.sort, order.desc)
        if key not in got[2]:
            got[2][key] = sorted_trials(doc.get("trials") or [], order.sort, order.desc)
        return got[1], got[2][key]

    async def usage(self, request: Request, viewer: Viewer) -> Response:
        return self.render(request, viewer, "usage.html", usage=await call(self.source.usage))

    async def history(self, request: Request, viewer: Viewer) -> Response:
        """The history's rows (runs, trials, waits; preempted runs among them), filtered and
        paginated; GPU-hours per owner per day (a chart) and week."""
        hf = history_filter(request.query_params)
        now = time.time()
        doc = await call(self.source.history, hf.query(now))
        usage = await call(self.source.usage)
        axis = [time.strftime("%Y-%m-%d", time.gmtime(now - k * 86400)) for k in range(USAGE_DAYS - 1, -1, -1)]
        days, _, series = by_owner_over_days(usage["days"], axis=axis)
        owners = sorted({r["owner"] for r in (*usage["days"], *usage["weeks"])} | ({hf.owner} if hf.owner else set()))
        pages = max(1, -(-doc["total"] // HISTORY_PAGE))
        return self.render(
            request, viewer, "history.html", doc=doc, usage=usage, hf=hf, pages=pages, owners=owners,
            chart=timecharts.hours_svg(days, series), kinds=HISTORY_KINDS, states=(*SHOWN_STATES, "running", "waiting"),
            since=list(SINCE), pager=pager(hf.page, pages),
        )  # fmt: skip

    async def quotas(self, request: Request, viewer: Viewer) -> Response:
        return self.render(request, viewer, "quotas.html", doc=await call(self.source.quotas))

    async def health(self, request: Request, viewer: Viewer) -> Response:
        return self.render(request, viewer, "health.html", health=await call(self.source.incidents))

    # ------------------------------------------------------------------ actions

    async def act(self, request: Request, viewer: Viewer) -> tuple[str, ActionAnswer]:
        """A POSTed action, checked: CSRF, then that the viewer may act on this job."""
        name, action = request.path_params["name"], request.path_params["action"]
        form = await form_of(request)
        check_csrf(request, viewer, str(form.get(CSRF_FIELD) or "") or None)
        if action not in (*ACTIONS, "promote"):
            raise Denied(404, f"no action {action} (there are {', '.join(ACTIONS)}, promote)")
        owner = await call(self.source.owner, name)
        if not viewer.may_act_on(owner):
            raise Denied(403, f"{viewer.who} may not {action} {name}: it is {owner or 'nobody'}'s")
        if action == "promote":
            trial = whole_number(str(form.get("trial") or ""), "trial")
            return name, await call(self.source.promote, name, trial, viewer.who)
        return name, await call(getattr(self.source, action), name, viewer.who)

    async def act_page(self, request: Request, viewer: Viewer) -> Response:
        name, out = await self.act(request, viewer)
        if request.path_params["action"] == "promote":
            return self.render(request, viewer, "promoted.html", name=name, out=out)
        done = urlencode({"done": self._say(name, str(out.get("message", "")))})
        return RedirectResponse(f"/jobs/{quote(name)}?{done}", status_code=303)

    async def act_api(self, request: Request, viewer: Viewer) -> Response:
        _, out = await self.act(request, viewer)
        return JSONResponse(out, status_code=200 if out.get("ok", True) else 409)

    async def login(self, request: Request) -> Response:
        """Token mode's sign-in form: the token goes into an HttpOnly cookie."""
        if request.method == "POST":
            form = await form_of(request)
            token = str(form.get("token") or "")
            try:
                known = self.auth.tokens is not None and self.auth.tokens.owner_of(token) is not None
            except ProvisionError as e:  # the tokens' database is away
                return self._failed(request, None, Unavailable(e.message), False)
            if not known:
                return refusal(401, "this token is not valid (wrong or revoked)", False)
            resp = RedirectResponse("/", status_code=303)
            resp.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
            return resp
        return self.render(request, None, "login.html")

    # ------------------------------------------------------------------ for machines

    async def api_hosts(self, request: Request, viewer: Viewer) -> Response:
        doc = self._current(await call(self.source.hosts))
        return Response(await call(self._hosts_body, doc), media_type="application/json")

    def _hosts_body(self, doc: JobsDoc) -> bytes:
        """The hosts' JSON, encoded once per document (1,000 hosts x 8 GPUs with their last
        hour: 3 MB, encoded again for every request before)."""
        got = self._hosts_encoded
        if got is None or got[0] is not doc:
            got = self._hosts_encoded = (doc, bytes(JSONResponse({k: v for k, v in doc.items() if k != "jobs"}).body))
        return got[1]

    async def api_jobs(self, request: Request, viewer: Viewer) -> Response:
        flt = job_filter(request.query_params)
        doc = await call(self.source.jobs)
        rest = {k: v for k, v in doc.items() if k != "hosts"}
        return JSONResponse({**rest, "jobs": [j for j in doc.get("jobs") or [] if flt.matches(j)]})

    async def api_job(self, request: Request, viewer: Viewer) -> Response:
        return JSONResponse(await call(self.source.job, request.path_params["name"]))

    async def api_logs(self, request: Request, viewer: Viewer) -> Response:
        after = request.query_params.get("after") or None
        return JSONResponse(await call(self.source.logs, request.path_params["name"], after))

    async def api_study(self, request: Request, viewer: Viewer) -> Response:
        name = request.path_params["name"]
        doc = await call(self.source.study, name)
        got = self._encoded.get(name)
        if got is None or got[0] is not doc:
            got = self._encoded[name] = (doc, await call(lambda: JSONResponse(doc).body))
        return Response(got[1], media_type="application/json")

    async def api_usage(self, request: Request, viewer: Viewer) -> Response:
        return JSONResponse(await call(self.source.usage))

    async def api_history(self, request: Request, viewer: Viewer) -> Response:
        hf = history_filter(request.query_params)
        return JSONResponse(await call(self.source.history, hf.query(time.time())))

    async def api_quotas(self, request: Request, viewer: Viewer) -> Response:
        return JSONResponse(await call(self.source.quotas))

    async def api_health(self, request: Request, viewer: Viewer) -> Response:
        return JSONResponse(await call(self.source.incidents))

    async def api_events(self, request: Request, viewer: Viewer) -> Response:
        """Events after `after` (an id; 0: from the oldest kept), of `job`, of `kind`s."""
        q = request.query_params
        raw = q.get("after", "0") or "0"
        if not raw.isascii() or not raw.isdigit() or len(raw) > 18:
            return refusal(400, f"after: expected an event id (a number), got {raw[:40]!r}", True)
        try:
            kinds = parse_kinds(q.get("kind", ""))
        except ValueError as e:
            return refusal(400, f"kind: {str(e.args[0])[:40]!r} is not an event kind", True)
        return JSONResponse(await call(self.source.events, int(raw), q.get("job") or None, kinds))

    async def metrics(self, request: Request, viewer: Viewer) -> Response:
        return PlainTextResponse(await call(self._exposition), media_type=CONTENT_TYPE)

    def _exposition(self) -> str:
        studies = {}
        for name in self.source.studies():
            try:
                studies[name] = self.source.study(name)
            except NotFound:
                continue  # not started: no trials to count
        latest = self.source.latest()
        # The same documents (a sampling round's hosts, unchanged studies): the same text,
        # made once (8,000 GPUs' gauges are ~30,000 lines). The documents are kept with it,
        # so their ids are not reused meanwhile; the queue's waits are as of that round.
        key = (id(latest), *(id(d) for d in studies.values()))
        got = self._metrics
        if got is None or got[0] != key:
            got = self._metrics = (key, (latest, studies), exposition(latest, studies, time.time()))
        return got[2]
