"""`lowcomm join RUNDIR` as a user meets it: one more worker, started from another terminal while
a W=2 elastic run trains, joins at a commit point with the live state (its hash equals its
peers'), trains to the end with them, and its steps go into the run's own steps.jsonl; a
RUNDIR that is not a run, a run that is not elastic, a finished run and a run whose launcher is
gone are each refused in one line.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="--elastic needs torchft (pip install 'lowcomm[elastic]')")

from lowcomm.cli.main import main  # noqa: E402
from lowcomm.elastic.address import check_reachable  # noqa: E402
from elastic_runs import TINY, check_finished, join_once, jsonl  # noqa: E402

# The members wait at HOLD's commit point until the joiner has announced itself (a test-only
# hook): its start, a fresh python importing torch, takes 3 to 15 s with the machine's load.
STEPS, HOLD = 24, 12


def refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.fixture
def lighthouse():
    """A torchft lighthouse of the test's own (as an operator runs one for several launches)."""
    from lowcomm.elastic.lighthouse import start
    server = start(2)
    yield server.address().replace("http://", "")
    server.shutdown()


def train_with_a_joiner(out: Path, *flags: str) -> subprocess.CompletedProcess:
    """Train W=2 in this process (the workers' fork server stays warm across tests) while
    `lowcomm join OUT`, another process, is started once the run has logged its first step."""
    logged = out / "steps.jsonl"
    thread, joiner = join_once(out, lambda: logged.exists() and logged.stat().st_size)
    assert main(["train", *TINY, "--workers", "2", "--steps", str(STEPS), "--out", str(out), *flags]) == 0
    thread.join()
    out_, err = joiner[0].communicate(timeout=60)
    assert joiner[0].returncode == 0, err
    return subprocess.CompletedProcess(joiner[0].args, 0, out_, err)


@pytest.mark.elastic
def test_a_worker_joined_from_another_terminal_trains_with_the_live_state(tmp_path, monkeypatch, lighthouse):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOWCOMM_TEST_HOLD_FOR_JOINER", str(HOLD))
    out = tmp_path / "run"
    # sparseloco: diloco whose workers each keep an error-feedback residual, which the joiner starts
    # at zero (a join with ddp, zero1 and diloco: test_elastic_faults.py). The run also uses a
    # lighthouse given with --lighthouse, which outlives it.
    joiner = train_with_a_joiner(out, "--strategy", "sparseloco", "--sync-every", "4", "--lighthouse", lighthouse)
    assert "joining the run" in joiner.stdout and "as worker 2" in joiner.stdout
    assert f"lowcomm: worker 2 trained steps {HOLD + 1} to {STEPS} of the run in {out} (it has finished)" in joiner.stdout
    records, summary = check_finished(out, STEPS)
    assert summary["elastic"]["members"] == [0, 1, 2]  # ends with 3 members, equal hashes (check_finished)
    join = next(q for q in jsonl(out / "membership.jsonl") if 2 in q["healed"])
    assert join["slots"] == [0, 1, 2] and join["committed"][2] == -1 and join["step"] == HOLD
    # The joiner's replicated state (θ_global, the outer state) equals its peers' when it starts training.
    assert len(set(join["state_sha256"])) == 1, join
    # It came through the run's Comm: the heal's record is the pickled state (θ_global, the outer
    # momentum, the inner AdamW, ...: more than the model's own bytes), no link priced it, and
    # summary.json adds up the run's heals.
    heal, heals = join["heal"], [q["heal"] for q in jsonl(out / "membership.jsonl") if q.get("heal")]
    assert heal["from"] in (0, 1) and heal["bytes"] > 4 * summary["params"] and heal["seconds"] > 0, heal
    assert heal["link_s"] == 0.0 and summary["elastic"]["heals"]["heals"] == len(heals) >= 1, summary["elastic"]
    assert summary["elastic"]["heals"]["bytes"] == sum(h["bytes"] for h in heals)
    # Its steps are the run's: from the join on, every record names it, and it trained each of them.
    assert [r["members"] for r in records] == [[0, 1]] * HOLD + [[0, 1, 2]] * (STEPS - HOLD)
    assert summary["micro_batches_per_rank"][2] == (STEPS - HOLD) * summary["micro_batches_per_rank"][0] // STEPS
    assert not (out / "elastic.json").exists()  # the launcher ended: the run takes no more joiners
    # the outer syncs' contributors: 2 before the join, 3 after
    assert summary["elastic"]["contributors_per_outer_sync"] == {"4": 2, "8": 2, "12": 2, "16": 3, "20": 3, "24": 3}
    assert (out / "config.toml").read_text().count(f'lighthouse = "{lighthouse}"') == 1
    check_reachable(f"http://{lighthouse}", "the lighthouse given")  # not the launcher's to stop


def test_a_run_with_nothing_to_join_is_refused_in_one_line(tmp_path, capsys):
    from lowcomm import config as C
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(C.to_toml(C.RunConfig(elastic=True)))
    assert "is not running (no elastic.json" in refused(["join", str(run)], capsys)
    (run / "elastic.json").write_text(json.dumps({"lighthouse": "http://127.0.0.1:9", "store": "127.0.0.1:9"}))
    assert "is not reachable: its store at 127.0.0.1:9 does not answer" in refused(["join", str(run)], capsys)
    (run / "summary.json").write_text("{}")
    assert "has finished" in refused(["join", str(run)], capsys)
    (run / "config.toml").write_text(C.to_toml(C.RunConfig()))
    assert "is not elastic" in refused(["join", str(run)], capsys)
    assert "is not a lowcomm run directory" in refused(["join", str(tmp_path)], capsys)


i = TINY.index("--elastic")
PLAIN = TINY[:i] + TINY[i + 3:]  # without --elastic --min-workers 2


@pytest.mark.parametrize("argv, line", [
    ([*TINY, "--lighthouse", "nowhere"], "--lighthouse must be HOST:PORT (a running torchft lighthouse), got 'nowhere'"),
    ([*TINY, "--lighthouse", "127.0.0.1:9"], "--lighthouse 127.0.0.1:9: nothing answers at 127.0.0.1:9"),
    ([*PLAIN, "--lighthouse", "127.0.0.1:9"], "--lighthouse applies only with --elastic"),
])
def test_a_bad_lighthouse_is_refused_in_one_line(argv, line, capsys, tmp_path):
    assert line in refused(["train", *argv, "--steps", "2", "--out", str(tmp_path / "r")], capsys)
    assert not (tmp_path / "r").exists()

