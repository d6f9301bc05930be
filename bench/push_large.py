"""Benchmark: pushing 100 MB of `files:` to one sandbox host.

    python bench/push_large.py [--mb 100] [--repeat 1] [--out bench/results/DATE-push-100mb]

Starts a 1-host sandbox and, for each variant (one file of MB megabytes of random bytes;
a directory of 100 files making MB megabytes together), writes an inventory whose `files:`
pushes it, then times:
  - `provision apply -y` with the same job but no files (the cost of an apply as such),
  - the first `provision apply -y` (the push),
  - a second `provision apply -y`, which must send nothing: it must say "No changes",
    `plan --detailed-exitcode` must then exit 0, and the pushed files on the host must be
    the very same inodes with the same mtimes (not rewritten).
The pushed files' SHA-256 on the host are checked against the local ones. Prints a markdown
table and writes it with the raw figures to OUT.md and OUT.json. Target: the first push of
100 MB to one host in under 5 s; exit 1 when missed or when a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provision import sandbox
from provision.sandbox.inventory import dump

TARGET_S = 5.0
LONG = ["/bin/sh", "-c", "exec sleep 600"]
HERE = Path(__file__).resolve().parent


def cli(*args: object, cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "provision", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=900
    )
    return time.monotonic() - t, r


def must(r: subprocess.CompletedProcess, what: str) -> None:
    if r.returncode != 0:
        raise SystemExit(f"{what} failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")


def host_sh(sb: sandbox.Sandbox, cmd: str) -> str:
    code, out = sb.docker_exec("host-1", ["/bin/sh", "-c", cmd])
    if code != 0:
        raise SystemExit(f"on host-1: {cmd}: exit {code}: {out}")
    return out


def make_variant(root: Path, kind: str, mb: int) -> tuple[Path, dict[str, str]]:
    """The source to push and {relative path: sha256} of its files."""
    shas = {}
    if kind == "file":
        src = root / "big.bin"
        data = os.urandom(mb << 20)
        src.write_bytes(data)
        shas["."] = hashlib.sha256(data).hexdigest()
        return src, shas
    src = root / "bigdir"
    n = 100
    size = (mb << 20) // n
    for i in range(n):
        data = os.urandom(size)
        rel = f"part-{i // 10}/chunk-{i:03d}.bin"
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
        shas[rel] = hashlib.sha256(data).hexdigest()
    return src, shas


def host_paths(dest: str, shas: dict[str, str]) -> dict[str, str]:
    return {(dest if rel == "." else f"{dest}/{rel}"): sha for rel, sha in shas.items()}


def host_stat(sb: sandbox.Sandbox, paths: list[str]) -> dict[str, str]:
    """path -> 'inode mtime_ns sha256' on the host."""
    quoted = " ".join(shlex.quote(p) for p in sorted(paths))
    out = host_sh(
        sb, f'for p in {quoted}; do echo "$p $(stat -c "%i %.9Y" "$p") $(sha256sum < "$p" | cut -c1-64)"; done'
    )
    res = {}
    for line in out.splitlines():
        p, _, rest = line.partition(" ")
        res[p] = rest
    return res


def run_variant(sb: sandbox.Sandbox, work: Path, kind: str, mb: int, rep: int) -> dict:
    job = f"push-{kind}-{rep}"
    dest = f"/opt/{job}/big.bin" if kind == "file" else f"/opt/{job}/data"
    d = work / job
    d.mkdir()
    src, shas = make_variant(d, kind, mb)
    paths = host_paths(dest, shas)
    inv = d / "inv.yaml"
    pools = {"chief": {"replicas": 1, "command": LONG}}

    def write(files: list | None) -> None:
        data = sandbox.inventory_dict(sb, job=job, pools=pools)
        if files:
            data["files"] = files
        inv.write_text(dump(data, sb))

    res: dict = {"variant": kind, "mb": mb, "files": len(paths), "repeat": rep}
    # An apply as such (connect, probe, unit files, start) with nothing to push.
    write(None)
    res["apply_no_files_s"], r = cli("apply", "-y", inv, cwd=d)
    must(r, "apply without files")
    write([{"src": str(src), "dest": dest}])
    res["first_push_s"], r = cli("apply", "-y", inv, cwd=d)
    must(r, "first push")
    before = host_stat(sb, list(paths))
    bad = [p for p, sha in paths.items() if before.get(p, "").split(" ")[-1] != sha]
    res["hashes_match"] = not bad
    res["second_apply_s"], r = cli("apply", "-y", inv, cwd=d)
    must(r, "second apply")
    res["second_says_no_changes"] = "No changes" in r.stdout
    after = host_stat(sb, list(paths))
    res["second_rewrote_nothing"] = before == after
    _, r = cli("plan", "--detailed-exitcode", inv, cwd=d)
    res["plan_after_exit"] = r.returncode
    res["destroy_s"], r = cli("destroy", "-y", inv, cwd=d)
    must(r, "destroy")
    res["ok"] = bool(
        res["hashes_match"]
        and res["second_says_no_changes"]
        and res["second_rewrote_nothing"]
        and res["plan_after_exit"] == 0
    )
    return res


def table(rows: list[dict], mb: int) -> str:
    lines = [
        f"| variant | files | apply, no files | first push ({mb} MB) | push - no-files apply | second apply "
        f"| sends nothing | target < {TARGET_S:g} s |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for kind in dict.fromkeys(r["variant"] for r in rows):
        rs = [r for r in rows if r["variant"] == kind]

        def med(k: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[k] for r in rs)

        first = med("first_push_s")
        nothing = all(
            r["second_says_no_changes"] and r["second_rewrote_nothing"] and r["plan_after_exit"] == 0 for r in rs
        )
        lines.append(
            f"| {'one file' if kind == 'file' else 'directory'} | {rs[0]['files']} | {med('apply_no_files_s'):.2f} s "
            f"| {first:.2f} s | {first - med('apply_no_files_s'):.2f} s | {med('second_apply_s'):.2f} s "
            f"| {'yes' if nothing else 'NO'} | {'ok' if first < TARGET_S else 'MISSED'} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=100, help="megabytes per variant (default 100)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per variant (default 1; medians shown)")
    ap.add_argument("--variants", default="file,dir", help="file and/or dir (default both)")
    ap.add_argument(
        "--out",
        default=str(HERE / "results" / f"{datetime.date.today():%Y-%m-%d}-push-100mb"),
        help="results path without extension (.md and .json are written)",
    )
    args = ap.parse_args()

    client = sandbox.check_engine()
    name = f"benchpush{os.getpid()}"
    rows: list[dict] = []
    t = time.monotonic()
    sb = sandbox.up(name, hosts=1, client=client)
    print(f"sandbox {name}: 1 host up in {time.monotonic() - t:.1f} s", file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory(prefix="push-large-") as tmp:
            for rep in range(args.repeat):
                for kind in args.variants.split(","):
                    row = run_variant(sb, Path(tmp), kind, args.mb, rep)
                    print(json.dumps(row), file=sys.stderr)
                    rows.append(row)
    finally:
        sandbox.down(name, client=client)

    head = (
        f"# {args.mb} MB pushed to one sandbox host ({datetime.date.today():%Y-%m-%d})\n\n"
        f"`python bench/push_large.py --mb {args.mb} --repeat {args.repeat}`: "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, one Docker sandbox host on this machine. "
        'Times are whole `provision` CLI runs (process start included). "apply, no files" is the same job '
        'with no `files:` (connect, probe, unit files, start); "sends nothing": the second apply said '
        '"No changes", rewrote no file on the host (same inode and mtime) and `plan --detailed-exitcode` '
        "then exited 0; every pushed file's SHA-256 on the host matched.\n\n"
    )
    text = head + table(rows, args.mb) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(
        json.dumps({"target_s": TARGET_S, "cores": os.cpu_count(), "runs": rows}, indent=2) + "\n"
    )
    ok = all(r["ok"] and r["hashes_match"] for r in rows) and all(r["first_push_s"] < TARGET_S for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
