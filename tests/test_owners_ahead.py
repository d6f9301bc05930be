"""run/planning: the other owners of a trial's pushed files, asked beside the probe
(owners_ahead) and used when they cover what the plan wants, else asked again after it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from provision.core.target import Target
from provision.host.protocol import OwnersReport, OwnersRequest
from provision.render.files import FileKind
from provision.rules.sharing import OtherJob
from provision.run import planning


@dataclass
class _File:
    path: str
    kind: FileKind = FileKind.FILE


@dataclass
class _Bundle:
    files: list[_File]
    setup: Any = None


@dataclass
class _HostPlan:
    name: str
    error: str | None = None


@dataclass
class _Plan:
    hosts: list[_HostPlan]


class _Session:
    def map(self, fn: Any, targets: Any) -> dict[str, Any]:
        return {t.name: fn(t) for t in targets}


@dataclass
class _Ctx:
    targets: dict[str, Target]
    rendered: Any
    session: _Session = field(default_factory=_Session)
    inventory: Any = None


def _ctx() -> _Ctx:
    targets = {n: Target(name=n, address=n) for n in ("a", "b")}
    hosts = {
        "a": _Bundle([_File("/opt/t.py"), _File("/etc/provision/j/chief-0.env", FileKind.ENV)]),
        "b": _Bundle([_File("/opt/t.py")]),
    }

    @dataclass
    class _Rendered:
        hosts: dict[str, _Bundle]

    @dataclass
    class _Inv:
        job: str = "j-t5"

    return _Ctx(targets, _Rendered(hosts), inventory=_Inv())


def test_owners_asked_beside_the_probe_are_used_and_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, list[str]]] = []

    def call_agent(session: Any, t: Target, req: OwnersRequest) -> OwnersReport:
        asked.append((t.name, list(req.paths)))
        return OwnersReport({p: {"j-t1": "ab"} for p in req.paths})

    monkeypatch.setattr(planning, "call_agent", call_agent)
    wanted = {"a": ["/opt/t.py"], "b": ["/opt/t.py", "/opt/other.py"]}  # b's other path was not asked ahead
    monkeypatch.setattr(planning, "owners_wanted", lambda hp: wanted[hp.name])
    ctx = _ctx()
    ahead = planning._owners_beside(ctx)  # type: ignore[arg-type]
    plan = _Plan([_HostPlan("a"), _HostPlan("b")])
    got = planning._other_owners(ctx, plan, {}, ahead)  # type: ignore[arg-type]
    assert sorted(asked) == [("a", ["/opt/t.py"]), ("b", ["/opt/t.py"]), ("b", ["/opt/t.py", "/opt/other.py"])]
    assert got["a"] == {"/opt/t.py": [OtherJob("j-t1", "ab", "?", running=True)]}
    assert set(got["b"]) == {"/opt/t.py", "/opt/other.py"}  # b asked again after the plan: all it wants
