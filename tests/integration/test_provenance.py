"""on a real sandbox host: two teammates share one state (a local state
file both name with --state); ana applies train.py v2, ben's checkout still has v1. ben's
plan names ana's newer content, his `apply -y` refuses (no terminal, no flag) and changes
nothing, and `apply -y --force-conflicts` replaces it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clirun import cli, ok, sh

pytestmark = pytest.mark.integration

DEST = "/opt/provenance/train.py"
ANA, BEN = {"PROVISION_OWNER": "ana@lab"}, {"PROVISION_OWNER": "ben@lab"}


@pytest.fixture(scope="module")
def one_host(sandbox_factory):
    sb = sandbox_factory(hosts=1)
    yield sb
    sandbox_factory.down(sb)


def checkout(sb, make, d: Path, train: str) -> Path:
    """A teammate's checkout: the inventory and its train.py."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.py").write_text(train)
    inv = d / "job.yaml"
    pools = {"chief": {"replicas": 1, "command": ["/bin/sh", "-c", "exec sleep 600"]}}
    make(sb, job="provenance", pools=pools, path=inv, files=[{"src": str(d / "train.py"), "dest": DEST}])
    return inv


def test_a_teammates_newer_apply_is_not_reverted_in_silence(one_host, sandbox_inventory, tmp_path):
    state = ["--state", str(tmp_path / "shared" / "provenance.state.json")]
    ana = checkout(one_host, sandbox_inventory, tmp_path / "ana", "print('v2')\n")
    ben = checkout(one_host, sandbox_inventory, tmp_path / "ben", "print('v1')\n")

    def on_host() -> str:
        return sh(one_host, "host-1", f"cat {DEST}")

    try:
        ok(cli("apply", "-y", *state, ana, cwd=ana.parent, env=ANA))
        assert "v2" in on_host()

        p = ok(cli("plan", *state, ben, cwd=ben.parent, env=BEN))
        line = re.compile(
            rf"~ file {re.escape(DEST)} \(content changed\): replaces ana@lab's content applied "
            r"\d{4}-\d\d-\d\d \d\d:\d\d UTC \(serial \d+\)"
        )
        assert line.search(p.stdout), p.stdout
        assert "1 change replaces content ana@lab applied" in p.stdout
        doc = json.loads(ok(cli("plan", "--json", *state, ben, cwd=ben.parent, env=BEN)).stdout)
        change = next(f for f in doc["hosts"]["host-1"]["files"] if f["path"] == DEST)
        assert change["replaces"]["who"] == "ana@lab" and change["replaces"]["at"].startswith("20")

        # -y alone does not answer it: without a terminal, one line naming the flag.
        r = cli("apply", "-y", *state, ben, cwd=ben.parent, env=BEN)
        assert r.returncode == 1, r.stdout + r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and "--force-conflicts" in errors[0] and "nothing was changed" in errors[0], r.stderr
        assert "Traceback" not in r.stderr and "v2" in on_host()

        ok(cli("apply", "-y", "--force-conflicts", *state, ben, cwd=ben.parent, env=BEN))
        assert "v1" in on_host()
        assert "replaces" not in ok(cli("plan", *state, ben, cwd=ben.parent, env=BEN)).stdout
        # Now it is ben's content that ana's checkout would replace.
        assert "replaces ben@lab's content" in ok(cli("plan", *state, ana, cwd=ana.parent, env=ANA)).stdout
    finally:
        cli("destroy", "-y", *state, ben, cwd=ben.parent, env=BEN)
