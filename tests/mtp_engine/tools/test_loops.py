"""Loop detection: an output ends in a loop when its last 48 tokens repeat a
cycle of period at most 12 (the model card's loop rate, the benchmarks'
loop-free subsets)."""

from mtp_engine.tools.loops import find_loop, loop_start


def test_a_cycle_of_period_up_to_12_over_the_last_48_tokens_is_a_loop():
    head = list(range(100, 130))
    assert find_loop(head + [1, 2, 3] * 16) == 3
    assert find_loop(head + list(range(12)) * 4) == 12
    assert find_loop(head + list(range(13)) * 4) is None  # period 13
    assert find_loop([7] * 47) is None  # too short to tell
    broken = head + [1, 2, 3] * 16
    broken[-20] = 9
    assert find_loop(broken) is None


def test_loop_start_is_where_the_final_cycle_begins():
    tokens = list(range(100, 130)) + [1, 2] * 30
    assert loop_start(tokens) == 30
    assert loop_start(list(range(60))) == 60
