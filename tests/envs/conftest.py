"""Fixtures of the environment tests (the agent domain itself is `tests/conftest.py`'s `domain`)."""

from __future__ import annotations

import pytest

from trl_dta.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded tiny tokenizer (`trl_dta.tiny`), one per test module."""
    return build_tokenizer()
