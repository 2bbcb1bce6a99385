"""A plan does not depend on the process's hash seed: the same model planned in two processes
with different ``PYTHONHASHSEED`` values gives the same plan, field by field.

The case is one where it did depend on it: a two-stage pipeline under a memory budget
half-way between recomputing no layer and recomputing every layer, so each rank recomputes
only the fewest alike layers that fit (``solver/partial_recompute.py``). Which of the alike
layers a rank took first came from their bytes-per-second ratios, summed over each layer's
nodes in a set's order: the ratios differed in their last bits with the hash seed
(``transformer.h.0, h.2, h.3`` at seed 0, ``h.0, h.1, h.2`` at seed 1). Llama 3 405B on
16,384 GPUs with Meta's degrees pinned planned 8.20-8.70 s steps by seed for the same reason.
"""
import json
import os
import subprocess
import sys

import autopar
from examples.models import gpt_factory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = 8
SEEDS = ("0", "1")        # two seeds that planned different layers before the fix
PINS = dict(cluster="2xA100", pipeline=2, schedule="1f1b", micro_batch_size=1)

PLAN = f"""
import json, sys
import autopar
from examples.models import gpt_factory

ex = gpt_factory(batch=8, n_layer={LAYERS}, n_embd=32, block_size=64)
budget = int(sys.stdin.readline())      # sent once the test has worked it out
chosen = autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,
                      memory_budget=budget, **{PINS!r}).to_dict()
chosen.pop("solver")       # the solver's report: its timings
print(json.dumps(chosen, sort_keys=True, default=str))
"""


def _half_way() -> int:
    """A budget half-way between the plan recomputing every layer and the one recomputing
    none: each rank recomputes some of its layers."""
    ex = gpt_factory(batch=8, n_layer=LAYERS, n_embd=32, block_size=64)
    plan = lambda **kw: autopar.plan(ex.model, ex.inputs, ex.loss_fn, target=ex.target,  # noqa: E731
                                     **PINS, **kw)
    low, high = plan(recompute="full").estimate.memory_total, plan(recompute="none").estimate.memory_total
    assert low < 0.8 * high, (low, high)            # recomputing saves memory here
    return int((low + high) / 2)


def test_plan_does_not_depend_on_the_hash_seed():
    # each process starts (imports torch and autopar) while this one works out the budget
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    runs = {seed: subprocess.Popen([sys.executable, "-c", PLAN], cwd=ROOT, text=True,
                                   env={**env, "PYTHONHASHSEED": seed}, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for seed in SEEDS}
    try:
        budget = _half_way()
    except BaseException:
        for proc in runs.values():
            proc.kill()
        raise
    plans = {}
    for seed, proc in runs.items():
        out, err = proc.communicate(f"{budget}\n", timeout=240)
        assert proc.returncode == 0, f"planning at PYTHONHASHSEED={seed} failed:\n{err[-3000:]}"
        plans[seed] = json.loads(out.strip().splitlines()[-1])
    a, b = (plans[s] for s in SEEDS)
    # the case happened: a pipeline whose ranks recompute some layers, not all or none
    assert a["pipeline"]["stages"] == 2, a["pipeline"]
    assert 0 < len(a["recompute"]) < LAYERS, a["recompute"]
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    assert not differ, (f"the plan depends on the hash seed: {differ} differ "
                        f"(recompute {a['recompute']} at seed {SEEDS[0]}, "
                        f"{b['recompute']} at seed {SEEDS[1]})")
