"""The VLA node's frame ledger (synflux_ros.runtimes.ledger), without ROS: outcomes, rates, silence, verdicts."""
from __future__ import annotations

import threading

import pytest

from synflux_ros.core.pipeline import PipelineCounters
from synflux_ros.runtimes.ledger import (ERROR, INPUTS, OK, OUTCOMES, SKIPPED, WARN, FrameLedger, Health,
                                         NO_FRAME_MIN_S, RATE_WINDOW)

HINT = "use shared memory"


def feed(ledger: FrameLedger, stamps, period: float | None = None, t0: float = 50.0, clock0: float = 1000.0):
    """Frames stamped ``stamps`` arriving ``period`` apart (default: as stamped), on both clocks."""
    for i, stamp in enumerate(stamps):
        dt = (stamp - stamps[0]) if period is None else i * period
        ledger.receive(t0 + dt, clock0 + dt, stamp)


def clean(**counts) -> dict:
    out = dict.fromkeys(("received", *OUTCOMES, *INPUTS, "in_flight"), 0)
    out.update(counts)
    return out


RATES_OK = {"receive_rate_hz": 30.0, "camera_rate_hz": 30.0, "delivery_ratio": 1.0, "estimated_camera_rate_hz": 30.0}


# ---------------------------------------------------------------- counts
def test_every_frame_is_in_exactly_one_outcome_or_in_flight():
    ledger = FrameLedger(30.0)
    feed(ledger, [i / 30 for i in range(40)])
    for kind, n in zip(SKIPPED, (1, 2, 3, 4, 5)):
        ledger.count(kind, n)
    ledger.retire(PipelineCounters(submitted=9, processed=6, dropped=2, failed=1))
    live = PipelineCounters(submitted=8, processed=3, dropped=1, failed=1)
    counts = ledger.counts(live)
    assert (counts["published"], counts["dropped"], counts["failed"]) == (9, 3, 2)
    assert counts["in_flight"] == 40 - 15 - 14 == 11
    assert sum(counts[k] for k in OUTCOMES) + counts["in_flight"] == counts["received"] == 40
    assert ledger.counts()["in_flight"] == 40 - 15 - 9  # without the live pipeline: its frames count as in flight


@pytest.mark.parametrize("kind", SKIPPED)
def test_each_skip_takes_its_frame_out_of_flight(kind):
    ledger = FrameLedger()
    feed(ledger, [0.0, 0.1])
    ledger.count(kind)
    counts = ledger.counts()
    assert counts[kind] == 1 and counts["in_flight"] == 1


def test_other_inputs_are_counted_apart_from_the_frames():
    ledger = FrameLedger()
    for key in INPUTS:
        ledger.count(key, 2)
    counts = ledger.counts()
    assert all(counts[key] == 2 for key in INPUTS) and counts["received"] == counts["in_flight"] == 0


@pytest.mark.parametrize("key", ["received", "published", "processed", "lost"])
def test_only_the_node_s_own_outcomes_and_inputs_are_counted_by_name(key):
    with pytest.raises(KeyError, match=key):
        FrameLedger().count(key)


def test_counting_from_several_threads_loses_nothing():
    ledger = FrameLedger()

    def work():
        for i in range(2000):
            ledger.receive(float(i), float(i), float(i))
            ledger.count("inactive")
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counts = ledger.counts()
    assert counts["received"] == counts["inactive"] == 8000 and counts["in_flight"] == 0


# ---------------------------------------------------------------- rates
def test_too_few_frames_give_no_rates():
    ledger = FrameLedger(30.0)
    feed(ledger, [0.0, 1 / 30])
    assert ledger.rates() == {"receive_rate_hz": 0.0, "camera_rate_hz": 30.0, "delivery_ratio": 1.0,
                              "estimated_camera_rate_hz": 0.0}


def test_a_stated_camera_rate_counts_the_frames_that_never_arrive():
    ledger = FrameLedger(30.0)
    feed(ledger, [i / 30 for i in range(0, 60, 2)])  # every other frame of a 30 Hz camera
    rates = ledger.rates()
    assert rates["receive_rate_hz"] == pytest.approx(15.0)
    assert rates["camera_rate_hz"] == 30.0
    assert rates["delivery_ratio"] == pytest.approx(0.5)
    assert rates["estimated_camera_rate_hz"] == pytest.approx(15.0)  # the stamps alone cannot tell


def test_without_a_stated_rate_the_camera_s_rate_comes_from_the_stamps():
    ledger = FrameLedger()
    feed(ledger, [i / 30 for i in range(90) if i % 3 != 2])  # a third lost on the way
    rates = ledger.rates()
    assert rates["estimated_camera_rate_hz"] == pytest.approx(30.0)
    assert rates["camera_rate_hz"] == rates["estimated_camera_rate_hz"]
    assert rates["delivery_ratio"] == pytest.approx(2 / 3, abs=0.02)
    assert rates["receive_rate_hz"] == pytest.approx(20.0, rel=0.02)


def test_the_receive_rate_is_on_the_node_s_clock():
    """Under use_sim_time the node's clock is simulated time: a simulation at half speed receives its 30 Hz
    camera at 30 Hz of simulated time, whatever the steady clock says."""
    ledger = FrameLedger(30.0)
    for i in range(30):
        ledger.receive(50.0 + i * 2 / 30, 1000.0 + i / 30, i / 30)
    rates = ledger.rates()
    assert rates["receive_rate_hz"] == pytest.approx(30.0) and rates["delivery_ratio"] == pytest.approx(1.0)


def test_the_rates_cover_the_recent_frames():
    ledger = FrameLedger(30.0)
    feed(ledger, [i / 10 for i in range(50)])  # 10 Hz first ...
    feed(ledger, [10 + i / 30 for i in range(RATE_WINDOW)], t0=100.0, clock0=2000.0)  # ... then 30 Hz
    assert ledger.rates()["receive_rate_hz"] == pytest.approx(30.0)


# ---------------------------------------------------------------- silence, latency, publish rate
def test_silence_counts_from_activation_until_the_first_frame_then_from_the_last():
    ledger = FrameLedger(30.0)
    ledger.activate(10.0)
    assert ledger.silence(12.5) == 2.5
    ledger.receive(13.0, 500.0, 0.0)  # the node's clock and the stamp play no part
    assert ledger.silence(13.25) == 0.25
    ledger.activate(20.0)  # reactivated after the last frame
    assert ledger.silence(21.0) == 1.0


def test_latencies_and_the_publish_rate_come_from_the_published_chunks():
    ledger = FrameLedger()
    assert ledger.publish_rate() == 0.0 and ledger.latencies() == []
    ledger.published(40.0, 5.0)
    assert ledger.publish_rate() == 0.0
    for i in range(1, 11):
        ledger.published(40.0 + i, 5.0 + i * 0.2)
    assert ledger.publish_rate() == pytest.approx(5.0)
    assert ledger.latencies() == [40.0 + i for i in range(11)]


# ---------------------------------------------------------------- health
def test_frames_that_all_arrive_and_pass_are_ok():
    health = FrameLedger(30.0, HINT).health(clean(received=30, published=30), RATES_OK, 0.1)
    assert health == Health(OK, ())
    assert health.message(29.96) == "30.0 Hz"


@pytest.mark.parametrize("counts,problem", [
    (dict(rejected=2), "2 rejected, 0 failed"),
    (dict(failed=3), "0 rejected, 3 failed"),
    (dict(no_state=4), "4 skipped without a fresh joint state"),
    (dict(no_camera=5), "5 skipped without an image of every camera"),
    (dict(camera_images_rejected=6), "6 camera images rejected"),
    (dict(states_rejected=7), "7 joint states rejected"),
])
def test_frames_and_inputs_refused_on_the_way_warn(counts, problem):
    health = FrameLedger(30.0, HINT).health(clean(**counts), RATES_OK, 0.1)
    assert health == Health(WARN, (problem,))


def test_the_problems_found_elsewhere_come_first_and_warn():
    health = FrameLedger(30.0, HINT).health(clean(rejected=1), RATES_OK, 0.1, problems=["holding: stale state"])
    assert health == Health(WARN, ("holding: stale state", "1 rejected, 0 failed"))
    assert health.message(2.0) == "2.0 Hz, holding: stale state, 1 rejected, 0 failed"


def test_frames_lost_in_transport_warn_with_the_hint():
    rates = dict(RATES_OK, delivery_ratio=0.66, camera_rate_hz=30.0)
    health = FrameLedger(30.0, HINT).health(clean(), rates, 0.1)
    assert health == Health(WARN, (f"receiving 66% of the camera's 30.0 Hz: frames are lost in transport ({HINT})",))


def test_a_camera_rate_not_stated_warns():
    rates = dict(RATES_OK, camera_rate_hz=30.0)
    health = FrameLedger(0.0, HINT).health(clean(), rates, 100.0)  # no silence verdict without a stated rate
    assert health == Health(WARN, ("camera_rate_hz not set: frames lost before this node cannot be counted",))


@pytest.mark.parametrize("estimated,warns", [(30.0, False), (24.5, False), (35.5, False), (23.0, True),
                                             (37.0, True), (0.0, False)])
def test_a_stated_rate_the_stamps_contradict_warns(estimated, warns):
    health = FrameLedger(30.0, HINT).health(clean(), dict(RATES_OK, estimated_camera_rate_hz=estimated), 0.1)
    expected = (f"the frames' stamps say {estimated:.1f} Hz, camera_rate_hz says 30: check the parameter",)
    assert health == (Health(WARN, expected) if warns else Health(OK, ()))


@pytest.mark.parametrize("rate,silence,error", [
    (30.0, NO_FRAME_MIN_S - 0.01, False), (30.0, NO_FRAME_MIN_S + 0.01, True),  # 10 periods < 2 s
    (2.0, 4.9, False), (2.0, 5.1, True),  # 10 periods of a slow camera
])
def test_no_frame_for_long_is_an_error_naming_the_topic(rate, silence, error):
    health = FrameLedger(rate, HINT).health(clean(), dict(RATES_OK, camera_rate_hz=rate,
                                                          estimated_camera_rate_hz=rate), silence, "/cam/image")
    if not error:
        assert health == Health(OK, ())
    else:
        assert health == Health(ERROR, (f"no camera frame for {silence:.1f} s on /cam/image (is the camera "
                                        f"publishing? {HINT})",))


def test_the_worst_verdict_wins_and_every_problem_is_said():
    rates = dict(RATES_OK, delivery_ratio=0.5, estimated_camera_rate_hz=15.0)
    health = FrameLedger(30.0, HINT).health(clean(rejected=1), rates, 10.0, "image")
    assert health.level == ERROR
    assert [p.split(" ")[0] for p in health.problems] == ["1", "receiving", "the", "no"]
