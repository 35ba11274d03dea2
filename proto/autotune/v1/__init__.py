"""bagua_lightning.autotune.v1: generated messages and service stubs (see codegen.py)."""
