"""What every benchmark runs on: the models (`models.py`, built through the package's families table), process
isolation (`isolation.py`), peak memory (`memory.py`), the per-sequence oracle check (`oracle.py`) and the scripts'
command-line helpers (`cli.py`)."""
