"""Communication hooks for torch's own data parallelism (public module ``mixprec.hooks``).

``fp32_accumulate_hook``: for ``torch.nn.parallel.DistributedDataParallel.register_comm_hook``; each
bucket is averaged with the wire in the gradient dtype and the sum in fp32 (one rounding). Example::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state=None, hook=mixprec.hooks.fp32_accumulate_hook)

``uint8_compress_hook`` with its state ``Uint8HookState``: 8-bit min-max compression (mixprec.compress)::

    ddp.register_comm_hook(mixprec.hooks.Uint8HookState(error_feedback=True), mixprec.hooks.uint8_compress_hook)

Either hook audits its reductions live with ``audit_every=N`` (``mixprec.hooks.FP32HookState(audit_every=N)``
as the fp32 hook's state; ``Uint8HookState(audit_every=N)``).

The hooks live in :mod:`mixprec.integrations`; this module is their one public path.
"""

from mixprec.integrations.ddp_fp32 import FP32HookState, fp32_accumulate_hook
from mixprec.integrations.ddp_uint8 import Uint8HookState, uint8_compress_hook

__all__ = ["FP32HookState", "Uint8HookState", "fp32_accumulate_hook", "uint8_compress_hook"]
