"""ZeRO stages as policies over the same flat units (see DESIGN.md, "One mechanism")."""
from zeroshard.stages.stage_policy import StagePolicy, policy_for_stage

__all__ = ["StagePolicy", "policy_for_stage"]
