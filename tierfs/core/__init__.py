"""The store's parts, one concept each; :class:`tierfs.TieredStore` is the facade over them.

- ``ledger``: what this process knows of every step on every tier (one lock, named operations)
- ``parts``: the tiers in their roles, the ranks and groups, the workers and the throttle
- ``saving``: stage, commit, hand on to the slower tiers; ``catchup``: the copies a crash left undone
- ``timeline``: which steps a save supersedes
- ``restore``: the restore pipeline (``pipeline``: plan, attempts, agreement; ``sources``; ``sinks``)
- ``reads``: reads of any rank's shard without collectives
- ``retention``: which steps each tier deletes
"""
