"""autopar: automatic parallelization for PyTorch.

>>> import autopar
>>> plan = autopar.plan(model, (x,), loss_fn, target=y, cluster="4x8xH100")
>>> pm = autopar.parallelize(model, (x,), loss_fn, target=y)   # inside torchrun
"""
from autopar.api import parallelize, plan
from autopar.capture import CaptureError, capture
from autopar.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from autopar.coverage import coverage
from autopar.errors import ArgumentError, AutoparInputError, PinError
from autopar.options import Options
from autopar.plan import Plan, PlanError
from autopar.preemption import Preemption
from autopar.runtime.weights import WeightsError, meta_parameters
from autopar.runtime.updates.hogwild import hogwild

__all__ = ["plan", "parallelize", "Options", "Plan", "PlanError", "CaptureError", "capture", "coverage",
           "save_checkpoint", "load_checkpoint", "CheckpointError", "meta_parameters",
           "WeightsError"]
__all__ += ["AutoparInputError", "ArgumentError", "PinError"]   # autopar.errors
__all__ += ["hogwild"]     # issue 31: Hogwild on one host (autopar.runtime.updates.hogwild)
__all__ += ["Preemption"]    # issue 43: a checkpoint on SIGTERM (autopar.preemption)
