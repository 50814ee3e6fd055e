"""--attack, --attackers, --aggregate and --score refused in one line where they make no sense,
before anything is written."""
from __future__ import annotations

import pytest

from lowcomm.cli.main import main

FAMILY = "it is an option of: demo, diloco, sparseloco, streaming_diloco"


@pytest.mark.parametrize("argv, said", [
    (["--strategy", "ddp", "--aggregate", "median"], f"--aggregate does not apply to strategy 'ddp' ({FAMILY})"),
    (["--strategy", "acco", "--attack", "zero", "--attackers", "1"],
     f"--attack does not apply to strategy 'acco' ({FAMILY})"),
    (["--strategy", "demo", "--score-every", "5"], "--score-every 5 needs --score: it says how often to score"),
    # a scoring flag given at its default value without --score would do nothing as well
    (["--strategy", "demo", "--score-every", "10"], "--score-every 10 needs --score: it says how often to score"),
    (["--score-patience", "3"], "--score-patience 3 needs --score: it counts rounds of scores"),
    (["--score-batches", "2"], "--score-batches 2 needs --score: it sizes what is scored on"),
    (["--score", "--score-batches", "9", "--micro-batch", "8"], "--score-batches 9 is more than --micro-batch 8: a "
     "worker holds the first sequences of one micro-batch, so it would score on 8"),
    (["--score", "--score-every", "5"], "--score-every does not apply to strategy 'diloco' (it is an option of: demo)"),
    (["--strategy", "zero1", "--score"], f"--score does not apply to strategy 'zero1' ({FAMILY})"),
    (["--workers", "4", "--attack", "sign-flip", "--attackers", "4"],
     "--attackers 4: rank 4 is out of range for 4 workers (ranks 0 to 3)"),
    (["--attack", "sign-flip", "--attackers", "1,x"],
     "--attackers '1,x': 'x' is not a worker rank (ranks are 0, 1, ...; several: 2,3)"),
    (["--attack", "scale:big", "--attackers", "1"], "--attack 'scale:big': scale's value must be a finite number, "
                                                    "got 'big'"),
    (["--attack", "flip", "--attackers", "1"],
     "--attack 'flip' is not one of: sign-flip, scale:K, noise:σ, zero, copy, stale:N, alie[:z], wrong-data (or none)"),
    (["--attack", "zero"], "--attack zero needs --attackers RANKS: which workers attack"),
    (["--attack", "zero", "--attackers", "0,1"], "--attackers 0,1 leaves no honest worker of 2"),
    (["--workers", "4", "--aggregate", "trimmed:0.6"],
     "--aggregate 'trimmed:0.6': β must be a number above 0 and below 0.5 (the share trimmed on each side), got '0.6'"),
    (["--workers", "4", "--aggregate", "trimmed:0.2"],
     "--aggregate trimmed:0.2 trims ⌊0.2·4⌋ = 0 of 4 workers on each side (the mean): give β of at least 0.25"),
    (["--aggregate", "median", "--sync-by", "time"],
     "--aggregate median does not run with --sync-by time: a robust aggregate trusts every worker alike, it takes "
     "no weights"),
    (["--strategy", "demo", "--elastic", "--score", "--validators", "1"],
     "--validators 1 does not run with --elastic yet: it names ranks, and ranks change as members come and go "
     "(every member scores instead)"),
    (["--strategy", "demo", "--workers", "4", "--replicas", "2", "--aggregate", "centered-clip:1"],
     "--aggregate centered-clip:1 does not run on strategy 'demo' across replica groups with --inside ddp: each rank "
     "holds part of every norm it clips by"),
])
def test_a_flag_that_makes_no_sense_is_refused_in_one_line(tmp_path, data_file, capfd, argv, said):
    out = tmp_path / "run"
    strategy = [] if "--strategy" in argv else ["--strategy", "diloco"]
    assert main(["train", *strategy, *argv, "--data", str(data_file), "--out", str(out)]) == 2
    assert capfd.readouterr().err.strip().splitlines() == [f"error: {said}"]
    assert not out.exists()
