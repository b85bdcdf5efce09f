"""The graph-pass tests: every module here runs on the fake 2-rank default group (plus a 1-rank gloo group for
numerics) of ``tests/_pass_graphs.py``, with the rewrite counts reset before each test."""

from _pass_graphs import fake_world, fresh_stats  # noqa: F401 - autouse fixtures for every module in this folder
