"""The fabric a host's hardware tells of (host/topology.py's facts: untrusted, checked and
bounded here), as `provision facts` shows it, and the labels placement can prefer
(`placement: {prefer_same: [...]}`; `provision init --facts` writes them). Pure.

- nvlink: the fewest NVLinks between any two of the host's GPUs (`NV18`), from `nvidia-smi
  topo -m`; None when a pair of them has none (PCIe only);
- nics: the NICs the matrix names, and per GPU the nearest (PIX or PXB: behind the same PCIe
  switch);
- infiniband: each port's state, rate and subnet (/sys/class/infiniband);
- nvlink_domain: the NVLink fabric every GPU is in (ClusterUUID.CliqueId, on multi-node
  NVLink systems), when each says its fabric is Completed and all agree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LABEL_NVLINK = "nvlink_domain"
LABEL_IB = "ib_subnet"
MAX_ITEMS = 64
WORD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,63}$")
UUID = re.compile(r"^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$")
SUBNET = re.compile(r"^[0-9a-f]{4}(:[0-9a-f]{4}){3}$")
NEAR = ("PIX", "PXB")  # a NIC behind the same PCIe switch(es) as the GPU


@dataclass(frozen=True)
class IbPort:
    device: str
    port: str
    state: str  # ACTIVE, DOWN, INIT, ...
    rate_gbps: float | None
    link_layer: str
    subnet: str | None


@dataclass(frozen=True)
class Fabric:
    gpus: int = 0
    nvlink: str | None = None
    nics: tuple[tuple[str, str], ...] = ()  # (NIC0, mlx5_0)
    near_nic: tuple[tuple[str, str], ...] = ()  # (GPU0, NIC0)
    infiniband: tuple[IbPort, ...] = ()
    nvlink_domain: str | None = None

    @property
    def active_ib(self) -> list[IbPort]:
        return [p for p in self.infiniband if p.state == "ACTIVE"]

    def labels(self) -> dict[str, str]:
        """What placement can prefer (label values: letters, digits, '.', '_', '-')."""
        out = {}
        if self.nvlink_domain:
            out[LABEL_NVLINK] = self.nvlink_domain
        subnets = sorted({p.subnet for p in self.active_ib if p.subnet})
        if len(subnets) == 1:
            out[LABEL_IB] = subnets[0].replace(":", "-")
        return out

    def summary(self) -> str:
        """One cell of `provision facts`' table."""
        parts = []
        if self.gpus:
            parts.append(f"{self.nvlink} between GPUs" if self.nvlink else "no NVLink between GPUs")
        ib = self.active_ib
        if ib:
            rates = sorted({f"{p.rate_gbps:g} Gb/s" for p in ib if p.rate_gbps})
            parts.append(
                f"{len(ib)} InfiniBand port{'s' if len(ib) != 1 else ''} up"
                + (f" ({', '.join(rates)})" if rates else "")
            )
        elif self.infiniband:
            parts.append(f"InfiniBand: {len(self.infiniband)} port{'s' if len(self.infiniband) != 1 else ''}, none up")
        if self.nvlink_domain:
            parts.append(f"NVLink domain {self.nvlink_domain}")
        return "; ".join(parts) or "-"

    def to_json(self) -> dict[str, Any]:
        return {
            "nvlink": self.nvlink,
            "nics": dict(self.nics),
            "near_nic": dict(self.near_nic),
            "infiniband": [
                {
                    "device": p.device,
                    "port": p.port,
                    "state": p.state,
                    "rate_gbps": p.rate_gbps,
                    "link_layer": p.link_layer,
                    "subnet": p.subnet,
                }
                for p in self.infiniband
            ],
            "nvlink_domain": self.nvlink_domain,
        }


def _word(v: Any) -> str | None:
    return v if isinstance(v, str) and WORD.fullmatch(v) else None


def _dict(v: Any) -> dict[str, Any]:
    return dict(list(v.items())[:MAX_ITEMS]) if isinstance(v, Mapping) else {}


def _nv(cell: Any) -> int | None:
    m = re.fullmatch(r"NV(\d{1,3})", cell) if isinstance(cell, str) else None
    return int(m.group(1)) if m else None


def _gpu(name: str) -> bool:
    return bool(re.fullmatch(r"GPU\d{1,3}", name))


def fabric_of(facts: Mapping[str, Any]) -> Fabric:
    """The host's `fabric` fact, each value checked (anything else: left out)."""
    raw = _dict(facts.get("fabric"))
    gpus = facts.get("gpus")
    count = len(gpus) if isinstance(gpus, list) else 0
    topo = _dict(raw.get("gpu_topology"))
    links = {k: _dict(v) for k, v in _dict(topo.get("links")).items() if isinstance(k, str)}
    nvlink = None
    names = sorted((k for k in links if _gpu(k)), key=lambda k: int(k[3:]))
    counts = [_nv(links[a].get(b)) for a in names for b in names if a != b]
    if counts and all(c is not None for c in counts):
        nvlink = f"NV{min(c for c in counts if c is not None)}"
    nics = tuple((k, v) for k, v in _dict(topo.get("nics")).items() if _word(k) and _word(v))
    near = []
    for g in names:
        close = sorted((k for k, v in links[g].items() if v in NEAR and _word(k) and not _gpu(k)), key=len)
        if close:
            near.append((g, close[0]))
    return Fabric(
        count, nvlink, nics, tuple(near), _ib(raw.get("infiniband")), _domain(raw.get("nvlink_fabric"), count)
    )


def _ib(value: Any) -> tuple[IbPort, ...]:
    out = []
    for p in value[:MAX_ITEMS] if isinstance(value, list) else []:
        if not isinstance(p, Mapping) or not _word(p.get("device")) or not _word(p.get("port")):
            continue
        state = str(p.get("state") or "").partition(":")[2].strip() or str(p.get("state") or "")
        m = re.match(r"^\s*(\d{1,5}(?:\.\d{1,3})?) Gb/sec", str(p.get("rate") or ""))
        subnet = str(p.get("subnet") or "").lower()
        out.append(
            IbPort(
                str(p["device"]),
                str(p["port"]),
                state.upper() if re.fullmatch(r"[A-Za-z_]{1,20}", state) else "?",
                float(m.group(1)) if m else None,
                str(p.get("link_layer")) if _word(p.get("link_layer")) else "?",
                subnet if SUBNET.fullmatch(subnet) else None,
            )
        )
    return tuple(out)


def _domain(value: Any, gpus: int) -> str | None:
    """ClusterUUID.CliqueId when every GPU reports the same, its fabric Completed."""
    seen = set()
    rows = value[:MAX_ITEMS] if isinstance(value, list) else []
    for r in rows:
        if not isinstance(r, Mapping) or r.get("state") != "Completed":
            return None
        uuid, clique = str(r.get("cluster_uuid") or ""), str(r.get("clique_id") or "")
        if not UUID.fullmatch(uuid) or not clique.isdigit() or len(clique) > 10:
            return None
        seen.add(f"{uuid.lower()}.{clique}")
    return seen.pop() if len(seen) == 1 and len(rows) == gpus else None
