"""Fixtures of the environment tests (the agent domain itself is `tests/conftest.py`'s `domain`)."""

from __future__ import annotations

import pytest

from trl_dta.demos.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded tiny tokenizer (`trl_dta.demos.tiny`), one per test module."""
    return build_tokenizer()
