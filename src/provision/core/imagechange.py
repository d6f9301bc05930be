"""An image a host needs before its tasks start: shipped from the controller or pulled
(io/images decides which; the plan and its printout carry it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ImageChange:
    """An image a host needs before its tasks start."""

    ref: str
    how: Literal["ship", "pull"]
    size: int = 0  # bytes, for a shipped image (the controller's `docker image inspect` Size)
    image_id: str = ""  # the controller's image ID, for a shipped image
    replaces: str = ""  # the host's ID when it has another image under this name

    def line(self) -> str:
        if self.how == "pull":
            return f"image {self.ref} (pulled on the host: this machine does not have it)"
        other = ", replacing the host's older image" if self.replaces else ""
        return f"image {self.ref} (shipped from this machine, {human(self.size)}{other})"

    def to_json(self) -> dict[str, object]:
        return {
            "image": self.ref,
            "how": self.how,
            "bytes": self.size if self.how == "ship" else None,
            "id": self.image_id,
        }


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit in ("B", "MB", "GB") or n >= 10 else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.0f} GB"
