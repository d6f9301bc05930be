"""images.py without hosts: what plan shows, and the host check's shell."""

from __future__ import annotations

import subprocess

from provision.core.imagechange import ImageChange, human
from provision.io.images import host_check_command


def test_plan_lines():
    assert ImageChange("trainer:1", "ship", 120_400_000, "sha256:a").line() == (
        "image trainer:1 (shipped from this machine, 120 MB)"
    )
    assert (
        ImageChange("t:1", "ship", 2_000_000, "sha256:a", "sha256:b")
        .line()
        .endswith("2 MB, replacing the host's older image)")
    )
    assert ImageChange("reg.local/x:2", "pull").line() == (
        "image reg.local/x:2 (pulled on the host: this machine does not have it)"
    )
    assert [human(n) for n in (512, 1500, 2_000_000, 3_500_000_000)] == ["512 B", "1.5 KB", "2 MB", "4 GB"]


def test_host_check_prints_a_line_per_image(tmp_path):
    """A missing image (docker prints an empty line and exits 1) is '-'; a docker that
    answers nothing (a stand-in) gives an empty line, which plan leaves alone."""
    fake = tmp_path / "docker"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$5" in have*) echo sha256:1;; none*) ;; *) echo; echo "Error: No such image" >&2; exit 1;; esac\n'
    )
    fake.chmod(0o755)
    cmd = host_check_command(["have:1", "gone:1", "none:1", "it's; odd"])
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert out.stdout.splitlines() == ["sha256:1", "-", "", "-"]


def test_host_check_names_an_engine_that_does_not_answer(tmp_path):
    """item 14: with the engine stopped every image looked missing ("+ image
    shipped") and the ship then failed as "Unreachable ... Socket is closed"."""
    fake = tmp_path / "docker"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2\n'
        "exit 1\n"
    )
    fake.chmod(0o755)
    cmd = host_check_command(["a:1"])
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    assert out.stdout.splitlines() == [
        "@engine Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"
    ]
    bare = tmp_path / "bare"  # a PATH with no docker on it
    bare.mkdir()
    (bare / "tail").symlink_to("/usr/bin/tail")
    none = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, env={"PATH": str(bare)})
    assert none.stdout.startswith("@engine ") and "not found" in none.stdout
