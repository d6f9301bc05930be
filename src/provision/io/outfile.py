"""Files the commands write for the user (`init -o`, `import -o`): never through a link,
never half-written.

An output path that is a symbolic link (dangling or not) is refused: following it would
create or overwrite its target, wherever that is. The text goes to a new temporary file in
the same directory (created exclusively, not following links), then takes the path's place
by rename, so a reader sees the old file or the whole new one.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from provision.core.errors import ProvisionError


def check_output(path: Path, shown: str, *, force: bool) -> None:
    """Refuse a path that is a link, or that exists without force (before any work)."""
    if path.is_symlink():
        raise ProvisionError(f"{shown}: is a symbolic link; refused (write to a path that is not a link)")
    if path.exists() and not force:
        raise ProvisionError(f"{shown}: already exists; give --force to overwrite it")


def write_output(path: Path, text: str, shown: str, *, force: bool) -> None:
    check_output(path, shown, force=force)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        check_output(path, shown, force=force)  # a link made meanwhile is refused too
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ProvisionError(f"{shown}: cannot write: {e.strerror}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
