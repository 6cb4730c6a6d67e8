"""Model weights: safetensors checkpoints read lazily and rank by rank, tensor-parallel rules."""

from tensorcast.weights.rules import register_rules, rules_for
from tensorcast.weights.safetensors import Checkpoint, CheckpointTensor, open_checkpoint

__all__ = ["Checkpoint", "CheckpointTensor", "open_checkpoint", "register_rules", "rules_for"]
