"""fp32-accumulating reduce-scatter for torch FSDP2 (public module ``mixprec.fsdp``). Example::

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    mixprec.fsdp.use_fp32_accumulation(model)   # bf16 on the wire, fp32 sums, one rounding

``FP32AccumulateReduceScatter`` implements FSDP2's ``ReduceScatter`` comm interface; it can also be
passed to ``FSDPModule.set_custom_reduce_scatter`` directly.
"""

from mixprec.integrations.fsdp2 import FP32AccumulateReduceScatter, use_fp32_accumulation

__all__ = ["FP32AccumulateReduceScatter", "use_fp32_accumulation"]
