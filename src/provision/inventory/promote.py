"""From study to job: the study's inventory with one trial's exact arguments and no `tune:`,
ready for `provision plan` / `apply`. Pure (the file's text in, the new text out).

The job is named `<job>-p<N>` (core/tuning.promoted_job: not the study's own name, whose
destroy would remove it, nor the trial's `<job>-t<N>`); `files:` sources are rewritten
relative to where the new file goes, so they still name the same files. `outputs:` becomes
the trial's own, `<base>/<N>`: `fetch` of the promoted job brings back that trial's model,
and a run of it writes there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from provision.core.tuning import Tune, Value, promoted_job
from provision.inventory.trial import flags, with_flags


def promoted(
    text: str, tune: Tune, params: Mapping[str, Value], *, number: int, why: str, src_dir: Path, out_dir: Path
) -> str:
    doc: dict[str, Any] = yaml.safe_load(text)
    doc.pop("tune", None)
    study = doc.get("job")
    if isinstance(study, str):
        doc["job"] = promoted_job(study, number)
    extra = list(flags(tune, params))
    for pool in (doc.get("pools") or {}).values():
        if not isinstance(pool, dict):
            continue
        if "image" in pool:
            pool["args"] = list(with_flags(pool.get("args") or [], extra))
        else:  # as the trial ran: a flag the command has is replaced, not given twice
            command = pool.get("command") or []
            pool["command"] = [*command[:1], *with_flags(command[1:], extra)]
    if isinstance(doc.get("outputs"), str):  # the trial's own directory (inventory/trial.py), not every trial's
        doc["outputs"] = f"{doc['outputs'].rstrip('/')}/{number}"
    for f in doc.get("files") or []:
        if isinstance(f, dict) and isinstance(f.get("src"), str) and not os.path.isabs(os.path.expanduser(f["src"])):
            f["src"] = os.path.relpath((src_dir / f["src"]).resolve(), out_dir.resolve())
    head = f"# Trial {number} of study {study}, promoted by `provision tune --promote`: {why}\n"
    head += "# Its arguments: " + " ".join(extra) + "\n"
    return head + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=1000)
