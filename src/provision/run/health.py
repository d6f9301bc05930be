"""The hosts' health, read and acted on: one agent call per host (host/health.py changes the
record under the ledger's lock; the host refuses a change that finds the mark otherwise).

- `look`: every host's and GPU's state and what the health read finds there now
  (`provision health INVENTORY`);
- `quarantine`, `release`, `test`: by hand (`provision health quarantine|release|test`),
  recorded with who did it;
- `send`: the service's changes (serve/health.py), one call per host with changes.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from provision.core.errors import ProvisionError
from provision.core.target import HostError, Target
from provision.host.protocol import HealthReport, HealthRequest, HealthTestReport, HealthTestRequest, ProbeReport
from provision.io.ssh import call_agent
from provision.io.steps import GroupResult, Step, run_step
from provision.rules import health as hl
from provision.rules.health import Change, HostHealth, Signal, State
from provision.rules.tenancy import holders, identity
from provision.run.context import Ask, Context, probe

LOOK_ASK = Ask(facts="check", files=False, tenancy=True, listening=False, health=True)
TEST_TIMEOUT = 900.0  # seconds the host's test may take (host/health.TEST_TIMEOUT)


def who() -> str:
    """Who acts by hand, as the ledgers name owners."""
    return identity(socket.gethostname())


@dataclass(frozen=True)
class HostLook:
    """A host's health now: its record, what the read found, who holds each GPU."""

    name: str
    declared: int
    health: HostHealth = HostHealth()
    signals: tuple[Signal, ...] = ()
    holders: Mapping[int, tuple[str, str]] = field(default_factory=dict)
    error: str | None = None  # unreachable, or the agent's words


def look(ctx: Context, only: set[str] | None = None) -> list[HostLook]:
    """Every host of the inventory (or `only`), asked once, all at once."""
    res = probe(ctx, LOOK_ASK, fast=True, only=only)
    out = []
    for h in ctx.inventory.hosts:
        if only is not None and h.name not in only:
            continue
        r = res.get(h.name) if h.name in res else None
        if isinstance(r, ProbeReport):
            sigs = hl.signals(h.accelerator_count, r, ctx.policy.health, ctx.inventory.outputs)
            held = {g: (x.job, x.who) for x in holders(h.name, r) if x.hold.holds for g in x.gpus}
            out.append(HostLook(h.name, h.accelerator_count, hl.of_report(r), sigs, held))
        else:
            why = r.message if isinstance(r, HostError) else "not asked"
            out.append(HostLook(h.name, h.accelerator_count, error=why))
    return out


def send(ctx: Context, requests: Mapping[str, HealthRequest]) -> GroupResult[HealthReport]:
    """Each host's request (one agent call each, all at once)."""

    def one(t: Target) -> HealthReport:
        rep: HealthReport = call_agent(ctx.session, t, requests[t.name], timeout=60)
        return rep

    return run_step(ctx.session, Step.HEALTH, one, [ctx.targets[n] for n in sorted(requests) if n in ctx.targets])


def _target(ctx: Context, text: str) -> tuple[str, int | None, int]:
    """HOST[:GPU] of the inventory, checked: (host, GPU, the GPUs it declares); one line
    naming what is wrong otherwise."""
    try:
        host, gpu = hl.parse_target(text)
    except ValueError:
        raise ProvisionError(f"{text!r}: expected HOST or HOST:GPU (a GPU's number), e.g. gpu-1:0") from None
    hosts = {h.name: h for h in ctx.inventory.hosts}
    if host not in hosts:
        known = ", ".join(sorted(hosts)[:8])
        raise ProvisionError(f"{text}: no host named {host} in {ctx.where} (hosts: {known}); nothing was changed")
    n = hosts[host].accelerator_count
    if gpu is not None and gpu >= n:
        has = f"GPUs 0-{n - 1}" if n > 1 else "GPU 0" if n == 1 else "no GPU"
        raise ProvisionError(f"{text}: {host} declares {has}; nothing was changed")
    return host, gpu, n


def _now(ctx: Context, host: str) -> HostLook:
    got = look(ctx, {host})[0]
    if got.error is not None:
        raise ProvisionError(f"{host}: {got.error}; nothing was changed")
    return got


def _state(h: HostHealth, gpu: int | None) -> tuple[State, hl.Mark | None]:
    m = h.host if gpu is None else h.gpus.get(gpu)
    return (m.state if m is not None else State.HEALTHY), m


def _change(ctx: Context, host: str, change: Change) -> HealthReport:
    res = send(ctx, {host: HealthRequest(changes=[change.to_wire()])})
    if host in res.errors:
        raise ProvisionError(res.errors[host].message)
    rep = res.ok[host]
    if rep.refused:
        raise ProvisionError(f"{host}: {rep.refused[0]}")
    return rep


def quarantine(ctx: Context, target: str, reason: str) -> str:
    """Quarantine a GPU (or the whole host) by hand; what was done, in words."""
    if not reason.strip():
        raise ProvisionError("--reason: say why (it is shown to the GPU's users), e.g. --reason 'fan noise'")
    host, gpu, _ = _target(ctx, target)
    now = _now(ctx, host)
    state, m = _state(now.health, gpu)
    what = hl.target_words(host, gpu)
    if state in (State.QUARANTINED, State.DRAINING, State.TESTING):
        raise ProvisionError(f"{what} is {state.value} already ({m.reason if m else '?'}); nothing was changed")
    job, owner = now.holders.get(gpu, ("", "")) if gpu is not None else ("", "")
    by = who()
    expect = (State.HEALTHY, State.SUSPECT)
    _change(ctx, host, Change(gpu, State.QUARANTINED, expect, reason.strip()[:300], "by hand", by, job, owner))
    running = f"; job {job} ({owner}) runs on it and goes on" if job else ""
    if gpu is None:
        jobs = sorted({j for j, _ in now.holders.values()})
        running = f"; what runs there goes on ({', '.join(jobs)})" if jobs else ""
    return f"{what} quarantined by {by}: no new work goes there{running}."


def release(ctx: Context, target: str, *, skip_test: bool = False) -> tuple[bool, str]:
    """Release a quarantined (draining, suspect) GPU or host: after a passing test when the
    team's policy asks one (and skip_test is not given). (released, what happened)."""
    host, gpu, declared = _target(ctx, target)
    now = _now(ctx, host)
    state, m = _state(now.health, gpu)
    what = hl.target_words(host, gpu)
    if state in (State.HEALTHY, State.TESTING):
        why = "a test runs on it" if state is State.TESTING else "it is not quarantined"
        raise ProvisionError(f"{what} is {state.value} ({why}): nothing was changed")
    if state.blocks and ctx.policy.health.test_before_release and not skip_test:
        return test(ctx, target)
    reason = "released by hand" + (" without a test" if state.blocks and skip_test else "")
    _change(ctx, host, Change(gpu, State.HEALTHY, (state,), reason, "", who()))
    return True, f"{what} released by {who()} ({state.value} since by {m.by if m else '?'}: {m.reason if m else ''})."


def test(ctx: Context, target: str) -> tuple[bool, str]:
    """Test a GPU (every GPU of a host) on it: a pass releases it, a failure quarantines it
    with the evidence, nothing to test with leaves it as it was. (passed, what happened)."""
    host, gpu, declared = _target(ctx, target)
    if declared == 0:
        raise ProvisionError(f"{target}: {host} declares no GPU to test; nothing was changed")
    gpus = [gpu] if gpu is not None else list(range(declared))
    req = HealthTestRequest(gpus=gpus, host=gpu is None, by=who(), release=True, timeout=TEST_TIMEOUT)

    def one(t: Target) -> HealthTestReport:
        rep: HealthTestReport = call_agent(ctx.session, t, req, timeout=TEST_TIMEOUT + 120)
        return rep

    res = run_step(ctx.session, Step.TEST, one, [ctx.targets[host]])
    if host in res.errors:
        raise ProvisionError(res.errors[host].message)
    rep = res.ok[host]
    what = hl.target_words(host, gpu)
    if rep.errors:
        raise ProvisionError(f"{what}: {'; '.join(rep.errors)}")
    after = HostHealth.from_record(rep.record)
    state, _ = _state(after, gpu)
    if rep.passed is None:
        return False, f"{what}: not run, {rep.words}; it stays {state.value}."
    if rep.passed:
        return True, f"{what} passed {rep.ran} ({rep.words}): it is {state.value}, and gets work again."
    return False, f"{what} failed {rep.ran}: {rep.words}; it stays {state.value}."
