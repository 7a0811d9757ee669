"""Collective times on a multi-node GPU cluster: intra-node links + inter-node NICs.

    topo = Topology.of(LINKS["mi325x"], num_devices=32, gpus_per_node=8)   # 4 nodes x 8 GPUs
    topo.collective_time_us("all-to-all", payload_bytes, groups=((0, 1, ..., 31),))
    sched, durs = cost_model.simulate(schedule, HARDWARE["mi325x"], topology=topo)

Per GPU (one direction; every figure below is a `Links` field, with its source in `LINKS` and
docs/multinode.md):

    intra_bw       bytes/s a GPU sends to all its node peers at once (aggregate fabric bandwidth)
    intra_peer_bw  bytes/s to one given peer: a point-to-point link of a full mesh (MI300X/MI325X
                   Infinity Fabric: 7 links, one per peer); = intra_bw behind a switch (NVSwitch)
    inter_bw       bytes/s a GPU sends off its node: nics_per_node * nic_bw / gpus_per_node

Each bandwidth is the line rate times an efficiency, and inside a node also times the size curve
g(S) of cost_model.size_efficiency (S = the payload per device); the efficiencies, the intra-node
all-reduce bus bandwidth, the curve and the intra-node latency are the values fitted to published
component measurements (calibration_data/fitted.json, docs/calibration.md).

All-to-all over a group of n devices, payload P per device (P/n to every member, itself included):
each device sends L = (local peers) * P/n inside its node and R = (remote members) * P/n through
its NIC, both at once on separate links, so

    t = latency + max(L / (intra_bw g), (P/n) / (intra_peer_bw g) [if it has a local peer], R / inter_bw)

with latency = inter_latency_us when any member is on another node, else intra_latency_us; the
group's time is its slowest member's (all groups of a collective run at the same time on disjoint
devices). On one node of a full mesh with every peer in the group this is the single-node formula
of cost_model.py: P (n-1)/n / intra_bw.

All-reduce (and reduce-scatter / all-gather = half of it), hierarchical as NCCL/RCCL run it on
rail-connected nodes: l members per node, m nodes,

    t = latency + 2 (l-1)/l * P / (allreduce_bw g) + 2 (m-1)/m * (P / l) / inter_bw

(a reduce-scatter inside the node, an all-reduce of each GPU's 1/l shard with its rail peers across
the nodes, an all-gather inside the node). Collective-permute: one peer, P over the link it uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence
import dataclasses

from farskip_jax.errors import ConfigError
from farskip_jax.analysis.calibration_fit import load_fitted
from farskip_jax.analysis.cost_model import size_efficiency

GBIT = 1e9 / 8  # bytes/s of 1 Gb/s
SUM_ALL_TO_ALL = "sum-all-to-all"  # an all-to-all + local sum standing for a reduce-scatter (collective_time_us)


@dataclass(frozen=True)
class Links:
    """Link parameters of one GPU model in its usual node (see module doc; sources in LINKS)."""

    name: str
    intra_link_bw: float  # bytes/s, one direction, of one GPU-to-GPU link (full mesh) or of the switch port
    intra_links: int  # links per GPU into the node fabric (full mesh: gpus_per_node - 1); 1 = a switch
    switch: bool  # True: every peer is reached through one switch port of intra_link_bw (NVSwitch)
    nic_bw: float  # bytes/s of one NIC, one direction
    nics_per_node: int
    gpus_per_node: int
    intra_eff: float = 0.7  # achieved / line rate inside a node (RCCL/NCCL all-to-all at MB sizes)
    inter_eff: float = 0.8  # achieved / line rate across nodes (RDMA all-to-all at MB sizes)
    intra_latency_us: float = 10.0  # fixed cost of one collective inside a node
    inter_latency_us: float = 20.0  # fixed cost of one collective that crosses nodes
    intra_allreduce_bw: float = 0.0  # bus bandwidth of an intra-node all-reduce (0: intra_bw)
    size_half: float = 0.0  # size curve g(S) of intra-node transfers (cost_model.size_efficiency; 0: none)
    size_q: float = 1.0

    @property
    def intra_bw(self) -> float:
        return self.intra_eff * self.intra_link_bw * (1 if self.switch else self.intra_links)

    @property
    def intra_peer_bw(self) -> float:
        return self.intra_eff * self.intra_link_bw

    @property
    def inter_bw(self) -> float:
        return self.inter_eff * self.nic_bw * self.nics_per_node / self.gpus_per_node

    @property
    def allreduce_bw(self) -> float:
        return self.intra_allreduce_bw or self.intra_bw

    def g(self, payload: float) -> float:
        return size_efficiency(payload, self.size_half, self.size_q)


# Line rates (vendor data sheets): MI300X / MI325X: 7 Infinity Fabric links per GPU, 64 GB/s per
# direction each (AMD: "896 GB/s aggregate bidirectional peer-to-peer" = 7 x 128 GB/s), full mesh of
# 8 GPUs per node. H100 / H200 SXM: NVLink 4, 450 GB/s per direction through NVSwitch. NICs: 8 x
# 400 Gb/s per node, one per GPU (AMD Instinct MI300X/MI325X platforms with Pollara 400 / ConnectX-7;
# NVIDIA DGX H100/H200 with ConnectX-7), the paper's "400 Gb/s between nodes" per GPU; the count is
# an assumption the calibration sweeps (nics_per_node). Efficiencies, the intra-node all-reduce bus
# bandwidth, latency and size curve: fitted (calibration_data/fitted.json); the cross-node latency
# (20 us) is not (no measurement confirmed).
_LINE = {"mi300x": ("MI300X", 64e9, 7, False), "mi325x": ("MI325X", 64e9, 7, False),
         "h100_sxm": ("H100-SXM", 450e9, 1, True), "h200": ("H200", 450e9, 1, True)}


def links_from_fit(name: str, fitted: dict, which: Optional[dict] = None, **overrides) -> Links:
    """Links of `name` with the fitted constants at their central value in `fitted`
    (calibration_fit.load_fitted()), or at "low" / "high" for those named in `which`."""
    label, link_bw, n_links, switch = _LINE[name]
    f = fitted[name]
    which = which or {}

    def v(k):
        return float(f[k][which.get(k, "value")])

    base = dict(intra_link_bw=link_bw, intra_links=n_links, switch=switch, nic_bw=400 * GBIT, nics_per_node=8,
                gpus_per_node=8, intra_eff=v("intra_eff"), inter_eff=v("inter_eff"),
                intra_latency_us=v("coll_latency_us"), inter_latency_us=20.0, intra_allreduce_bw=v("coll_bw"),
                size_half=v("coll_size_half"), size_q=v("coll_size_q"))
    base.update(overrides)
    return Links(label, **base)


def _links_table() -> dict:
    fitted = load_fitted()
    return {name: links_from_fit(name, fitted) for name in _LINE}


LINKS = _links_table()


def resized(links: Links, gpus_per_node: int, **overrides) -> Links:
    """`links` on nodes of `gpus_per_node` GPUs: a full mesh has gpus_per_node - 1 links per GPU, and
    each GPU keeps its NIC share (nics_per_node scales with the GPUs: one 400 Gb/s NIC per GPU stays
    one per GPU); `overrides` replace fields afterwards."""
    nics = max(1, round(links.nics_per_node * gpus_per_node / links.gpus_per_node))
    full_mesh = {} if links.switch else {"intra_links": gpus_per_node - 1}
    return dataclasses.replace(links, gpus_per_node=gpus_per_node, nics_per_node=nics, **{**full_mesh, **overrides})


@dataclass(frozen=True)
class Topology:
    """`links` + which node each logical device id (a position in the program's device
    assignment, i.e. mesh.devices.flat) is on."""

    links: Links
    node_of: tuple[int, ...]

    @classmethod
    def of(cls, links: Links, num_devices: int, gpus_per_node: Optional[int] = None, **overrides) -> "Topology":
        """Devices 0..num_devices-1 on consecutive nodes of gpus_per_node (default links.gpus_per_node).
        `overrides` replace Links fields (e.g. nic_bw=200 * GBIT, inter_eff=0.6)."""
        per = gpus_per_node or links.gpus_per_node
        if per < 1 or num_devices % per:
            raise ConfigError(f"{num_devices} devices do not fill nodes of {per} GPUs; pick gpus_per_node dividing "
                              f"{num_devices}")
        return cls(resized(links, per, **overrides), tuple(i // per for i in range(num_devices)))

    @classmethod
    def of_mesh(cls, links: Links, mesh, **overrides) -> "Topology":
        """From a mesh of (compile-only) devices: node = the device's process_index (host)."""
        nodes = tuple(int(d.process_index) for d in mesh.devices.flat)
        per = max(nodes.count(n) for n in set(nodes))
        return cls(resized(links, per, **overrides), nodes)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))

    def _groups(self, groups: Optional[Sequence[Sequence[int]]]) -> list[tuple[int, ...]]:
        return [tuple(g) for g in groups] if groups else [tuple(range(len(self.node_of)))]

    def all_to_all_us(self, payload: float, groups: Optional[Sequence[Sequence[int]]] = None) -> float:
        """All-to-all of `payload` bytes per device over each replica group (module doc)."""
        lk = self.links
        worst = 0.0
        for g in self._groups(groups):
            n = len(g)
            if n < 2:
                continue
            chunk = payload / n
            ge = lk.g(payload)
            for d in g:
                local = sum(1 for x in g if x != d and self.node_of[x] == self.node_of[d])
                remote = n - 1 - local
                t = max(local * chunk / (lk.intra_bw * ge), chunk / (lk.intra_peer_bw * ge) if local else 0.0,
                        remote * chunk / lk.inter_bw)
                lat = lk.inter_latency_us if remote else lk.intra_latency_us
                worst = max(worst, lat + 1e6 * t)
        return worst

    def all_reduce_us(self, payload: float, groups: Optional[Sequence[Sequence[int]]] = None,
                      factor: float = 2.0) -> float:
        """Hierarchical all-reduce (factor 2) / reduce-scatter, all-gather (factor 1) (module doc)."""
        lk = self.links
        worst = 0.0
        for g in self._groups(groups):
            if len(g) < 2:
                continue
            per_node: dict[int, int] = {}
            for d in g:
                per_node[self.node_of[d]] = per_node.get(self.node_of[d], 0) + 1
            m, l = len(per_node), max(per_node.values())
            t = factor * (l - 1) / l * payload / (lk.allreduce_bw * lk.g(payload))
            if m > 1:
                t += factor * (m - 1) / m * (payload / l) / lk.inter_bw
            worst = max(worst, (lk.inter_latency_us if m > 1 else lk.intra_latency_us) + 1e6 * t)
        return worst

    def collective_time_us(self, kind: str, payload: float, groups: Optional[Sequence[Sequence[int]]] = None) -> float:
        """Modelled time of one collective (module doc). Kind SUM_ALL_TO_ALL: an all-to-all that
        implements a reduce-scatter (FoE's fp8 cross-group sum, parallel/foe.fp8_reduce_scatter),
        priced as the all-to-all it is."""
        if kind in ("all-to-all", "ragged-all-to-all", SUM_ALL_TO_ALL):
            return self.all_to_all_us(payload, groups)
        if kind == "all-reduce":
            return self.all_reduce_us(payload, groups, 2.0)
        if kind in ("all-gather", "reduce-scatter"):
            return self.all_reduce_us(payload, groups, 1.0)
        # collective-permute, send/recv, broadcast: one peer; cross-node when any group spans nodes
        lk = self.links
        cross = any(len({self.node_of[d] for d in g}) > 1 for g in self._groups(groups))
        bw, lat = (lk.inter_bw, lk.inter_latency_us) if cross else (lk.intra_peer_bw, lk.intra_latency_us)
        return lat + 1e6 * payload / bw

    def crossing_fraction(self, groups: Optional[Sequence[Sequence[int]]] = None) -> float:
        """Share of an all-to-all's off-device bytes that leave the node (0 inside one node)."""
        fr = []
        for g in self._groups(groups):
            n = len(g)
            if n < 2:
                continue
            for d in g:
                local = sum(1 for x in g if x != d and self.node_of[x] == self.node_of[d])
                fr.append((n - 1 - local) / (n - 1))
        return max(fr, default=0.0)
