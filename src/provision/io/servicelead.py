"""Which `provision serve` leads: the database decides, no consensus code of provision's.

- PostgreSQL: a session advisory lock held on a connection of its own (as the state lock in
  io/pgstate.py); the server frees it when the leader's session ends: at once when its
  process dies (the kernel closes the connection), within pgstate.LOCK_BOUND (10) s of its
  last word when its machine dies or is cut off (no FIN reaches the server: the server's own
  keepalives and TCP_USER_TIMEOUT, set on the session, end it).
- The embedded SQLite file: an fcntl lock on a file beside the database, freed by the
  kernel when the leader's process dies.

A follower tries again every POLL seconds (take-over within POLL + that bound). A leader cut
off from the database learns it within CUT_OFF s (its own TCP_USER_TIMEOUT on the lock's
connection, shorter than the server's bound): it stops leading before a follower can start.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

from provision.core.errors import ProvisionError

POLL = 1.0  # seconds between a follower's tries
LEAD_KEY = 0x70726F766C656164  # "provlead": the advisory lock's key
# Seconds a word to the database may go unacknowledged before the connection fails (the
# lead's and the service store's): a cut-off leader's look fails within CUT_OFF after it
# was sent, and one stuck in a store call looks at the lead (dead by then) after it: both
# within 2 * CUT_OFF + POLL, before the server's LOCK_BOUND frees the lead for a follower.
CUT_OFF = 3


class Leadership:
    """try_take() until it says True; held until release() or the process ends."""

    def __init__(self, *, lock_file: Path | None = None, pg_url: str | None = None):
        self.lock_file, self.pg_url = lock_file, pg_url
        self._fd: int | None = None
        self._conn: Any = None
        self._backend: int | None = None  # the lock's session on the server (PostgreSQL)

    @property
    def held(self) -> bool:
        return self._fd is not None or self._conn is not None

    def try_take(self) -> bool:
        if self.held:
            return True
        return self._try_file() if self.lock_file is not None else self._try_pg()

    def _try_file(self) -> bool:
        assert self.lock_file is not None
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def _try_pg(self) -> bool:
        # Here, not at the top: only a team's service needs psycopg (start-up of the embedded path).
        import psycopg

        from provision.io.pgstate import bound_session, connect_url, why  # (start-up, as above)

        try:
            # The client's side: TCP_USER_TIMEOUT fails a word unanswered CUT_OFF s; keepalives
            # after 1 s idle end the connection as soon while the loop is stuck elsewhere (a
            # store call), so its next look fails at once (Linux: the user timeout, counted from
            # the last answer, ends it once a probe is out).
            conn = connect_url(
                self.pg_url or "",
                "provision serve (leader)",
                keepalives=1,
                keepalives_idle=1,
                keepalives_interval=1,
                keepalives_count=CUT_OFF,
                tcp_user_timeout=CUT_OFF * 1000,
            )
        except psycopg.Error as e:
            raise ProvisionError(f"the service's database: cannot connect to take the lead: {why(e)}") from None
        try:
            bound_session(conn)  # the server's side: a dead leader's machine frees the lead in seconds
            row = conn.execute("SELECT pg_try_advisory_lock(%s)", (LEAD_KEY - (1 << 63),)).fetchone()
        except psycopg.Error as e:
            conn.close()
            raise ProvisionError(f"the service's database: cannot take the lead: {why(e)}") from None
        if not row or not row[0]:
            conn.close()
            return False
        self._conn = conn
        try:
            got = conn.execute("SELECT pg_backend_pid()").fetchone()
            self._backend = int(got[0]) if got else None
        except psycopg.Error:
            self._backend = None
        return True

    def backend(self) -> int | None:
        """The server process of the lock's session (PostgreSQL), so that a follower can end
        a frozen leader's session (its kernel still answers for it: the lock would live on)."""
        return self._backend if self._conn is not None else None

    def still_held(self) -> bool:
        """The lock's connection still answers (PostgreSQL); a file lock holds while we live."""
        if self._conn is None:
            return self._fd is not None
        try:
            self._conn.execute("SELECT 1")
            return True
        except Exception:  # the session is gone (so is the lock): lead no more
            self._conn = None
            return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # already gone: so is its lock
                pass
            self._conn = None
