"""A `setup:` shared by every job on the host that needs the same one (host/layout.py names
its files by its key): run once, by whichever job comes first, while the others wait for
that run and take its result; a failed run is not reused (the next job runs it again).

Who uses a setup is what the jobs' manifests list, as for a shared pushed file
(ledger.other_owners): its script, env and unit go with the last job that lists them
(ledger.remove_unowned), and `release` then takes its done mark.

Runs on the host (shipped by host/bundle.py, imported only by the requests that use it:
setup and destroy), stdlib only.
"""

from __future__ import annotations

import os

from . import layout, ledger
from . import protocol as P
from .agent import unit_states
from .hostlib import run

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

HEX = "0123456789abcdef"


def shared_key(setup: Any) -> str | None:
    """The key of a manifest's "setup" record when it is a shared setup (releases up to
    1a5e7ca ran one per job, named by the job: None)."""
    if not isinstance(setup, dict):
        return None
    key, unit = setup.get("key"), setup.get("unit")
    if not isinstance(key, str) or len(key) != 64 or key.strip(HEX) or unit != layout.setup_unit(key):
        return None
    return key


def done(key: str) -> bool:
    try:
        with open(layout.setup_done_path(key), "rb") as f:
            return f.read() == layout.setup_done_record(key)
    except OSError:
        return False


def used_elsewhere(job: str, setup: Any) -> bool:
    """Another job's manifest lists this job's shared setup (its unit file): stopping the
    unit would stop a run that job waits for."""
    key = shared_key(setup)
    return key is not None and bool(ledger.other_owners(job, [layout.setup_unit_path(key)]))


def _KeyLock(key: str) -> ledger.FileLock:  # noqa: N802 - reads as the context manager it returns
    """One run of a setup at a time; the others wait, then find it done."""
    return ledger.FileLock(layout.SETUPS_VAR, layout.setup_lock_path(key))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _write_done(key: str) -> None:
    path = layout.setup_done_path(key)
    tmp = path + layout.TMP_SUFFIX
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, layout.setup_done_record(key))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def op_setup(req: P.SetupRequest) -> P.SetupReport:
    """Run the setup unit and wait for it, unless it is done here (or `force`): its done
    mark is written only when it succeeded. Under the setup's lock: a job that asks while
    another runs it waits for that run, then finds it done (its reservation renewed
    meanwhile: the run may take an hour)."""
    key = req.key
    renewed = ledger.renewing(req.job, req.renew_every)
    try:
        with _KeyLock(key):
            if not req.force and done(key):
                return P.SetupReport(ran=False)
            _unlink(layout.setup_done_path(key))  # a setup that fails half-way is not done
            run(["systemctl", "reset-failed", "--", req.unit])
            code, _, err = run(["systemctl", "start", "--", req.unit], timeout=req.timeout)
            if code == 0:
                _write_done(key)
                return P.SetupReport(ran=True)
    finally:
        renewed.set()
    return _failed(req, code, err)


def _failed(req: P.SetupRequest, code: int, err: str) -> P.SetupReport:
    """What a failed run says: its exit status and its last lines (this run's only)."""
    st = unit_states([req.unit]).get(req.unit, {})
    status = st.get("ExecMainStatus", "")
    inv = st.get("InvocationID", "")
    argv = ["journalctl", "-u", req.unit, "-n", str(req.tail), "-o", "cat", "--no-pager"]
    _, out, _ = run(argv + (["_SYSTEMD_INVOCATION_ID=" + inv] if inv else []), timeout=30)
    lines = out.splitlines()[-req.tail :] if out.strip() else []
    if st.get("Result") == "timeout":
        return P.SetupReport(True, None, lines, ["timed out: it ran longer than its setup.timeout"])
    return P.SetupReport(True, int(status) if status.isdigit() else None, lines, [err.strip() or "exit %d" % code])


def release(setup: Any) -> bool:
    """After destroy removed the job's files (ledger.remove_unowned): when the shared setup's
    unit file went with them, no job uses it any more, and its done mark, lock and
    directory go too. True when it went."""
    key = shared_key(setup)
    if key is None or os.path.lexists(layout.setup_unit_path(key)):
        return False
    _remove(key)
    return True


def _remove(key: str) -> None:
    for path in (layout.setup_done_path(key), layout.setup_lock_path(key)):
        _unlink(path)
    _rmdirs(layout.setup_dir(key), layout.SETUPS_ETC, layout.SETUPS_VAR)


def _files(key: str) -> list[str]:
    return [layout.setup_script_path(key), layout.setup_env_path(key), layout.setup_unit_path(key)]


def hold(setup: Any, study: str) -> list[str]:
    """A trial's removal: its study holds its shared setup (the study's next trial on this
    host finds it done). Returns the setup's files, which stay."""
    key = shared_key(setup)
    if key is None or not study or study.strip("abcdefghijklmnopqrstuvwxyz0123456789-") or len(study) > 63:
        return []
    with _ledger_lock():
        keys = _held(study)
        if layout.setup_short(key) not in keys:
            os.makedirs(layout.SETUPS_HOLDS, 0o755, exist_ok=True)
            data = "".join(k + "\n" for k in [*keys, layout.setup_short(key)]).encode()
            path = layout.setup_hold_path(study)
            fd = os.open(path + layout.TMP_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.rename(path + layout.TMP_SUFFIX, path)
    return _files(key)


def _ledger_lock() -> Any:
    """The ledger's lock, as remove_unowned takes it (no ledger yet: none is made for this)."""
    return ledger._Locked() if os.path.isdir(layout.LEDGER_DIR) else ledger._Unlocked()


def _held(study: str) -> list[str]:
    """The setups (short keys) the study holds here."""
    try:
        with open(layout.setup_hold_path(study)) as f:
            return [k for k in f.read().split() if len(k) == 32 and not k.strip(HEX)]
    except OSError:
        return []


def release_holds(study: str) -> int:
    """The study is destroyed: its holds go, and each setup no job's manifest and no other
    study's hold keeps goes with them (under the ledger's lock, as remove_unowned). Returns
    how many setups went."""
    if not os.path.lexists(layout.setup_hold_path(study)):
        return 0
    gone = 0
    with _ledger_lock():
        keys = _held(study)
        _unlink(layout.setup_hold_path(study))
        try:
            others = [_held(s) for s in os.listdir(layout.SETUPS_HOLDS)]
        except OSError:
            others = []
        for short in keys:
            if any(short in o for o in others) or ledger.other_owners(study, [layout.setup_unit_path(short)]):
                continue
            for path in _files(short):
                _unlink(path)
            _remove(short)
            gone += 1
        if not others:
            _rmdirs(layout.SETUPS_HOLDS, layout.SETUPS_VAR)
    return gone


def _rmdirs(*dirs: str) -> None:
    for d in dirs:
        try:
            os.rmdir(d)
        except OSError:
            pass  # not empty: another setup's, or still used
