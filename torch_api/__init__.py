"""Bagua's own API (``bagua.torch_api``), module for module, over bagua-lightning's engine.

A Bagua script migrates by changing ``bagua.torch_api`` to ``bagua_lightning.torch_api`` in its imports.
"""
