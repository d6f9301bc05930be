"""The program hosts run (host/bundle.py) and its stand-ins: the bundle runs under
`python3 -S` exactly as on a host, answers a request in protocol.py's wire form, and its
dataclass stand-in behaves like the real module for what protocol.py uses."""

from __future__ import annotations

import dataclasses
import json
import marshal
import os
import stat
import subprocess

import pytest

from provision.host import bundle, protocol, standins


def run_bundle(request: dict) -> dict:
    """The bundle and a request on stdin, as ssh.call_agent sends them, run locally."""
    cmd = ["python3", "-S", "-c", bundle.boot_command().split(" -c ", 1)[1].strip("'")]
    out = subprocess.run(cmd, input=bundle.payload() + json.dumps(request).encode(), capture_output=True, check=True)
    return json.loads(out.stdout)


def test_the_bundle_answers_a_probe_without_importing_dataclasses(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"hello\n")
    req = protocol.ProbeRequest("bundle-test", want={str(f): "0" * 64}, content_max=100)
    wire = run_bundle(protocol.to_wire(req))
    rep = protocol.report_from_wire("probe", wire)
    assert rep.files[str(f)].type == "file" and rep.files[str(f)].size == 6
    assert rep.files[str(f)].content is not None  # differs from want: sent for the diff
    assert rep.manifest is None and rep.units == {} and rep.boot_id
    # The host-side program imports neither dataclasses nor typing: the stand-in serves.
    probe_src = (
        bundle.payload().decode()
        + "\nimport sys\nprint(sorted(m for m in ('dataclasses','typing','inspect') if m in sys.modules and getattr(sys.modules[m], '__file__', None)))"
    )
    assert "'dataclasses', 'typing'" not in probe_src  # sanity: the loader names no such module


def test_a_broken_request_is_a_fatal_answer_not_a_traceback():
    out = subprocess.run(
        ["python3", "-S", "-c", bundle.boot_command().split(" -c ", 1)[1].strip("'")],
        input=bundle.payload() + json.dumps({"op": "destroy"}).encode(),
        capture_output=True,
    )
    assert out.returncode != 0 or "fatal" in json.loads(out.stdout)


@pytest.mark.parametrize("impl", [dataclasses, standins], ids=["real", "stand-in"])
def test_the_dataclass_stand_in_behaves_like_the_module(impl):
    @impl.dataclass(frozen=True)
    class Rec:
        a: str
        b: int = 3
        c: list = impl.field(default_factory=list)

        def twice(self) -> int:
            return self.b * 2

    r = Rec("x")
    assert (r.a, r.b, r.c, r.twice()) == ("x", 3, [], 6)
    assert Rec("x", 4, [1]) == Rec(a="x", b=4, c=[1]) and Rec("x") != Rec("y")
    assert Rec("x").c is not Rec("x").c
    with pytest.raises(AttributeError):
        r.a = "y"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Rec()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Rec("x", nope=1)  # type: ignore[call-arg]
    assert "Rec(a='x', b=3, c=[])" in repr(r)


@pytest.mark.parametrize(
    "msg",
    [
        protocol.ProbeRequest(
            "j", want={"/a": "0" * 64}, paths=["/b"], units=["u"], facts="check", facts_only=["gpus"]
        ),
        protocol.WriteRequest(
            "j",
            manifest_pending="eA==",
            stop=["u"],
            files=[protocol.FileWrite("/a", 0o600, "eA==", True)],
            remove=["/c"],
            daemon_reload=True,
            reset_failed=["u"],
            clear_lifecycle=True,
            manifest="eA==",
        ),
        protocol.UnitsRequest("j", [["stop", ["u"]]], lifecycle={"phase": "Succeeded"}, report=["u"]),
        protocol.DestroyRequest("j", ["u"]),
        protocol.BatchRequest([protocol.DestroyRequest("j"), protocol.UnitsRequest("j")]),
    ],
    ids=lambda m: type(m).__name__,
)
def test_requests_survive_the_wire(msg):
    assert protocol.request_from_wire(json.loads(json.dumps(protocol.to_wire(msg)))) == msg


def test_reports_survive_the_wire():
    rep = protocol.ProbeReport(
        {"job": "j"},
        None,
        {"/a": protocol.FileInfo("file", 0o600, 0, 1, "ab"), "/b": None},
        {"u": {"Id": "u"}},
        {"u": [["1", "success", "exited", "0"]]},
        {"gpus": []},
        1.5,
        2,
        "b",
    )
    assert protocol.report_from_wire("probe", json.loads(json.dumps(protocol.to_wire(rep)))) == rep
    with pytest.raises(protocol.WireError):
        protocol.request_from_wire({"op": "format-disk"})


def run_with_cache(cache, request: dict) -> subprocess.CompletedProcess:
    data = bundle.payload(str(cache))
    boot = bundle.boot_command(str(cache)).split(" -c ", 1)[1].strip("'")
    return subprocess.run(
        ["python3", "-S", "-c", boot], input=data + json.dumps(request).encode(), capture_output=True, check=True
    )


def test_the_host_keeps_the_agent_compiled(tmp_path):
    cache = tmp_path / "agent"
    req = protocol.to_wire(protocol.ProbeRequest("bundle-test"))
    first = json.loads(run_with_cache(cache, req).stdout)
    entries = sorted(p.name for p in cache.iterdir())
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    # trust.py decides whether the cache may be used, so it is never loaded from it.
    cached = {f"provision.host.{m}" for m in bundle.MODULES if m != "trust"}
    assert {e.split("-")[0] for e in entries} == {"dataclasses", *cached}
    # The next run loads them: a corrupt one is compiled again (and written, which removes
    # its module's entries of older sources), and the answers are the same.
    corrupt = next(p for p in cache.iterdir() if p.name.startswith("provision.host.protocol-"))
    corrupt.write_bytes(b"\x00garbage")
    (cache / "provision.host.protocol-0123.cpython-311").write_bytes(b"old")
    again = json.loads(run_with_cache(cache, req).stdout)
    assert again.keys() == first.keys() and again["units"] == first["units"]
    assert not (cache / "provision.host.protocol-0123.cpython-311").exists()
    assert corrupt.read_bytes() != b"\x00garbage"


def test_a_cache_others_can_write_is_not_used(tmp_path):
    cache = tmp_path / "agent"
    cache.mkdir(mode=0o700)
    cache.chmod(0o777)
    req = protocol.to_wire(protocol.ProbeRequest("bundle-test"))
    out = json.loads(run_with_cache(cache, req).stdout)
    assert "units" in out and list(cache.iterdir()) == []


def test_modules_loaded_on_demand_are_kept_compiled_too(tmp_path):
    """hostcheck is sent along but loaded only by the requests that use it (a network
    check here); its compiled code is kept like the others', and the next run uses it."""
    cache = tmp_path / "agent"
    net = protocol.to_wire(protocol.NetcheckRequest(job="bundle-test", timeout=1.0, window=1.0))
    run_with_cache(cache, protocol.to_wire(protocol.ProbeRequest("bundle-test")))
    assert not [p for p in cache.iterdir() if p.name.startswith("provision.host.hostcheck-")]
    first = json.loads(run_with_cache(cache, net).stdout)
    assert first["results"] == [] and first["accepted"] == {}
    (kept,) = [p for p in cache.iterdir() if p.name.startswith("provision.host.hostcheck-")]
    # What is in the cache is what runs: a stand-in module there answers instead.
    fake = "def op_netcheck(req):\n    from provision.host import protocol as P\n    return P.NetcheckReport(seconds=42.0)\n"
    kept.write_bytes(marshal.dumps(compile(fake, "fake", "exec")))
    assert json.loads(run_with_cache(cache, net).stdout)["seconds"] == 42.0


def test_a_request_imports_no_heavy_standard_module(tmp_path):
    """typing (with re, collections, enum) imported by one host module cost every request
    ~6 ms of the host's CPU (60 % of the agent's start): the agent's modules type-check with
    `TYPE_CHECKING = False` instead."""
    import re

    cache = tmp_path / "agent"
    req = json.dumps(protocol.to_wire(protocol.ProbeRequest("bundle-test"))).encode()
    boot = bundle.boot_command(str(cache)).split(" -c ", 1)[1].strip("'")
    subprocess.run(
        ["python3", "-S", "-c", boot], input=bundle.payload(str(cache)) + req, capture_output=True, check=True
    )
    r = subprocess.run(
        ["python3", "-S", "-X", "importtime", "-c", boot],
        input=bundle.payload(str(cache)) + req,
        capture_output=True,
        check=True,
    )
    imported = {m.group(1) for m in re.finditer(r"\|\s+(\S+)\s*$", r.stderr.decode(), re.M)}
    # ("dataclasses" is there: host/standins.py under that name.)
    assert not imported & {"typing", "re", "enum", "collections", "json", "subprocess"}, imported


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("how", ["owned by a user", "group-writable", "a link", "two links"])
def test_a_planted_file_in_a_cache_given_back_to_root_is_not_loaded(tmp_path, how):
    """item 3: a user who owned the cache directory replaced its files; an
    administrator gave the directory back to root; the files are checked one by one (a
    regular file of one link, root's, only root may write) and a planted one is replaced."""
    cache = tmp_path / "agent"
    net = protocol.to_wire(protocol.NetcheckRequest(job="bundle-test", timeout=1.0, window=1.0))
    run_with_cache(cache, net)
    (kept,) = [p for p in cache.iterdir() if p.name.startswith("provision.host.hostcheck-")]
    fake = "def op_netcheck(req):\n    from provision.host import protocol as P\n    return P.NetcheckReport(seconds=42.0)\n"
    planted = marshal.dumps(compile(fake, "fake", "exec"))
    kept.unlink()
    if how == "a link":
        (tmp_path / "elsewhere").write_bytes(planted)
        kept.symlink_to(tmp_path / "elsewhere")
    elif how == "two links":
        (tmp_path / "elsewhere").write_bytes(planted)
        os.link(tmp_path / "elsewhere", kept)
    else:
        kept.write_bytes(planted)
        if how == "owned by a user":
            os.chown(kept, 4242, 4242)
        else:
            kept.chmod(0o664)
    assert json.loads(run_with_cache(cache, net).stdout)["seconds"] != 42.0
    st = kept.lstat()  # compiled again, in place of the planted one
    assert stat.S_ISREG(st.st_mode) and st.st_uid == 0 and st.st_nlink == 1 and kept.read_bytes() != planted
    if how in ("a link", "two links"):
        assert (tmp_path / "elsewhere").read_bytes() == planted  # never written through


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_link_planted_where_the_cache_writes_is_not_written_through(tmp_path):
    """The temporary name a compiled module is written to first: a link a user left there
    is removed, not followed (root would have written wherever it led)."""
    cache = tmp_path / "agent"
    net = protocol.to_wire(protocol.NetcheckRequest(job="bundle-test", timeout=1.0, window=1.0))
    run_with_cache(cache, net)
    (kept,) = [p for p in cache.iterdir() if p.name.startswith("provision.host.hostcheck-")]
    kept.unlink()
    victim = tmp_path / "shadow"
    victim.write_text("root's\n")
    boot = bundle.boot_command(str(cache)).split(" -c ", 1)[1].strip("'")
    subprocess.run(
        ["python3", "-S", "-c", boot],
        input=bundle.payload(str(cache)) + json.dumps(net).encode(),
        capture_output=True,
        check=True,
        # In the child before python3 starts: the pid it will have names the temporary file.
        preexec_fn=lambda: (cache / f"{kept.name}.{os.getpid()}").symlink_to(victim),
    )
    assert victim.read_text() == "root's\n"
    assert kept.is_file() and not kept.is_symlink()
