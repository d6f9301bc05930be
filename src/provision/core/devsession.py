"""A dev session (`provision dev`): a job of one task that holds GPUs for a person's shell,
editor or notebook, and the terms it holds them on. Pure.

Its name: `dev-<who>-<hash>-<NAME>`, where <who> is the owner's name cut to a short word
and <hash> four hex digits of the whole owner, so two people's sessions named alike never
share a job. Its terms (DevTerms) are written into its ledger entry on the host at the
reserve (Reservation.dev) and changed there by `--extend` (the agent's `dev` request):
every look at the host (`provision jobs`, the service's rounds, the dashboard) sees them,
and a host's copy is untrusted when it comes back (parsed here, bounded).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

PREFIX = "dev-"
ALIAS_PREFIX = "provision-dev-"  # the ssh config's Host name: `ssh provision-dev-NAME`
NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?$")  # <= 20 characters
MAX_HOURS = 24 * 30.0
MAX_IDLE_S = 7 * 86400
WARN_BEFORE_S = 600  # the person is warned this long before a session ends (idle or --hours)


def name_problem(name: str) -> str | None:
    """Why NAME cannot name a session (None: it can)."""
    if not NAME.fullmatch(name):
        return f"{name!r} is not a session name (1-20 of a-z, 0-9 and '-', not starting or ending with '-')"
    return None


def who_word(owner: str) -> str:
    """The owner's name as a short plain word: `ana@lab.example` -> `ana`."""
    word = re.sub(r"[^a-z0-9]", "", owner.split("@", 1)[0].lower())[:8]
    return word or "u"


def default_name(owner: str) -> str:
    return who_word(owner)


def session_job(owner: str, name: str) -> str:
    """The session's job name (a DNS label of at most 38 characters)."""
    digest = hashlib.sha256(owner.encode("utf-8")).hexdigest()[:4]
    return f"{PREFIX}{who_word(owner)}-{digest}-{name}"


def alias(name: str) -> str:
    return ALIAS_PREFIX + name


@dataclass(frozen=True)
class DevTerms:
    """What a session holds its GPUs on: its NAME, who (the owner) and the login user on the
    host, since when, until when (its --hours: the controller's clock), and the idle rule
    it was given (the team policy's when it started): ended when its GPUs stay below
    `idle_below` % for `idle_s` seconds with nobody logged in."""

    name: str
    owner: str
    started: float
    until: float
    idle_s: int
    idle_below: int
    user: str = ""
    image: str = ""
    jupyter: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "owner": self.owner,
            "started": self.started,
            "until": self.until,
            "idle_s": self.idle_s,
            "idle_below": self.idle_below,
            "user": self.user,
            "image": self.image,
            "jupyter": self.jupyter,
        }

    @classmethod
    def parse(cls, d: object) -> DevTerms | None:
        """The terms in `d` (a ledger entry's "dev", as a host sent it back), None when
        they are not terms: a name that is no session name, a time or bound out of range."""
        if not isinstance(d, dict):
            return None
        name, owner = d.get("name"), d.get("owner")
        started, until = _num(d.get("started")), _num(d.get("until"))
        idle_s, below = _int(d.get("idle_s")), _int(d.get("idle_below"))
        if not isinstance(name, str) or name_problem(name) is not None or not isinstance(owner, str):
            return None
        if started is None or until is None or idle_s is None or below is None:
            return None
        if not (0 < idle_s <= MAX_IDLE_S and 0 <= below <= 100 and until >= started):
            return None
        user, image = d.get("user"), d.get("image")
        return cls(
            name,
            owner[:200],
            started,
            until,
            idle_s,
            below,
            user[:64] if isinstance(user, str) else "",
            image[:300] if isinstance(image, str) else "",
            d.get("jupyter") is True,
        )


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


_LOGIN = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._-]{0,31}@(?:pts/[0-9]{1,6}|notty)$")
MAX_LOGINS = 32  # a session's logins a host may report


def logins_of(v: object) -> tuple[str, ...]:
    """A host's list of a session's logins (`user@pts/3`, `user@notty`), bounded: anything
    else in it is dropped."""
    if not isinstance(v, list):
        return ()
    return tuple(x for x in v[:MAX_LOGINS] if isinstance(x, str) and _LOGIN.fullmatch(x))
