"""The agent's atomic_write when two agents write one file at the same moment (
item 12: an apply interrupted during the setup leaves its agent waiting on the host; the
next apply's agent waits on the same setup, and both record its key when it ends)."""

from __future__ import annotations

import os

from provision.host import agent


def test_two_agents_writing_one_file_at_once_both_succeed(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fchown", lambda fd, uid, gid: None)  # not root here
    key = str(tmp_path / "setup.key")
    r, w = os.pipe()
    kids = []
    for n in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            os.close(w)
            os.read(r, 1)  # both start together
            code = 0
            for _ in range(300):
                try:
                    agent.atomic_write(key, b"k%d\n" % n, 0o600, [])
                except OSError:
                    code = 1
            os._exit(code)
        kids.append(pid)
    os.close(r)
    os.write(w, b"go")
    os.close(w)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in kids]
    assert codes == [0, 0], "a writer lost its temp file to the other (No such file or directory)"
    assert open(key).read() in ("k0\n", "k1\n")
    assert os.listdir(tmp_path) == ["setup.key"]  # no temp file left
