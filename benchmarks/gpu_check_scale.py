"""The GPU check's ``scale`` section: one rank's program of a real-scale plan, run on one
GPU (issue 39, item 3).

autopar's GPU checks otherwise run models that fit one device at world 1, where most ops
are launch-bound and nothing is sharded. Here each case is planned by autopar for the
cluster it would really train on, and the program of **rank 0** of that plan (its local
shards, its stage, its experts, at the plan's real local shapes) is built by
``autopar.parallelize`` and trained on the one GPU, under torch's fake process group
(``torch.testing._internal.distributed.fake_pg``: backend ``"fake"`` at the plan's world
size; every collective returns at once, an all-gather / all-to-all copying this rank's
input into each peer's slot, so shapes and routed token counts are real):

- ``llama3_8b_tp8``: Llama-3-8B (``hf:llama3-8b``) under ``tensor=8`` on ``8xH100``, one
  sequence of 8,192 tokens;
- ``llama3_70b_pp_stage``: Llama-3-70B (``hf:llama3-70b``) planned for 64 H100
  (``8x8xH100``) under ``tensor=8, pipeline=8``, 8 micro-batches of one 8,192-token
  sequence: rank 0 runs the first stage (embedding + its layers) of the 1F1B schedule,
  its sends and receives no-ops;
- ``deepseek_v3_moe_ep8``: a DeepSeek-V3-shaped stack (``hf:deepseek-v3``'s hidden 7,168,
  MLA attention, 256 routed experts of 2,048, top-8, one shared expert) of
  ``MOE_LAYERS`` MoE layers (``first_k_dense_replace=0``) under ``expert=8`` on
  ``8xH200``, 8 sequences of 4,096 tokens (4,096 a rank): rank 0 holds 32 experts. The
  fake all-to-all hands rank 0, as if from peer j, what rank 0 sends to peer j (the counts
  first, then the tokens): its 32 experts receive all 32,768 of its routed token copies,
  1,024 each on average, what a balanced router gives them. Planned for H200s: on
  ``8xH100`` the two layers need 85 GiB a device (the replicated embedding and head, 1.85 B
  parameters, with their AdamW states), more than an H100 has.

For each case: the module's parameters (bytes held against the whole model's), one
training step's peak ``torch.cuda.max_memory_allocated`` (after the weights and optimizer
states exist) against ``plan.estimate.memory_total`` (the plan's per-device prediction),
and compute by op family (``autopar.runtime.timing.measure``: every ATen op timed between
two device synchronisations) against the plan's price table
(``autopar.runtime.timing.predicted_compute``). For the pipeline stage the price table is
not rebuilt per stage (``pricing.prices.plan_prices`` refuses pipeline plans): its total
compute is compared with the plan's estimate of its busiest stage (``estimate.compute_s``,
``solver.pipeline_price``) and its peak with the fullest stage's memory; rank 0 runs stage
0 (the embedding, and under 1F1B the most micro-batches in flight). Goal: ratios within
10% (reported, not asserted).

Run::

    PYTHONPATH=. python3 benchmarks/gpu_check.py --only scale          # on a GPU
    PYTHONPATH=. python3 benchmarks/gpu_check.py --dry --only scale    # CPU, tiny sizes
    python benchmarks/gpu_check.py --prepare-scale                     # here: the plans

The real-scale plans are made on a CPU with OR-Tools (``--prepare-scale``) into
``benchmarks/data/gpu_check_scale.json`` and loaded on the GPU machine (which may have no
OR-Tools); a plan is checked against the graph captured there (its fingerprint). The
weights are random (``normal(0, 0.02)``, written straight into the local shards: a real
checkpoint is not needed to time or size a step). ``--dry`` runs the same code on the CPU
at tiny sizes (1-2 layers, hidden 64, 32 tokens; ``tensor=2`` on ``cpu:2``,
``tensor=2, pipeline=2`` on ``cpu:4``, ``expert=2`` on ``cpu:2``), planned live; its numbers
mean nothing. It takes about 10 s (the section's ``seconds`` in the report, on the 2-core
development machine).

Planning the real-scale cases (``--prepare-scale``, on that machine with OR-Tools, capture
on FakeTensors included): Llama-3-8B 6-7 s, Llama-3-70B 4-19 s, DeepSeek-V3 stack 2-13 s
(the larger figures with other work running). Predicted memory per device: 20.7, 52.6 and
85.2 GiB: an H200 (139 GiB) runs all three; on an 80 GB GPU the MoE case records its
out-of-memory error and the others run.

Limits: the fake process group measures no communication (the plan's communication
terms are reported, not checked); the pipeline stage runs without its peers, so its
bubble is absent and the gradients it receives are zeros; rank 0 is one rank (other
stages and expert ranks differ: the last pipeline stage holds the output head and loss);
the expert router's choices follow random weights, not a trained router's; the plans are
priced for H100 / H200 (``cluster``), so on another GPU the compute ratios mix the cost
model's error with the device's difference; per-op timing adds a launch and two
synchronisations to every op (as in the ``op_timing`` section).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data" / "gpu_check_scale.json"
INIT_STD = 0.02
"""Standard deviation of the random weights: ``initializer_range`` of transformers'
``LlamaConfig`` and ``DeepseekV3Config`` (their default; the shipped configs leave it out)."""
MOE_LAYERS = 2

# name -> how it is planned. "hf": a shipped config; "config": keys changed in it;
# "layers": layers kept; batch x seq tokens per step (the global batch).
CASES = {
    "llama3_8b_tp8": {"hf": "llama3-8b", "batch": 1, "seq": 8192, "cluster": "8xH100",
                      "pins": {"tensor": 8}},
    "llama3_70b_pp_stage": {"hf": "llama3-70b", "batch": 8, "seq": 8192, "cluster": "8x8xH100",
                            "pins": {"tensor": 8, "pipeline": 8, "micro_batch_size": 1}},
    "deepseek_v3_moe_ep8": {"hf": "deepseek-v3", "layers": MOE_LAYERS, "batch": 8, "seq": 4096,
                            "cluster": "8xH200", "config": {"first_k_dense_replace": 0},
                            "pins": {"expert": 8}},
}
# the same code paths on a CPU: tiny configs, small worlds
DRY_CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 8192}
DRY_CASES = {
    "llama3_8b_tp8": {"hf": "llama3-8b", "layers": 2, "batch": 1, "seq": 32, "cluster": "cpu:2",
                      "config": DRY_CONFIG, "pins": {"tensor": 2}},
    "llama3_70b_pp_stage": {"hf": "llama3-70b", "layers": 2, "batch": 2, "seq": 32, "cluster": "cpu:4",
                            "config": DRY_CONFIG, "pins": {"tensor": 2, "pipeline": 2, "micro_batch_size": 1}},
    "deepseek_v3_moe_ep8": {"hf": "deepseek-v3", "layers": 1, "batch": 2, "seq": 32, "cluster": "cpu:2",
                            "config": {"first_k_dense_replace": 0, "hidden_size": 64, "intermediate_size": 128,
                                       "moe_intermediate_size": 32, "n_routed_experts": 8,
                                       "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                                       "num_attention_heads": 4, "num_key_value_heads": 4,
                                       "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                                       "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 256,
                                       "max_position_embeddings": 64, "rope_scaling": None},
                            "pins": {"expert": 2}},
}
PLAN_KW = {"precision": "bf16", "optimizer": "adamw"}


def cases(dry: bool) -> dict:
    return DRY_CASES if dry else CASES


def build_meta(case: dict):
    """(model on the meta device with real buffers, inputs, loss_fn, target): the case's
    shipped config with its changes, built by transformers (``autopar.hf_models``: the
    class its ``architectures`` names, SDPA attention, fp32, no KV cache)."""
    from autopar import hf_models
    name, cfg = hf_models.load_config(case["hf"])
    cfg = {**cfg, **case.get("config", {})}
    with torch.device("meta"):
        model, config = hf_models._model(name, cfg, case.get("layers"))
    real_buffers(model, config)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (case["batch"], case["seq"]), generator=g)
    # the target its own tensor: one tensor passed as both would be one graph input
    return model, (tokens,), hf_models.lm_loss, tokens.roll(-1, dims=1)


def real_buffers(model, config) -> None:
    """The buffers of a model built on the meta device computed for real: each module that
    holds meta buffers and no parameters of its own (a rotary embedding's tables) is built
    again on the CPU from ``config`` and its buffers taken; a module with parameters gets
    zeros (DeepSeek-V3's router ``e_score_correction_bias``, zeros in transformers' init).
    (``autopar.meta_parameters`` would allocate each parameter on the CPU before moving it:
    30 GB for one DeepSeek-V3 expert stack.)"""
    for mod in model.modules():
        if any(b is not None and b.is_meta for b in mod._buffers.values()):
            if mod._parameters:   # DeepSeek's router: its bias buffer starts at zero
                for k, b in mod._buffers.items():
                    if b is not None and b.is_meta:
                        mod._buffers[k] = torch.zeros(b.shape, dtype=b.dtype)
                continue
            with torch.device("cpu"):
                fresh = type(mod)(config)
            for k in list(mod._buffers):
                mod._buffers[k] = fresh._buffers[k]


def make_plan(case: dict, time_limit_s: float = 120.0):
    """autopar's plan of ``case`` for its cluster, captured as ``parallelize`` captures a meta
    model (``autopar.runtime.weights.capture_view``: the same fingerprint)."""
    import autopar
    from autopar.runtime.weights import capture_view
    model, inputs, loss_fn, target = build_meta(case)
    with capture_view(model, inputs, target) as (inputs, target):
        return autopar.plan(model, inputs, loss_fn, target=target, cluster=case["cluster"],
                            time_limit_s=time_limit_s, **PLAN_KW, **case["pins"])


@contextlib.contextmanager
def fake_world(world: int, device: torch.device):
    """torch's fake process group of ``world`` ranks, this process rank 0 (collectives return
    at once), its collectives' outputs written as :class:`Loopback` says; a process group
    open before (gpu_check's world-1 group) is destroyed, and :func:`section_scale` makes it
    again once every case has run and freed its memory (made again here, after a case that
    failed holding the GPU's memory, NCCL's own set-up failed and hid the case's error)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from autopar.ops.comm import DistComm
    if dist.is_initialized():
        dist.destroy_process_group()
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    made = DistComm.__init__

    def loopback_comm(self, *a, **k):
        made(self, *a, **k)
        self.dist = Loopback(self.dist)
    DistComm.__init__ = loopback_comm
    try:
        yield
    finally:
        DistComm.__init__ = made
        dist.destroy_process_group()
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Loopback:
    """``torch.distributed`` as autopar's communicator (``ops.comm.DistComm.dist``) calls it
    under the fake process group, each collective's output then written as if every peer
    had sent what this rank sends: an all-gather copies the input into each peer's slot, a
    reduce-scatter keeps this rank's chunk of its own input, an all-to-all whose receive
    counts equal its send counts (the counts' exchange, then the tokens: a balanced
    router's) hands back what it sends. torch 2.13's fake group does the same (its "fake
    collective semantics"); torch 2.11's leaves the outputs as allocated (uninitialised
    memory: session 28's NaN loss and its token counts of 10^18), so the data must not
    depend on the torch of the GPU machine. An all-reduce leaves this rank's own partial sum
    (finite; the scale, not the shape, differs from a real one)."""

    def __init__(self, dist_module):
        self._dist = dist_module

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def _peers(self, group):
        return self._dist.get_world_size(group), self._dist.get_rank(group)

    def all_gather_into_tensor(self, out, t, group=None, async_op=False):
        work = self._dist.all_gather_into_tensor(out, t, group=group, async_op=async_op)
        n, _ = self._peers(group)
        with torch.no_grad():
            for slot in out.chunk(n):
                slot.copy_(t.reshape(slot.shape))
        return work

    def all_gather(self, parts, t, group=None, async_op=False):
        work = self._dist.all_gather(parts, t, group=group, async_op=async_op)
        with torch.no_grad():
            for part in parts:
                part.copy_(t)
        return work

    def reduce_scatter_tensor(self, out, t, group=None, async_op=False, **kw):
        work = self._dist.reduce_scatter_tensor(out, t, group=group, async_op=async_op, **kw)
        n, me = self._peers(group)
        with torch.no_grad():
            out.copy_(t.chunk(n)[me].reshape(out.shape))
        return work

    def all_to_all_single(self, out, t, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        work = self._dist.all_to_all_single(out, t, output_split_sizes, input_split_sizes,
                                            group=group, async_op=async_op)
        with torch.no_grad():
            if out.shape == t.shape and list(output_split_sizes or []) == list(input_split_sizes or []):
                out.copy_(t)
            else:     # counts this rank did not send: its first rows, repeated (finite, arbitrary)
                flat, src = out.reshape(out.shape[0], -1), t.reshape(t.shape[0], -1)
                step = max(src.shape[0], 1)
                for start in range(0, flat.shape[0] if src.shape[0] else 0, step):
                    rows = min(step, flat.shape[0] - start)
                    flat[start:start + rows].copy_(src[:rows])
        return work


@contextlib.contextmanager
def without_peers():
    """What rank 0 alone cannot do with peers that only exist in the fake group, left out
    while open: (1) ``autopar.runtime.collective_order``'s check that every rank issues the
    same collectives (it exchanges the programs over a gloo group, which a fake world cannot
    make; every rank runs the same plan here, so it would pass); (2) the answer of the last
    pipeline stage to torch's warm-up vote on shape inference (``PipelineStage.
    _warmup_backward_result``; a fake receive leaves it 0, "infer shapes at run time", whose
    metadata exchange then reads garbage sizes): every stage autopar builds has plain-tensor
    inputs and outputs with complete metadata (``InferenceMode.needs_dynamic`` is False), so
    the real vote is 1, static shapes. (3) The values a stage receives: its receive buffers
    (``pipelining.stage._make_tensor_from_meta`` at set-up, ``runtime.receive_buffers``'s
    fresh one per receive) are zeroed, so that what a fake receive leaves in them is zeros,
    not uninitialised memory (NaNs)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import stage as pp_stage
    from autopar.runtime import parallel_module, receive_buffers
    # (2) exists from torch 2.13 (torch 2.11 has no warm-up vote: nothing to answer)
    vote = getattr(PipelineStage, "_warmup_backward_result", None)
    saved = (parallel_module.order_check, pp_stage._make_tensor_from_meta,
             receive_buffers._make_tensor_from_meta)
    make = saved[1]
    parallel_module.order_check = lambda comm, pipelined: None
    if vote is not None:
        PipelineStage._warmup_backward_result = (
            lambda self, received_result=None: torch.ones(1, dtype=torch.int32, device=self.device))
    zeroed = lambda *a, **k: make(*a, **k).zero_()
    pp_stage._make_tensor_from_meta = receive_buffers._make_tensor_from_meta = zeroed
    try:
        yield
    finally:
        (parallel_module.order_check, pp_stage._make_tensor_from_meta,
         receive_buffers._make_tensor_from_meta) = saved
        if vote is not None:
            PipelineStage._warmup_backward_result = vote


@contextlib.contextmanager
def random_weights(seed: int = 0):
    """While open, ``parallelize(..., weights=...)`` fills the local shards with
    ``normal(0, INIT_STD)`` (norm weights with 1) instead of reading a file: yields the
    placeholder path to pass as ``weights=``."""
    from autopar.runtime import parallel_module
    from autopar.runtime.dcp_state import Layout

    def fill(pm, path, model):
        g = torch.Generator(device=pm.device).manual_seed(seed)
        with torch.no_grad():
            for attr, t in Layout(pm).held.items():
                if not t.is_floating_point():
                    continue
                if attr not in pm._shards.params:
                    continue                     # buffers: the model's own (rotary tables)
                if "norm" in attr:
                    t.fill_(1.0)
                else:
                    t.normal_(0.0, INIT_STD, generator=g)
        return {}
    original = parallel_module.load_weights
    parallel_module.load_weights = fill
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "random_weights.pt"
        path.touch()
        try:
            yield str(path)
        finally:
            parallel_module.load_weights = original


# ---- plans: solved here (OR-Tools) or prepared ---------------------------------------------
def load_plan(name: str, case: dict, live: bool):
    """(the plan of ``case``, where it came from, seconds it took): solved here (``live``:
    gpu_check's ``--plans live``, OR-Tools importable, or a dry run), else the prepared one
    of ``DATA``."""
    from autopar import Plan
    if live:
        t = time.perf_counter()
        p = make_plan(case)
        return p, "solved here (OR-Tools)", time.perf_counter() - t
    saved = (json.loads(DATA.read_text()) if DATA.exists() else {}).get("plans", {}).get(name)
    if saved is None:
        raise RuntimeError(f"no OR-Tools here and no prepared plan of {name} in "
                           f"{DATA.relative_to(ROOT)}: run `python benchmarks/gpu_check.py --prepare-scale` "
                           "on a machine with OR-Tools and commit the file")
    return Plan.from_dict(saved["plan"]), f"prepared ({DATA.name}, solved in {saved['seconds']:.0f} s)", 0.0


def prepare(log) -> int:
    """``--prepare-scale``: the real-scale plans, solved here, into ``DATA``."""
    data = {"what": "the real-scale plans of benchmarks/gpu_check_scale.py's cases, solved on a CPU with "
                    "OR-Tools by `python benchmarks/gpu_check.py --prepare-scale`",
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__, "plans": {}}
    for name, case in CASES.items():
        t = time.perf_counter()
        p = make_plan(case)
        dt = time.perf_counter() - t
        log(f"  {name}: mesh {tuple(p.mesh_shape)} {tuple(p.mesh_axes)} in {dt:.0f} s, "
            f"estimate {p.estimate.memory_total / 2**30:.1f} GiB/device")
        data["plans"][name] = {"case": case, "seconds": dt, "plan": json.loads(p.to_json())}
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    return 0


# ---- one rank's program, run ---------------------------------------------------------------
def peak_or_resident(original):
    """``timing.peak_memory``, except where torch's MemTracker (the CPU's measure) refuses a
    module run several times a step (a pipeline stage's micro-batches): there the bytes of
    the parameters, gradients and optimizer states after the step (a dry run's number)."""
    def peak_memory(pm, opt, one_step):
        try:
            return original(pm, opt, one_step)
        except NotImplementedError:
            one_step()
            held = [t for p in pm.parameters() for t in (p, p.grad) if t is not None]
            held += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            return float(sum(t.numel() * t.element_size() for t in held)), \
                "parameters + gradients + optimizer states (MemTracker refuses a pipeline stage)"
    return peak_memory


def stage_prediction(cap, plan) -> dict | None:
    """Forward + backward seconds by family row of the plan's price table
    (``timing.predicted_compute``); None for a pipeline plan, whose per-stage prices
    ``pricing.prices.plan_prices`` does not rebuild yet."""
    from autopar.runtime.timing import predicted_compute
    return predicted_compute(cap, plan)


class OpMemory(TorchDispatchMode):
    """Every ATen op of one step: its phase (forward; backward, where autograd's engine runs
    it; optimizer, while ``phase`` says so), the device's allocated bytes after it, and its
    seconds between two synchronisations. Where the peak falls, what forward left saved,
    and which ops take the time: what a ratio by family cannot say."""

    def __init__(self, allocated, sync):
        super().__init__()
        self.allocated, self.sync = allocated, sync
        self.phase = "step"
        self.trace: list[tuple[str, str, int]] = []
        self.seconds: dict = defaultdict(float)
        self.calls: dict = defaultdict(int)
        self.made: dict = {}          # storage -> (op, dtype, shape, bytes, weak ref), forward's
        self.live_at_backward: dict | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sync()
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.sync()
        if func.namespace == "aten":
            node = getattr(torch._C, "_current_autograd_node", lambda: None)()
            phase = self.phase if self.phase != "step" else ("backward" if node is not None else "forward")
            name = func.name().removeprefix("aten::")
            self.seconds[(phase, name)] += time.perf_counter() - t0
            self.calls[(phase, name)] += 1
            self.trace.append((phase, name, self.allocated()))
            if phase == "forward":
                self._note(name, out)
            elif phase == "backward" and self.live_at_backward is None:
                self.live_at_backward = self._live()
        return out

    def _note(self, name, out) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = st.data_ptr()        # an address freed and given again: the new tensor
                if key and (key not in self.made or self.made[key][-1].expired()):
                    self.made[key] = (name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                      st.nbytes(), StorageWeakRef(st))

    def _live(self) -> dict:
        """What forward made and backward's first op finds alive (saved for backward, the
        loss's tensors), by the op that made it and its dtype: bytes, count, a shape."""
        groups: dict = {}
        for name, dtype, shape, nbytes, ref in self.made.values():
            if ref.expired():
                continue
            g = groups.setdefault(f"{name} {dtype}", {"bytes": 0, "count": 0, "shape": list(shape)})
            g["bytes"] += nbytes
            g["count"] += 1
        top = dict(sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])[:20])
        return {"bytes": sum(g["bytes"] for g in groups.values()), "by_op": top}


def op_memory(pm, inputs, target, ctx, resident: float) -> dict:
    """One AdamW step of the rank's program (after one that makes the optimizer's states)
    under :class:`OpMemory`: bytes allocated (less ``resident``) before it, at the end of
    forward, at the highest point after an op of each phase (which op), the allocator's
    peak inside the step, and the 15 ops of most time."""
    dev = ctx.device
    allocated = (lambda: torch.cuda.memory_allocated(dev)) if ctx.cuda else (lambda: 0)
    sync = (lambda: torch.cuda.synchronize(dev)) if ctx.cuda else (lambda: None)
    opt = torch.optim.AdamW(list(pm.parameters()), lr=1e-4)

    def step(mode=None):
        opt.zero_grad(set_to_none=True)
        pm.train_step(*inputs, target=target)
        if mode is not None:
            mode.phase = "optimizer"
        pm.step(opt)
        if mode is not None:
            mode.phase = "step"
    step()
    sync()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    before = allocated() - resident
    mode = OpMemory(allocated, sync)
    with mode:
        step(mode)
    peak_in = (torch.cuda.max_memory_allocated(dev) - resident) if ctx.cuda else None
    trace = mode.trace
    fwd = [i for i, (ph, _, _) in enumerate(trace) if ph == "forward"]
    phases = {}
    for ph in ("forward", "backward", "optimizer"):
        rows = [(b, i, name) for i, (p_, name, b) in enumerate(trace) if p_ == ph]
        if rows:
            b, i, name = max(rows)
            phases[ph] = {"peak_after_op_bytes": b - resident, "op": name, "op_index": i, "ops": len(rows)}
    top = sorted(mode.seconds.items(), key=lambda kv: -kv[1])[:15]
    first_bwd = next((i for i, (ph, _, _) in enumerate(trace) if ph == "backward"), None)
    del opt
    return {"before_step_bytes": before,
            "end_of_forward_bytes": trace[first_bwd - 1][2] - resident if first_bwd else None,
            "made_by_forward_live_at_backward": mode.live_at_backward,
            "phases": phases, "peak_in_step_bytes": peak_in, "ops": len(trace),
            "top_ops": [{"phase": ph, "op": name, "calls": mode.calls[(ph, name)], "seconds": sec}
                        for (ph, name), sec in top]}


def local_checks(pm, plan, inputs, target) -> dict:
    """One training step of the rank's program: its loss and gradients finite, and every
    local parameter the shape the plan's placements give (``pm._shards``)."""
    pm.zero_grad(set_to_none=True)
    loss = pm.train_step(*inputs, target=target)
    grads = {n: p.grad for n, p in pm.module.named_parameters()}
    sh = pm._shards
    mesh = tuple(pm._stage_mesh)
    wrong = []
    for n, p in pm.module.named_parameters():
        want = sh.local_shape(n, mesh) if n in sh.placements else None
        if want is not None and tuple(p.shape) != tuple(want):
            wrong.append(f"{n}: {tuple(p.shape)}, plan {want}")
    missing = [n for n, g in grads.items() if g is None]
    finite = all(bool(torch.isfinite(g).all()) for g in grads.values() if g is not None)
    lv = float(loss.detach()) if loss is not None else None
    pm.zero_grad(set_to_none=True)
    return {"loss": lv, "loss_finite": lv is not None and math.isfinite(lv), "grads_finite": finite,
            "params_without_grad": missing[:8], "n_params_without_grad": len(missing),
            "wrong_local_shapes": wrong[:8], "n_wrong_local_shapes": len(wrong)}


def run_case(ctx, name: str, case: dict, live: bool, log) -> dict:
    """Case ``name``: planned (or its prepared plan), rank 0's module built under the fake
    process group with random weights, checked (:func:`local_checks`) and timed."""
    import autopar
    from autopar.plan import PlanError
    from autopar.runtime import timing
    plan, source, plan_s = load_plan(name, case, live)
    log(f"  {name}: plan {source}, mesh {tuple(plan.mesh_shape)} {tuple(plan.mesh_axes)} on {plan.cluster}")
    model, inputs, loss_fn, target = build_meta(case)
    whole = {n: p for n, p in model.named_parameters()}
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.values())
    dev = ctx.device
    steps, warmup = (1, 0) if ctx.dry else (3, 1)
    with fake_world(plan.world_size, dev), without_peers(), random_weights() as weights:
        resident = float(torch.cuda.memory_allocated(dev)) if ctx.cuda else 0.0
        t = time.perf_counter()
        try:
            pm = autopar.parallelize(model, inputs, loss_fn, target=target, plan=plan, weights=weights)
        except PlanError as e:
            raise PlanError(f"{e} [{name}: plan {source}; a prepared plan is made for the graph one torch "
                            "and transformers capture: run `python benchmarks/gpu_check.py --prepare-scale` "
                            "with this machine's versions, or carry OR-Tools to solve here]") from e
        build_s = time.perf_counter() - t
        built = float(torch.cuda.memory_allocated(dev)) if ctx.cuda else None
        local = dict(pm.module.named_parameters())
        local_bytes = sum(p.numel() * p.element_size() for p in local.values())
        checks = local_checks(pm, plan, inputs, target)
        original = timing.peak_memory
        timing.peak_memory = peak_or_resident(original)
        try:
            rank = timing.measure(pm, inputs, target, steps=steps, warmup=warmup,
                                  optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
        finally:
            timing.peak_memory = original
        # what stays between steps (weights, gradients, optimizer states): the peak less this
        # is the step's transient memory (activations, workspaces, the optimizer's temporaries)
        held = float(torch.cuda.memory_allocated(dev)) if ctx.cuda else None
        reserved = float(torch.cuda.max_memory_reserved(dev)) if ctx.cuda else None
        # a pipeline's receive buffers (runtime.receive_buffers: one per micro-batch in
        # flight and received value or gradient): the peak held at once in the last step
        buffers = getattr(pm.runner, "receive_buffer_bytes", None)
        buffers = float(buffers()) if buffers is not None else None
        rep = timing.report(plan, pm._cap, [rank], steps, warmup)
        predicted = stage_prediction(pm._cap, plan) or {}
        try:
            traced = op_memory(pm, inputs, target, ctx, resident)
        except Exception as e:  # noqa: BLE001 - a diagnostic: the case's numbers stand without it
            traced = {"error": f"{type(e).__name__}: {e}"[:600]}
        del pm
    if ctx.cuda:
        torch.cuda.empty_cache()
    est = plan.estimate
    peak = rank.peak_bytes - resident
    families = {}
    for fam in sorted(set(rank.compute_s) | set(predicted)):
        meas, pred = rank.compute_s.get(fam), predicted.get(fam)
        families[fam] = {"measured_s": meas, "predicted_s": pred,
                         "ratio": meas / pred if meas and pred else None}
    compute_meas = sum(rank.compute_s.values())
    pipelined = plan.pipeline_stages > 1
    # a pipeline plan's estimate is of its busiest stage's compute and its fullest stage's
    # memory (solver.pipeline_price); rank 0 runs stage 0, which under 1F1B holds the most
    # micro-batches in flight and the embedding
    compute_pred = est.compute_s if pipelined else (sum(predicted.values()) if predicted else None)
    out = {"case": case, "plan_source": source, "plan_seconds": plan_s, "build_seconds": build_s,
           "world_size": plan.world_size, "mesh": list(plan.mesh_shape), "mesh_axes": list(plan.mesh_axes),
           "cluster": plan.cluster, "summary": plan.summary(),
           "whole_model_param_bytes": whole_bytes, "local_param_bytes": local_bytes,
           "whole_over_local": whole_bytes / local_bytes if local_bytes else None,
           "checks": checks,
           "peak_bytes": peak, "peak_source": rank.memory_source, "resident_before_bytes": resident,
           "predicted_memory_bytes": est.memory_total, "predicted_memory_terms": dict(est.memory_bytes),
           "memory_ratio": peak / est.memory_total if est.memory_total else None,
           "families": families, "compute_measured_s": compute_meas, "compute_predicted_s": compute_pred,
           "compute_ratio": compute_meas / compute_pred if compute_pred else None,
           "family_prediction": "plan price table (timing.predicted_compute)" if predicted else
                                "none: pricing.prices.plan_prices does not rebuild a pipeline stage's prices",
           "prediction_note": "pipeline: compute_predicted_s is the plan's busiest stage's compute per step and "
                              "predicted_memory_bytes its fullest stage's (solver.pipeline_price); this is stage 0"
                              if pipelined else "the plan's per-device estimate (every rank alike)",
           # rank 0's own prediction (a pipeline's ranks differ: ``memory_bytes`` is the fullest's)
           "predicted_rank0_memory_terms": dict(est.rank_memory_bytes[0]) if est.rank_memory_bytes else None,
           "memory_ratio_rank0": peak / sum(est.rank_memory_bytes[0].values())
           if est.rank_memory_bytes and sum(est.rank_memory_bytes[0].values()) else None,
           "receive_buffer_bytes": buffers,
           "allocated_after_build_bytes": None if built is None else built - resident,
           "allocated_after_steps_bytes": None if held is None else held - resident,
           "max_reserved_bytes": reserved, "op_memory": traced,
           "step_measured_s": rank.step_s, "step_predicted_s": est.step_time_s,
           "timing_report": str(rep)}
    log(f"  {name}: local params {local_bytes / 2**30:.3f} GiB of {whole_bytes / 2**30:.3f} GiB; peak "
        f"{peak / 2**30:.3f} GiB vs plan {est.memory_total / 2**30:.3f} GiB; compute "
        f"{compute_meas * 1e3:.1f} ms vs {(compute_pred or 0) * 1e3:.1f} ms; {checks}")
    return out


def section_scale(ctx, have_ortools: bool, log, error_info, restore_group) -> dict:
    """gpu_check's ``scale`` section: every case, each error recorded and the next one run
    (``error_info``: gpu_check's record of an exception; ``restore_group(device)``: its
    world-1 process group, made again once every case has run and freed its memory)."""
    had_group = dist.is_initialized()
    if ctx.cuda:      # the earlier sections' modules: off the device, its memory is this section's
        ctx.models.clear()
        torch.cuda.empty_cache()
    out = {"goal": "measured/predicted within 10% (peak memory, compute by family); reported, not asserted",
           "process_group": "torch fake process group (collectives return at once; no communication measured)",
           "cases": {}}
    chosen = [c for c in getattr(ctx.args, "scale_cases", "").split(",") if c]   # in the order given
    for name, case in ([(c, cases(ctx.dry)[c]) for c in chosen] if chosen else cases(ctx.dry).items()):
        if ctx.budget.left() < (0 if ctx.dry else 30):
            out["cases"][name] = {"skipped": "time budget spent"}
            continue
        t = time.perf_counter()
        try:
            live = ctx.dry or (ctx.plan_source == "live" and have_ortools)
            out["cases"][name] = run_case(ctx, name, case, live, log)
        except Exception as e:  # noqa: BLE001 - recorded; the next case runs
            out["cases"][name] = error_info(e)
            log(f"  {name}: ERROR {out['cases'][name]['error'][:400]}")
        if ctx.cuda:
            import gc
            gc.collect()
            out["cases"][name]["memory_left_after_bytes"] = torch.cuda.memory_allocated()
            torch.cuda.empty_cache()
        out["cases"][name]["seconds"] = time.perf_counter() - t
        if ctx.cuda:
            torch.cuda.empty_cache()
    if had_group and not dist.is_initialized():
        try:
            restore_group(ctx.device)
        except Exception as e:  # noqa: BLE001 - the cases' results stand; later sections see it
            out["restore_group_error"] = error_info(e)
    return out


def summary_lines(sec: dict) -> list[str]:
    lines = []
    for name, c in sec.get("cases", {}).items():
        if "peak_bytes" not in c:
            lines.append(f"scale {name}: {c.get('error') or c.get('skipped')}"[:240])
            continue
        fams = ", ".join(f"{k} {v['ratio']:.2f}x" for k, v in c["families"].items() if v["ratio"])
        ch = c.get("checks", {})
        bad = "" if ch.get("loss_finite") and ch.get("grads_finite") else " [loss or gradients not finite]"
        held = c.get("allocated_after_steps_bytes")
        held = f" (held between steps {held / 2**30:.2f} GiB)" if held is not None else ""
        lines.append(f"scale {name} (mesh {c['mesh']}): peak {c['peak_bytes'] / 2**30:.2f} GiB{held} vs plan "
                     f"{c['predicted_memory_bytes'] / 2**30:.2f} GiB ({c['memory_ratio']:.2f}x); compute "
                     f"{c['compute_measured_s'] * 1e3:.1f} ms" + (f" ({c['compute_ratio']:.2f}x"
                                                                   + (f": {fams})" if fams else ")")
                                                                   if c["compute_ratio"] else "") + bad)
        om = c.get("op_memory") or {}
        if om.get("phases") and om.get("end_of_forward_bytes") is not None:
            gib = 2**30
            peaks = ", ".join(f"{ph} {r['peak_after_op_bytes'] / gib:.2f} GiB after {r['op']}"
                              for ph, r in om["phases"].items())
            top = ", ".join(f"{r['op']} ({r['phase']}) {r['seconds'] * 1e3:.1f} ms" for r in om["top_ops"][:5])
            lines.append(f"  {name} traced: before the step {om['before_step_bytes'] / gib:.2f} GiB, end of forward "
                         f"{om['end_of_forward_bytes'] / gib:.2f} GiB; highest {peaks}; top ops {top}")
            live = om.get("made_by_forward_live_at_backward") or {}
            if live.get("by_op"):
                lines.append(f"  {name} made by forward, alive at backward: {live['bytes'] / gib:.2f} GiB: " + ", ".join(
                    f"{k} {g['bytes'] / gib:.2f} GiB x{g['count']}" for k, g in list(live["by_op"].items())[:8]))
        elif om.get("error"):
            lines.append(f"  {name} traced: {om['error'][:200]}")
    return lines
