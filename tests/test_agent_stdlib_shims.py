"""The host agent's stand-ins for json, base64, hashlib and subprocess (agent.py imports
their C cores to save start-up CPU on every call) must behave exactly like the modules."""

from __future__ import annotations

import base64 as real_base64
import hashlib
import json as real_json
import math
import random
import sys
import time

import pytest


@pytest.fixture(scope="module")
def agent() -> dict:
    """The stand-ins (host/hostlib.py) as the agent sees them."""
    from provision.host import agent as module
    from provision.host import hostlib

    assert module.json is not real_json, "this interpreter has _json: the stand-in should be in use"
    assert module.json is hostlib.json and module.run is hostlib.run
    return vars(hostlib)


def _value(rnd: random.Random, depth: int = 0):
    alphabet = 'abc "\\/\n\t\r\x00\x1f\x7f é€😀\ud800'
    text = lambda: "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 12)))  # noqa: E731
    k = rnd.randint(0, 8 if depth < 4 else 5)
    if k == 0:
        return None
    if k == 1:
        return rnd.choice([True, False])
    if k == 2:
        return rnd.randint(-(10**20), 10**20)
    if k == 3:
        return rnd.choice([0.0, -0.0, 1.5, 1e300, 1e-300, math.pi, math.inf, -math.inf, rnd.random()])
    if k in (4, 5):
        return text()
    if k == 6:
        return [_value(rnd, depth + 1) for _ in range(rnd.randint(0, 4))]
    return {text(): _value(rnd, depth + 1) for _ in range(rnd.randint(0, 4))}


def test_json_dumps_and_loads_match_the_module(agent):
    j = agent["json"]
    rnd = random.Random(7)
    for _ in range(3000):
        v = _value(rnd)
        text = real_json.dumps(v)
        assert j.dumps(v) == text
        assert real_json.dumps(j.loads(text)) == text
        pretty = real_json.dumps(v, indent=1, sort_keys=True) + "\n"  # how manifests are written
        assert real_json.dumps(j.loads(pretty)) == real_json.dumps(real_json.loads(pretty))
    for key in (1, 2.5, True, None):
        assert j.dumps({key: 1}) == real_json.dumps({key: 1})
    assert math.isnan(j.loads("NaN"))


@pytest.mark.parametrize(
    "bad", ["", " ", "{", "[1,]", '{"a": }', "\ufeff{}", "1 2", "tru", '"\\x"', "{'a': 1}", "[1", '{"gpus": [0, 1']
)
def test_json_errors_match_the_module(agent, bad):
    with pytest.raises(ValueError) as ours:
        agent["json"].loads(bad)
    with pytest.raises(ValueError) as theirs:
        real_json.loads(bad)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


def test_base64_and_sha256_match(agent, tmp_path):
    for data in (b"", b"x", bytes(range(256)) * 5):
        assert agent["base64"].b64encode(data) == real_base64.b64encode(data)
        assert agent["base64"].b64decode(real_base64.b64encode(data).decode()) == data
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_bytes(b"abc" * 1000)
    big.write_bytes(b"z" * (3 << 20))  # past 1 MiB: hashlib's OpenSSL SHA-256
    for p in (small, big):
        assert agent["sha256_file"](str(p)) == hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.skipif(sys.platform != "linux", reason="the agent runs on Linux hosts")
def test_run_matches_subprocess(agent):
    cases = [
        (["true"], 60),
        (["false"], 60),
        (["nonexistent-command-xyz"], 60),
        (["sh", "-c", "echo out; echo err >&2; exit 3"], 60),
        (["sh", "-c", "head -c 300000 /dev/zero | tr '\\0' a; head -c 200000 /dev/zero | tr '\\0' b >&2"], 60),
        (["sh", "-c", "kill -TERM $$"], 60),
        (["sh", "-c", "printf '\\377\\n'"], 60),
        (["sh", "-c", "yes | head -c 100000 | wc -c"], 60),  # SIGPIPE back to default in the child
    ]
    for argv, timeout in cases:
        assert agent["run"](argv, timeout) == agent["_run_subprocess"](argv, timeout), argv
    t0 = time.monotonic()
    assert agent["run"](["sleep", "5"], 0.3) == (124, "", "sleep: timed out after 0.3s")
    assert time.monotonic() - t0 < 3


def test_truncated_json_in_a_fresh_host_interpreter_is_a_json_error():
    """item 9: on a host (python3 -S, json.decoder not loaded) the C scanner's error
    path for a truncated ledger entry returned NULL, and the agent died with a SystemError."""
    import subprocess
    import sys

    from provision.host import bundle

    code = (
        bundle.source("hostlib")
        + "\ntry:\n    json.loads('{\"gpus\": [0, 1')\nexcept ValueError as e:\n    print(type(e).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "JSONDecodeError", out.stderr
