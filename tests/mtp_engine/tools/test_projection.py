"""Projected drafts under a profile that falls with context (benchmarks)."""

import pytest

from mtp_engine.tools.projection import ProjectedDrafts, parse_later, parse_profile


def test_a_later_profile_takes_over_from_its_new_token():
    reference = list(range(1, 41))
    projection = ProjectedDrafts(parse_profile("1,1"), reference, vocab=50, seed=0, later=parse_later("20:0.01"))
    for emitted in range(20):
        assert projection.drafts(3, emitted) == reference[emitted : emitted + 3]
    misses = sum(projection.drafts(1, emitted)[0] != reference[emitted] for emitted in range(20, 40))
    assert misses >= 18
    with pytest.raises(ValueError, match="NEW_TOKENS:PROFILE"):
        parse_later("0.7,0.4")
