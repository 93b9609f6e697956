"""`trl_dta._checks`: one-time warnings come from the main process only."""

from __future__ import annotations

import logging

from trl_dta import _checks


def test_warn_once_speaks_once_and_on_the_main_process_only(monkeypatch, caplog):
    keys = ("test:main", "test:replica", "test:every_rank")
    try:
        with caplog.at_level(logging.WARNING, logger="trl_dta"):
            monkeypatch.setenv("RANK", "0")
            _checks.warn_once("test:main", "said on rank 0")
            _checks.warn_once("test:main", "said on rank 0")
            monkeypatch.setenv("RANK", "1")
            assert not _checks.is_main_process()
            _checks.warn_once("test:replica", "not said on rank 1")
            _checks.warn_once("test:every_rank", "said on rank 1 too", every_rank=True)
        assert [r.getMessage() for r in caplog.records] == ["said on rank 0", "said on rank 1 too"]
    finally:
        _checks._warned.difference_update(keys)
