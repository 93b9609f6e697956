"""Everything that runs inside a transformers model: which families DTA runs, the attention it registers, the LM head.

Modules: `families.py` (one row per model family: tested, recurrent mixer, router experts, logit scaling, FLOP
fields, a config rule), `routers.py` (a MoE model's routers: the families whose load-balancing loss DTA reproduces,
the hooks that record their logits), `support.py` (the family rules, the four-token probe against the dense forward,
the refusal), `attention.py` (the registered `"dta"` attention: the engine context a forward carries, the backend
dispatch), `lm_head.py` (the chunked log-prob/entropy head and the families' logit scalings).
"""

from .families import FAMILIES, TESTED_MODEL_TYPES, Family
from .support import check_model_support

__all__ = ["FAMILIES", "TESTED_MODEL_TYPES", "Family", "check_model_support"]
