"""mixprec: numerically robust low-precision training for PyTorch.

The names below are the front door; each also has one home in its subpackage. Subpackages, one per
concern: ``scaling`` (loss scaling, master weights, the updater, the advisor), ``comm`` (fp32-accumulating
collectives, the reducer protocol), ``parallel`` (bucketed data parallel, sharded optimizer), ``compress``
(8-bit gradient compression), ``hooks`` and ``fsdp`` (torch DDP / FSDP2 integrations), ``emulate``
(bit-exact rounding, modelled matmuls), ``kernels`` (GPU kernels), ``lab`` (training runs and studies),
``cli``. ``docs/api.md`` lists every public name; ``docs/architecture.md`` shows how they depend on
each other.
"""

from mixprec.comm import all_reduce_fp32_accumulate, reduce_scatter_fp32_accumulate
from mixprec.compress import compressed_all_reduce
from mixprec.emulate import emulate_linear_layers, round_to
from mixprec.parallel import DistributedDataParallel
from mixprec.scaling import (
    DynamicLossScaler,
    LossScaleFloorError,
    MasterWeightOptimizer,
    StaticLossScaler,
    Updater,
)

__version__ = "0.1.0"

__all__ = [
    "DistributedDataParallel",
    "DynamicLossScaler",
    "LossScaleFloorError",
    "MasterWeightOptimizer",
    "StaticLossScaler",
    "Updater",
    "__version__",
    "all_reduce_fp32_accumulate",
    "compressed_all_reduce",
    "emulate_linear_layers",
    "reduce_scatter_fp32_accumulate",
    "round_to",
]
