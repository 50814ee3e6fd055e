from .comm import Comm, CommStats, Handle
from .wire import COLLECTIVES, latency_hops, wire_bytes

__all__ = ["Comm", "CommStats", "Handle", "COLLECTIVES", "latency_hops", "wire_bytes"]
