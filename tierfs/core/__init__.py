"""The store's parts, one concept each; :class:`tierfs.TieredStore` is the facade over them.

- ``ledger``: what this process knows of every step on every tier (one lock, named operations)
- ``context``: what every path shares: the tiers in their roles, the ledger, ``ownership`` (who the ranks
  are and what they share) and ``background`` (the workers and their failures)
- ``saving``: stage, commit, hand on to the slower tiers; ``catchup``: the copies a crash left undone
- ``timeline``: which steps a save supersedes
- ``restore``: the restore pipeline (``pipeline``: attempts, agreement; ``plan``; ``sources``; ``sinks``)
- ``reads``: reads of any rank's shard without collectives
- ``retention``: which steps each tier deletes
"""
