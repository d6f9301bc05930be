"""The example study (inventories/tune-torch.yaml, examples/tune_torch/train.py: real PyTorch,
reporting through the real cloudml-hypertune) on sandbox hosts with fake GPUs: 12 trials, at
most 4 at once, never two on one GPU, the best learning rate in the region the example's
README measured, the picture written and the table the same as --json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from clirun import cli, ok

from .test_tune import HOSTS, GpuWatch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1500)
def test_the_example_study_finds_a_good_learning_rate(sandbox_factory, sandbox_inventory, tmp_path):
    example = yaml.safe_load((REPO / "inventories" / "tune-torch.yaml").read_text())
    sb = sandbox_factory(hosts=2, gpus_per_host=2, with_=("torch",))
    try:
        shutil.copy(REPO / "examples" / "tune_torch" / "train.py", tmp_path / "train.py")
        # The hosts' python3 (the torch layer is on its path); no --step_seconds: the example's
        # pause lets the median rule stop trials on a real run, here it is only waiting.
        command = ["python3"] + [
            w for w in example["pools"]["chief"]["command"][1:] if not w.startswith("--step_seconds")
        ]
        inv = tmp_path / "study.yaml"
        sandbox_inventory(
            sb,
            job="tune-torch",
            path=inv,
            hosts=HOSTS,
            files=[{"src": "train.py", "dest": "/opt/tune/train.py"}],
            pools={"chief": {**example["pools"]["chief"], "command": command}},
            tune=example["tune"],
        )
        watch = GpuWatch(inv, tmp_path, "tune-torch")
        try:
            r = ok(cli("tune", "--seed", "1", "--poll", "0.5", inv, cwd=tmp_path, timeout=1400))
        finally:
            watch.done()
        doc = json.loads(ok(cli("tune", "--status", "--json", inv, cwd=tmp_path)).stdout)
        assert [t["number"] for t in doc["trials"]] == list(range(1, 13)), doc["trials"]
        assert not watch.overlaps, watch.overlaps
        assert watch.most <= 4, watch.most
        best = doc["best"]
        assert 0.01 <= best["params"]["learning_rate"] <= 0.35, best
        assert best["value"] < 0.1, best
        assert Path(doc["picture"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # The table printed at the end says what --json says, trial by trial.
        table = ok(cli("tune", "--status", inv, cwd=tmp_path)).stdout
        for t in doc["trials"]:
            line = next(ln for ln in table.splitlines() if ln.split() and ln.split()[0] == str(t["number"]))
            assert t["state"] in line, (line, t)
        assert f"Best: trial {best['number']}," in table and f"Best: trial {best['number']}," in r.stdout
    finally:
        sandbox_factory.down(sb)
