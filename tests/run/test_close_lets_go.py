"""What a closed run lets go of, in one process (a world of 1 on gloo): after close() and
destroy_process_group() nothing holds the default group, so torch frees it and joins its gloo
threads; the link emulator's deadline thread is joined once what it was due to run has run.
(The same under torchrun, W=2, every engine: test_torchrun_exit.py.)"""
from __future__ import annotations

import gc
import importlib
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import lowcomm
from lowcomm.comm.link import Deadlines
from lowcomm.run.teardown import unpin_default_group
from lowcomm.strategies import get


@pytest.fixture
def world_of_one():
    """A default gloo group of this process alone; destroyed after the test if it is still there."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield weakref.ref(dist.group.WORLD)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def gone_after_destroy(world: weakref.ref) -> bool:
    dist.destroy_process_group()
    gc.collect()
    return world() is None


def test_the_default_group_torch_pins_in_default_arguments_is_let_go(world_of_one):
    # torch.optim imports torch.distributed.nn.functional on its first optimizer, usually after
    # init_process_group: its collectives' `group=group.WORLD` defaults then hold the group
    functional = importlib.reload(importlib.import_module("torch.distributed.nn.functional"))
    assert functional.all_reduce.__defaults__[-1] is world_of_one()
    unpin_default_group()
    assert gone_after_destroy(world_of_one)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "acco", "diloco"])
def test_a_closed_run_holds_no_process_group(world_of_one, strategy):
    importlib.reload(importlib.import_module("torch.distributed.nn.functional"))  # pinned, as in a script
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    # reproducible options: adaptive acco's rounds follow the timing, and at load 8 micro-batches
    # once made no whole round (steps 0)
    run = lowcomm.wrap(model, lambda p: torch.optim.AdamW(p, lr=1e-2), strategy, accum=2, link="1gbit,1ms",
                       **get(strategy).reproducible_options)
    for _ in range(8):
        x = torch.randn(4, 4)
        run.backward((run.model(x) - x.sum(1, keepdim=True)).pow(2).mean())
    run.close()
    assert run.steps > 0
    assert gone_after_destroy(world_of_one)  # while `run` is still held, as a script's globals are


def test_closing_the_deadlines_runs_what_is_due_and_joins_every_thread():
    deadlines, ran = Deadlines(), []
    due = time.perf_counter() + 0.2
    deadlines.at(due, lambda: ran.append(time.perf_counter()))
    deadlines.at(due, lambda: deadlines.at(time.perf_counter(), lambda: ran.append(0.0)))  # a chained one
    deadlines.close()
    assert len(ran) == 2 and ran[0] >= due
    assert not [t for t in threading.enumerate() if t.name.startswith("lowcomm-link")]
