"""``compile=True``: each rank's programs through torch.compile (``autopar.runtime.compiled``).

On real gloo ranks (one torchrun launch, 2 processes): the free plan of the small GPT, a
ZeRO-3 and a pipeline plan compiled with Inductor train as one device does, every program
compiled (its compile seconds reported), ZeRO-3's weights gathered again in the compiled
backward. The other compiled cases of ``tests/compile_worker.py`` (tensor, a transformers
Llama under tensor=2, Mixtral's experts split by all-to-all and by all-gather, a zero-bubble
pipeline, ZeRO-Offload, compressed gradient reduction, branch parallelism) are
``benchmarks/compiled_plans.py``'s: on a fresh machine every case compiles its own kernels,
minutes of this 2-core machine for them all. In process: a graph break is an error naming
the program's node; simulated (thread) ranks are refused; the option is checked like any
other; the cost model prices fused memory-bound ops, and only those.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import autopar
from autopar.errors import ArgumentError, PinError
from autopar.options import Options
from autopar.runtime.compiled import CompiledProgram, CompileError, check_compilable
from compile_worker import CASES as ALL_CASES, check_compiled
from launch import case_result, torchrun_cases

# a cold Inductor cache (a fresh machine) compiles every kernel: the launch below, setup of
# the first test, takes minutes
pytestmark = pytest.mark.timeout(1200)

# make test runs these; benchmarks/compiled_plans.py runs every case of
# compile_worker.CASES (tensor, transformers' Llama, Mixtral's experts both ways, a
# zero-bubble pipeline, offload, compression, branches): each compiles its own kernels, and
# Inductor's first compile of a kernel costs this 2-core machine seconds (minutes a launch)
CORE = ("free", "zero3", "pipeline", "zero3-graphs")
CASES = [c for c in ALL_CASES if c["id"] in CORE]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    from autopar.runtime.compiled import COMPILE_FROM_TORCH
    if torch.__version__ < COMPILE_FROM_TORCH:
        pytest.skip(f"compile=True is refused on torch {torch.__version__} "
                    "(test_torch_before_2_11_is_refused)")
    return torchrun_cases("compile_worker.py", 2, CASES, tmp_path_factory.mktemp("compile") / "r.json",
                          timeout=1100, case_timeout=500)


@pytest.mark.parametrize("case_id", [c["id"] for c in CASES])
def test_compiled_plans_equal_one_device(gloo_results, case_id):
    check_compiled(case_result(gloo_results, case_id))    # loss, gradients, weights equal


def test_compiled_zero3_gathers_weights_again_in_backward(gloo_results):
    """Saved, the gathered weights would be gathered once a step (each rank sending its
    shards once); recomputed in the compiled backward (``ops.collectives.all_gather``), the
    weights backward reads are sent again."""
    r = case_result(gloo_results, "zero3")
    assert r["sharded_numel"] > 0 and r["gathers"] > 0, r
    assert r["gathered_numel"] > r["sharded_numel"], r


def _graph_with_a_break() -> fx.GraphModule:
    def breaks(x):
        torch._dynamo.graph_break()
        return x
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    z = g.call_function(breaks, (y,))
    z.name = "the_breaking_node"
    g.output(g.call_function(operator.add, (z, 1.0)))
    return fx.GraphModule(torch.nn.Module(), g)


def test_a_graph_break_names_the_node():
    program = CompiledProgram(_graph_with_a_break(), "train")
    with pytest.raises(CompileError, match=r"node 'the_breaking_node' \(breaks\) of this rank's "
                                           r"train program.*without compile=True"):
        program(torch.ones(3))


def test_thread_ranks_are_refused():
    from autopar.ops.comm import ThreadWorld
    with pytest.raises(ArgumentError, match="compile=True runs on torch.distributed ranks"):
        check_compilable(ThreadWorld((2,)).comm(0), version="2.13.0")


def test_torch_before_2_11_is_refused():
    """compile=True is checked on torch 2.11 and later (``COMPILE_FROM_TORCH``): an older
    torch is refused before anything runs; 2.11 itself passes the check."""
    from autopar.ops.comm import ThreadWorld
    with pytest.raises(ArgumentError, match=r"compile=True needs torch >= 2.11 \(this is 2.10.0\+cu128"):
        check_compilable(ThreadWorld((2,)).comm(0), version="2.10.0+cu128")
    with pytest.raises(ArgumentError, match="compile=True runs on torch.distributed ranks"):
        check_compilable(ThreadWorld((2,)).comm(0), version="2.11.0+cu130")


def test_a_compiled_autograd_function_keeps_its_gradient():
    """An autograd function whose output is also one of its forward's intermediates (a
    ``contiguous()`` of a contiguous block, as ``ops.collectives._slice`` returns): torch 2.11's
    Dynamo sent its gradient elsewhere and the backward ran on zeros, unless the output is a
    tensor of its own (``ops.collectives._own``, identity on torch >= 2.13)."""
    from autopar.ops.collectives import _own

    class FirstHalf(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return _own(x.chunk(2, dim=0)[0].contiguous())

        @staticmethod
        def backward(ctx, g):
            return torch.cat([g, torch.zeros_like(g)])

    def loss(x, w):
        return (FirstHalf.apply(x) * w).sum()
    x, w = torch.randn(4, 3), torch.arange(1.0, 7.0).view(2, 3)
    want = torch.cat([w, torch.zeros_like(w)])
    torch._dynamo.reset()
    xc = x.clone().requires_grad_()
    torch.compile(loss, fullgraph=True, backend="aot_eager")(xc, w).backward()
    assert torch.equal(xc.grad, want), xc.grad


def test_the_option_is_checked_and_eager_is_its_default():
    assert Options.from_pins({"compile": False}) == Options()
    assert Options.from_pins({"compile": True}).compile is True
    with pytest.raises(PinError, match="compile='yes'"):
        Options.from_pins({"compile": "yes"})


def test_compiled_plans_price_fused_memory_bound_ops():
    """Compiled, GPT's device side is predicted faster (its layer norms, GELU, residual adds
    and softmax read fused inputs) and its matmuls cost the same; an MLP of matmuls and GELUs
    alone has nothing to fuse (every GELU reads a matmul's output).

    The host's dispatch (``cost_models.host``) is priced too: a compiled program pays
    ``COMPILED_HOST_FRACTION`` (0.99) of the eager program's ATen calls, the committed GPU
    reports' compiled over eager step (Inductor fuses the pointwise ops, yet its kernel
    launches, the autograd engine and the eager optimizer remain). These tiny models are
    host-bound on an H100 (a step of ~4.8 ms of dispatch against ~0.5 ms on the device), so
    each step is ``max(device, host)`` and compiling saves the host's 1%, not the fusion's
    gain; the fusion shows on the device side (``compute_s``)."""
    from examples.models import EXAMPLES
    from autopar.cost_models.compute import FUSABLE, family
    from autopar.cost_models.hardware import parse_cluster
    from autopar.pricing.costing import CostModel
    from autopar.pricing.prices import fused_reads
    from autopar.pricing.problem import build_problem
    from autopar.capture import capture

    from autopar.cost_models.host import COMPILED_HOST_FRACTION
    from autopar.cost_models.step import step_time

    def steps(name):
        ex = EXAMPLES[name](batch=8, seed=0)
        return [autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster="1x1xH100",
                             compile=c).estimate for c in (None, True)]

    def host_priced(eager, compiled):
        """Fewer host calls compiled, each step the longer of its device side and its host."""
        assert eager.host_s > 0
        assert compiled.host_s == pytest.approx(COMPILED_HOST_FRACTION * eager.host_s, rel=1e-12)
        for e in (eager, compiled):
            assert e.step_time_s == pytest.approx(step_time(e.compute_s + e.comm_s, e.host_s))
        assert compiled.step_time_s < eager.step_time_s
    eager, compiled = steps("gpt")
    assert compiled.compute_s < 0.95 * eager.compute_s, (eager, compiled)
    host_priced(eager, compiled)
    ex = EXAMPLES["gpt"](batch=8, seed=0)
    cap = capture(ex.model, ex.inputs, ex.loss_fn, target=ex.target)
    problem = build_problem(cap, (1,))
    fused = fused_reads(problem)
    fams = {name: family(problem.vars[name].call.op) for name in fused}
    assert fused and all(f in FUSABLE for f in fams.values()), fams
    cl = parse_cluster("1x1xH100")
    model = {c: CostModel.for_pins(cl, (1,), Options(compile=c or None)) for c in (False, True)}
    for name, v in problem.vars.items():
        if v.kind == "op" and family(v.call.op) not in FUSABLE:
            combo = v.options[0]
            assert model[False].base_time(v, combo) == model[True].base_time(v, combo), name
    eager, compiled = steps("mlp")
    assert compiled.compute_s == pytest.approx(eager.compute_s, rel=1e-9)
    host_priced(eager, compiled)


def test_cuda_graphs_option_checked_and_selected_by_device():
    """``compile="reduce-overhead"``: torch.compile's mode of that name (Inductor's CUDA
    graph trees) on CUDA ranks; elsewhere compile=True's options and a warning that says so."""
    from autopar.runtime.compiled import INDUCTOR_OPTIONS, cuda_graphs_note, inductor_options
    assert Options.from_pins({"compile": "reduce-overhead"}).compile == "reduce-overhead"
    with pytest.raises(PinError, match="compile='max-autotune'.*'reduce-overhead'"):
        Options.from_pins({"compile": "max-autotune"})
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert inductor_options("reduce-overhead", cuda) == {**INDUCTOR_OPTIONS, "triton.cudagraphs": True}
    for mode, dev in ((True, cuda), ("reduce-overhead", cpu), (True, cpu)):
        assert inductor_options(mode, dev) == INDUCTOR_OPTIONS, (mode, dev)
    assert "runs on cpu" in cuda_graphs_note("reduce-overhead", cpu)
    assert cuda_graphs_note("reduce-overhead", cuda) is None and cuda_graphs_note(True, cpu) is None


def test_cuda_graphs_are_priced_as_replays():
    """Replayed as CUDA graphs, a step's host time is its two replays, its inputs copied in,
    each parameter's gradient rebuilt and accumulated, and the optimizer's foreach calls
    (``cost_models.host.graphs_dispatches``), not every op's dispatch: the small GPT, host
    bound on an H100 under compile=True, is predicted faster; its device side is
    compile=True's. On a CPU cluster nothing changes (CPU ranks price no host term)."""
    from examples.models import EXAMPLES
    from autopar.cost_models.host import GPU_HOST_OP_S, OPTIMIZER_DISPATCHES
    ex = EXAMPLES["gpt"](batch=8, seed=0)

    def plan(mode, cluster="1x1xH100"):
        return autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target, cluster=cluster,
                            compile=mode)
    compiled, graphs = plan(True), plan("reduce-overhead")
    n_params = len(set(graphs.params.values()))     # tied weights: one gradient
    want = (2 + 2 + 2 * n_params + OPTIMIZER_DISPATCHES[2]) * GPU_HOST_OP_S  # x and target
    assert graphs.estimate.host_s == pytest.approx(want, rel=1e-12)
    assert graphs.estimate.host_s < 0.5 * compiled.estimate.host_s, (graphs.estimate, compiled.estimate)
    assert graphs.estimate.compute_s == pytest.approx(compiled.estimate.compute_s, rel=1e-9)
    assert graphs.estimate.step_time_s < compiled.estimate.step_time_s
    assert graphs.options.compile == "reduce-overhead"
    on_cpu = plan("reduce-overhead", "cpu:1")
    assert on_cpu.estimate.host_s == 0
