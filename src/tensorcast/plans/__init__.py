"""Plans: DAGs of lifecycle operations run by a gateway (builder, pure scheduler, executor, operations)."""

from tensorcast.plans.builder import Plan, PlanOutcome, PlanStep, StepOutput

__all__ = ["Plan", "PlanOutcome", "PlanStep", "StepOutput"]
