"""The store's parts, one concept each; :class:`tierfs.TieredStore` is the facade over them.

- ``ledger``: what this process knows of every step on every tier (one lock, named operations)
- ``parts``: the tiers in their roles, the ranks and groups, the workers and the throttle
- ``saving``: stage, commit, hand on to the slower tiers
- ``reading``: a rank's shard from a tier, verified, into a sink; reads without collectives
- ``restoring``: the restore plan (one gather) and its execution across ranks
- ``retention``: which steps each tier deletes
"""
