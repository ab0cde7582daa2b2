"""Communication hooks for torch's own data parallelism (public module ``mixprec.hooks``).

``fp32_accumulate_hook``: for ``torch.nn.parallel.DistributedDataParallel.register_comm_hook``; each
bucket is averaged with the wire in the gradient dtype and the sum in fp32 (one rounding). Example::

    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state=None, hook=mixprec.hooks.fp32_accumulate_hook)

``compressed_hook`` with its state ``CompressedHookState``: a :class:`mixprec.compress.CompressedReducer` on
any compressed wire (uint8 by default; fp8, MXFP8, NVFP4 ... or ``"auto"`` with ``wire=``)::

    ddp.register_comm_hook(mixprec.hooks.CompressedHookState(error_feedback=True), mixprec.hooks.compressed_hook)

Either hook audits its reductions live with ``audit_every=N`` (``FP32HookState(audit_every=N)`` as the fp32
hook's state; ``CompressedHookState(audit_every=N, on_audit=...)``), rows in ``state.audit_rows``.
Deprecated names, importable with a DeprecationWarning: ``Uint8HookState`` (now ``CompressedHookState``),
``uint8_compress_hook`` (now ``compressed_hook``). The hooks live in :mod:`mixprec.integrations`; this module
is their one public path.
"""

import warnings
from typing import Any

from mixprec.integrations.ddp_fp32 import FP32HookState, fp32_accumulate_hook
from mixprec.integrations.ddp_uint8 import CompressedHookState, compressed_hook

__all__ = ["CompressedHookState", "FP32HookState", "compressed_hook", "fp32_accumulate_hook"]

# Old public name -> (the object, its name now). Out of __all__, so ``from mixprec.hooks import *`` does not warn.
_DEPRECATED: dict[str, tuple[Any, str]] = {
    "Uint8HookState": (CompressedHookState, "CompressedHookState"),
    "uint8_compress_hook": (compressed_hook, "compressed_hook"),
}


def __getattr__(name: str) -> Any:
    entry = _DEPRECATED.get(name)
    if entry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    obj, new_name = entry
    warnings.warn(
        f"mixprec.hooks.{name} is deprecated and will be removed in a later release; use mixprec.hooks.{new_name}"
        " (the same object: it takes every compressed wire, not only uint8)",
        DeprecationWarning,
        stacklevel=2,
    )
    return obj


def __dir__() -> list[str]:
    return sorted([*globals(), *_DEPRECATED])
