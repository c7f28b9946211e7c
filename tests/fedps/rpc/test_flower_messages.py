"""Tests for fedps.rpc.flower_messages: what the Flower strategy and nodes exchange round-trips,
and a malformed payload is refused with a clear error, never half-parsed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedps.errors import InvalidArgumentError
from fedps.rpc.flower_messages import (
    STAGE_KEY,
    STAGES,
    FlowerTask,
    Registration,
    RoundReport,
    stage_of,
)

_text = st.text(min_size=1, max_size=40)
_count = st.integers(min_value=0, max_value=2**40)
_real = st.floats(min_value=0, max_value=1e9, allow_nan=False)


@given(
    st.builds(
        FlowerTask,
        round=_count,
        version=_count,
        deadline_unix=_real,
        weight_scale=_real,
        context_id=_text,
        client_id=_text,
        run_id=_text,
    )
)
def test_task_round_trips(task: FlowerTask) -> None:
    # Prepare / Execute
    parsed = FlowerTask.from_record(task.to_record())
    # Assert
    assert parsed == task


@given(
    st.builds(
        RoundReport,
        round=_count,
        trained=st.booleans(),
        bytes_pushed=_count,
        budget_exhausted=st.booleans(),
        weight=_real,
        epsilon=_real,
        delta=st.floats(min_value=0, max_value=0.5),
        num_examples=_count,
    )
)
def test_report_round_trips_through_metric_values(report: RoundReport) -> None:
    # Prepare
    metrics = report.to_metrics()
    # Execute
    parsed = RoundReport.from_metrics(metrics)
    # Assert: Flower's MetricRecord holds only ints and floats
    assert parsed == report
    assert all(type(v) in (int, float) for v in metrics.values())


def test_registration_round_trips() -> None:
    # Prepare
    reg = Registration(signing_key=bytes(range(32)), name="flower-0", num_examples=9, num_params=7)
    # Execute / Assert
    assert Registration.from_record(reg.to_record()) == reg


def test_registration_carries_the_token_but_never_shows_it() -> None:
    # Prepare
    token = "client-0." + "ab" * 32
    reg = Registration(bytes(range(32)), "flower-0", 9, 7, enrolment_token=token)
    # Execute
    parsed = Registration.from_record(reg.to_record())
    # Assert
    assert parsed.enrolment_token == token
    assert token not in repr(parsed)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("round", "1", "'round' must be int"),
        ("round", True, "'round' must be int"),
        ("round", -1, "'round' must be >= 0"),
        ("deadline", float("nan"), "'deadline' must be finite"),
        ("client-id", b"c", "'client-id' must be str"),
    ],
)
def test_malformed_task_is_refused(key: str, value: object, message: str) -> None:
    # Prepare
    record: dict[str, object] = {
        **FlowerTask(1, 0, 10.0, 5.0, "ctx", "client-0", "run").to_record(),
        key: value,
    }
    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match=message):
        FlowerTask.from_record(record)


def test_missing_field_is_refused() -> None:
    # Prepare
    record = dict(Registration(b"k" * 32, "n", 1, 1).to_record())
    del record["num-params"]
    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match="'num-params' must be int"):
        Registration.from_record(record)


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_is_read_back(stage: str) -> None:
    # Prepare
    record = {**FlowerTask(1, 0, 10.0, 5.0, "ctx", "client-0", "run").to_record(), STAGE_KEY: stage}
    # Execute / Assert
    assert stage_of(record) == stage


@pytest.mark.parametrize(
    ("value", "message"),
    [(None, "'stage' must be str"), ("fedps_register", "'stage' must be one of")],
)
def test_an_unknown_stage_is_refused(value: object, message: str) -> None:
    # Prepare
    record: dict[str, object] = {STAGE_KEY: value}
    # Execute / Assert
    with pytest.raises(InvalidArgumentError, match=message):
        stage_of(record)
