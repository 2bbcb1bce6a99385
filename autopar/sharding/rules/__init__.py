"""Sharding rules by op family; importing this package fills the registry.

The order is the registration order: where two families name the same op, the later wins.
"""
from autopar.sharding.rules import pointwise  # noqa: F401
from autopar.sharding.rules import matmul  # noqa: F401
from autopar.sharding.rules import reductions  # noqa: F401
from autopar.sharding.rules import norms  # noqa: F401
from autopar.sharding.rules import attention  # noqa: F401
from autopar.sharding.rules import conv  # noqa: F401
from autopar.sharding.rules import views  # noqa: F401
from autopar.sharding.rules import embedding  # noqa: F401
from autopar.sharding.rules import losses  # noqa: F401
from autopar.sharding.rules import misc  # noqa: F401
from autopar.sharding.rules import hf_masks  # noqa: F401
from autopar.sharding.rules import experts  # noqa: F401
from autopar.sharding.rules import scatters  # noqa: F401
