"""`lowcomm join RUNDIR`: one more worker for an elastic run that is training now.

    lowcomm join runs/diloco-w4-20261201-181500        # from another terminal, or another machine

The launcher of an elastic run publishes where its run can be reached in RUNDIR/elastic.json
(the lighthouse's and the TCP store's addresses; written atomically at start, removed when the
launcher ends). A joiner reads RUNDIR/config.toml (the run's own settings: model, strategy,
data, seed), takes the next free slot from the store (slots 0..W-1 are the launcher's, joiners
count on from W), announces itself and waits for the members' next commit point, where they
re-form with it and one of them sends it the live state (transfer.py). From there it is a
member like the others: rank 0 of each quorum (the lowest slot) writes its records into
RUNDIR's steps.jsonl and membership.jsonl.

On another machine RUNDIR must hold a copy of the run's config.toml and elastic.json, and the
data must be found under the same name (`--data` as the run was started with).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from .. import config as C
from . import rundir
from ..errors import UsageError
from ..storage.files import write_text_atomic
from ..elastic.membership import Membership
from ..elastic.support import member_timeout

PUBLISHED = "elastic.json"
NEXT_SLOT = "lowcomm/elastic/next_slot"  # joiners taken so far; slot = W + this - 1
WATCH_S = 0.5  # how often a waiting joiner looks whether the run is still on
REACH_S = 5.0  # a run's store that does not answer within this is not reachable
STORE_ANSWER_S = 15.0  # c10d's client retries a bad answer within REACH_S: past this, it is no store


def publish(out: Path | None, lighthouse: str, store_port: int) -> None:
    """Where a joiner finds the run: written atomically, so it never reads half a file."""
    if out is not None:
        store = f"{_this_host()}:{store_port}"
        write_text_atomic(out / PUBLISHED, json.dumps({"lighthouse": lighthouse, "store": store}) + "\n")


def _this_host() -> str:
    """This machine's name, as another one would reach the store (which listens on every
    interface); the loopback address where the name does not resolve (a bare container)."""
    name = socket.gethostname()
    try:
        socket.gethostbyname(name)
        return name
    except OSError:
        return "127.0.0.1"


def unpublish(out: Path | None) -> None:
    """The launcher ended: the run takes no more joiners."""
    if out is not None:
        (out / PUBLISHED).unlink(missing_ok=True)


def add_join_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rundir", metavar="RUNDIR", help="the directory of an elastic run that is training "
                        "(lowcomm train --elastic --out RUNDIR)")
    parser.add_argument("--quiet", action="store_true", help="no progress output (default: off)")


def find_run(run: Path) -> tuple[C.RunConfig, dict]:
    """The run's config and published addresses, or one UsageError line saying why not."""
    rundir.check_readable(run)  # a directory it may not read is not taken for one that is no run
    if not rundir.is_run(run):
        raise UsageError(f"'{run}' is not a lowcomm run directory (no config.toml naming a strategy)")
    cfg = C.load_toml(run / "config.toml")
    if not cfg.elastic:
        raise UsageError(f"the run in '{run}' is not elastic (started without --elastic): it takes no joiners")
    if (run / "summary.json").exists():
        raise UsageError(f"the run in '{run}' has finished (summary.json is there): nothing to join")
    try:
        where = json.loads((run / PUBLISHED).read_text())
        host, port = where["store"].rsplit(":", 1)
        where["store"] = (host, int(port))
        str(where["lighthouse"])
    except FileNotFoundError:
        raise UsageError(f"the run in '{run}' is not running (no {PUBLISHED}: its launcher has ended)") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UsageError(f"'{run / PUBLISHED}' is not what an elastic launcher writes") from None
    return cfg, where


def connect(run: Path, where: dict):
    """The run's TCP store, or one line saying it does not answer (the launcher was killed), or
    that what answers there is not a store (a stale elastic.json, the port taken by another service)."""
    host, port = where["store"]
    try:  # a refused connection first, at once (c10d's client retries it until its timeout)
        socket.create_connection((host, port), timeout=REACH_S).close()
    except OSError:  # refused, timed out, unknown host
        raise UsageError(f"the run in '{run}' is not reachable: its store at {host}:{port} does not "
                         f"answer within {REACH_S:.0f} s (has its launcher ended?)") from None
    with stderr_silenced():  # c10d logs each failed try with a C++ stack: the line below says it
        store = within(lambda: _store(host, port), STORE_ANSWER_S)
    if isinstance(store, Exception) or store is None:
        why = (f"it said nothing in {STORE_ANSWER_S:.0f} s" if store is None else
               f"c10d: {' '.join(str(store).split())[:100]}")
        raise UsageError(f"the run in '{run}' is not reachable: what answers at {host}:{port} (the store named in "
                         f"{run / PUBLISHED}) is not its launcher's store ({why}); has its launcher ended?") from None
    return store


def _store(host: str, port: int):
    import torch.distributed as dist
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=REACH_S))
    store.add(NEXT_SLOT, 0)  # a round trip of the store's own protocol
    return store


@contextlib.contextmanager
def stderr_silenced():
    """This process's stderr (fd 2, where c10d's C++ logs go) to /dev/null for a while."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def within(call, seconds: float):
    """call()'s value, or the exception it raised, or None when it has not returned within `seconds`
    (c10d's client can wait for ever on a service that accepts and says nothing: it runs on a
    thread that is then left behind, a daemon)."""
    got: list = []

    def run() -> None:
        try:
            got.append(call())
        except Exception as e:  # c10d raises several types
            got.append(e)
    thread = threading.Thread(target=run, name="lowcomm-join-store", daemon=True)
    thread.start()
    thread.join(seconds)
    return got[0] if got else None


class Joiner(Membership):
    """A member that knows when a quorum first took it (`joined`) and whether it waits for one
    (`waiting`: to join, or to rejoin after the others dropped it)."""

    def __init__(self, *args, **kwargs):
        self.joined, self.joined_at = threading.Event(), 0  # joined_at: the committed step it joined at
        self.waiting = True
        super().__init__(*args, **kwargs)

    def agree(self, step: int, joining: bool = False):
        self.waiting = joining
        view = super().agree(step, joining)
        self.waiting = False
        if not self.joined.is_set():
            self.joined_at = max(view.steps)
        self.joined.set()
        return view


def watch(run: Path, member: Joiner) -> None:
    """While this worker waits for a quorum to take it in (before it first joined, or dropped since:
    frozen, then continued): the run ending first (its launcher removed elastic.json, or
    summary.json appeared) ends it in one line, instead of asking a lighthouse that is gone for a
    quorum (up to 60 s: membership.LIGHTHOUSE_AWAY_S)."""
    while True:
        time.sleep(WATCH_S)
        if member.waiting and ((run / "summary.json").exists() or not (run / PUBLISHED).exists()):
            again = "rejoin" if member.joined.is_set() else "join"
            print(f"error: the run in '{run}' ended before this worker could {again} it", file=sys.stderr, flush=True)
            os._exit(1)


def join(args: argparse.Namespace) -> int:
    """Train as one more worker of the run in args.rundir until the run ends."""
    from ..elastic.address import check_lighthouse
    from ..train.elastic import run_elastic

    run = Path(args.rundir)
    cfg, where = find_run(run)
    store = connect(run, where)
    check_lighthouse(where["lighthouse"], f"the run in '{run}' is not reachable: its lighthouse")
    if cfg.replicas and cfg.replicas != cfg.workers:  # a run of replica groups takes a replica
        from .join_replica import join_replica
        return join_replica(run, cfg, where, store, args.quiet)
    slot = cfg.workers + int(store.add(NEXT_SLOT, 1)) - 1
    del store
    if not args.quiet:
        print(f"lowcomm: joining the run in {run} as worker {slot}", flush=True)
    # The run's member timeout, as the launcher's workers have: with --timeout instead, a joiner
    # blocked in a collective with a dead member waited up to --timeout (600 s), and the others
    # with it, for the lighthouse waits for a live worker to ask for the next quorum.
    m = Joiner(where["lighthouse"], where["store"][0], where["store"][1], slot, member_timeout(cfg),
               quorum_timeout_s=cfg.quorum_timeout)
    threading.Thread(target=watch, args=(run, m), name="lowcomm-join-watch", daemon=True).start()
    try:
        w = run_elastic(cfg, slot, m, run, args.quiet, joining=True)
    finally:
        m.close()
    if not args.quiet:
        print(f"lowcomm: worker {slot} trained steps {m.joined_at + 1} to {w.step} of the run in {run}"
              f"{' (it has finished)' if w.step >= cfg.steps else ''}", flush=True)
    return 0
