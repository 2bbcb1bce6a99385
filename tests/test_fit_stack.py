"""``stage_tables.FitStack``: the stage DP's cost tables worked out when read (each stage its
own table, DualPipeV) read as the whole array they stand for, and the DP's cuts on them the
same as on that array; one fit count per table (``Tables.arrays``) or a fit count per share
(``_by_share``, tables of (count, share) pairs)."""
import numpy as np
import pytest

from autopar.solver.stage_dp import _band_width, stage_dp
from autopar.solver.stage_tables import INF, FitStack, Stack, Tiebreak


def _case(seed: int, n_stages: int, one_each: bool, rows: int = 13, band: int = 0):
    rng = np.random.default_rng(seed)
    j, i = np.indices((rows, rows))
    valid = (j < i) & ((i - j <= band) if band else True)
    time = np.where(valid, rng.uniform(0.5, 2.0, (rows, rows)) * (i - j), INF)
    n = n_stages if one_each else 3
    fits = [np.where(valid, rng.integers(0, n + 1, (rows, rows)), 0) for _ in range(2)]
    pairs = [(int(rng.integers(0, n)), int(rng.integers(0, 2))) for _ in range(n)]
    which = np.arange(n_stages) if one_each else rng.integers(0, n, n_stages)
    whole = Stack(np.stack([np.where(fits[lv] > u, time, INF) for u, lv in pairs]), which)
    return FitStack(time, fits, pairs, which), whole, time, rng.uniform(0, 0.1, rows)


@pytest.mark.parametrize("one_each", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_reads_as_the_whole_array(seed, one_each):
    lazy, whole, time, plus = _case(seed, 4, one_each)
    assert lazy.one_each == one_each
    np.testing.assert_array_equal(np.asarray(lazy), np.asarray(whole))
    for k in range(4):
        np.testing.assert_array_equal(lazy[k], whole[k])
        np.testing.assert_array_equal(lazy[k, 0], whole[k, 0])
        assert lazy[k, 2, 7] == whole[k, 2, 7]
    np.testing.assert_array_equal(lazy.widths(), Stack.widths(whole))
    for u in range(len(whole.tables)):
        np.testing.assert_array_equal(lazy.table(u), whole.tables[u])


@pytest.mark.parametrize("band", [0, 5])
@pytest.mark.parametrize("one_each", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_the_dp_cuts_alike(seed, one_each, band):
    """The DP on the lazy stack and its tiebreak against the whole arrays (a plain
    ``Stack`` of the tiebreak: ``_within``'s other path), bands included."""
    lazy, whole, time, plus = _case(seed, 4, one_each, band=band)
    tie = Tiebreak(lazy, time, plus)
    assert (_band_width(lazy, tie) is None) == (band == 0)
    assert stage_dp(lazy, tie) == stage_dp(whole, Stack(whole.tables + plus, whole.which))
    limit = float(np.median(time[np.isfinite(time)]))
    within = tie.within(limit)
    for k in range(4):
        np.testing.assert_array_equal(within(k), np.where(whole[k] <= limit, whole[k] + plus, INF))
