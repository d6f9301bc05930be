"""Runs ON the host: what the health read takes there (the GPUs' health fields, the kernel's
Xid messages since the last look, DCGM's health watch), and the host's health record (a
state per GPU and for the host: rules/health.py judges, this file keeps), changed under the
ledger's lock so that a reservation sees it (ledger.health_refusals). Stdlib only; shipped
with the agent and compiled only by the requests that use it (bundle.LAZY).

One reader for both paths: HEALTH_SH is the sh the shell probe (probe.sh) runs, put in
its place when the controller loads that script (io/probe.py), and the agent runs the same
text through `sh -c` (`read`); `parse_section` reads either's output.
tests/integration/test_probe.py holds the two answers equal on real hosts.

Everything read is bounded (lines, bytes per line, seconds) and is the host's word: the
controller validates it again (rules/health.py).

The record (layout.HEALTH_PATH), JSON:
    {"host": MARK, "gpus": {"1": MARK, ...}}   a GPU or host without a mark is healthy
    MARK = {"state", "reason", "evidence", "since" (host clock), "by", "job", "owner",
            "uuid", "prior": MARK (while testing: what it was before)}
"""

from __future__ import annotations

import os
import time

from . import layout, ledger
from . import protocol as P
from .hostlib import json, run

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

STATES = ("healthy", "suspect", "quarantined", "draining", "testing")
BLOCKING = ledger.HEALTH_BLOCKING  # no new work there
# The health fields beside the facts' query, in a run of their own: a driver that does not
# know one (clocks_event_reasons came with 535) fails this query, not the facts'; then the
# field's older name is asked.
FIELDS = (
    "index",
    "pci.bus_id",
    "clocks_event_reasons.active",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
    "remapped_rows.failure",
    "retired_pages.double_bit.count",
    "ecc.errors.uncorrected.volatile.total",
    "remapped_rows.pending",
    "retired_pages.pending",
)
LEGACY_FIELDS = tuple("clocks_throttle_reasons.active" if f.startswith("clocks_event") else f for f in FIELDS)
XID_LIMIT = 200  # kernel lines read at most per look (the newest)
LINE_CHARS = 400  # characters kept of each line read
TEXT_LIMIT = 16_000  # characters of a record's text fields, in all (reason, evidence, by)
TIMEOUT = 10  # seconds each command of the read may take

# The read, in sh (no single quotes, no backslashes: probe.sh travels in one quoted word).
# Its variables: hsec (seconds per command), hlim (kernel lines), hgok (1: the facts'
# nvidia-smi query answered, so this one is asked), hfields and hlegacy (the queries'
# fields), hafter (the last look's file) and hkmsg (the sandbox's kernel messages).
HEALTH_SH = """echo @health
if [ "$hgok" = 1 ]; then
    out=$(timeout $hsec nvidia-smi --query-gpu=$hfields --format=csv,noheader,nounits 2>&1 </dev/null)
    code=$?
    case $out in *"is not a valid field"*)
        out=$(timeout $hsec nvidia-smi --query-gpu=$hlegacy --format=csv,noheader,nounits 2>&1 </dev/null)
        code=$? ;;
    esac
    echo "@hgpus $code"
    printf %s "$out" | head -n 64 | cut -c 1-400
    echo
    echo @hgpus-end
fi
a=
if [ -f $hafter ] && [ ! -h $hafter ]; then read -r a <$hafter; fi
case $a in *[!0-9.]*) a= ;; esac
up=
read -r up _ </proc/uptime
now=$(date +%s)
since=$((now - 86400))
if [ -n "$a" ]; then since=${a%%.*}; fi
if [ -f $hkmsg ]; then
    echo "@xid file $now $up $a"
    grep -a -F "NVRM: Xid" $hkmsg 2>/dev/null </dev/null | tail -n $hlim | cut -c 1-400
elif command -v journalctl >/dev/null 2>&1; then
    echo "@xid journal $now $up $a"
    timeout $hsec journalctl -k -b -q --no-pager -o short-unix --since=@$since 2>/dev/null </dev/null | grep -a -F "NVRM: Xid" | tail -n $hlim | cut -c 1-400
elif command -v dmesg >/dev/null 2>&1; then
    echo "@xid dmesg $now $up $a"
    timeout $hsec dmesg 2>/dev/null </dev/null | grep -a -F "NVRM: Xid" | tail -n $hlim | cut -c 1-400
else
    echo "@xid none $now $up $a"
fi
echo @xid-end
if command -v dcgmi >/dev/null 2>&1; then
    out=$(timeout $hsec dcgmi health -c 2>&1 </dev/null)
    echo "@dcgm $?"
    printf %s "$out" | head -n 200 | cut -c 1-400
    echo
    echo @dcgm-end
fi
echo @health-end
"""


def words(seconds: int, limit: int = XID_LIMIT) -> str:
    """HEALTH in probe.sh's words: SECONDS LIMIT FIELDS LEGACY AFTER KMSG."""
    return " ".join(
        (str(int(seconds)), str(int(limit)), ",".join(FIELDS), ",".join(LEGACY_FIELDS), layout.XID_AFTER_PATH,
         layout.SANDBOX_KMSG)
    )  # fmt: skip


def read(asked: Any, gpu_ok: bool) -> dict[str, Any]:
    """The agent's read: HEALTH_SH through sh, parsed as probe.py parses probe.sh's."""
    seconds = _seconds(asked)
    head = "set -f; hsec=%d; hlim=%d; hgok=%d; hfields=%s; hlegacy=%s; hafter=%s; hkmsg=%s\n" % (
        seconds, XID_LIMIT, 1 if gpu_ok else 0, ",".join(FIELDS), ",".join(LEGACY_FIELDS),
        layout.XID_AFTER_PATH, layout.SANDBOX_KMSG,
    )  # fmt: skip
    code, out, err = run(["sh", "-c", head + HEALTH_SH], timeout=4 * seconds + 10)
    got = parse_section(out.splitlines())
    if code != 0 and got is None:
        return {"error": (err.strip() or "exit %d" % code)[:LINE_CHARS]}
    return got or {"error": "no answer"}


def _seconds(asked: Any) -> int:
    t = asked.get("timeout") if isinstance(asked, dict) else None
    return int(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and 1 <= t <= 120 else TIMEOUT


def parse_section(lines: list[str]) -> dict[str, Any] | None:  # noqa: C901  one branch per part of HEALTH_SH's answer, in its order
    """HEALTH_SH's output (from `@health` to `@health-end`), as the health read's report:
    {"gpus": [...] | None, "gpus_error", "xid": {"source", "now", "uptime", "after",
    "lines"}, "dcgm": {"code", "lines"} | None}; None when it is not there."""
    try:
        i = lines.index("@health")
    except ValueError:
        return None
    out: dict[str, Any] = {"gpus": None, "gpus_error": None, "xid": None, "dcgm": None}
    i += 1

    def block(end: str) -> list[str]:
        nonlocal i
        got = []
        while i < len(lines) and lines[i] != end:
            if lines[i]:
                got.append(lines[i][:LINE_CHARS])
            i += 1
        i += 1
        return got

    while i < len(lines) and lines[i] != "@health-end":
        head = lines[i].split()
        i += 1
        if head and head[0] == "@hgpus":
            code = _num(head[1] if len(head) > 1 else "", int)
            text = block("@hgpus-end")
            if code == 0:
                out["gpus"] = parse_gpus(text)
            else:
                out["gpus_error"] = (" ".join(text) or "exit %s" % code)[:LINE_CHARS]
        elif head and head[0] == "@xid":
            out["xid"] = {
                "source": head[1] if len(head) > 1 else "none",
                "now": _num(head[2] if len(head) > 2 else "", float),
                "uptime": _num(head[3] if len(head) > 3 else "", float),
                "after": _num(head[4] if len(head) > 4 else "", float),
                "lines": block("@xid-end")[-XID_LIMIT:],
            }
        elif head and head[0] == "@dcgm":
            out["dcgm"] = {"code": _num(head[1] if len(head) > 1 else "", int), "lines": block("@dcgm-end")[:200]}
    return out


def _num(text: str, kind: Any) -> Any:
    try:
        return kind(text)
    except ValueError:
        return None


def parse_gpus(lines: list[str]) -> list[dict[str, Any]]:
    """The health query's rows (FIELDS), per GPU index; a field the GPU does not give is None."""
    out = []
    for line in lines:
        p = [x.strip() for x in line.split(",")]
        if len(p) < len(FIELDS) or not p[0].isdigit():
            continue
        mask = p[2].lower()
        out.append(
            {
                "index": int(p[0]),
                "pci": p[1][:40],
                "throttle": int(mask, 16) if mask.startswith("0x") and len(mask) <= 18 and _hex(mask[2:]) else None,
                "gen": _small(p[3]),
                "gen_max": _small(p[4]),
                "width": _small(p[5]),
                "width_max": _small(p[6]),
                "remap_failed": _yes(p[7]),
                "retired_dbe": _small(p[8]),
                "ecc_uncorrected": _small(p[9]),
                "remap_pending": _yes(p[10]),
                "retired_pending": _yes(p[11]),
            }
        )
    return out


def _yes(s: str) -> bool | None:
    return True if s.lower() == "yes" else False if s.lower() == "no" else None


def _hex(s: str) -> bool:
    return bool(s) and all(c in "0123456789abcdef" for c in s)


def _small(s: str) -> int | None:
    return int(s) if s.isdigit() and len(s) < 10 else None


# --------------------------------------------------------------------------- the record


def read_record() -> dict[str, Any]:
    """The host's health record ({} when there is none; {"_unreadable": why} when it is not one)."""
    got = ledger.read_entry(layout.HEALTH_PATH)
    return got if isinstance(got, dict) else {}


def _write_record(rec: dict[str, Any]) -> None:
    tmp = layout.HEALTH_PATH + layout.TMP_SUFFIX
    os.makedirs(layout.LEDGER_DIR, 0o755, exist_ok=True)
    if not rec.get("host") and not rec.get("gpus"):
        try:
            os.unlink(layout.HEALTH_PATH)
        except FileNotFoundError:
            pass
        return
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, json.dumps(rec).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, layout.HEALTH_PATH)


def _write_after(after: float) -> None:
    tmp = layout.XID_AFTER_PATH + layout.TMP_SUFFIX
    os.makedirs(layout.LEDGER_DIR, 0o755, exist_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, ("%.6f\n" % after).encode())
    finally:
        os.close(fd)
    os.rename(tmp, layout.XID_AFTER_PATH)


def _text(v: Any, n: int) -> str:
    return str(v)[:n] if isinstance(v, (str, int, float)) and not isinstance(v, bool) else ""


def _mark(change: dict[str, Any], now: float, prior: Any = None) -> dict[str, Any]:
    m = {
        "state": change["to"],
        "reason": _text(change.get("reason"), 300),
        "evidence": _text(change.get("evidence"), 1000),
        "since": now,
        "by": _text(change.get("by"), 200),
        "job": _text(change.get("job"), 100),
        "owner": _text(change.get("owner"), 200),
        "uuid": _text(change.get("uuid"), 100),
    }
    if isinstance(prior, dict):
        m["prior"] = {k: v for k, v in prior.items() if k != "prior"}
    return m


def _slot(rec: dict[str, Any], gpu: Any) -> tuple[dict[str, Any], str]:
    """(the mapping a change's mark lives in, its key): the host's, or a GPU's."""
    if gpu is None:
        return rec, "host"
    gpus = rec.get("gpus")
    if not isinstance(gpus, dict):
        gpus = rec["gpus"] = {}
    return gpus, str(int(gpu))


def state_of(mark: Any) -> str:
    return str(mark.get("state")) if isinstance(mark, dict) and mark.get("state") in STATES else "healthy"


def apply_changes(rec: dict[str, Any], changes: list[Any], now: float) -> list[str]:
    """Each change applied to rec when its mark's state is one it expects ("from"), else
    refused (why, in one line each): the host is the arbiter, as for a reservation."""
    refused = []
    for c in changes:
        if not isinstance(c, dict) or c.get("to") not in STATES:
            refused.append("not a health change: %s" % _text(repr(c), 100))
            continue
        gpu = c.get("gpu")
        if gpu is not None and (not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < 1024):
            refused.append("not a GPU number: %s" % _text(repr(gpu), 40))
            continue
        where, key = _slot(rec, gpu)
        now_state = state_of(where.get(key))
        expect = c.get("from")
        if isinstance(expect, list) and now_state not in expect:
            what = "this host" if gpu is None else "GPU %d" % gpu
            refused.append("%s is %s, not %s: nothing was changed" % (what, now_state, " or ".join(map(str, expect))))
            continue
        if c["to"] == "healthy":
            where.pop(key, None)
        else:
            keep = where.get(key) if c["to"] == "testing" else None
            where[key] = _mark(c, now, keep)
    if isinstance(rec.get("gpus"), dict) and not rec["gpus"]:
        rec.pop("gpus")
    return refused


def op_health(req: P.HealthRequest) -> P.HealthReport:
    """The changes (and the last look's time) written under the ledger's lock."""
    with ledger.FileLock(layout.LEDGER_DIR, layout.LEDGER_LOCK):
        rec = read_record()
        if "_unreadable" in rec:
            rec = {}  # a record that is not one is replaced: its states are lost, and said so
        refused = apply_changes(rec, list(req.changes), time.time())
        if req.changes and len(refused) < len(req.changes):
            _write_record(rec)
        if isinstance(req.xid_after, (int, float)) and not isinstance(req.xid_after, bool):
            _write_after(float(req.xid_after))
    return P.HealthReport(record=read_record(), refused=refused)


# --------------------------------------------------------------------------- the test

TEST_TIMEOUT = 900  # seconds a test may take (DCGM's level 2 takes a few minutes)
DIAG = ("dcgmi", "diag", "-r", "2")
# The GPU test the project ships, for hosts without DCGM: a matmul checked against the CPU
# in float64, and memory patterns written and read back, on each GPU CUDA_VISIBLE_DEVICES
# shows (exit 0 passed, 1 failed, 3 no torch, 4 no CUDA GPU).
TORCH_TEST = """
import os, sys
try:
    import torch
except Exception as e:
    print("torch cannot be imported: %s" % e)
    sys.exit(3)
device = os.environ.get("PROVISION_GPU_TEST_DEVICE", "cuda")
if device == "cuda" and not torch.cuda.is_available():
    print("torch sees no CUDA GPU")
    sys.exit(4)
count = torch.cuda.device_count() if device == "cuda" else 1
bad = []
for i in range(count):
    d = torch.device(device, i) if device == "cuda" else torch.device(device)
    g = torch.Generator().manual_seed(1234 + i)
    a = torch.randn(1024, 1024, generator=g)
    b = torch.randn(1024, 1024, generator=g)
    want = (a.double() @ b.double()).float()
    got = (a.to(d) @ b.to(d)).cpu()
    err = float((got - want).abs().max())
    if not err < 1e-2:
        bad.append("GPU %d: matmul off by %.3g" % (i, err))
        continue
    n = int(os.environ.get("PROVISION_GPU_TEST_BYTES", str(256 << 20)))
    x = torch.empty(n, dtype=torch.uint8, device=d)
    for p in (0x00, 0xFF, 0xAA, 0x55):
        x.fill_(p)
        wrong = int((x != p).sum())
        if wrong:
            bad.append("GPU %d: %d bytes read back wrong after writing 0x%02X" % (i, wrong, p))
            break
    print("GPU %d: matmul within %.2g, %d MiB of memory patterns read back" % (i, err, n >> 20))
if bad:
    print("; ".join(bad))
    sys.exit(1)
sys.exit(0)
"""


def _held_by_running(gpus: list[int]) -> list[str]:
    """Jobs whose units run now on these GPUs (a test would disturb their work)."""
    out = []
    for job, e in sorted(ledger.read_all().items()):
        if isinstance(e, dict) and "_unreadable" not in e and ledger._runs(e):
            taken = sorted(set(gpus) & {g for g in e.get("gpus") or [] if isinstance(g, int)})
            if taken:
                out.append("GPU %s held by job %s, which runs there" % (", ".join(map(str, taken)), job))
    return out


def _failures(text: str) -> list[str]:
    """The failed rows of dcgmi diag's table ("Memory: Fail - GPU: 1"), each with the
    lines that follow it (its words)."""
    out: list[str] = []
    failing = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or line.strip().startswith("+"):
            failing = False
            continue
        if cells[0] and "fail" in cells[1].lower():
            out.append("%s: %s" % (cells[0], cells[1]))
            failing = True
        elif not cells[0] and failing and cells[1]:
            out[-1] += " " + cells[1]
        else:
            failing = False
    return out


def run_test(gpus: list[int], timeout: float) -> tuple[str, bool | None, str]:
    """(what ran, passed (None: nothing ran), its words): DCGM's diagnostics where dcgmi
    is, else TORCH_TEST where torch is, else nothing."""
    ids = ",".join(str(g) for g in gpus)
    code, out, err = run([*DIAG, "-i", ids], timeout=timeout)
    text = (out + err).strip()
    if code != 127:
        failed = _failures(text) or ([] if code == 0 else [ln.strip() for ln in text.splitlines() if ln.strip()][-3:])
        words = "; ".join(failed)[:LINE_CHARS] if failed else "every test passed"
        return " ".join(DIAG), code == 0 and not failed, words if code != 124 else "timed out after %ds" % timeout
    env = ["env", "CUDA_VISIBLE_DEVICES=" + ids]
    code, out, err = run([*env, "python3", "-c", TORCH_TEST], timeout=timeout)
    said = " ".join((out + err).strip().splitlines()[-3:])[:LINE_CHARS]
    if code in (3, 4, 127):
        return "", None, "nothing to test with: no dcgmi, and " + (said or "no python3")
    if code == 124:
        return "torch", False, "timed out after %ds" % timeout
    return "torch", code == 0, said or "exit %d" % code


def op_healthtest(req: P.HealthTestRequest) -> P.HealthTestReport:
    """Test the GPUs asked (the host's, when it is the host that is tested): marked testing
    under the ledger's lock (no reservation takes them meanwhile), tested, then released
    when they passed (and `release`), quarantined with the evidence when they failed, left
    as they were when nothing could test them."""
    gpus = sorted({int(g) for g in req.gpus if isinstance(g, int) and not isinstance(g, bool) and 0 <= g < 1024})
    if not gpus:
        return P.HealthTestReport(errors=["no GPU to test"])
    targets: list[Any] = [None] if req.host else []
    targets += [] if req.host else gpus
    with ledger.FileLock(layout.LEDGER_DIR, layout.LEDGER_LOCK):
        busy = _held_by_running(gpus)
        if busy:
            return P.HealthTestReport(errors=busy + ["nothing was tested (stop that work first)"])
        rec = read_record()
        rec = {} if "_unreadable" in rec else rec
        apply_changes(
            rec, [{"gpu": t, "to": "testing", "by": req.by, "reason": "a test runs"} for t in targets], time.time()
        )
        _write_record(rec)
    what, passed, said = run_test(gpus, min(float(req.timeout or TEST_TIMEOUT), 3600.0))
    with ledger.FileLock(layout.LEDGER_DIR, layout.LEDGER_LOCK):
        rec = read_record()
        rec = {} if "_unreadable" in rec else rec
        changes = []
        for t in targets:
            where, key = _slot(rec, t)
            prior = (where.get(key) or {}).get("prior") if state_of(where.get(key)) == "testing" else None
            if passed and req.release:
                changes.append({"gpu": t, "to": "healthy", "from": ["testing"]})
            elif passed is False:
                why = "failed its test (%s)" % what
                changes.append({"gpu": t, "to": "quarantined", "from": ["testing"], "reason": why, "evidence": said,
                                "by": req.by})  # fmt: skip
            elif isinstance(prior, dict) and prior.get("state") in STATES:
                where[key] = prior  # as it was before the test
            else:
                changes.append({"gpu": t, "to": "healthy", "from": ["testing"]})
        apply_changes(rec, changes, time.time())
        _write_record(rec)
    return P.HealthTestReport(ran=what, passed=passed, words=said, record=read_record())
