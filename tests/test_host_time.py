"""The host-time term of eager GPU programs (``cost_models.host``) against the committed GPU
check reports: the GPT (held out: the constant comes from the Llama on the H100) within
25% of its measured step once host time is priced, and far outside it without."""
import pytest

from autopar.cost_models.host import GPU_HOST_OP_S, host_time, node_dispatches, step_dispatches
from autopar.cost_models.step import step_time


def test_gpt_step_within_25_percent_of_the_committed_measurements():
    import benchmarks.host_time as ht
    rows = ht.rows()
    gpt = [r for r in rows if r["model"] == "gpt"]
    assert len(gpt) == 3 and all(r["held_out"] for r in gpt)
    for r in gpt:
        assert abs(r["error_before"]) > 0.5, r          # the device side alone: off by 3x
        assert abs(r["error_after"]) <= 0.25, r
    llama = [r for r in rows if r["model"] == "llama"]
    for r in llama:                                     # two of three held out
        assert abs(r["error_after"]) <= 0.25, r


def test_host_time_rules():
    assert node_dispatches("<built-in function getitem>") == (0.0, 0.0)
    assert node_dispatches("aten.some_unlisted_op.default") == (1.0, 1.0)
    f, b = node_dispatches("aten.linear.default")
    assert 5 < f < 7 and 11 < b < 13
    one = step_dispatches(["aten.linear.default"], optimizer_states=1)
    assert one == pytest.approx(f + b + 3)
    # recomputation runs the forward again; micro-batches repeat forward and backward
    assert step_dispatches(["aten.linear.default"], ["aten.linear.default"], optimizer_states=1) \
        == pytest.approx(2 * f + b + 3)
    assert step_dispatches(["aten.linear.default"], optimizer_states=1, microbatches=2) \
        == pytest.approx(2 * (f + b) + 3)
    assert host_time(1000, GPU_HOST_OP_S) == pytest.approx(1000 * GPU_HOST_OP_S)
    assert host_time(1000, GPU_HOST_OP_S, compiled=True) < host_time(1000, GPU_HOST_OP_S)
    assert host_time(1000, 0.0) == 0.0
    assert step_time(3.0, 2.0) == 3.0 and step_time(2.0, 3.0) == 3.0
