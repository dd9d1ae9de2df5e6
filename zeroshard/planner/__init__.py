"""The memory planner behind ``zeroshard estimate``: bytes per GPU, CPU and NVMe for each
stage/offload choice, which ones fit, and the fastest that does."""
from zeroshard.planner.estimate import Choice, Estimate, Hardware, Plan, Workload, all_choices, estimate, plan
from zeroshard.planner.model_shape import ModelShape
from zeroshard.planner.sizes import parse_bytes, parse_count

__all__ = ["Choice", "Estimate", "Hardware", "Plan", "Workload", "ModelShape", "all_choices", "estimate",
           "plan", "parse_bytes", "parse_count"]
