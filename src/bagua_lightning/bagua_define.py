"""Bagua's ``bagua.bagua_define`` under the package root (it lives in :mod:`bagua_lightning.torch_api.bagua_define`)."""

from bagua_lightning.torch_api.bagua_define import (
    BaguaHyperparameter,
    TensorDeclaration,
    TensorDtype,
    get_tensor_declaration_bytes,
)

__all__ = ["BaguaHyperparameter", "TensorDeclaration", "TensorDtype", "get_tensor_declaration_bytes"]
