"""--elastic as a user meets it: a worker SIGKILLed mid-run, with no restart left, is dropped by
the survivors once its heartbeats stop (about 2 s), not after --member-timeout, and they finish the run; no step is logged (applied) twice; every
live worker ends with the same parameters (by hash); a worker whose training thread is stuck is
left out; what a plain run records (validation, dashboards, the flight recorder's account of a
fault) and how it stops on bad steps hold under --elastic. What a strategy declares it cannot run
elastically is refused in one line. (Every fault kind, for
each elastic strategy, in one run each: test_elastic_faults.py.)
"""
from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="--elastic needs torchft (pip install 'lowcomm[elastic]')")

from lowcomm.cli.main import main  # noqa: E402
from elastic_runs import TINY, check_finished, jsonl, wait_for  # noqa: E402

MEMBER_TIMEOUT = 30.0  # --member-timeout where a test tells the heartbeats' drop from the timeout's


def train(out: Path, monkeypatch, capfd, *flags: str, **faults: str) -> str:
    """`lowcomm train` in this process (its workers from the suite's warm fork server), with test
    faults (kill_at="1:5" sets LOWCOMM_TEST_KILL_AT); the launcher's stderr."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name, value in faults.items():
        monkeypatch.setenv(f"LOWCOMM_TEST_{name.upper()}", value)
    code = main(["train", *TINY, *flags, "--out", str(out)])
    err = capfd.readouterr().err
    assert code == 0, err
    return err


@pytest.mark.elastic
def test_diloco_survivors_drop_a_killed_worker_by_its_heartbeats_and_finish(tmp_path, monkeypatch, capfd):
    """... with what a plain run records: validation between commit points, the dashboards (each
    committed step once, none of the redone round's twice), the flight recorder's account of the
    fault (who was lost, the collective each survivor was in)."""
    pytest.importorskip("tensorboard", reason="the optional tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, log, board = tmp_path / "run", tmp_path / "killed", tmp_path / "tb"
    # Four workers, so that in the ring of a collective a survivor waits on another survivor, not only
    # on the dead one: it must fail at once too (the other destroyed its group, closing its sockets).
    err = train(out, monkeypatch, capfd, "--strategy", "diloco", "--sync-every", "4", "--steps", "24", "--workers", "4",
                "--member-timeout", str(MEMBER_TIMEOUT), "--eval-every", "5", "--eval-batches", "2",
                "--tensorboard", str(board), kill_in="1:6", kill_log=str(log))
    assert "worker 1 failed: killed by signal SIGKILL; the others go on without it" in err
    records, summary = check_finished(out, 24)
    quorums = jsonl(out / "membership.jsonl")
    assert [q["slots"] for q in quorums] == [[0, 1, 2, 3], [0, 2, 3]]
    # Worker 1 died inside the first collective of the strategy's own from step 6 on, the sync of
    # step 8, which failed for every survivor.
    fault = quorums[1]["fault"]
    assert fault["lost"] == [1] and set(fault["in"]) == {"0", "2", "3"}, fault
    assert all(e["state"] == "failed" and e["step"] == 8 and not e["bookkeeping"] for e in fault["in"].values()), fault
    assert [r["step"] for r in records if "val_loss" in r] == [5, 10, 15, 20, 24]  # all but 24: between commits
    events = EventAccumulator(str(board))
    events.Reload()
    assert [s.step for s in events.Scalars("train/loss")] == list(range(1, 25))
    assert [s.step for s in events.Scalars("train/val_loss")] == [5, 10, 15, 20, 24]
    # The round in which it died (steps 5-8) is kept: the survivors go back to their state before
    # step 8 (the step ending the round, whose sync failed) and redo only that step and the sync.
    assert quorums[1]["step"] == 4 and quorums[1]["round"] == 7, quorums[1]
    # Dropped by its stopped heartbeats (the lighthouse's 1 s timeout: about 2 s on a quiet machine,
    # 2.7 s seen at load 10-19; bench/faults.py reports the time), not after the member timeout,
    # the other way a silent member leaves: well under a third of it, whatever the load.
    took = quorums[1]["time"] - float(log.read_text().split()[0])
    assert took < MEMBER_TIMEOUT / 3, f"the survivors re-formed {took:.2f} s after the kill"
    assert records[3]["members"] == [0, 1, 2, 3] and records[4]["members"] == [0, 2, 3]
    # each outer sync records its contributors (token-weighted merge): four, then the three survivors
    assert [r["outer"]["contributors"] for r in records if "outer" in r] == [4, 3, 3, 3, 3, 3]
    assert summary["elastic"]["members"] == [0, 2, 3]


@pytest.mark.elastic
def test_consecutive_bad_steps_end_the_run_in_one_line_without_restarting_a_worker(tmp_path, monkeypatch, capfd):
    # Every member sees the same gathered records, so all stop at the same step: the run failed,
    # not a worker, and a restarted one would only train into the same steps.
    out = tmp_path / "run"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOWCOMM_TEST_NAN_AT", "0:3,0:4")
    code = main(["train", *TINY, "--strategy", "ddp", "--steps", "8", "--max-bad-steps", "2", "--max-restarts", "2",
                 "--out", str(out)])
    err = capfd.readouterr().err
    assert code == 1, err
    assert err.strip().splitlines()[-1] == ("error: 2 consecutive steps had a non-finite loss or gradient (the last "
                                            "at step 4; --max-bad-steps 2); try a lower --lr (flight records in "
                                            f"{out / 'flight'})"), err
    assert "restarting" not in err and "go on" not in err, err
    assert [r["step"] for r in jsonl(out / "steps.jsonl")] == [1, 2, 3, 4]


@pytest.mark.elastic
def test_streaming_diloco_survivors_go_back_to_the_last_fragment_merge_and_take_the_restarted_worker_in(
        tmp_path, monkeypatch, capfd):
    # Fragments of H=4 merge a step after their syncs: commits at steps 3, 5, 7, ... Worker 1 dies
    # inside a collective of step 6, with fragment 1's sync of that step in flight: the survivors
    # drop it, go back to step 5's commit, and the restarted worker joins them with their
    # replicated state (θ_global of each fragment, the outer momentum) and a fresh local one:
    # at step 5 if it is up by then, else the survivors re-form at 5 alone and take it in at the
    # next commit point (7), where they wait for it (a loaded machine once started it after the
    # 12 steps were done) unless the test has seen it back already (`back`, a file).
    out, back = tmp_path / "run", tmp_path / "back"

    def restarted_worker_in() -> None:
        wait_for(lambda: (out / "membership.jsonl").exists()
                 and any(1 in q["healed"] for q in jsonl(out / "membership.jsonl")), "the restarted worker's quorum")
        back.touch()
    watcher = threading.Thread(target=restarted_worker_in, daemon=True)
    watcher.start()
    err = train(out, monkeypatch, capfd, "--strategy", "streaming_diloco", "--sync-every", "4", "--fragments", "2",
                "--fragment-delay", "1", "--steps", "12", "--max-restarts", "1", kill_in="1:6",
                kill_log=str(tmp_path / "killed"), hold_for_joiner=f"7:{back}")
    assert "worker 1 failed: killed by signal SIGKILL; the others go on; restarting it (1 of 1)" in err
    records, _ = check_finished(out, 12)
    quorums = jsonl(out / "membership.jsonl")
    assert [q["step"] for q in quorums] in ([0, 5], [0, 5, 5], [0, 5, 7]), quorums
    assert quorums[1]["fault"]["lost"] == [1] and quorums[1]["step"] == 5, quorums[1]
    joined = quorums[-1]
    assert joined["slots"] == [0, 1, 2] and joined["healed"] == [1] and joined["committed"][1] == -1, joined
    for q in quorums:  # a joiner's replicated state equals its peers', and the state it resumed from
        assert len(set(q["state_sha256"] + q["resumed_sha256"])) == 1, q
    assert all(r["outer"]["contributors"] == len(r["members"]) for r in records if "outer" in r)


@pytest.mark.elastic
def test_a_step_the_members_committed_is_logged_when_the_lead_dies_before_writing_it(tmp_path, monkeypatch, capfd):
    # zero1's commit is not atomic: after the gather the members still gather the snapshot. Here the
    # lead (rank 0, steps.jsonl's writer) dies once all of them hold step 4, before writing it: the
    # survivors go on from step 4 and the new lead writes its record, carried in their snapshots.
    out = tmp_path / "run"
    train(out, monkeypatch, capfd, "--strategy", "zero1", "--steps", "6", kill_before_log="0:4",
          kill_log=str(tmp_path / "killed"))
    records, _ = check_finished(out, 6)
    quorums = jsonl(out / "membership.jsonl")
    assert [(q["slots"], q["step"]) for q in quorums] == [([0, 1, 2], 0), ([1, 2], 4)]
    assert records[3]["members"] == [0, 1, 2] and records[4]["members"] == [1, 2]


@pytest.mark.elastic
def test_a_worker_whose_training_thread_is_stuck_stops_heartbeating_and_is_left_out(tmp_path):
    from datetime import timedelta

    import torch.distributed as dist

    from lowcomm.elastic import lighthouse
    from lowcomm.elastic.membership import Membership

    server = lighthouse.start(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stuck, asking = (Membership(server.address(), "127.0.0.1", store.port, slot, timeout_s=0.3) for slot in (0, 1))
    alive = threading.Event()

    def progressing():
        while not alive.wait(0.05):
            stuck.progress()
    threading.Thread(target=progressing, daemon=True).start()
    try:
        # While its training thread makes progress, the lighthouse waits for it to ask too.
        with pytest.raises(Exception, match="(?i)timeout|timed out|deadline"):
            asking._client.quorum(replica_id=asking.id, timeout=timedelta(seconds=2), step=0, world_size=1)
        alive.set()  # stuck from now on: its heartbeats stop 2 x 0.3 s later, the lighthouse drops it 1 s after
        views = []
        threading.Thread(target=lambda: views.append(asking.agree(0)), daemon=True).start()
        # about 2 s; a lighthouse that kept waiting for it would take JOIN_TIMEOUT_MS (600 s)
        wait_for(lambda: views, "quorum without the stuck worker", within=60.0)
        assert views[0].slots == (1,)
    finally:
        alive.set()
        asking.close()
        stuck.close()
        server.shutdown()


@pytest.mark.parametrize("flags, line", [
    (["--strategy", "diloco", "--sync-by", "time"], "--elastic does not run strategy 'diloco': it needs --sync-by steps")])
def test_what_a_strategy_declares_it_cannot_run_elastically_is_refused_in_one_line(flags, line, capsys, tmp_path):
    assert main(["train", *TINY, *flags, "--steps", "2", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {line}") and "\n" not in err, err
    assert not (tmp_path / "r").exists()


def test_min_workers_and_member_timeout_need_elastic(capsys):
    for flag in ("--min-workers", "--member-timeout", "--quorum-timeout"):
        assert main(["train", flag, "2", "--steps", "2", "--data", "pydoc"]) == 2
        assert f"error: {flag} applies only with --elastic" in capsys.readouterr().err
    assert main(["train", *TINY, "--member-timeout", "900", "--timeout", "60", "--steps", "2"]) == 2
    assert "error: --member-timeout must be positive and at most --timeout (60 s), got 900" in capsys.readouterr().err
    assert main(["train", *TINY, "--quorum-timeout", "0", "--steps", "2"]) == 2
    assert "error: --quorum-timeout must be a positive number of seconds, got 0" in capsys.readouterr().err


@pytest.mark.elastic
@pytest.mark.faults
def test_a_quorum_blocked_for_good_ends_the_run_after_the_quorum_timeout_in_one_line(tmp_path, monkeypatch, capfd):
    """Worker 1 stops itself (SIGSTOP) before step 3 and is never continued: the launcher counts it
    live, and the lighthouse never has --min-workers 2 for a quorum. Worker 0 drops it after
    --member-timeout and fails the run --quorum-timeout later, in one line, flight records written."""
    out = tmp_path / "run"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOWCOMM_TEST_STOP_AT", "1:3")
    code = main(["train", *TINY, "--workers", "2", "--min-workers", "2", "--strategy", "ddp", "--steps", "20",
                 "--member-timeout", "2", "--quorum-timeout", "5", "--out", str(out)])
    err = capfd.readouterr().err
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"error: worker 0 had no quorum for \d+ s \(--quorum-timeout 5\); the lighthouse at \S+ "
                        r"says: .*min_replicas 2.* \(flight records in " + re.escape(str(out / "flight")) + r"\)", last), err
    assert (out / "flight" / "rank-0.json").exists()


def test_a_changed_membership_reads_on_in_the_runs_stream_never_a_window_twice_in_an_epoch():
    """A membership of the run's size from the start reads, rank by rank, what a plain run's
    ranks read; memberships of 3, 5 and 4 members after it, each from the position the last
    commit recorded, read the rest of the stream: every window of the epoch once (a fresh
    order per membership read about a quarter of a faulted run's tokens twice)."""
    import numpy as np
    from types import SimpleNamespace

    from lowcomm.data.loader import ShardedBatches
    from lowcomm.elastic.membership import View
    from lowcomm.train.member_data import loader_for

    cfg = SimpleNamespace(workers=4, replicas=0, seed=3, loader_micro_batch=2, model=SimpleNamespace(seq_len=8))
    train = np.arange(4 * 8 * 2 * 30 + 1, dtype=np.int64)  # each token its own value: windows by their start

    def members(world: int, start: int) -> list:
        return [loader_for(cfg, train, View("q", r, world, tuple(range(world)), (0,) * world), start)
                for r in range(world)]

    plain = [ShardedBatches(train, r, 4, 8, 2, cfg.seed) for r in range(4)]
    first = members(4, 0)
    for _ in range(5):
        for mine, theirs in zip(first, plain):
            assert all(np.array_equal(a, b) for a, b in zip(mine.next(), theirs.next()))
    read, position = [], first[0].frontier()
    for world, draws in ((3, 7), (5, 4), (4, 6)):
        loaders = members(world, position)
        for _ in range(draws):
            read += [int(x[0]) for loader in loaders for x in loader.next()[0]]
        position = loaders[0].frontier()
    again = [ShardedBatches(train, r, 4, 8, 2, cfg.seed) for r in range(4)]
    before = {int(x[0]) for loader in again for _ in range(5) for x in loader.next()[0]}
    assert len(before) == 4 * 5 * 2
    assert len(read) == len(set(read)) == 2 * (3 * 7 + 5 * 4 + 4 * 6) and not before & set(read)


def test_validation_batches_are_the_same_whatever_the_membership():
    """Members of any quorum evaluate, between them, exactly the batches the full run does, so a
    validation loss compares across memberships (a 3-member quorum's own shards read other text)."""
    import numpy as np
    from types import SimpleNamespace

    from lowcomm.train.member_data import val_for
    from lowcomm.elastic.membership import View

    cfg = SimpleNamespace(workers=4, micro_batch=2, eval_batches=2, model=SimpleNamespace(seq_len=8))
    val = np.arange(1000, dtype=np.int64) % 251

    def windows(world: int) -> list[bytes]:
        views = [View("q", r, world, tuple(range(world)), (0,) * world) for r in range(world)]
        return sorted(x.numpy().tobytes() for v in views for xs, _ in val_for(cfg, val, v) for x in xs)

    full = windows(4)
    assert len(full) == 4 * 2 * 2
    for world in (1, 2, 3, 5):
        assert windows(world) == full, world
