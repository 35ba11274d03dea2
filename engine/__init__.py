"""The engine both front doors drive (runs in every training rank).

``bagua_lightning.strategy`` (Lightning's ``BaguaStrategy``) and ``bagua_lightning.torch_api``
(Bagua's ``with_bagua``) each build an :class:`~bagua_lightning.engine.ddp.AlgorithmDriver` over one
of the algorithms here (:mod:`.algorithms`), with its buckets (:mod:`.buckets`, :mod:`.runners`),
process groups and collectives (:mod:`.comm`, :mod:`.compressed_comm`), MinMax compression
(:mod:`.compression`, Triton kernels in :mod:`.kernels`), peer topology (:mod:`.topology`), the
trainer side of autotuning (:mod:`.autotune`) and the contrib implementations (:mod:`.contrib`);
:mod:`.hooks` offers the compressed allreduce to plain PyTorch DDP. Nothing here imports Lightning
or either front door.
"""
