"""A trial's reports, read from what its chief wrote. Pure: bytes and lines in, `Report`s out.

Two collectors, as Katib has them:

- the metric file cloudml-hypertune writes (`CLOUD_ML_HP_METRIC_FILE`): JSON lines,
  `{"checkpoint_path": "", "global_step": "1000", "<tag>": "0.987", "timestamp": 1525851440.12,
  "trial": "0"}`, every value a string but the timestamp. The library keeps the last 100
  reports and rewrites the whole file at each one (`open(path, "w")`, not atomic), so a
  reader may find it empty, or cut in the middle of a line: such a line is skipped, and a
  read that finds fewer reports than the one before is a read during a rewrite (the caller
  keeps the longer one, or reads again);
- the chief's log lines, matched by `tune.metric.regex` (Katib's stdout collector): a
  group named `value` (or the only group) holds the number, a group named `step` the step.

Non-finite values ("nan", "inf") are kept as floats: `core.tuning.measured` skips them, and a
trial that only ever reports NaN is one that measured nothing.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Iterable
from typing import Any

from provision.core.tuning import (
    DEFAULT_METRIC_TAG,
    MAX_MATCHED_LINE,
    STEP_GROUP,
    VALUE_GROUP,
    Report,
    metric_pattern,
    regex_problem,
)


def _number(v: Any) -> float | None:
    """A JSON value as a float: a number, or a string holding one ("0.98", "nan", "1e-3")."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            return None
    return None


MAX_STEP = 2**31 - 1  # a step the study's storage keeps (PostgreSQL's integer column)


def _step(v: Any) -> int | None:
    """A step as hypertune writes it ("1000"), or as some writers do ("1000.0", 1000);
    None for one no storage keeps (negative, or past MAX_STEP)."""
    x = _number(v)
    if x is None or not math.isfinite(x) or not 0 <= x <= MAX_STEP:
        return None
    return int(x)


def parse_metric_file(data: bytes, tag: str) -> tuple[Report, ...]:
    """The reports for metric `tag` in a cloudml-hypertune metric file, in file order.

    `tag` empty means the library's default, `training/hptuning/metric`. Skipped: lines that
    are not a whole JSON object (a partial last line, garbage bytes), lines without the tag
    (another metric's reports) and lines whose value or step is not a number. A line without
    `global_step` is step 0, as the library writes a report given no step.
    """
    key = tag or DEFAULT_METRIC_TAG
    out: list[Report] = []
    for raw in data.split(b"\n"):
        try:
            obj = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError and json.JSONDecodeError are both ValueErrors
            continue
        if not isinstance(obj, dict) or key not in obj:
            continue
        value = _number(obj[key])
        step = _step(obj.get("global_step", "0"))
        if value is None or step is None:
            continue
        stamp = _number(obj.get("timestamp"))
        out.append(
            Report(step=step, value=value, timestamp=stamp if stamp is not None and math.isfinite(stamp) else 0.0)
        )
    return tuple(out)


check_regex = regex_problem  # the rule is core's: validation checks the same


def parse_log_lines(lines: Iterable[str], regex: str, *, before: int = 0) -> tuple[Report, ...]:
    """One report per log line `regex` matches (its first match in the line), in order.

    The value is the group named `value`, or the only group; the step the group named
    `step`, or, without one (or when it did not take part in the match), the report's index
    (1, 2, ...; `before`: reports found in earlier lines, for a reader that follows the
    log). Only a line's first MAX_MATCHED_LINE characters are looked at (RE2: linear time
    in those). A match whose value or step is not a number is skipped. Raises ValueError
    for a regex `check_regex` refuses.
    """
    reason = check_regex(regex)
    if reason is not None:
        raise ValueError(f"metric regex {regex!r}: {reason}")
    pattern = metric_pattern(regex)
    value_group: str | int = VALUE_GROUP if VALUE_GROUP in pattern.groupindex else 1
    out: list[Report] = []
    for line in lines:
        m = pattern.search(line[:MAX_MATCHED_LINE].rstrip("\r\n"))
        if m is None:
            continue
        value = _number(m.group(value_group))
        if value is None:
            continue
        step_text = m.group(STEP_GROUP) if STEP_GROUP in pattern.groupindex else None
        step = before + len(out) + 1 if step_text is None else _step(step_text)
        if step is None:
            continue
        out.append(Report(step=step, value=value))
    return tuple(out)


# --------------------------------------------------------------------------- reading the file

METRIC_FILE_CAP = 1 << 20  # bytes; cloudml-hypertune keeps 100 reports (~15 KB)

# Run on the host by sh, coreutils and dd, with no Python to start at every poll: a link is
# refused, so is anything but a regular file with one name (not a hard link to another
# job's file) of at most `cap` bytes, and dd opens it without following a link (the checks
# and the open are two steps: a file swapped in between is still read through no link and
# at most cap + 1 bytes, and the controller stops reading there). Exit 3: refused, why on
# stderr.
_READ_METRIC = """\
p=$1 cap=$2
if [ -L "$p" ]; then echo "a symbolic link" >&2; exit 3; fi
[ -e "$p" ] || exit 0
if [ ! -f "$p" ]; then echo "not a regular file" >&2; exit 3; fi
n=$(stat -c %h -- "$p") s=$(stat -c %s -- "$p")
if [ "$n" != 1 ]; then echo "a hard link ($n names)" >&2; exit 3; fi
if [ "$s" -gt "$cap" ]; then echo "$s bytes, over the cap of $cap" >&2; exit 3; fi
exec dd if="$p" iflag=nofollow,nonblock bs=$((cap + 1)) count=1 status=none"""


def metric_read_command(path: str, cap: int = METRIC_FILE_CAP) -> str:
    """The command that reads a trial's metric file on its host (see _READ_METRIC)."""
    return " ".join(shlex.quote(a) for a in ("sh", "-c", _READ_METRIC, "sh", path, str(cap)))


def metric_read_problem(exit_status: int, stderr: bytes, size: int, cap: int = METRIC_FILE_CAP) -> str | None:
    """Why the read's answer is not believed (None: it is): the host refused the file, or
    sent more than the cap whatever it said."""
    if size > cap:
        return f"the host sent more than {cap} bytes"
    if exit_status == 0:
        return None
    why = stderr.decode("utf-8", "replace").strip().splitlines()
    return (why[-1][:200] if why else "") or f"the read exited {exit_status}"
