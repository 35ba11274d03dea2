"""Examples to copy, shipped as ``bagua_lightning.examples``.

* :mod:`bagua_lightning.examples.demo`: the main job (``bagua-lightning demo`` runs it twice): a
  Lightning fit on several processes with ``BaguaStrategy(autotune=True)`` and a ``CachedDataset``.
* :mod:`bagua_lightning.demo_report`: its summary and plot, from the JSON a job writes (no torch).
"""
