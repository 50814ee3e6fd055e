"""A full disk, as a user meets it: one `error:` line naming it and the path, no partial file
left to keep the disk full, never a directory that looks like a run.

End to end on a 2 MB tmpfs where this process may mount one (root), else skipped; the
pieces (atomic writes, the log's truncation, the start-up path) with an injected ENOSPC
everywhere.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import uuid

import pytest

from lowcomm.launch import rundir
from lowcomm.storage import files as storage
from lowcomm.cli.main import main
from lowcomm.errors import DiskFull
from lowcomm.metrics.runlog import StepLog

TINY = ["--workers", "2", "--n-layer", "2", "--n-head", "2", "--d-model", "64", "--seq-len", "16",
        "--data", "pydoc", "--eval-every", "0", "--eval-batches", "1", "--quiet"]


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs, unmounted afterwards; skipped where mounting is not allowed."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


def lowcomm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lowcomm", "train", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)


@pytest.mark.procs
def test_a_disk_that_fills_up_mid_run_and_a_run_into_a_full_disk(small_disk):
    out = small_disk / "run"
    done = lowcomm(*TINY, "--steps", "60", "--checkpoint-every", "5", "--out", str(out))
    assert done.returncode == 1
    line = one_error_line(done.stderr)
    assert "disk is full" in line and str(out) in line, line
    assert not list(out.glob(".ckpt-*")) and not list(out.glob("*.tmp")), sorted(os.listdir(out))
    for line in (out / "steps.jsonl").read_text().splitlines():  # no record cut short
        json.loads(line)
    # Fill what is left, then start another run there: refused in one line, nothing left behind.
    try:
        with open(small_disk / "filler", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * 4096)
    except OSError:
        pass
    again = small_disk / "again"
    done = lowcomm(*TINY, "--steps", "4", "--out", str(again))
    assert done.returncode == 1
    line = one_error_line(done.stderr)
    assert "disk is full" in line and str(again / "config.toml") in line, line
    assert not again.exists()


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_an_atomic_write_onto_a_full_disk_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "config.toml"
    path.write_text('strategy = "ddp"\n')
    monkeypatch.setattr(os, "fsync", _enospc)  # the data reaches the disk at fsync: out of space there
    with pytest.raises(DiskFull, match=f"disk is full.*{path}"):
        storage.write_text_atomic(path, 'strategy = "zero1"\n')
    assert path.read_text() == 'strategy = "ddp"\n' and sorted(os.listdir(tmp_path)) == ["config.toml"]


def test_the_step_log_leaves_no_record_cut_short(tmp_path):
    log = StepLog(tmp_path)
    log.write({"step": 1, "loss": 1.0})

    class HalfThenFull:  # the file as a full disk leaves it: half a record written, then ENOSPC
        def __init__(self, f):
            self.f = f

        def write(self, s):
            self.f.write(s[: len(s) // 2])
            self.f.flush()
            _enospc()

        def __getattr__(self, name):
            return getattr(self.f, name)
    log._f = HalfThenFull(log._f)
    with pytest.raises(DiskFull, match="steps.jsonl"):
        log.write({"step": 2, "loss": 0.5})
    log.close()
    assert [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()] == [{"step": 1, "loss": 1.0}]


def test_a_run_that_cannot_write_its_config_leaves_no_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "fsync", _enospc)
    out = tmp_path / f"run-{uuid.uuid4().hex[:6]}"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "disk is full" in line and str(out / "config.toml") in line, line
    assert not out.exists() and not rundir.is_run(out)


def test_partial_files_are_removed(tmp_path):
    (tmp_path / ".ckpt-000010.tmp").mkdir()
    (tmp_path / ".ckpt-000010.tmp" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "summary.json.tmp").write_text("{")
    (tmp_path / "ckpt-000005").mkdir()
    (tmp_path / "steps.jsonl").write_text("")
    storage.remove_partial(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000005", "steps.jsonl"]


@pytest.mark.procs
def test_a_checkpoint_that_cannot_be_written_is_named_in_the_error(tmp_path, capsys):
    """Not a full disk: the checkpoint's directory name is taken by a file. The one line names
    that checkpoint, so a failure elsewhere can no longer read as a checkpoint's."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ".ckpt-000001.tmp").write_text("in the way\n")  # where step 1's checkpoint is assembled
    assert main(["train", *TINY, "--steps", "2", "--checkpoint-every", "1", "--out", str(out)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"writing checkpoint {out / 'ckpt-000001'} failed: FileExistsError" in line, line
