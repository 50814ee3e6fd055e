"""`--tensorboard DIR`: each step's scalars in TensorBoard event files, read back as TensorBoard
reads them; without the optional package the flag is refused (exit 2) before anything starts.
CI installs the `tensorboard` extra (Makefile), so the first test runs there."""
from __future__ import annotations

import json
import sys

import pytest

from tiny_runs import TINY, error_line, unwritable_dir

from lowcomm.cli.main import main


@pytest.mark.procs
def test_scalars_are_written_and_read_back(tmp_path, data_file):
    pytest.importorskip("tensorboard", reason="the optional tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, board = tmp_path / "run", tmp_path / "tb"
    assert main(["train", *TINY, "--steps", "4", "--eval-every", "2", "--data", str(data_file),
                 "--out", str(out), "--tensorboard", str(board)]) == 0
    events = EventAccumulator(str(board))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/val_loss", "throughput/tokens_per_s", "comm/wire_bytes",
            "comm/exposed_pct", "comm/cross/rank0_bytes_total", "compute_s/rank0", "compute_s/rank1"} <= tags
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    logged = [(s.step, s.value) for s in events.Scalars("train/loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records]
    assert [s.step for s in events.Scalars("train/val_loss")] == [2, 4]
    assert all(s.value > 0 for s in events.Scalars("throughput/tokens_per_s"))
    assert events.Scalars("comm/cross/rank0_bytes_total")[-1].value == pytest.approx(
        sum(r["wire_bytes"] for r in records) / 2, rel=1e-6)  # rank 0 sent half of the two ranks' bytes


def test_without_the_package_the_flag_exits_2_saying_what_to_install(tmp_path, data_file, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if it were not installed
    out = tmp_path / "run"
    code = main(["train", *TINY, "--steps", "2", "--data", str(data_file), "--out", str(out),
                 "--tensorboard", str(tmp_path / "tb")])
    assert code == 2
    line = error_line(capfd.readouterr().err)
    assert "--tensorboard" in line and "pip install 'lowcomm[tensorboard]'" in line, line
    assert not out.exists() and not (tmp_path / "tb").exists()


def test_a_directory_that_became_unwritable_is_named_with_its_flag(tmp_path):
    """Writable when the run was checked, not when rank 0 opens it: the error says --tensorboard
    and the directory, not a bare errno (nor, as it once did, that a checkpoint failed)."""
    pytest.importorskip("tensorboard", reason="the optional tensorboard extra is not installed")
    from lowcomm.errors import RunError
    from lowcomm.metrics.tensorboard import TensorBoardLog

    board = unwritable_dir(tmp_path) / "tb"
    with pytest.raises(RunError, match=f"--tensorboard {board}: cannot write there"):
        TensorBoardLog(str(board))
