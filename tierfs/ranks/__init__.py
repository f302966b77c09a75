"""Who else is saving: the ranks of the job (:mod:`~tierfs.ranks.groups`), agreeing or raising across them
(:mod:`~tierfs.ranks.agree`), and which of them share a RAM directory (:mod:`~tierfs.ranks.nodes`)."""

from .agree import agree, agreement, check, check_started, outcomes, ranks_failed
from .collectives import framed
from .groups import DEFAULT_TIMEOUT, GATHER_WIDTH, Group, SingleProcess, TorchGroup, default_group, seconds
from .nodenumbers import env_node_rank

__all__ = ["DEFAULT_TIMEOUT", "GATHER_WIDTH", "Group", "SingleProcess", "TorchGroup", "agree", "agreement",
           "check", "check_started", "default_group", "env_node_rank", "framed", "outcomes", "ranks_failed", "seconds"]
