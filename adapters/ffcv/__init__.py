"""``FFCVLoader`` over ``.beton`` files, and ``write_beton`` to make them."""

from lightning_loaders.adapters.ffcv.beton import BetonWriteError, infer_fields, write_beton
from lightning_loaders.adapters.ffcv.loader import FFCV_INSTALL_HINT, FFCVLoader, require_ffcv

__all__ = [
    "FFCV_INSTALL_HINT",
    "BetonWriteError",
    "FFCVLoader",
    "infer_fields",
    "require_ffcv",
    "write_beton",
]
