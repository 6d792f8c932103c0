"""StepRecorder: per-request TPOT and the pure-decode window, from synthetic StepOutputs."""

from __future__ import annotations

import pytest
from benchlib.step_timing import StepRecord, StepRecorder

from tokenmill.messages import RequestOutput, SchedulerStats


def stats(num_steps: int, step_s: float, model_s: float) -> SchedulerStats:
    return SchedulerStats(2, 0, 0.1, 0, 0, 0, num_steps=num_steps, step_time_s=step_s, model_time_s=model_s)


def record(t: float, ids: list[str], finished: tuple[str, ...] = (), report: SchedulerStats | None = None):
    return StepRecord(t, ids, len(ids), list(finished), report)


def test_decode_window_starts_after_every_request_has_a_token_and_ends_at_the_first_finish():
    recorder = StepRecorder(
        [
            record(0.0, ["a"]),  # b still prefilling
            record(1.0, ["a", "b"], report=stats(2, 5.0, 1.0)),  # b's first token: the window starts after this
            record(1.5, ["a", "b"], report=stats(9, 9.0, 9.0)),  # first report in the window: may cover older steps
            record(2.0, ["a", "b"]),
            record(2.5, ["a", "b"], report=stats(2, 1.0, 0.9)),
            record(3.0, ["a", "b"], finished=("a",), report=stats(1, 0.5, 0.45)),
            record(9.0, ["b"], finished=("b",)),  # after the first finish: not a full batch any more
        ]
    )
    window = recorder.decode_window({"a", "b"})
    assert window.batch_size == 2
    assert window.num_steps == 4
    assert window.wall_step_time_s == pytest.approx(0.5)
    assert window.stats_steps == 3
    assert window.step_time_s == pytest.approx(0.5)
    assert window.model_time_s == pytest.approx(0.45)
    assert window.overhead_fraction == pytest.approx(0.1)
    assert window.loop_overhead_fraction == pytest.approx(0.1)


def test_decode_window_rejects_a_batch_that_never_fully_decodes():
    recorder = StepRecorder([record(0.0, ["a"]), record(1.0, ["a"])])
    with pytest.raises(ValueError, match="produced a token"):
        recorder.decode_window({"a", "b"})
    partial = StepRecorder([record(0.0, ["a", "b"]), record(1.0, ["a"]), record(2.0, ["a", "b"], ("a", "b"))])
    with pytest.raises(ValueError, match="every request"):
        partial.decode_window({"a", "b"})


def test_tpot_is_time_between_first_and_last_token_over_the_gaps():
    recorder = StepRecorder()
    for t, ids in ((0.0, ["a"]), (1.0, ["a", "b"]), (3.0, ["a", "b"]), (4.0, ["b"])):
        recorder.records.append(record(t, ids))
    assert sorted(recorder.tpots_s()) == [pytest.approx(1.5), pytest.approx(1.5)]


def test_recorder_reads_step_outputs():
    from tokenmill.messages import StepOutputs

    recorder = StepRecorder()
    recorder(
        StepOutputs(
            [RequestOutput("a", [1, 2]), RequestOutput("b", [], finish_reason="length"), RequestOutput("c", [])],
            stats(1, 0.1, 0.09),
        )
    )
    [rec] = recorder.records
    assert rec.request_ids == ["a", "b"] and rec.num_new_tokens == 2 and rec.finished_ids == ["b"]
    assert rec.stats.num_steps == 1
