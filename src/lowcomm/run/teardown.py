"""What a closed run lets go of, so that `destroy_process_group()` really ends gloo.

gloo runs each collective on a worker thread of its process group, and that thread drops the
op's tensors after completing it. A tensor that Python has seen needs the GIL to be dropped;
a worker that gets there after the interpreter began to finalize is ended by CPython inside
C++ code, and the process aborts ("terminate called without an active exception", SIGABRT)
after the script printed its result. `destroy_process_group()` joins a group's workers, and
with them ends the race, only where nothing else holds the group: so a closed run keeps no
reference to a group, and the one torch itself keeps is undone here (`unpin_default_group`).
"""
from __future__ import annotations

import atexit
import sys
import weakref

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def release_ddp(module: nn.Module) -> None:
    """Drop what a DistributedDataParallel wrapper holds of its process group: the C++ reducer
    (and the logger that holds it) and the group itself. The wrapper still runs a forward
    without gradients (its `.module` any forward); a backward through it is a closed run's."""
    if not isinstance(module, DistributedDataParallel):
        return
    for name in ("reducer", "logger", "process_group"):
        module.__dict__.pop(name, None)


def unpin_default_group() -> None:
    """torch.distributed.nn.functional's collectives take `group=group.WORLD` as a default
    argument, read once when the module is first imported; torch.optim imports it (through
    torch._dynamo) at the first optimizer, which is usually after init_process_group. From then
    on the default group outlives `destroy_process_group()`, its workers running into the
    interpreter's exit. A default of None means the same to them (the default group, read at
    the call) without holding it."""
    # the package re-exports them (`from .functional import *`): the same functions, unless reloaded
    modules = (sys.modules.get(name) for name in ("torch.distributed.nn.functional", "torch.distributed.nn"))
    for module in filter(None, modules):
        for fn in list(vars(module).values()):
            defaults = getattr(fn, "__defaults__", None)
            if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


def destroy(groups: list[dist.ProcessGroup]) -> None:
    """Destroy the process groups a run made itself, the default one last (it takes every
    other group with it); one already destroyed is passed over."""
    default = dist.group.WORLD if dist.is_initialized() else None
    for group in sorted(groups, key=lambda g: g is default):
        if not dist.is_initialized():
            return
        try:
            dist.destroy_process_group(None if group is default else group)
        except ValueError:  # destroyed already (torch: "Invalid process group specified")
            continue


def destroy_at_exit(group: dist.ProcessGroup) -> None:
    """The default group wrap() made from torchrun's environment is destroyed when the script
    ends (atexit: before the interpreter finalizes), unless the script destroyed it itself:
    a script may end with destroy_process_group(), as torch asks, or leave it to lowcomm.
    Not on close(): a destroy_process_group() after it would fail on the missing group."""
    made = weakref.ref(group)

    def destroy_if_still_there() -> None:
        if dist.is_initialized() and dist.group.WORLD is made():
            dist.destroy_process_group()
    atexit.register(destroy_if_still_there)
