"""The per-bucket planner's model: hand-computed passes, calibration, and the search."""

import pytest

from fastddp.hooks import planner

pytestmark = pytest.mark.timeout(60)

MB = 1e6


def _profile(**over):
    # Three buckets of 1M elements, ready 0.1 s apart; fp32 ("none") sends 4 MB each, int8 1 MB
    # and costs 20 ns per element on the host.
    base = dict(
        numel=[10**6] * 3,
        gaps={"none": [0, 0.1, 0.1], "int8": [0, 0.1, 0.1]},
        cost={"none": 0.0, "int8": 20e-9},
        sent={"none": [4 * MB] * 3, "int8": [1 * MB] * 3},
        reduce_s={"none": 0.0, "int8": 0.0},
        blocking=frozenset(),
    )
    return planner.Profile(**{**base, **over})


def test_the_pass_by_hand():
    p = _profile()
    # fp32 at 40 MB/s: each bucket 0.1 s on the link, ready every 0.1 s; the last ends at 0.3 s.
    assert planner.simulate(p, ["none"] * 3, {"none": 40 * MB}) == pytest.approx(0.3)
    # at 20 MB/s the link is the bottleneck: 3 x 0.2 s from the first bucket.
    assert planner.simulate(p, ["none"] * 3, {"none": 20 * MB}) == pytest.approx(0.6)
    # int8: 10 ms to encode and 10 ms to decode a bucket on the compute thread, 0.05 s on the
    # link. Bucket 0: encoded by 0.01, through at 0.06; bucket 1 comes at 0.11, decodes bucket
    # 0 (0.12), is encoded (0.13) and through at 0.18; bucket 2 likewise at 0.23: 0.24, 0.25,
    # through at 0.30; its decode ends the pass at 0.31.
    took = planner.simulate(p, ["int8"] * 3, {"int8": 20 * MB})
    assert took == pytest.approx(0.31)


def test_blocking_waits_for_the_previous_bucket_of_the_same_mode():
    slow = {"int8": 2 * MB}  # 0.5 s per bucket on the link
    free = planner.simulate(_profile(), ["int8"] * 3, slow)
    blocked = planner.simulate(_profile(blocking=frozenset({"int8"})), ["int8"] * 3, slow)
    assert blocked == pytest.approx(free)  # the link is the bottleneck either way
    assert blocked == pytest.approx(0.01 + 1.5 + 0.01)
    # Where compute follows, the wait delays it: bucket 1 waits for bucket 0 (through at 0.177
    # s, decoded by 0.187) before the backward pass goes on for 0.5 s to bucket 2.
    long = {"int8": [0, 0.1, 0.5], "none": [0, 0.1, 0.5]}
    medium = {"int8": 6 * MB, "none": 1e13}  # int8: 0.167 s per bucket
    plan = ["int8", "int8", "none"]
    free = planner.simulate(_profile(gaps=long), plan, medium)
    blocked = planner.simulate(_profile(gaps=long, blocking=frozenset({"int8"})), plan, medium)
    assert free == pytest.approx(0.12 + 0.5 + 0.02)  # bucket 2 at 0.62: decodes 0 and 1
    assert blocked == pytest.approx(0.01 + 1 / 6 + 0.01 + 0.5 + 0.01)


def test_calibration_finds_the_rate_that_made_the_measured_time():
    truth = {"none": 25 * MB, "int8": 7 * MB}
    p = _profile()
    p.reduce_s = {m: planner.simulate(p, [m] * 3, truth) for m in truth}
    rates = planner.calibrate(p)
    for m in truth:
        assert rates[m] == pytest.approx(truth[m], rel=1e-6)


def test_a_hidden_transfer_gets_the_slowest_rate_that_still_hides_it():
    p = _profile()
    p.reduce_s = {"none": 0.15, "int8": 0.15}  # under the 0.2 s of compute alone: noise
    rates = planner.calibrate(p)
    floor = planner.simulate(p, ["none"] * 3, {"none": 1e13})
    assert planner.simulate(p, ["none"] * 3, rates) == pytest.approx(floor * 1.01, rel=1e-6)


def test_search_compresses_only_the_bucket_the_backward_pass_cannot_hide():
    # fp32 at 50 MB/s: 0.08 s per bucket, hidden behind the 0.1 s gaps except the last one.
    p = _profile()
    rates = {"none": 50 * MB, "int8": 50 * MB}
    plan = planner.search(p, rates, ["int8"] * 3, ["none", "int8"])
    assert plan == ["none", "none", "int8"]
    assert planner.simulate(p, plan, rates) < planner.simulate(p, ["none"] * 3, rates)
    assert planner.simulate(p, plan, rates) < planner.simulate(p, ["int8"] * 3, rates)


def test_search_keeps_the_more_accurate_mode_when_both_are_as_fast():
    p = _profile(cost={"none": 0.0, "int8": 0.0})
    rates = {"none": 1e12, "int8": 1e12}
    assert planner.search(p, rates, ["int8"] * 3, ["none", "int8"]) == ["none"] * 3


def test_a_mixed_plan_is_kept_only_where_its_turns_confirm_the_model():
    # Modelled 16 ms faster than a 96 ms step: measured 1 ms faster is noise, 10 ms confirms.
    assert not planner.confirms(0.102, 0.103, 0.016, 0.02)
    assert planner.confirms(0.093, 0.103, 0.016, 0.02)
    # A small modelled gain still needs the least relative gain.
    assert not planner.confirms(0.1015, 0.103, 0.001, 0.02)
    assert not planner.confirms(0.104, 0.103, 0.0, 0.02)  # slower
