"""The lighthouse's own process: torchft's LighthouseServer on a port, until the launcher is gone.

keeper.py runs this file by its path, not as a module of lowcomm: importing the torchft package
(or lowcomm) imports torch, seconds of a restart while the workers wait; torchft's native module
alone loads in a tenth of a second. It prints the server's address, then watches its parent: the
launcher gone (killed, even by SIGKILL), it exits too.

    python lighthouse_serve.py PORT MIN_REPLICAS JOIN_TIMEOUT_MS QUORUM_TICK_MS HEARTBEAT_TIMEOUT_MS
"""
import importlib.util
import os
import sys
import time


def native():
    """torchft's native module (torchft/_torchft*.so), without the package around it."""
    os.environ.setdefault("RUST_LOG", "warn")  # it logs every quorum at INFO
    package = os.path.dirname(importlib.util.find_spec("torchft").origin)
    name = next(f for f in os.listdir(package) if f.startswith("_torchft") and f.endswith(".so"))
    spec = importlib.util.spec_from_file_location("torchft._torchft", os.path.join(package, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> None:
    port, min_replicas, join_ms, tick_ms, heartbeat_ms = (int(a) for a in argv)
    parent = os.getppid()
    server = native().LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=join_ms,
                                       quorum_tick_ms=tick_ms, heartbeat_timeout_ms=heartbeat_ms)
    print(server.address(), flush=True)
    while os.getppid() == parent:
        time.sleep(0.2)
    server.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
