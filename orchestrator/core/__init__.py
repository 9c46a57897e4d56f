"""The decision core: pure functions over the coordinator's state.

``transition(state, event, now) -> (state, commands)`` and the rules it is made of.
Imports only :mod:`ddpbus.codecs` and the standard library: no NATS, asyncio or torch
(tests/contract/test_layers.py holds it to that).
"""
