"""A `lowcomm.wrap()` script under torchrun ends with exit 0: after close() and
destroy_process_group() no gloo thread is left that could drop a collective's tensors while the
interpreter finalizes (which aborts the process: "terminate called without an active
exception"), whether the script made its group or wrap() did, for one strategy of each engine
(ddp's comm hook, zero1's flat buffers, acco's overlapped rounds, diloco's outer sync).

The abort itself is a race with the interpreter's exit; what is tested is what rules it out:
the script counts gloo's threads after destroy_process_group() and exits 3 if any is left
(each family's run kept alive to the end, as a script's globals are).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

FAMILIES = "ddp,zero1,acco,diloco"

SCRIPT = '''
import atexit, os, sys
import torch, torch.distributed as dist, torch.nn.functional as F
import lowcomm
import lowcomm.strategies

def no_gloo_thread_left():
    names = (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    left = sorted(n for n in names if "gloo" in n)
    sys.stdout.write(f"gloo threads left: {left}\\n")  # one write: the ranks share the pipe
    if left:
        os._exit(3)

group = sys.argv[1]  # "made": the script makes its group; "wrap": wrap() makes it from torchrun's environment
ending = sys.argv[2]  # "destroy": the script ends with destroy_process_group(); "none": it does not
if ending == "none":  # checked at exit, after lowcomm's own exit handler (atexit runs them last first)
    atexit.register(no_gloo_thread_left)
if group == "made":
    dist.init_process_group("gloo")
runs = []
for strategy in sys.argv[3].split(","):  # the README loop, tiny
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    # at its reproducible options: adaptive acco's rounds follow the timing (16 micro-batches
    # once made a single step)
    run = lowcomm.wrap(model, lambda p: torch.optim.AdamW(p, lr=1e-2), strategy=strategy, accum=2,
                       link="1gbit,1ms", **lowcomm.strategies.get(strategy).reproducible_options)
    rng = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(16):
        x = torch.randn(4, 8, generator=rng)
        run.backward(F.mse_loss(run.model(x), x.sum(1, keepdim=True)))
    run.close()
    runs.append(run)
    sys.stdout.write(f"{strategy} steps {run.steps}\\n")
if ending == "destroy":
    dist.destroy_process_group()
    no_gloo_thread_left()
'''


def torchrun(script, *args: str) -> subprocess.CompletedProcess:
    """The script as a user launches it: torchrun, 2 processes on one machine."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(script), *args]
    return subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)


def ended_cleanly(done: subprocess.CompletedProcess) -> None:
    tail = done.stdout[-3000:]
    assert done.returncode == 0 and "terminate called" not in done.stdout, tail
    for strategy in FAMILIES.split(","):  # both ranks trained every family
        steps = [int(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith(f"{strategy} steps ")]
        assert len(steps) == 2 and min(steps) > 0, tail


# Every job of this file, run side by side in one pool: what is checked is each job's exit and
# output, not its time, and a job is mostly three imports of torch (the agent's, each worker's):
# about 10 s of CPU each. Four at a time keep 2 cores busy through a job's waits (its rendezvous,
# the agent's polling). Each job has its own rendezvous port (--standalone: a free one) and its own
# output; at a load of 40 a job stays well within its 240 s.
# Four jobs of the README loop, not twenty: the abort was a race (7 of 12 jobs before the fix),
# but what rules it out is checked in every process of every job -- no gloo thread left after
# destroy_process_group(), exit 3 otherwise -- so one job already fails when it comes back; more
# jobs repeat that check at about 10 s of CPU each (measured: 23 jobs 224 s; 11 jobs 72 s, a
# tenth of the suite's wall time on 2 cores).
ENDINGS = [("made", "destroy"), ("wrap", "destroy"), ("wrap", "none")]
JOBS, AT_A_TIME = 4, 4


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """{(group, ending): its job} for each ending, and "loop": the JOBS jobs of the README loop."""
    script = tmp_path_factory.mktemp("torchrun") / "readme_loop.py"
    script.write_text(SCRIPT)
    asked = [*ENDINGS, *[("made", "destroy")] * JOBS]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(AT_A_TIME) as pool:
        done = list(pool.map(lambda args: torchrun(script, *args, FAMILIES), asked))
    print(f"{len(asked)} torchrun jobs, {AT_A_TIME} at a time, in {time.perf_counter() - t0:.0f} s")
    return {**dict(zip(ENDINGS, done)), "loop": done[len(ENDINGS):]}


@pytest.mark.procs
@pytest.mark.parametrize("group,ending", ENDINGS)
def test_no_gloo_thread_outlives_the_group(jobs, group, ending):
    """A script that destroys its group, or leaves wrap()'s own to lowcomm, has no gloo thread
    after that: none is left to race the interpreter's exit."""
    done = jobs[group, ending]
    ended_cleanly(done)
    assert done.stdout.count("gloo threads left: []") == 2, done.stdout[-3000:]


@pytest.mark.procs
def test_the_readme_loop_exits_0_in_every_torchrun_job(jobs):
    """JOBS torchrun jobs of the README loop, each training every family and destroying its
    group: each must exit 0 (measured: see docs/python-api.md)."""
    for number, done in enumerate(jobs["loop"], 1):
        try:
            ended_cleanly(done)
        except AssertionError as e:
            raise AssertionError(f"job {number} of {JOBS}: {e}") from None
