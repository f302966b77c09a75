"""A restore, as one pipeline: :mod:`.plan` (which steps each rank can get, agreed by every rank),
:mod:`.pipeline` (each step's attempt, agreeing, what follows),
:mod:`.sources` (where a rank's shard comes from), :mod:`.sinks` (where its entries go)."""
