"""What the hardware says of the fabric (part of `provision facts`): the GPUs' links to each
other and to the NICs (`nvidia-smi topo -m`), the NVLink fabric each GPU is in (`nvidia-smi
-q`'s Fabric section: ClusterUUID and CliqueId, on multi-node NVLink systems), and the
InfiniBand ports (/sys/class/infiniband). Runs on hosts: stdlib only, imported only by the
full facts (bundle.LAZY). What it returns is bounded here and checked again on the
controller (rules/fabricfacts.py)."""

from __future__ import annotations

import os

from .hostlib import run

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SYS_INFINIBAND = "/sys/class/infiniband"
MAX_DEVICES = 64  # GPUs, NICs or InfiniBand ports kept
CELL = 64  # characters kept of any one value
TIMEOUT = 20


def topology(gpus: int) -> dict[str, Any]:
    """The fabric's facts; the nvidia-smi ones only where there are GPUs."""
    out: dict[str, Any] = {"infiniband": infiniband()}
    if gpus:
        code, so, _ = run(["nvidia-smi", "topo", "-m"], timeout=TIMEOUT)
        out["gpu_topology"] = parse_topo(so) if code == 0 else None
        code, so, _ = run(["nvidia-smi", "-q"], timeout=TIMEOUT)
        out["nvlink_fabric"] = parse_fabric(so) if code == 0 else []
    return out


def _plain(line: str) -> str:
    """Without the terminal escapes nvidia-smi puts around the matrix's header (underline)."""
    out, i = [], 0
    while i < len(line):
        if line[i] == "\x1b":
            j = i + 1
            if j < len(line) and line[j] == "[":
                j += 1
                while j < len(line) and not ("@" <= line[j] <= "~"):
                    j += 1
            i = j + 1
            continue
        out.append(line[i])
        i += 1
    return "".join(out)


def _device(word: str) -> bool:
    return (word.startswith("GPU") and word[3:].isdigit()) or (word.startswith("NIC") and word[3:].isdigit())


def parse_topo(text: str) -> dict[str, Any]:  # noqa: C901  the matrix, its affinity columns and the NIC legend read in one pass
    """`nvidia-smi topo -m`: {"links": {GPU0: {GPU1: NV18, NIC0: PIX, ...}}, "cpu_affinity":
    {GPU0: "0-55"}, "numa": {GPU0: "0"}, "nics": {NIC0: "mlx5_0"}} (older drivers name the
    NIC columns by device, mlx5_0, themselves)."""
    lines = [_plain(x).rstrip("\n") for x in text.splitlines()]
    head: list[str] = []
    links: dict[str, dict[str, str]] = {}
    cpu: dict[str, str] = {}
    numa: dict[str, str] = {}
    nics: dict[str, str] = {}
    done = legend = False  # past the matrix; in the NIC legend
    for line in lines:
        cells = [c.strip() for c in line.split("\t")]
        stripped = line.strip()
        if not head and "GPU0" in cells:
            head = cells[1:] if cells[0] == "" else cells
            continue
        if stripped.startswith("NIC Legend"):
            legend = True
            continue
        if legend:
            name, colon, dev = stripped.partition(":")
            if colon and _device(name.strip()) and len(nics) < MAX_DEVICES:
                nics[name.strip()] = dev.strip()[:CELL]
            continue
        done = done or stripped.startswith("Legend")
        if done or not head:
            continue
        row = cells[0]
        if not (_device(row) or row.startswith("mlx")) or len(links) >= MAX_DEVICES:
            continue
        mine: dict[str, str] = {}
        for col, value in zip(head, cells[1:]):
            if col == "CPU Affinity" and value:
                cpu[row] = value[:CELL]
            elif col == "NUMA Affinity" and value:
                numa[row] = value[:CELL]
            elif (_device(col) or col.startswith("mlx")) and col != row and value and value != "X":
                mine[col] = value[:CELL]
        links[row] = mine
    return {"links": links, "cpu_affinity": cpu, "numa": numa, "nics": nics}


def parse_fabric(text: str) -> list[dict[str, str]]:
    """Each GPU's Fabric section of `nvidia-smi -q` (absent on drivers before it): state,
    status, clique_id, cluster_uuid, as printed ("N/A" where the GPU is in none)."""
    keys = {"State": "state", "Status": "status", "CliqueId": "clique_id", "ClusterUUID": "cluster_uuid"}
    out: list[dict[str, str]] = []
    gpu = None
    section: dict[str, str] | None = None
    depth = 0
    for raw in text.splitlines():
        line = raw.rstrip()
        indent = len(line) - len(line.lstrip())
        word = line.strip()
        if word.startswith("GPU ") and indent == 0:
            gpu = word[4:][:CELL]
            section = None
            continue
        if word == "Fabric" and gpu is not None:
            section, depth = {"gpu": gpu}, indent
            if len(out) < MAX_DEVICES:
                out.append(section)
            continue
        if section is not None:
            if indent <= depth:
                section = None
                continue
            name, colon, value = word.partition(":")
            if colon and name.strip() in keys and indent == depth + 4:
                section[keys[name.strip()]] = value.strip()[:CELL]
    return out


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(256).decode("ascii", "replace").strip()
    except OSError:
        return ""


def infiniband(root: str = SYS_INFINIBAND) -> list[dict[str, Any]]:
    """Every port of every device: state ("4: ACTIVE"), rate ("400 Gb/sec (4X NDR)"), link
    layer, LIDs, and its subnet (the first 64 bits of GID 0), as sysfs gives them."""
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return []
    out: list[dict[str, Any]] = []
    for dev in devices:
        try:
            ports = sorted(os.listdir(os.path.join(root, dev, "ports")), key=lambda p: (len(p), p))
        except OSError:
            continue
        for port in ports:
            if len(out) >= MAX_DEVICES:
                return out
            base = os.path.join(root, dev, "ports", port)
            gid = _read(os.path.join(base, "gids", "0"))
            out.append(
                {
                    "device": dev[:CELL],
                    "port": port[:CELL],
                    "state": _read(os.path.join(base, "state"))[:CELL],
                    "rate": _read(os.path.join(base, "rate"))[:CELL],
                    "link_layer": _read(os.path.join(base, "link_layer"))[:CELL],
                    "lid": _read(os.path.join(base, "lid"))[:CELL],
                    "sm_lid": _read(os.path.join(base, "sm_lid"))[:CELL],
                    "subnet": ":".join(gid.split(":")[:4])[:CELL],
                    "node_guid": _read(os.path.join(root, dev, "node_guid"))[:CELL],
                }
            )
    return out
