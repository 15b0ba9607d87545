"""The static device-map compiler: roles x stages x parallel sizes x cluster -> slots, rank groups, memory.

Runs on login nodes: imports only the standard library and hpcrl.config (no torch).
"""
from hpcrl.placement.compiler import compile_plan
from hpcrl.placement.errors import PlacementError
from hpcrl.placement.plan import STAGES, Plan, RolePlan, StagePlan
from hpcrl.placement.render import format_plan

__all__ = ["compile_plan", "Plan", "RolePlan", "StagePlan", "STAGES", "PlacementError", "format_plan"]
