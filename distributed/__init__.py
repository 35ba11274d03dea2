"""Bagua's launchers (``bagua.distributed``): ``python -m bagua_lightning.distributed.launch`` and ``baguarun``.

Both take Bagua's flags and start the ranks with torchrun (``torch.distributed.run``).
"""
