"""TRL trainers with Dynamic Tree Attention: `DTAGRPOTrainer` and `DTARLOOTrainer`, with their configs."""

from .grpo import DTAGRPOConfig, DTAGRPOTrainer
from .rloo import DTARLOOConfig, DTARLOOTrainer

__all__ = ["DTAGRPOConfig", "DTAGRPOTrainer", "DTARLOOConfig", "DTARLOOTrainer"]
