"""Adapters for torch's own data parallelism, above ``parallel`` and ``compress``.

``ddp_fp32`` and ``ddp_uint8`` hold the communication hooks for ``torch.nn.parallel.DistributedDataParallel``,
``fsdp2`` the reduce-scatter for FSDP2's ``fully_shard``. Users reach them through the public modules
``mixprec.hooks`` and ``mixprec.fsdp``; nothing below this package imports it.
"""
