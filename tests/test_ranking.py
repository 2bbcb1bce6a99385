"""benchmarks/ranking.py: its statistics (Spearman's rank correlation, the regret of the
predicted best), which rows count toward the goals, Megatron-LM's selective recomputation
policy on a captured graph, and a ``--dry`` run (tiny models) through the whole machinery.
The benchmark itself (published sizes) takes minutes and is not run here."""
import math

import pytest
import torch

from benchmarks.ranking import (DRY_GROUPS, Config, Group, Result, groups, main,
                                megatron_core_attention, ranks, regret, spearman)


def test_ranks_average_ties():
    assert ranks([3.0, 1.0, 2.0]) == [3.0, 1.0, 2.0]
    assert ranks([1.0, 1.0, 2.0]) == [1.5, 1.5, 3.0]
    assert ranks([5.0, 5.0, 5.0]) == [2.0, 2.0, 2.0]


def test_spearman_against_hand_computed_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2, 3) against (1, 3, 2): 1 - 6 * (0 + 1 + 1) / (3 * 8) = 0.5
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    # a tie on one side: ranks (1.5, 1.5, 3) against (1, 2, 3): Pearson's = sqrt(3) / 2
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    assert math.isnan(spearman([1, 1], [1, 2]))       # one distinct predicted value
    assert math.isnan(spearman([1], [1]))
    with pytest.raises(ValueError, match="predicted against"):
        spearman([1, 2], [1])


def test_regret_of_the_predicted_best():
    assert regret([1.0, 2.0, 3.0], [1.0, 1.2, 1.3]) == 0.0          # picks the best
    assert regret([1.0, 2.0, 3.0], [1.1, 1.0, 1.2]) == pytest.approx(0.1)
    # a tie for the predicted best counts as the worst of the tied, measured
    assert regret([1.0, 1.0, 2.0], [1.0, 1.3, 1.1]) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        regret([], [])


def test_rows_with_an_unpriced_technique_are_out_of_the_goal_figures():
    run = groups()[0].configs[0].run
    g = Group("x", "x", "src", "tok/s/GPU", [
        Config("a", run, 100.0), Config("b", run, 200.0), Config("c", run, 300.0, technique="Float8")])
    # predicted: a and b in the measured order, c (Float8) wildly off
    res = Result(g, predicted=[110.0, 190.0, 1.0], errors=["", "", ""])
    assert res.goal_rows() == [0, 1]
    rho, reg = res.figures(res.goal_rows())
    assert rho == pytest.approx(1.0) and reg == 0.0
    rho_all, reg_all = res.figures([0, 1, 2])
    # time ranks, predicted (2, 1, 3) against measured (3, 2, 1): 1 - 6 * 6 / 24
    assert rho_all == pytest.approx(-0.5)
    # time per token: b is predicted best, c measured best: regret 300 / 200 - 1
    assert reg_all == pytest.approx(0.5)
    res_failed = Result(g, predicted=[110.0, math.nan, 1.0], errors=["", "boom", ""])
    assert res_failed.goal_rows() == [0]
    assert all(math.isnan(x) for x in res_failed.figures(res_failed.goal_rows()))


def test_every_row_has_a_source_and_a_measurement():
    every = groups()
    assert len({g.key for g in every}) == len(every)
    for g in every:
        assert g.source and g.unit in ("s/step", "ms/layer", "tok/s/GPU", "TFLOP/s/GPU")
        assert len(g.configs) >= 2
        for c in g.configs:
            assert c.measured > 0 and c.run.source
            assert c.run.tensor * c.run.pipeline * c.run.data == c.run.gpus
            # the global batch splits into micro-batches over the data ranks
            assert c.run.batch % (c.run.data * c.run.micro) == 0, (g.key, c.label)
    # issue 39: at least 10 groups and 80 configurations
    assert len(every) >= 10 and sum(len(g.configs) for g in every) >= 80


def test_megatron_selective_recomputation_is_the_core_attention():
    """Korthikanti et al. 2022, Sec. 5: QK^T, softmax, softmax dropout and attention over V
    (with the scores' scaling and mask), in every layer; never the projections, the MLP or
    the attention output's dropout."""
    from autopar.capture import capture
    from benchmarks.published_runs import MegatronGPT
    from examples.base import lm_loss
    with torch.device("meta"):
        model = MegatronGPT(2, 64, 4, 128, 16)
    tokens = torch.zeros(2, 16, dtype=torch.long, device="meta")
    cap = capture(model, (tokens,), lm_loss, target=torch.zeros_like(tokens))
    nodes = {n.name: n for n in cap.gm.graph.nodes}
    again = megatron_core_attention(cap)
    ops = sorted(str(nodes[n].target).split(".")[1] for n in again)
    per_layer = ["dropout", "masked_fill", "matmul", "matmul", "mul", "ones", "softmax",
                 "transpose", "triu"]        # k^T: a view the scores read
    assert ops == sorted(per_layer * 2)
    assert not any(nodes[n].target is torch.ops.aten.linear.default for n in again)


def test_dry_run_prices_every_row():
    results = main(["--dry"])
    assert [r.group.key for r in results] == list(DRY_GROUPS)
    for r in results:
        assert r.errors == [""] * len(r.group.configs)
        assert all(p > 0 and math.isfinite(p) for p in r.predicted)
    layer = {c.label: p for c, p in zip(results[0].group.configs, results[0].predicted)}
    # recomputing the whole layer costs more than recomputing its core attention, which
    # costs more than recomputing nothing
    assert layer["baseline with recompute"] > layer["selective recompute"] \
        > layer["baseline no recompute"]


def test_float8_rows_are_priced_in_fp8_with_their_recipe():
    """Every configuration that trained in Float8 (torchtitan's tables) is pinned
    ``precision="fp8"`` with the recipe its label names (tensorwise unless rowwise), and is a
    goal row unless it also ran AsyncTP (not priced); the bf16 rows stay bf16."""
    from published_runs import pins_of
    n = 0
    for g in groups():
        for c in g.configs:
            pins = pins_of(c.run)
            if "float8" in c.label.lower():
                n += 1
                want = "rowwise" if "rowwise" in c.label else "tensorwise"
                assert (pins["precision"], pins["fp8_scaling"]) == ("fp8", want), c.label
                assert "Float8" not in c.technique
                assert c.technique == ("AsyncTP" if "async" in c.label else ""), c.label
            else:
                assert pins["precision"] == "bf16", c.label
    assert n == 2 + 4 + 4
