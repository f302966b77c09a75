"""Adapters over the store: the Orbax-like manager, the DCP storage layer, the fsspec filesystem, zarr
and tensorstore. Each sits on `tierfs.TieredStore` and never reaches into a tier's internals."""
