"""The contract between trainers and the autotune service.

``autotune/v1/autotune.proto`` is the wire format; :mod:`.plan` holds the same
structures as plain dataclasses (used by the strategy and the tuner alike) and
converts between the two.
"""
