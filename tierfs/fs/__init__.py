"""``tiered::`` — an fsspec filesystem that puts a RAM directory in front of any other filesystem.

:class:`TieredFileSystem` (``filesystem.py``) is registered with fsspec as the ``tiered`` protocol. Its
drain (``writeback.py``: the RAM directory's files on their way to the target; ``upload.py``: the upload
threads and the work left at exit), the RAM directory (``ramdir.py``), the writer of a RAM file
(``ramfile.py``), listings (``listing.py``) and the checks of its options and paths (``options.py``) are
its own: it works on files, not steps, and does not use the store.
"""

from .filesystem import TieredFileSystem

__all__ = ["TieredFileSystem"]
