"""Parameter servers (Li et al. 2014): the pin ``param_server=k`` (and ``staleness=s``).

The first k ranks of the data axis are the servers, colocated with the workers as in
MXNet's and BytePS's colocated mode (every rank of an autopar plan runs the plan's program,
so a server computes too). Each parameter belongs to one server (:func:`assign_owners`:
whole parameters, greedily by bytes, largest first), which keeps it and its optimizer state:

- push: as backward finishes a bucket of gradients, every rank sends the gradients of each
  server's parameters to that server (point-to-point ``isend``); the server sums what it
  receives with its own (``irecv``), so after ``train_step`` a server's ``.grad`` of its
  parameters is the global batch's gradient; a rank's other ``.grad`` are zeros.
- update: ``pm.step(opt)`` steps the optimizer on the parameters this rank serves only (the
  others' ``.grad`` are set to None, so torch's optimizers skip them and keep no state for
  them: optimizer memory is 1/k of the model's on a server and none on a worker).
- pull: each server sends its updated parameters to every other rank (``isend``/``irecv``).

Synchronous (no ``staleness=``) this equals one device (``tests/test_async_updates.py``).
With ``staleness=s`` a server applies at step t the gradients pushed at step t - s
(``autopar.runtime.updates.stale.Delayed``), the pushes of a step in flight behind the next s steps;
the pull stays synchronous.

Built on torch.distributed point-to-point on the data axis's process group: it is what a
push and a pull are (the server's link carries every worker's bytes, as the cost model
prices it: ``cost_models/comm.py``'s ``param_server_time``), it shares the plan's process
groups, and it runs on gloo and NCCL alike. ``torch.distributed.rpc`` would need a second,
TensorPipe-based initialisation beside the process groups and is in maintenance mode;
a rooted ``reduce``/``broadcast`` would let the library route bytes through a tree instead
of the server's link. No maintained library offers parameter servers for torch models
(BytePS and ps-lite are unmaintained), so the bookkeeping is written here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import ArgumentError
from autopar.ops.comm import Comm
from autopar.options import Options
from autopar.runtime.updates.rule import data_group
from autopar.runtime.updates.stale import Delayed, on_data_axis

PUSH, PULL = 1, 2
"""Point-to-point tags: a rank that is both a worker and a server has pushes and pulls in
flight to the same peer (under ``staleness=``, several steps' pushes)."""


def assign_owners(params: dict[str, nn.Parameter], servers: int) -> dict[str, int]:
    """The server (0 .. servers-1) of each parameter: largest first, to the least loaded
    server (ties: the lowest); deterministic, so every rank computes the same."""
    load = [0] * servers
    owner = {}
    for attr in sorted(params, key=lambda a: (-params[a].numel() * params[a].element_size(), a)):
        s = min(range(servers), key=lambda i: (load[i], i))
        owner[attr] = s
        load[s] += params[attr].numel() * params[attr].element_size()
    return owner


def make_rule(options: Options, comm: Comm, axis: int | None, params: dict) -> "ParamServer":
    """``param_server=``' rule on the data axis ``axis``, its pushed gradients applied
    ``staleness=`` steps late when that is pinned too."""
    on_data_axis("param_server", axis)
    return ParamServer(data_group(comm, axis), axis, options.param_server, params,
                       staleness=options.staleness or 0)


class ParamServer(Delayed):
    """Push gradients to their servers, step there, pull the parameters back."""

    def __init__(self, group, axis: int, servers: int, params: dict[str, nn.Parameter],
                 staleness: int = 0):
        super().__init__(group, axis, staleness)
        if servers > self.size:
            raise ArgumentError(f"param_server={servers}: the data axis has {self.size} ranks; pin "
                                f"param_server= at most {self.size}, or more data= ranks")
        self.servers = servers
        self.params = params
        self.owner = assign_owners(params, servers)
        self.me = dist.get_rank(group)
        self._peer = [dist.get_global_rank(group, r) for r in range(self.size)]
        self.pull_bytes = 0     # bytes this rank sent in the last pull

    def served(self) -> list[str]:
        """The parameters this rank serves."""
        return [a for a, s in self.owner.items() if s == self.me]

    def launch(self, names, grads, flat):
        by_owner: dict[int, list[int]] = {}
        for i, n in enumerate(names):
            by_owner.setdefault(self.owner[n], []).append(i)
        offsets, off = [], 0
        for g in grads:
            offsets.append(off)
            off += g.numel()
        works, sums = [], []
        for server, idx in sorted(by_owner.items()):
            mine = torch.cat([flat[offsets[i]: offsets[i] + grads[i].numel()] for i in idx])
            if server != self.me:       # a worker pushes
                self._step_bytes += mine.numel() * mine.element_size()
                works.append(dist.isend(mine, self._peer[server], group=self.group, tag=PUSH))
                continue
            bufs = [torch.empty_like(mine) for _ in range(self.size - 1)]
            others = [r for r in range(self.size) if r != self.me]
            works += [dist.irecv(b, self._peer[r], group=self.group, tag=PUSH)
                      for b, r in zip(bufs, others)]
            sums.append((idx, mine, bufs))

        def total():
            for w in works:
                w.wait()
            out = torch.zeros_like(flat)
            for idx, mine, bufs in sums:
                s = mine.clone()
                for b in bufs:          # in rank order: the same sum on every step
                    s += b
                o = 0
                for i in idx:
                    k = grads[i].numel()
                    out[offsets[i]: offsets[i] + k] = s[o: o + k]
                    o += k
            return out
        return total

    def optimizer_step(self, step, params) -> bool:
        """Step the optimizer on the parameters this rank serves, then pull every
        parameter from its server."""
        stepped = False
        if self.has_gradient:
            mine = set(self.served())
            for attr, p in self.params.items():
                if attr not in mine:
                    p.grad = None
            stepped = step()
        self.pull()
        return stepped

    @torch.no_grad()
    def global_grads(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``grads`` (this rank's ``.grad`` by attribute) with each parameter's gradient as
        its server holds it, the global batch's (a broadcast from each server; collective
        over the data axis: ``ParallelModule.full_grads``)."""
        out = {}
        for attr, g in grads.items():
            server = self.owner.get(attr)
            if server is None:
                out[attr] = g
                continue
            t = g.detach().clone().contiguous()
            dist.broadcast(t, self._peer[server], group=self.group)
            out[attr] = t
        return out

    @torch.no_grad()
    def pull(self) -> None:
        """Every rank receives each parameter from its server (point-to-point)."""
        works, into, sent = [], [], 0
        for server in range(self.servers):
            attrs = [a for a, s in self.owner.items() if s == server]
            if not attrs:
                continue
            if server == self.me:
                flat = torch.cat([self.params[a].detach().reshape(-1) for a in attrs])
                for r in range(self.size):
                    if r != self.me:
                        works.append(dist.isend(flat, self._peer[r], group=self.group, tag=PULL))
                        sent += flat.numel() * flat.element_size()
            else:
                flat = torch.empty(sum(self.params[a].numel() for a in attrs),
                                   dtype=self.params[attrs[0]].dtype, device=self.params[attrs[0]].device)
                works.append(dist.irecv(flat, self._peer[server], group=self.group, tag=PULL))
                into.append((attrs, flat))
        for w in works:
            w.wait()
        for attrs, flat in into:
            off = 0
            for a in attrs:
                p = self.params[a]
                p.copy_(flat[off: off + p.numel()].view_as(p))
                off += p.numel()
        self.pull_bytes = sent
