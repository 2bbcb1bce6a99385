"""torchtitan's own Llama 3 (0.3's ``Llama3Model``, tiny: dim 64, 1 layer, 4 heads,
vocabulary 256, sequence 32), model code written outside autopar, on 2 gloo ranks (one
torchrun launch): ZeRO-3 and tensor parallel plans under ``compile=True``, and a data
parallel plan eager (compiled, it is ``benchmarks/compiled_plans.py``'s kind of case: its
kernels cost minutes of a fresh machine), train as one device does (loss, every gradient,
the weights after 3 AdamW steps).

Issue 43: under ZeRO-3 this hung, the two ranks' compiled programs issuing their collectives
in different orders (``ops.collectives.to_partial`` chose by a Python branch on the rank, so
the ranks traced different graphs). The last case puts that branch back and checks that the
program is now refused before it runs, on both ranks, naming the first collective where they
differ (``runtime.collective_order``).

torchtitan is an optional test extra (``pip install torchtitan==0.3.0`` and ``triton``, which
its model modules import: tests/titan_llama.py); without it these tests skip, saying so.
Written for 0.2.0's ``Transformer``; since 2026-11-30 on 0.3.0's model, all four cases
passing (206 CPU s for the launch, a loaded machine, Inductor's cache mostly cold).

Under ``data=2`` the plan multiplies the rotary embedding's complex values replicated by a
partial frequency table; the rewrite treated complex tensors as carrying no gradient (as
ids and masks), so that product's gradient was never summed: wq's and wk's gradients were
one rank's term, 73% off, eager and compiled alike (``TensorMeta.carries_grad`` now counts
complex values: the ``data`` case below).

On a fresh machine Inductor compiles every kernel (no cache yet): the launch, the setup of
the first test, then takes minutes, hence the module's timeout. One layer rather than two:
the cases hold every op kind either way (a second layer repeats the first's kernels), and
the launch's CPU seconds with a cold Inductor cache were 277 against 348 with two layers
(this module's launch, ``launch.torchrun_cases`` of CASES, with TORCHINDUCTOR_CACHE_DIR
an empty folder: the user + system seconds of its processes, 2026-11-29, a loaded machine).
"""
from __future__ import annotations

import pytest
import torch

import titan_llama
from launch import case_result, torchrun_cases

pytestmark = pytest.mark.timeout(1500)

CASES = [
    {"id": "zero3", "pins": {"zero": 3}},          # the reported plan: data 2 (the free mesh), ZeRO-3
    {"id": "data", "pins": {"data": 2}, "compile": False},
    {"id": "tensor", "pins": {"tensor": 2}},
    {"id": "rank-branch", "pins": {"zero": 3}, "rank_branch": True},
]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    why = titan_llama.missing()
    if why:
        pytest.skip(why)
    from autopar.runtime.compiled import COMPILE_FROM_TORCH
    if torch.__version__ < COMPILE_FROM_TORCH:
        pytest.skip(f"compile=True is refused on torch {torch.__version__}")
    return torchrun_cases("titan_worker.py", 2, CASES, tmp_path_factory.mktemp("titan") / "r.json",
                          timeout=1400, case_timeout=600)


@pytest.mark.parametrize("case_id", ["zero3", "data", "tensor"])
def test_torchtitan_llama3_equals_one_device(gloo_results, case_id):
    r = case_result(gloo_results, case_id)      # loss, gradients, weights: tests/equivalence
    compiled = next(c for c in CASES if c["id"] == case_id).get("compile", True)
    assert bool(r["options"].get("compile")) is compiled, r
    if compiled:
        assert r["report"] and r["report"]["compile_s"], r      # the compiled path ran
    if case_id in ("zero3", "tensor"):
        assert r["local_bytes"] < r["model_bytes"], r           # weights sharded
    if case_id == "zero3":
        assert any("S(" in p for p in r["placements"].values()), r


def test_a_rank_dependent_graph_is_refused_not_hung(gloo_results):
    r = case_result(gloo_results, "rank-branch")
    msg = r["refused"]
    assert msg is not None and r["refused_on"] == [True, True], r
    assert "the ranks of one process group would issue different collectives" in msg, msg
    assert "on rank 0, " in msg and "on rank 1, " in msg and "without compile=True" in msg, msg
