"""A restore, as one pipeline: :mod:`.pipeline` (the plan, each step's attempt, agreeing, what follows),
:mod:`.sources` (where a rank's shard comes from), :mod:`.sinks` (where its entries go)."""
