"""Every byte a strategy sends: Comm counts, times and (on request) slows it to an emulated link
(comm.py, link.py, pacer.py); replica groups (groups.py); torch's comm hooks counted
(torch_hooks.py); the flight
ring each Comm writes (flight.py); Python objects through a Comm (objects.py: an elastic run's
agreements, counted as bookkeeping, and its heal, counted apart and paced by the link).

Imports: errors.
"""
from .comm import Comm, CommStats, Handle
from .wire import COLLECTIVES, latency_hops, wire_bytes

__all__ = ["Comm", "CommStats", "Handle", "COLLECTIVES", "latency_hops", "wire_bytes"]
