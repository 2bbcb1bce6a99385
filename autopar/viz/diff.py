"""What changed between two plans: mesh, pins and cluster; the estimate term by term (step
time, compute, communication by collective, memory by term); and node placements, grouped
by (op, old placement, new placement) so repeated layers fold into one row."""
from __future__ import annotations

from dataclasses import dataclass, field

from autopar.plan import Plan


@dataclass
class Delta:
    name: str
    a: float
    b: float

    @property
    def change(self) -> float:
        return self.b - self.a

    @property
    def rel(self) -> float | None:
        return None if self.a == 0 else self.change / self.a


@dataclass
class PlanDiff:
    setup: list[tuple[str, str, str]] = field(default_factory=list)      # (what, a, b)
    times: list[Delta] = field(default_factory=list)
    comm: list[Delta] = field(default_factory=list)
    memory: list[Delta] = field(default_factory=list)
    placements: list[tuple[str, str, str, list[str]]] = field(default_factory=list)  # op, a, b, nodes
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    same_graph: bool = True

    @property
    def n_changed(self) -> int:
        return sum(len(nodes) for *_, nodes in self.placements)

    @property
    def empty(self) -> bool:
        return not (self.setup or self.placements or self.only_a or self.only_b
                    or any(d.change for d in self.times + self.comm + self.memory))


def diff(a: Plan, b: Plan) -> PlanDiff:
    d = PlanDiff(same_graph=a.fingerprint == b.fingerprint)
    for what in ("cluster", "world_size", "mesh_shape", "mesh_axes", "pins", "memory_budget",
                 "fingerprint"):
        va, vb = getattr(a, what), getattr(b, what)
        if va != vb:
            d.setup.append((what, str(va), str(vb)))
    ea, eb = a.estimate, b.estimate
    for what in ("step_time_s", "compute_s", "comm_s", "bubble_fraction"):
        d.times.append(Delta(what, getattr(ea, what), getattr(eb, what)))
    for k in sorted(set(ea.comm) | set(eb.comm)):
        d.comm.append(Delta(k, ea.comm.get(k, 0.0), eb.comm.get(k, 0.0)))
    for k in sorted(set(ea.memory_bytes) | set(eb.memory_bytes)):
        d.memory.append(Delta(k, ea.memory_bytes.get(k, 0.0), eb.memory_bytes.get(k, 0.0)))
    d.memory.append(Delta("total", ea.memory_total, eb.memory_total))
    groups: dict[tuple[str, str, str], list[str]] = {}
    param_of = {ph: name for name, ph in a.params.items()}
    param_of.update({ph: name for name, ph in b.params.items()})
    for n, pa in a.nodes.items():
        pb = b.nodes.get(n)
        if pb is None:
            d.only_a.append(n)
            continue
        if str(pa) != str(pb):
            op = a.node_ops.get(n) or ("parameter" if n in param_of else "input")
            label = param_of.get(n, n)
            groups.setdefault((op.replace("aten.", ""), str(pa), str(pb)), []).append(label)
    d.only_b = [n for n in b.nodes if n not in a.nodes]
    d.placements = [(op, pa, pb, names) for (op, pa, pb), names in groups.items()]
    return d
