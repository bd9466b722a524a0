"""GIR rewriting: rule tables (sync, merge, swap) and the greedy driver."""
from powerfusion.rewrite.base import Rewrite
from powerfusion.rewrite.driver import ALL_RULES, TraceStep, clear_memo, measure, optimise
from powerfusion.rewrite.merge_rules import MERGE_RULES
from powerfusion.rewrite.swap_rules import SWAP_RULES
from powerfusion.rewrite.sync_rules import SYNC_RULES

__all__ = ["Rewrite", "TraceStep", "optimise", "measure", "clear_memo", "SYNC_RULES", "MERGE_RULES",
           "SWAP_RULES", "ALL_RULES"]
