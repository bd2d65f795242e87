"""``DALILoader``: a DALI pipeline as a deterministic, distributed, exactly resumable loader."""

from lightning_loaders.adapters.dali.loader import INSTALL_HINT, DALILoader
from lightning_loaders.adapters.dali.source import FileSamples

__all__ = ["INSTALL_HINT", "DALILoader", "FileSamples"]
