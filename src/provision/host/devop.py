"""A dev session's operation on its host (`provision dev --extend`, the service's warning
before it ends one): its terms in the ledger entry, a message to its terminals. Loaded
when a request first needs it (bundle.LAZY)."""

from __future__ import annotations

import time

from . import ledger, logins
from . import protocol as P


def op_dev(req: P.DevRequest) -> P.DevReport:
    """A dev session's terms changed, and/or a message to its terminals."""
    errors = ledger.set_dev(req.job, req.dev, req.lineage, time.time()) if req.dev is not None else []
    sent = logins.warn(req.unit, req.warn) if req.warn and req.unit and not errors else 0
    return P.DevReport(errors, sent)
