"""Communication hooks for torch's own data parallelism (public module ``mixprec.hooks``).

``fp32_accumulate_hook``: for ``torch.nn.parallel.DistributedDataParallel.register_comm_hook``; each
bucket is averaged with the wire in the gradient dtype and the sum in fp32 (one rounding). Example::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state=None, hook=mixprec.hooks.fp32_accumulate_hook)

``uint8_compress_hook`` with its state ``Uint8HookState``: 8-bit min-max compression (mixprec.compress)::

    ddp.register_comm_hook(mixprec.hooks.Uint8HookState(error_feedback=True), mixprec.hooks.uint8_compress_hook)

The hooks live in :mod:`mixprec.integrations`; this module is their one public path.
"""

from mixprec.integrations.ddp_fp32 import fp32_accumulate_hook
from mixprec.integrations.ddp_uint8 import Uint8HookState, uint8_compress_hook

__all__ = ["Uint8HookState", "fp32_accumulate_hook", "uint8_compress_hook"]
