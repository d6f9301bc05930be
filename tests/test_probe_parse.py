"""probe.parse: the script's output either adds up to the agent's report or is refused
(and the agent asked); tests/integration/test_probe.py holds the two equal on real hosts."""

from __future__ import annotations

import base64
import hashlib
import shlex
import subprocess

import pytest

from provision.host import agent, hostfacts
from provision.host.protocol import FileInfo, ProbeReport, ProbeRequest
from provision.io import probe

JOB = "j"
ENV = f"/etc/provision/{JOB}/chief-0.env"
MANIFEST = f"/etc/provision/{JOB}/manifest.json"
UNIT = f"provision-{JOB}-chief-0.service"


def req(**kw) -> ProbeRequest:
    return ProbeRequest(
        **{
            "job": JOB,
            "facts": "check",
            "facts_only": [],
            "files": True,
            "content_max": 100,
            "want": {ENV: "0" * 64},
            "units": [UNIT],
            **kw,
        }
    )


def output(
    files: dict[str, bytes],
    *,
    sha_count=None,
    content_cut=0,
    units="Id=%s\nActiveState=active\n" % UNIT,
    dropins: tuple[str, ...] = (),
) -> bytes:
    r = req()
    _, _, paths = probe._asked(r)
    lines = [b"@probe 1", b"@systemd", b"@dropins", *(d.encode() for d in dropins), b"@stat"]
    regular = [p for p in paths if p in files]
    for p in regular:
        lines.append(f"{len(files[p])} 8180 0 {p}".encode())  # 0x8180: a regular file, 0600
    lines.append(b"@sha256 %d" % (len(regular) if sha_count is None else sha_count))
    for p in regular:
        lines.append(f"{hashlib.sha256(files[p]).hexdigest()}  {p}".encode())
    lines.append(b"@content")
    content = b"".join(files[p][:101] for p in regular)
    body = b"\n".join(lines) + b"\n" + content[: len(content) - content_cut] + b"@units\n" + units.encode() + b"@end\n"
    return body


def parse(out: bytes, r: ProbeRequest | None = None) -> ProbeReport:
    r = r or req()
    return probe.parse(out, r)


def test_a_whole_answer_is_the_agents_report():
    manifest = b'{"files": {}, "tasks": {"chief-0": {"unit": "%s"}}}' % UNIT.encode()
    rep = parse(output({ENV: b"A=1\n", MANIFEST: manifest}))
    assert rep.files[ENV] == FileInfo(
        "file", 0o600, 0, 4, hashlib.sha256(b"A=1\n").hexdigest(), base64.b64encode(b"A=1\n").decode()
    )  # differs from want: sent
    assert rep.manifest["tasks"]["chief-0"]["unit"] == UNIT
    assert rep.units[UNIT]["ActiveState"] == "active"
    assert rep.exits == {UNIT: []} and rep.lifecycle is None
    assert rep.facts == {"systemd_pid1": True}


@pytest.mark.parametrize(
    "broken",
    [
        lambda files: output(files, sha_count=0),  # a file stopped being regular between stat and sha256sum
        lambda files: output(files, content_cut=1),  # a file shrank between stat and head
        lambda files: output(files)[: -len(b"@end\n")],  # cut short
        lambda files: b"Welcome to fish!\n" + output(files),  # something else answered
    ],
    ids=["checksums", "content", "end", "start"],
)
def test_an_answer_that_does_not_add_up_is_refused(broken):
    with pytest.raises(probe._Mismatch):
        parse(broken({ENV: b"A=1\n"}))


def test_a_manifest_naming_unknown_files_is_the_agents_to_read():
    manifest = b'{"files": {"/opt/other": {}}, "tasks": {}}'
    with pytest.raises(probe._Mismatch):
        parse(output({MANIFEST: manifest}))


def test_nvidia_smi_is_read_with_the_agents_parser():
    r = req(facts_only=["gpus"])
    out = output({})
    smi = b"@gpus 0\n0, GPU-1, NVIDIA H100, 81559\n1, GPU-2, NVIDIA H100, 81559\n@gpus-end\n"
    out = out.replace(b"@systemd\n", b"@systemd\n" + smi)
    rep = probe.parse(out, r)
    assert rep.facts == {
        "systemd_pid1": True,
        **hostfacts.gpu_report(0, smi.decode().split("\n", 1)[1].rsplit("@gpus-end", 1)[0], ""),
    }
    assert len(rep.facts["gpus"]) == 2
    with pytest.raises(probe._Mismatch):  # nvidia-smi failed: the agent has its words
        probe.parse(out.replace(b"@gpus 0", b"@gpus 9"), r)


def test_a_program_is_only_looked_at(tmp_path):
    # A task's program (python3: megabytes) is stat-ed, never hashed or sent back, by the
    # script and by the agent alike.
    prog = tmp_path / "python3"
    prog.write_bytes(b"\x7fELF" + b"x" * 500)
    prog.chmod(0o755)
    f = tmp_path / "a.env"
    f.write_bytes(b"A=1\n")
    r = ProbeRequest(JOB, content_max=100, want={str(f): "0" * 64}, programs=[str(prog)])
    cmd = probe.command(r)
    assert "sha256sum" in cmd
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, check=True).stdout
    assert b"ELF" not in out and out.count(str(prog).encode()) == 1  # its stat line only
    rep = probe.parse(out, r)
    assert rep.files[str(prog)] == FileInfo("file", 0o755, prog.stat().st_uid, 504)
    assert rep.files[str(f)].content is not None  # a file provision writes is still read
    assert agent.file_info(str(prog), None, 100, look=True) == rep.files[str(prog)]
    # A program that is also a file provision put there is read like the others.
    r2 = ProbeRequest(JOB, content_max=100, paths=[str(prog)], programs=[str(prog)])
    out2 = subprocess.run(["sh", "-c", probe.command(r2)], capture_output=True, check=True).stdout
    assert probe.parse(out2, r2).files[str(prog)].sha256 == hashlib.sha256(prog.read_bytes()).hexdigest()


def test_the_script_travels_as_one_single_quoted_word():
    text = probe.script()
    assert "'" not in text and "\\" not in text
    assert shlex.split(shlex.quote(text)) == [text]


def test_the_script_runs_under_a_posix_shell(tmp_path):
    # Locally, on files of our own: the same sections in the same order.
    f = tmp_path / "a.env"
    f.write_bytes(b"A=1\n")
    r = ProbeRequest(JOB, content_max=100, paths=[str(f)])
    cmd = probe.command(r)
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, check=True).stdout
    rep = probe.parse(out, r)
    assert rep.files[str(f)].sha256 == hashlib.sha256(b"A=1\n").hexdigest()
    assert rep.manifest is None and rep.units == {}


def test_drop_ins_are_listed_as_the_agent_lists_them(tmp_path, monkeypatch):
    """item 10: every drop-in of a provision-*.d directory in systemd's unit paths,
    found by the script's glob as by the agent (hidden names and other units' left out)."""
    from provision.host import hostlib, layout

    etc, run = tmp_path / "etc", tmp_path / "run"
    monkeypatch.setattr(layout, "DROPIN_BASES", (str(etc), str(run), str(tmp_path / "none")))
    for d, names in {
        etc / f"{UNIT}.d": ["override.conf", "10-x.conf", ".hidden.conf", "notes.txt"],
        etc / "provision-.service.d": ["all.conf"],
        etc / "other.service.d": ["other.conf"],
        run / f"{UNIT}.d": ["50-ExecStart.conf"],
    }.items():
        d.mkdir(parents=True)
        for n in names:
            (d / n).write_text("[Service]\nExecStart=\nExecStart=/bin/evil\n")
    r = ProbeRequest(JOB, content_max=100)
    out = subprocess.run(["sh", "-c", probe.command(r)], capture_output=True, check=True).stdout
    got = probe.parse(out, r).dropins
    assert got == hostlib.dropins(layout.DROPIN_BASES, layout.PREFIX, layout.DROPIN_SUFFIX)
    assert got == sorted(
        [
            f"{etc}/{UNIT}.d/10-x.conf",
            f"{etc}/{UNIT}.d/override.conf",
            f"{etc}/provision-.service.d/all.conf",
            f"{run}/{UNIT}.d/50-ExecStart.conf",
        ]
    )
    assert all(layout.dropin_applies(p, UNIT) for p in got)
    # A name the script's lines cannot carry: the agent answers.
    with pytest.raises(probe._Mismatch):
        parse(output({}, dropins=(f"{etc}/{UNIT}.d/a",)))  # the first line of "a<newline>b.conf"
    # Without files (status): no base is read, by the script or by the agent (perf: 13
    # directories listed on every host at every status, for a report nobody reads).
    r = ProbeRequest(JOB, content_max=100, files=False)
    out = subprocess.run(["sh", "-c", probe.command(r)], capture_output=True, check=True).stdout
    assert b"@dropins\n@stat" in out and probe.parse(out, r).dropins is None
    monkeypatch.setattr(agent, "dropins", lambda *a: pytest.fail("read without files"))
    monkeypatch.setattr(agent, "read_json", lambda p: None)
    assert agent.op_probe(r).dropins is None
