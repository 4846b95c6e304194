"""The progress helper: one summary line per phase, a bar only where a person watches (text logs,
terminals), and lines about a repeated state logged once."""

from __future__ import annotations

import io
import logging

import pytest

from inference_service import progress
from inference_service.observability import logging as service_logging


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def json_logs_restored(monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")  # configure() may set it; restored after
    yield
    progress.configure(False)


def test_a_phase_logs_its_time_once_done(caplog):
    with caplog.at_level(logging.INFO, logger="inference_service.progress"), progress.phase("warming up", "warmed up"):
        pass
    [record] = caplog.records
    assert record.getMessage().startswith("warmed up in ") and record.getMessage().endswith("s")


def test_a_failed_phase_says_nothing_of_being_done(caplog):
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(RuntimeError),
        progress.phase("loading weights", "loaded weights"),
    ):
        raise RuntimeError("no weights")
    assert not [r for r in caplog.records if "loaded weights" in r.getMessage()]


def test_no_bar_when_the_output_is_not_a_terminal(capsys, json_logs_restored):
    progress.configure(False)
    with progress.phase("loading weights", "loaded weights", total=2) as phase:
        phase.update(2)
    err = capsys.readouterr().err  # log lines may be there (a handler from another test), a bar not
    assert "%|" not in err and "0/2" not in err


def test_a_bar_on_a_terminal_and_none_with_json_logs(monkeypatch, json_logs_restored):
    stderr = Terminal()
    monkeypatch.setattr("sys.stdout", Terminal())
    monkeypatch.setattr("sys.stderr", stderr)
    progress.configure(False)
    assert progress.bars_enabled()
    with progress.phase("checking the model", "checked the model", total=3) as phase:
        for _ in phase.track(range(3)):
            pass
    assert "checking the model:   0%|" in stderr.getvalue() and "0/3" in stderr.getvalue()

    progress.configure(True)
    assert not progress.bars_enabled()
    with progress.phase("warming up", "warmed up", total=1) as phase:
        phase.update()
    assert "warming up:" not in stderr.getvalue()


def test_a_repeated_state_is_logged_once_until_it_changes(monkeypatch):
    monkeypatch.setattr(service_logging, "_last_states", {})
    levels = [
        service_logging.level_for_state("unavailable", state, logging.INFO)
        for state in ("still loading", "still loading", "still loading", "shutting down", "shutting down")
    ]
    assert levels == [logging.INFO, logging.DEBUG, logging.DEBUG, logging.INFO, logging.DEBUG]
