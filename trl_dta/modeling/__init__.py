"""Everything that runs inside a transformers model: which families DTA runs, the attention it registers, the LM head.

Modules: `support.py` (the family rules, the four-token probe against the dense forward, the refusal),
`attention.py` (the registered `"dta"` attention: the engine context a forward carries, the backend dispatch),
`lm_head.py` (the chunked log-prob/entropy head and the families' logit scalings).
"""

from .support import TESTED_MODEL_TYPES, check_model_support

__all__ = ["TESTED_MODEL_TYPES", "check_model_support"]
