"""Benchmark ("Speed"): the dashboard of a `provision serve --listen` over a seeded
PostgreSQL (tests/pgserver.py, on loopback):

- 100,000 finished runs in the service's history (provision_service_history, bulk SQL in
  the store's own schema: ServiceStore.open_pg makes the tables), spread over 8 weeks,
  40 owners, 8 GPUs each; the kept logs at their bound (256 MiB, of 4,096 of those jobs);
- one study of 10,000 finished trials in the state's database (the study opened with
  io/study.py's open_study, its trials, made by Optuna's create_trial, written into Optuna's
  tables with a COPY each: 3 parameters, one log-scaled, a value each);
- the study's inventory (`--inventory`: a job run from a terminal) holds --hosts sandbox
  hosts of 8 fake GPUs each: the Cluster page and /api/v1/hosts probe them over SSH;
- or, with --fake-hosts N (1,000 hosts x 8 GPUs: this machine runs ~128 sandbox
  hosts at most), N hosts that exist only as canned probe answers: the service runs with
  provision.run.context.probe_host (the one call that talks to a host, per host) replaced,
  in this bench's service process only, by one that returns a ProbeReport built from the
  real report types (ledger entries of jobs of 40 owners, their units active, nvidia-smi's
  facts and compute processes); everything above it (the probe rounds, the sampler, the
  pages) is the service's own code. The first --hosts of them are the study's inventory,
  the rest a second one (labelled by rack and GPU kind). The sampler's last hour is seeded
  too: a sample of every GPU every SAMPLE_EVERY s (one bulk COPY), the same holders.

Every page and /api/v1 answer (and /metrics) is asked --requests times in a row with httpx
after one warm-up: p50, p95, max. The Cluster page's first paint in Debian's chromium
(Selenium and chromium-driver, headless): performance.getEntriesByType('paint'), --loads
fresh loads. The service's RSS (its process and any child) sampled throughout.

    PYTHONPATH=$PWD/src python bench/dashboard_load.py [--hosts 128] [--requests 60]
        [--sandbox NAME (reuse a running sandbox)] [--keep]
        [--fake-hosts 1000 --gpus 8 (no sandbox: canned probe answers)]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import httpx
from servebench import Report, Sampler, Serve, median, p95, pg_env

from provision import sandbox
from provision.sandbox.inventory import dump

P95_BOUND = 0.300
PAINT_BOUND = 1.0
RSS_BOUND = 300.0
RUNS = 100_000
TRIALS = 10_000
WEEKS = 8


def seed_history(server: object, now: float) -> None:
    from provision.io.servicestore import ServiceStore

    url = server.url()  # type: ignore[attr-defined]
    os.environ.update(server.env())  # type: ignore[attr-defined]
    ServiceStore.open_pg(url, url.split("@")[-1]).close()  # the schema, as the service makes it
    span = WEEKS * 7 * 86400
    server.sql(  # type: ignore[attr-defined]
        "INSERT INTO provision_service_history (kind, job, owner, started, ended, how, hosts, gpus, submission) "
        f"SELECT 'run', 'job-' || g, 'user' || (g % 40) || '@example.com', {now} - {span} * (g::float8 / {RUNS}), "
        f"{now} - {span} * (g::float8 / {RUNS}) + 600 + (g % 7) * 1800, "
        "CASE WHEN g % 10 = 0 THEN 'failed: exit code 1' ELSE 'succeeded' END, "
        "'[\"host-' || (g % 1000) || '\"]', 8, 'sub-' || g "
        f"FROM generate_series(1, {RUNS}) AS g"
    )
    server.sql("ANALYZE provision_service_history")  # type: ignore[attr-defined]  # as autovacuum soon would


def seed_logs(server: object, total: int) -> int:
    """The kept logs at their total bound (io/servicelogs.TOTAL_BYTES): blocks of BLOCK_BYTES of
    lines, one job of the history each, as the log keeper writes them (one COPY)."""
    import psycopg

    from provision.io.servicelogs import BLOCK_BYTES

    line = "2026-11-27T10:00:00Z\tchief-0\thost-1\tstep 1200 loss 0.4182 lr 0.0003 (bench line, some words of a log)"
    per = BLOCK_BYTES // (len(line) + 1)
    data = "\n".join([line] * per)
    blocks = total // BLOCK_BYTES
    with psycopg.connect(server.url(password=True)) as conn:  # type: ignore[attr-defined]
        with (
            conn.cursor() as cur,
            cur.copy("COPY provision_service_logs (job, run, lines, bytes, data) FROM STDIN") as cp,
        ):
            for k in range(blocks):
                cp.write_row((f"job-{k % 4096 + 1}", 1, per, per * (len(line) + 1), data))
        conn.execute("ANALYZE provision_service_logs")
    return blocks * per * (len(line) + 1)


def study_trials(trials: int, job: str) -> list[Any]:
    """The study's finished trials (Optuna's FrozenTrial, as create_trial makes them): 3
    parameters, one log-scaled; a value each; one in five pruned at step 3."""
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    dists = {
        "lr": FloatDistribution(1e-5, 1e-1, log=True),
        "layers": IntDistribution(1, 12),
        "opt": CategoricalDistribution(["adam", "sgd", "lamb"]),
    }
    rnd = random.Random(1)
    out = []
    t0 = time.time() - 7 * 86400
    for n in range(trials):
        params = {
            "lr": 10 ** rnd.uniform(-5, -1),
            "layers": rnd.randint(1, 12),
            "opt": rnd.choice(["adam", "sgd", "lamb"]),
        }
        value = rnd.uniform(0.05, 2.0)
        pruned = n % 5 == 4
        start = dt.datetime.fromtimestamp(t0 + n * 60, dt.UTC)
        trial = optuna.trial.create_trial(
            state=optuna.trial.TrialState.PRUNED if pruned else optuna.trial.TrialState.COMPLETE,
            value=None if pruned else value,
            params=params,
            distributions=dists,
            user_attrs={
                "runner": "bench:1:x",
                "job": f"{job}-t{n + 1}",
                "phase": "ended",
                "ending": "stopped_early" if pruned else "succeeded",
                "value": value,
                "steps": 10,
                **({"why": "median rule at step 3"} if pruned else {}),
            },
            intermediate_values={s: value + 0.1 * (10 - s) for s in range(0, 10, 3)},
        )
        trial.datetime_start = start
        trial.datetime_complete = start + dt.timedelta(seconds=300)
        out.append(trial)
    return out


# Optuna's RDB tables a finished trial fills, and their columns (optuna/storages/_rdb/models.py).
TRIAL_TABLES = {
    "trials": "trial_id, number, study_id, state, datetime_start, datetime_complete",
    "trial_params": "param_id, trial_id, param_name, param_value, distribution_json",
    "trial_values": "trial_value_id, trial_id, objective, value, value_type",
    "trial_user_attributes": "trial_user_attribute_id, trial_id, key, value_json",
    "trial_intermediate_values": "trial_intermediate_value_id, trial_id, step, intermediate_value, "
    "intermediate_value_type",
}


def seed_study(inv_path: Path, url: str, dsn: str, trials: int = TRIALS) -> None:
    """The study made by io/study.py's open_study, its trials written straight into Optuna's
    tables with one COPY each (add_trials took 479 s for 10,000: a few statements a row)."""
    import json

    import psycopg
    from optuna.distributions import distribution_to_json

    from provision.inventory.inventory import load
    from provision.io.study import open_study

    inv = load(inv_path)
    assert inv.tune is not None
    study_id = open_study(inv.tune, inv.job, url, Path("/nonexistent")).study._study_id
    rows: dict[str, list[tuple[Any, ...]]] = {t: [] for t in TRIAL_TABLES}
    utc = dt.UTC
    for n, tr in enumerate(study_trials(trials, inv.job)):
        tid = n + 1
        start, end = (d.astimezone(utc).replace(tzinfo=None) for d in (tr.datetime_start, tr.datetime_complete))
        rows["trials"].append((tid, n, study_id, tr.state.name, start, end))
        for name, v in tr.params.items():
            d = tr.distributions[name]
            rows["trial_params"].append((None, tid, name, d.to_internal_repr(v), distribution_to_json(d)))
        if tr.value is not None:
            rows["trial_values"].append((None, tid, 0, tr.value, "FINITE"))
        for k, v in tr.user_attrs.items():
            rows["trial_user_attributes"].append((None, tid, k, json.dumps(v)))
        for step, v in tr.intermediate_values.items():
            rows["trial_intermediate_values"].append((None, tid, step, v, "FINITE"))
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        for table, cols in TRIAL_TABLES.items():
            key = cols.split(", ")[0]
            with cur.copy(f"COPY {table} ({cols}) FROM STDIN") as cp:
                for k, r in enumerate(rows[table]):
                    cp.write_row(r if r[0] is not None else (k + 1, *r[1:]))
            # The ids given here: the table's sequence goes on after them (Optuna's next insert).
            cur.execute(f"SELECT setval(pg_get_serial_sequence('{table}', '{key}'), (SELECT MAX({key}) FROM {table}))")
        cur.execute("ANALYZE")


# ---------------------------------------------------------------- --fake-hosts: the canned fleet
# Host i of N: which job holds each GPU, its owner and how busy it is, a pure function of i
# (the canned probe answers and the seeded samples agree). About a third of the hosts run an
# evaluation on GPUs 0-3, the others a training job (of two hosts) on GPUs 0-5; one job in
# ten idles (1 %: the Usage page flags it); a host in 97 does not answer; one in 125 is drained.
FLEET_OWNERS = 40
GPU_MIB = 81920


def fake_name(i: int) -> str:
    return f"fake-{i:04d}"


def fake_holder(i: int, g: int) -> str | None:
    if i % 3 == 0:
        return f"eval-{i}" if g < 4 else None
    return f"train-{i // 2}" if g < 6 else None


def fake_owner(job: str) -> str:
    return f"user{zlib.crc32(job.encode()) % FLEET_OWNERS}@ws-{zlib.crc32(job.encode()) % 7}"


def fake_util(i: int, g: int, t: float) -> int:
    job = fake_holder(i, g)
    if job is None:
        return 0
    if zlib.crc32(job.encode()) % 10 == 3:
        return 1
    return 50 + zlib.crc32(f"{job}/{g}".encode()) % 40 + int(t // 10) % 10


def fake_unreachable(i: int) -> bool:
    return i % 97 == 5


def fake_inventory(job: str, first: int, last: int, gpus: int, key: Path, **extra: Any) -> dict[str, Any]:
    """Hosts first..last-1 (addresses never dialled: the probe is canned), labelled by rack and kind."""
    from provision.sandbox.hosts import ACCELERATOR_TYPE

    hosts = [
        {
            "name": fake_name(i),
            "address": f"10.254.{i // 250}.{i % 250 + 1}",
            "accelerators": {"type": ACCELERATOR_TYPE, "count": gpus},
            "labels": {"rack": f"r{i // 100:02d}", "kind": "a100" if i % 2 else "h100"},
            **({"drain": True} if i % 125 == 1 else {}),
        }
        for i in range(first, last)
    ]
    return {
        "job": job,
        "ssh": {"user": "bench", "identity_file": str(key), "host_key_policy": "accept-new"},
        "hosts": hosts,
        "pools": {"chief": {"replicas": 1, "accelerators": 1, "command": ["sleep", "1"]}},
        **extra,
    }


def canned_report(i: int, gpus: int, now: float) -> Any:
    """What `_probe_hosts` gets for host i from a tenancy + GPU probe: each job's ledger
    entry (host/ledger.py's shape), its unit active, nvidia-smi's facts and processes."""
    from provision.host.protocol import ProbeReport

    by_job: dict[str, list[int]] = {}
    for g in range(gpus):
        job = fake_holder(i, g)
        if job is not None:
            by_job.setdefault(job, []).append(g)
    ledger, units, apps = {}, {}, []
    for job, held in by_job.items():
        unit = f"provision-{job}-chief-0.service"
        who = fake_owner(job)
        ledger[job] = {
            "job": job,
            "owner": {"lineage": f"lin-{job}", "who": who, "host": "ws", "pid": 1, "state": "postgresql://team"},
            "since": now - 7200,
            "updated": now - 7200,
            "token": f"tok-{job}",
            "gpus": held,
            "gpu_uuids": [f"GPU-{i:04d}-{g}" for g in held],
            "ports": [],
            "units": [unit],
            "started": True,
        }
        units[unit] = {"ActiveState": "active", "SubState": "running"}
        apps += [
            {"gpu_uuid": f"GPU-{i:04d}-{g}", "pid": 4000 + g, "name": "python3", "used_mib": 30000 + 1000 * g,
             "owner": {"unit": unit}}
            for g in held
        ]  # fmt: skip
    facts = {
        "gpus": [
            {"index": g, "uuid": f"GPU-{i:04d}-{g}", "util_pct": fake_util(i, g, now),
             "memory_used_mib": 30000 + 1000 * g if fake_holder(i, g) else 0, "memory_mib": GPU_MIB}
            for g in range(gpus)
        ]
    }  # fmt: skip
    return ProbeReport(facts=facts, ledger=ledger, ledger_units=units, listening=[], checks={"gpus": {"apps": apps}})


def serve_canned(gpus: int, serve_args: list[str]) -> None:
    """The service's process of a --fake-hosts run: `provision serve` with each host's round
    trip answered by canned_report (module docstring)."""
    import provision.run.context as context
    from provision.core.target import HostError, Target
    from provision.host.protocol import ProbeReport, ProbeRequest
    from provision.io.ssh import Session

    def probe_host(session: Session, t: Target, req: ProbeRequest) -> ProbeReport:
        i = int(t.name.rsplit("-", 1)[1])
        if fake_unreachable(i):
            raise HostError(t, "ssh: connect timed out (canned)", unreachable=True)
        return canned_report(i, gpus, time.time())  # type: ignore[no-any-return]

    context.probe_host = probe_host  # type: ignore[attr-defined]
    where = os.environ.get("PROVISION_BENCH_TRACEMALLOC")
    if where:  # where the service's memory goes: its top allocation sites every 15 s
        import threading
        import tracemalloc

        tracemalloc.start(1)

        def dump() -> None:
            while True:
                time.sleep(15)
                snap = tracemalloc.take_snapshot()
                files = snap.statistics("filename")
                total = sum(x.size for x in files) / 2**20
                rss = [x for x in Path("/proc/self/smaps_rollup").read_text().splitlines() if "Rss" in x or "Anon" in x]
                lines = [f"traced: {total:.1f} MiB", *rss, "", *map(str, files[:25]), ""]
                Path(where).write_text("\n".join(lines + [str(x) for x in snap.statistics("lineno")[:60]]) + "\n")

        threading.Thread(target=dump, daemon=True).start()
    from provision.cli.app import run

    sys.argv = ["provision", "serve", *serve_args]
    run()


def canned_serve(cwd: Path, env: dict[str, str], gpus: int, args: tuple[str, ...]) -> Serve:
    """Serve, its process serve_canned's (this file run with --as-service)."""
    return Serve(cwd, env, ("--", *args), (sys.executable, str(Path(__file__).resolve()), "--as-service", str(gpus)))


def seed_samples(server: object, hosts: int, gpus: int, now: float) -> int:
    """The sampler's last hour of every reachable GPU (a round every SAMPLE_EVERY s), one COPY,
    round after round as the sampler writes them (host after host, the last rounds' rows
    were spread over every page of the table: the Usage page's latest samples read 8,000
    pages for 250)."""
    import psycopg

    from provision.serve.gpusample import SAMPLE_EVERY

    rounds = int(3600 // SAMPLE_EVERY)
    cols = "host, gpu, t, util, memory_mib, memory_total_mib, job, owner"
    gpus_of = []  # (host i, gpu, the row's columns after t but util)
    for i in range(hosts):
        if fake_unreachable(i):
            continue
        for g in range(gpus):
            job = fake_holder(i, g)
            tail = f"{30000 + 1000 * g}\t{GPU_MIB}\t{job}\t{fake_owner(job)}" if job else f"0\t{GPU_MIB}\t\\N\t\\N"
            gpus_of.append((i, g, f"{fake_name(i)}\t{g}", tail))
    with psycopg.connect(server.url(password=True)) as conn:  # type: ignore[attr-defined]
        with conn.cursor() as cur, cur.copy(f"COPY provision_service_gpu_samples ({cols}) FROM STDIN") as cp:
            for k in range(rounds):
                t = now - 3600 + SAMPLE_EVERY * (k + 1)
                cp.write(
                    "".join(f"{head}\t{t}\t{fake_util(i, g, t)}\t{tail}\n" for i, g, head, tail in gpus_of).encode()
                )
        conn.execute("ANALYZE provision_service_gpu_samples")
    return rounds * len(gpus_of)


def timed(client: httpx.Client, url: str, n: int) -> tuple[list[float], int, int, float]:
    t = time.perf_counter()
    r = client.get(url)  # warm-up (the first probe opens the SSH connections; the first read of a study)
    first = time.perf_counter() - t
    size = len(r.content)
    times, bad = [], 0
    for _ in range(n):
        t = time.perf_counter()
        r = client.get(url)
        times.append(time.perf_counter() - t)
        if r.status_code != 200 and not bad:  # what it said, once (a 503 page says why)
            print(f"  {url}: {r.status_code}: {' '.join(r.text.split())[-300:]}", flush=True)
        bad += r.status_code != 200
    return times, size, bad, first


def first_paint(url: str, loads: int) -> list[float]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        opts.add_argument(arg)
    b = webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=opts)
    out = []
    try:
        b.get(url)  # warm-up: the browser's own start
        for _ in range(loads):
            b.get("about:blank")
            b.get(url)
            fp = None
            end = time.monotonic() + 3
            while fp is None and time.monotonic() < end:  # headless chromium may record the paint after load
                paints = dict(
                    b.execute_script("return performance.getEntriesByType('paint').map(e => [e.name, e.startTime]);")
                )
                fp = paints.get("first-contentful-paint") or paints.get("first-paint")
                if fp is None:
                    time.sleep(0.1)
            if fp is None:  # none recorded: the navigation's DOMContentLoaded instead (said so in the results)
                fp = b.execute_script("return performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd;")
                print(f"  no paint entry: DOMContentLoaded at {float(fp) / 1000:.3f} s used", flush=True)
            out.append(float(fp) / 1000)
    finally:
        b.quit()
    return out


URLS = [
    "/",
    "/jobs",
    "/jobs?owner=bench%40example.com&page=2",
    "/jobs?phase=failed&since=30d",
    "/jobs?fpage=200",
    "/jobs/bigstudy",
    "/jobs/bigstudy-t5000",
    "/jobs/job-5",
    "/jobs/eval-3",
    "/studies/bigstudy",
    "/history",
    "/history?owner=user7%40example.com&kind=run&page=20",
    "/quotas",
    "/usage",
    "/api/v1/hosts",
    "/api/v1/jobs",
    "/api/v1/jobs/bigstudy",
    "/api/v1/jobs/job-5/logs",
    "/api/v1/studies/bigstudy",
    "/api/v1/history",
    "/api/v1/quotas",
    "/api/v1/usage",
    "/metrics",
]


def cold_usage(rep: Report, base: str, n: int) -> None:
    """The Usage sum itself: the service keeps one sum up to USAGE_STALE s (serve/source.py),
    so each of these requests comes after that, and is answered by a new sum."""
    from provision.serve.source import USAGE_STALE

    times = []
    with httpx.Client(base_url=base, timeout=300) as client:
        for _ in range(n):
            time.sleep(USAGE_STALE + 1)  # past the kept sum's age: this request sums (not ordering)
            t = time.perf_counter()
            client.get("/api/v1/usage").raise_for_status()
            times.append(time.perf_counter() - t)
    rep.say(
        f"{'/api/v1/usage, each summed anew':42s} p50 {1000 * median(times):7.1f} ms  max {1000 * max(times):7.1f} ms  "
        f"({n} requests, each {USAGE_STALE + 1:g} s after the last)"
    )
    rep.verdict(
        f"a new Usage sum <= {1000 * P95_BOUND:g} ms (max)", f"{1000 * max(times):.1f} ms", max(times) <= P95_BOUND
    )


def measure(rep: Report, base: str, pid: int, urls: list[str], args: argparse.Namespace) -> None:
    """Each URL timed, the Cluster page's first paint, the service's RSS; the verdicts."""
    mem = Sampler(pid, every=1.0)
    stop = threading.Event()

    def sampling() -> None:
        while not stop.is_set():
            mem.sample()
            stop.wait(1.0)

    threading.Thread(target=sampling, daemon=True).start()
    worst: list[tuple[str, float]] = []
    with httpx.Client(base_url=base, timeout=300) as client:
        for u in urls:
            # The study's pages and /metrics (which reads every study) took seconds each at
            # 10,000 trials (before the study's reader, io/studyread.py): --slow requests of those.
            slow = "/studies/" in u or u == "/metrics" or "-t5000" in u
            times, size, bad, first = timed(client, u, args.slow if slow else args.requests)
            worst.append((u, p95(times)))
            rep.say(
                f"{u:42s} p50 {1000 * median(times):7.1f} ms  p95 {1000 * p95(times):7.1f} ms  "
                f"max {1000 * max(times):7.1f} ms  ({size} bytes, {bad} not 200, {len(times)} requests; "
                f"the warm-up before them {1000 * first:.0f} ms; RSS {mem.samples[-1][2] if mem.samples else 0:.0f} MiB)"
            )
    if args.usage_cold:
        cold_usage(rep, base, args.usage_cold)
    paints = first_paint(base + "/", args.loads) if args.loads else []
    if paints:
        rep.say(
            f"Cluster page first contentful paint, {len(paints)} loads: median {median(paints):.3f} s, max {max(paints):.3f} s"
        )
    stop.set()
    mem.sample()
    rss = mem.rss_max()
    rep.say(
        f"the service's RSS: max {rss:.1f} MiB over these requests ({len(mem.samples)} samples); "
        f"its CPU: {100 * mem.cpu_share():.0f} % of a core (the pages and the sampler's rounds)"
    )
    for u, p in worst:
        rep.verdict(f"p95 <= {1000 * P95_BOUND:g} ms: {u}", f"{1000 * p:.1f} ms", p <= P95_BOUND)
    if paints:
        rep.verdict(
            f"Cluster page first paint <= {PAINT_BOUND:g} s", f"max {max(paints):.3f} s", max(paints) <= PAINT_BOUND
        )
    rep.verdict(f"the service's memory <= {RSS_BOUND:g} MiB", f"{rss:.1f} MiB", rss <= RSS_BOUND)


STUDY_TUNE = {
    "metric": {"name": "loss", "goal": "minimize"},
    "parameters": {
        "lr": {"type": "double", "min": 1e-5, "max": 1e-1, "scale": "log"},
        "layers": {"type": "integer", "min": 1, "max": 12},
        "opt": {"type": "categorical", "values": ["adam", "sgd", "lamb"]},
    },
    "algorithm": "random",
    "max_trials": TRIALS,
    "parallel_trials": 4,
}


def main() -> int:  # noqa: C901  one bench's steps in order, each with its report lines
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=128, help="the study's hosts (sandbox hosts, or the first fake ones)")
    ap.add_argument("--fake-hosts", type=int, default=0, help="hosts in all, canned (no sandbox)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs a host")
    ap.add_argument("--trials", type=int, default=TRIALS, help="the study's trials")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--slow", type=int, default=60, help="requests of the study's pages and /metrics")
    ap.add_argument("--loads", type=int, default=10)
    ap.add_argument(
        "--usage-cold",
        type=int,
        default=0,
        help="requests of /api/v1/usage each past the service's sum's age (~11 s apart)",
    )
    ap.add_argument("--attach", metavar="BASE", help="measure a service already serving (http://HOST:PORT): no seeding")
    ap.add_argument("--pid", type=int, help="with --attach: the service's process")
    ap.add_argument("--urls", help="comma-separated paths to measure (default: all)")
    ap.add_argument("--sandbox", help="a running sandbox's name (else one is started and removed)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--name", default=time.strftime("%Y-%m-%d-dashboard-load", time.gmtime()))
    args = ap.parse_args()
    from pgserver import free_port, start_server

    rep = Report(args.name, "the dashboard over a seeded PostgreSQL")
    urls = args.urls.split(",") if args.urls else URLS
    if args.attach:
        measure(rep, args.attach, args.pid, urls, args)
        rep.write()
        return 0
    fake = args.fake_hosts > 0
    sb = None
    if not fake:
        sb = (
            sandbox.load(args.sandbox)
            if args.sandbox
            else sandbox.up("servebench", hosts=args.hosts, gpus_per_host=args.gpus, timeout=900)
        )
    server = start_server()
    tmp = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    svc: Serve | None = None
    try:
        now = time.time()
        t = time.monotonic()
        seed_history(server, now)
        rep.say(f"seeded {RUNS} finished runs over {WEEKS} weeks in {time.monotonic() - t:.0f} s")
        from provision.io.servicelogs import TOTAL_BYTES

        t = time.monotonic()
        kept = seed_logs(server, TOTAL_BYTES)
        rep.say(f"seeded {kept / 2**20:.0f} MiB of kept logs (the store's bound) in {time.monotonic() - t:.0f} s")
        tune = {**STUDY_TUNE, "max_trials": max(1, args.trials)}
        paths = [tmp / "bigstudy.yaml"]
        if fake:
            key = tmp / "key"
            key.write_text("")
            key.chmod(0o600)
            paths[0].write_text(dump(fake_inventory("bigstudy", 0, args.hosts, args.gpus, key, tune=tune)))
            paths.append(tmp / "fleet.yaml")
            paths[1].write_text(dump(fake_inventory("fleet", args.hosts, args.fake_hosts, args.gpus, key)))
            t = time.monotonic()
            n = seed_samples(server, args.fake_hosts, args.gpus, now)
            rep.say(f"seeded {n} GPU samples (the last hour, a round every 10 s) in {time.monotonic() - t:.0f} s")
        else:
            assert sb is not None
            hosts = [h.name for h in sb.hosts][: args.hosts]
            inv = sandbox.inventory_dict(
                sb,
                job="bigstudy",
                hosts=hosts,
                pools={"chief": {"replicas": 1, "accelerators": 1, "command": ["sleep", "1"]}},
                tune=tune,
            )
            paths[0].write_text(dump(inv, sb))
        env = {
            **pg_env(server),
            "PROVISION_OWNER": "bench@example.com",
            "PROVISION_SERVICE_DB": str(tmp / "svc.sqlite"),
        }
        os.environ.update(env)
        t = time.monotonic()
        dsn = server.url(password=True)
        seed_study(paths[0], "postgresql+psycopg://" + dsn.split("://", 1)[1], dsn, args.trials)
        rep.say(f"seeded a study of {args.trials} trials in {time.monotonic() - t:.0f} s")
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        serve_args: tuple[str, ...] = ("--listen", f"127.0.0.1:{port}")
        for path in paths:
            serve_args += ("--inventory", str(path))
        if fake:
            rep.say(
                f"the inventories: {args.fake_hosts} hosts x {args.gpus} GPUs, canned probe answers "
                f"(the study's: {args.hosts} of them; {sum(map(fake_unreachable, range(args.fake_hosts)))} never answer)"
            )
            svc = canned_serve(tmp / "serve", env, args.gpus, serve_args)
        else:
            rep.say(
                f"the study's inventory: {args.hosts} sandbox hosts x {args.gpus} fake GPUs (every host probed over SSH)"
            )
            svc = Serve(tmp / "serve", env, serve_args)
        svc.wait_for("Dashboard on", 120)
        measure(rep, base, svc.p.pid, urls, args)
    finally:
        if svc is not None:
            svc.stop()
        server.cleanup()
        if sb is not None and not args.keep and not args.sandbox:
            sandbox.down(sb.name)
        shutil.rmtree(tmp, ignore_errors=True)
    rep.write()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--as-service"]:  # the service's own process of a --fake-hosts run
        serve_canned(int(sys.argv[2]), sys.argv[4:])
        sys.exit(0)
    sys.exit(main())
