"""TRL trainers with Dynamic Tree Attention: `DTAGRPOTrainer` and `DTARLOOTrainer`, with their configs."""

from .config import DTAGRPOConfig, DTARLOOConfig
from .grpo import DTAGRPOTrainer
from .rloo import DTARLOOTrainer

__all__ = ["DTAGRPOConfig", "DTAGRPOTrainer", "DTARLOOConfig", "DTARLOOTrainer"]
