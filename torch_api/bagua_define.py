"""Bagua's ``bagua.bagua_define``: the hyperparameters the autotune service hands a job, and tensor declarations.

Bagua kept this module outside ``torch_api`` (``bagua.bagua_define``); here it is
``bagua_lightning.torch_api.bagua_define``, also importable as ``bagua_lightning.bagua_define``.
"""

from __future__ import annotations

import builtins
import enum
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypedDict

__all__ = ["BaguaHyperparameter", "TensorDeclaration", "TensorDtype", "get_tensor_declaration_bytes"]


class TensorDtype(str, enum.Enum):
    """Element types of declared tensors."""

    F32 = "f32"
    F16 = "f16"
    U8 = "u8"


class TensorDeclaration(TypedDict):
    """One tensor a job communicates: its name, number of elements and element type."""

    name: str
    num_elements: int
    dtype: TensorDtype


_DTYPE_BYTES = {TensorDtype.F32: 4, TensorDtype.F16: 2, TensorDtype.U8: 1}


def get_tensor_declaration_bytes(td: TensorDeclaration) -> int:
    """Size of the declared tensor in bytes."""
    return td["num_elements"] * _DTYPE_BYTES[TensorDtype(td["dtype"])]


@dataclass
class BaguaHyperparameter:
    """The hyperparameters of a job's communication.

    Attributes:
        buckets: tensors grouped into buckets, in communication order.
        bucket_size: bucket size in bytes the buckets were cut to (0: not set).
        is_hierarchical_reduce: reduce inside each node first, then between node leaders.
    """

    buckets: list[list[TensorDeclaration]] = field(default_factory=list)
    bucket_size: int = 0
    is_hierarchical_reduce: bool = False

    def update(self, param_dict: Mapping[str, Any]) -> BaguaHyperparameter:
        """Set the fields named in ``param_dict``; returns ``self``.

        Raises:
            ValueError: a key is not a field (the message lists the fields).
        """
        names = {f.name for f in fields(self)}
        unknown = sorted(set(param_dict) - names)
        if unknown:
            raise ValueError(f"unknown hyperparameters {unknown}; the fields are {sorted(names)}")
        for key, value in param_dict.items():
            setattr(self, key, value)
        return self

    def dict(self) -> builtins.dict[str, Any]:
        """The fields as a plain dict (as pydantic's ``.dict()`` gave in Bagua)."""
        return asdict(self)

    def json(self) -> str:
        """The fields as JSON."""
        return json.dumps(self.dict())

    @classmethod
    def parse_obj(cls, obj: Mapping[str, Any]) -> BaguaHyperparameter:
        """A hyperparameter set from a dict such as :meth:`dict` returns."""
        return cls().update(obj)
