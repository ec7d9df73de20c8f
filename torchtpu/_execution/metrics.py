"""Counters a user reads to see why a loop is slow (exposed as torchtpu.metrics())."""
import collections

counters = collections.Counter()


def snapshot():
    return dict(counters)


def reset():
    counters.clear()
