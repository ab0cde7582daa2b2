"""Adapters for torch's own data parallelism, above ``parallel`` and ``compress``.

``ddp_fp32`` (``fp32_accumulate_hook``) and ``ddp_uint8`` (``compressed_hook``, every compressed wire; the
module keeps its first name) hold the communication hooks for ``torch.nn.parallel.DistributedDataParallel``,
``ddp_reducer`` one hook for any registered reducer (the trainer adapters ``accelerate``, ``lightning``),
``fsdp2`` the reduce-scatter for FSDP2's ``fully_shard``. Users reach them through the public modules
``mixprec.hooks`` and ``mixprec.fsdp``; nothing below this package imports it.
"""
