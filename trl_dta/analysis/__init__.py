"""`trl-dta analyze` as a library: read rollouts (token ids, conversations, tau2 results, TRL's completion logs) and
estimate what DTA gains on them (compression, speed-up, the rank split, peak memory).

```python
from trl_dta.analysis import SourceOptions, analyze_source

analysis = analyze_source("outputs/completions", SourceOptions(tokenizer="Qwen/Qwen3-1.7B"))
analysis.results[None]["per_batch"]    # each optimizer step's compression, from TRL's `step` column
```
"""

from .analyzer import Analysis, SourceOptions, analyze, analyze_source
from .rollout_io import AnalysisError, layout_rows, load_conversations, load_sequences
from .trl_logs import load_trl_completions

__all__ = ["Analysis", "AnalysisError", "SourceOptions", "analyze", "analyze_source", "layout_rows",
           "load_conversations", "load_sequences", "load_trl_completions"]
