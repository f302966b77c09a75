"""Adapters over the store: the Orbax-like manager, the DCP storage layer, zarr and tensorstore, and the
frameworks (Lightning, Hugging Face, torchtitan). Each sits on `tierfs.TieredStore` and never reaches into a
tier's internals. The ``tiered::`` fsspec filesystem is :mod:`tierfs.fs`."""
