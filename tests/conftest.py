"""Shared fixtures: each example model is built and captured once per test session."""
from __future__ import annotations

import functools
import os

import pytest
from hypothesis import settings

# CI replays the same examples every run (a failure there is reproducible); on a developer's
# machine hypothesis draws new ones each run and keeps finding what CI has not seen.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_configure(config):
    """Compile the repository's sources to bytecode once per session. The environment may
    set PYTHONDONTWRITEBYTECODE, and every torchrun rank and CLI process the tests start
    would then compile autopar, passes, cost_models and examples again (about half a CPU
    second of each process's start). Stale files are never read: Python checks each one
    against its source's mtime and size."""
    import compileall
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in ("autopar", "passes", "cost_models", "examples", "tests"):
        compileall.compile_dir(os.path.join(root, d), quiet=2)

# The files whose tests take longest, longest first (seconds summed from `make test
# PYTEST_ARGS=--durations=40` on a fresh clone, session 24: a module's shared torchrun launch
# or compile counts once). Under `-n 2 --dist loadfile` a file runs whole on one worker, so
# the suite ends when the last file does: started last, test_titan's 4-minute launch left
# one worker idle while the other finished it (xdist's default order is by number of tests).
# Started first, the long files overlap the many short ones (longest-processing-time-first).
LONGEST_FIRST = (
    "test_titan.py", "test_experts.py", "test_losses.py", "test_sweep.py",
    "test_pipeline_runtime.py", "test_capture_cache.py", "test_compile.py",
    "test_checkpoint.py", "test_context_parallel.py", "test_backward_loop.py",
    "test_search_bounds.py", "test_gpu_check.py", "test_elastic.py", "test_elastic_axes.py",
    "test_api.py",
    "test_cli.py", "test_hf_trainer.py", "test_branches.py", "test_offload.py",
    "test_expert_search.py", "test_gloo.py", "test_same_plan.py", "test_precision.py",
    "test_compression.py", "test_collective_order.py", "test_restart.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Run the files of ``LONGEST_FIRST`` first, in its order; the rest keep theirs (the
    Makefile passes ``--no-loadscope-reorder`` so that xdist keeps this order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))


# planning's capture cache (autopar/capture/cache.py) in a folder of this session, never the
# user's ~/.cache/autopar; the CLI processes the tests start inherit it
if not os.environ.get("AUTOPAR_CACHE_DIR"):
    import atexit
    import shutil
    import tempfile
    os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-test-cache-")
    atexit.register(shutil.rmtree, os.environ["AUTOPAR_CACHE_DIR"], True)

# a folder the xdist workers of this run share (tests/launch.py's shared spawns): made by the
# controller before it starts the workers, who inherit the variable; removed at its exit
if os.environ.get("PYTEST_XDIST_WORKER") is None and not os.environ.get("AUTOPAR_TEST_SHARED_DIR"):
    import atexit
    import shutil
    import tempfile
    os.environ["AUTOPAR_TEST_SHARED_DIR"] = tempfile.mkdtemp(prefix="autopar-test-shared-")
    atexit.register(shutil.rmtree, os.environ["AUTOPAR_TEST_SHARED_DIR"], True)

from autopar.capture import capture
from examples.models import EXAMPLES


@functools.lru_cache(maxsize=None)
def example_and_capture(name: str):
    ex = EXAMPLES[name]()
    return ex, capture(ex.model, ex.inputs, ex.loss_fn, ex.target)


def meta_llama_capture(*, n_layer: int, seq: int, vocab: int, hidden_dim: int):
    """A small Llama (dim 32, 4 heads, 2 kv heads) built on the meta device and captured
    with its loss over a batch of 2 sequences of ``seq`` tokens."""
    import torch
    from examples.base import lm_loss
    from examples.llama import Llama, LlamaConfig
    cfg = LlamaConfig(vocab_size=vocab, max_seq_len=seq, n_layer=n_layer, n_head=4, n_kv_head=2,
                      dim=32, hidden_dim=hidden_dim)
    with torch.device("meta"):
        model = Llama(cfg)
    tokens = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return capture(model, (tokens,), lm_loss, target=torch.zeros_like(tokens))


@pytest.fixture
def captured():
    return example_and_capture
