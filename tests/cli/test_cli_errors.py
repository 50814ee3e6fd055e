"""`lowcomm train` rejects bad input with exit 2, one `error:` line naming the bad value,
no traceback, and an untouched output dir; a valid tiny run writes the output contract.

The CLI runs as a subprocess (`python -m lowcomm train ...`), as a user runs it.
Bad input fails before any worker is spawned, so each case takes about as long
as importing torch.
"""
from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from lowcomm import config as C
from tiny_runs import unwritable_dir

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife.\n") * 60  # ~6 KB


def run_cli(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lowcomm", "train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def train_in_process(argv: list[str], work: Path, monkeypatch, capfd, what: str) -> tuple[int, str, str]:
    """`lowcomm train ARGV` through `lowcomm.cli.main`, the function `python -m lowcomm` runs, in this
    process from directory `work`, with the launcher replaced by a failure (bad input is refused
    before it): (exit status, stdout, stderr)."""
    import lowcomm.launch.launcher
    from lowcomm.cli.main import main

    def no_training(*a, **k):
        raise AssertionError(f"{what}: the input was accepted and training was about to start")
    monkeypatch.setattr(lowcomm.launch.launcher, "launch", no_training)
    monkeypatch.chdir(work)
    capfd.readouterr()
    code = main(["train", *argv])
    captured = capfd.readouterr()
    return code, captured.out, captured.err


def snapshot(path: Path) -> dict | None:
    """A directory's full contents (relative path -> bytes), or None when it does not exist."""
    if not path.exists():
        return None
    if path.is_dir() and not os.access(path, os.W_OK):  # nothing this process runs can write there
        return {"": "not writable"}                     # (and /proc/1, root's case, cannot be walked)
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(path.rglob("*"))}


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


def _setup(case: str, tmp: Path, data_file: Path) -> tuple[list[str], str]:
    """The arguments of one bad-input case and the text(s) its message must name."""
    d = ["--data", str(data_file)]
    if case == "unknown_strategy":
        return ["--strategy", "telepathy", *d], "telepathy"
    if case == "workers_zero":
        return ["--workers", "0", *d], ("workers", "0")
    if case == "workers_negative":
        return ["--workers", "-1", *d], ("workers", "-1")
    if case == "workers_non_numeric":
        return ["--workers", "two", *d], "two"
    if case == "steps_non_numeric":
        return ["--steps", "ten", *d], "ten"
    if case == "steps_negative":
        return ["--steps", "-5", *d], ("steps", "-5")
    if case == "steps_float":
        return ["--steps", "2.5", *d], "2.5"
    if case == "lr_non_numeric":
        return ["--lr", "fast", *d], "fast"
    if case == "lr_negative":
        return ["--lr", "-0.001", *d], ("lr", "-0.001")
    if case == "lr_nan":
        return ["--lr", "nan", *d], "nan"
    if case == "micro_batch_negative":
        return ["--micro-batch", "-2", *d], ("--micro-batch", "-2")
    if case == "micro_batch_non_numeric":
        return ["--micro-batch", "lots", *d], "lots"
    if case == "accum_zero":
        return ["--accum", "0", *d], ("accum", "0")
    if case == "seq_len_negative":
        return ["--seq-len", "-16", *d], ("--seq-len", "-16")
    if case == "seed_negative":
        return ["--seed", "-3", *d], ("seed", "-3")
    if case == "missing_data":
        missing = tmp / "no_such_corpus.txt"
        return ["--data", str(missing)], str(missing)
    if case == "empty_data_file":
        p = tmp / "empty.txt"
        p.write_text("")
        return ["--data", str(p)], str(p)
    if case == "whitespace_data_file":
        p = tmp / "blank.txt"
        p.write_text("  \n\n \t\n")
        return ["--data", str(p)], str(p)
    if case == "empty_directory":
        p = tmp / "empty_dir"
        p.mkdir()
        return ["--data", str(p)], str(p)
    if case == "unreadable_data_chmod":
        if os.geteuid() == 0:
            pytest.skip("running as root: chmod 000 does not stop root from reading; "
                        "the unreadable_data_eio case covers an unreadable file for root")
        p = tmp / "secret.txt"
        p.write_text(TEXT)
        p.chmod(0)
        return ["--data", str(p)], str(p)
    if case == "unreadable_data_eio":
        # A regular file whose read fails even for root: /proc/self/mem at offset 0 (unmapped) -> EIO.
        if not Path("/proc/self/mem").exists():
            pytest.skip("needs Linux /proc")
        p = tmp / "corpus.txt"
        p.symlink_to("/proc/self/mem")
        return ["--data", str(p)], str(p)
    if case == "seq_len_longer_than_data":
        p = tmp / "tiny.txt"
        p.write_text("to be or not to be, that is the question\n" * 5)  # ~210 bytes
        return ["--data", str(p), "--seq-len", "512"], "512"
    if case == "malformed_toml":
        p = tmp / "bad.toml"
        p.write_text('strategy = "ddp"\nsteps = = 3\n[optim\n')
        return ["--config", str(p), *d], str(p)
    if case == "unknown_toml_key_top":
        p = tmp / "run.toml"
        p.write_text('strategy = "ddp"\nturbo_mode = true\n')
        return ["--config", str(p), *d], "turbo_mode"
    if case == "unknown_toml_key_in_table":
        p = tmp / "run.toml"
        p.write_text('[optim]\nlr = 0.001\nmomentum_magic = 0.5\n')
        return ["--config", str(p), *d], "momentum_magic"
    if case == "unknown_toml_table":
        p = tmp / "run.toml"
        p.write_text('[optimiser]\nlr = 0.001\n')
        return ["--config", str(p), *d], "optimiser"
    if case == "toml_non_numeric":
        p = tmp / "run.toml"
        p.write_text('steps = "many"\n')
        return ["--config", str(p), *d], "many"
    if case == "missing_config_file":
        p = tmp / "nowhere.toml"
        return ["--config", str(p), *d], str(p)
    if case == "unknown_flag":
        return ["--warp-speed", "9", *d], "--warp-speed"
    # -- what cannot work is refused before anything starts
    if case == "abbreviated_flag":  # flags match exactly: --step is not --steps
        return ["--step", "3", *d], "--step"
    if case == "steps_beyond_int64":
        return ["--steps", str(2**63), *d], ("--steps", str(2**63))
    if case == "toml_seed_beyond_int64":
        p = tmp / "run.toml"
        p.write_text("seed = 1e30\n")
        return ["--config", str(p), *d], ("seed", "64-bit")
    if case == "timeout_negative":
        return ["--timeout", "-1", *d], ("timeout", "-1")
    if case == "model_beyond_memory":
        return ["--d-model", "100000", "--n-head", "1", *d], ("memory", "--d-model 100000")
    if case == "micro_batch_beyond_memory":
        return ["--micro-batch", "100000000", *d], ("memory", "--micro-batch 100000000")
    if case == "workers_beyond_memory":
        return ["--workers", "100000", *d], ("memory", "100000 worker(s)")
    if case == "data_device":
        return ["--data", "/dev/null"], ("/dev/null", "not a regular file")
    if case == "data_fifo":  # reading a FIFO would block forever
        p = tmp / "pipe"
        os.mkfifo(p)
        return ["--data", str(p)], (str(p), "not a regular file")
    if case == "link_negative_bandwidth":
        return ["--link", "-100mbit,10ms", *d], "-100mbit"
    if case == "link_negative_latency":
        return ["--link", "100mbit,-5ms", *d], "-5ms"
    if case == "link_negative_jitter":
        return ["--link", "100mbit,5ms,-1ms", *d], "-1ms"
    if case == "slowdown_negative":
        return ["--slowdown", "-2,1", *d], "-2"
    # a refusal names the flag the user typed, not the TOML key behind it
    if case == "replicas_negative":
        return ["--replicas", "-1", *d], ("--replicas must", "-1")
    if case == "max_restarts_negative":
        return ["--max-restarts", "-1", *d], ("--max-restarts must", "-1")
    if case == "intra_link_negative_latency":
        return ["--workers", "4", "--replicas", "2", "--intra-link", "1gbit,-5ms", *d], ("--intra-link latency", "-5ms")
    if case == "intra_link_zero_bandwidth":
        return ["--workers", "4", "--replicas", "2", "--intra-link", "0mbit,5ms", *d], ("--intra-link bandwidth",
                                                                                       "0mbit")
    if case == "nccl_on_cpu":
        return ["--backend", "nccl", "--device", "cpu", *d], "--backend nccl needs --device cuda, got --device cpu"
    if case == "slowdown_of_other_workers":
        return ["--slowdown", "1,2", "--workers", "3", *d], ("--slowdown '1,2'", "--workers 3")
    if case == "resume_with_another_outer_delay":
        prev = _previous_run(tmp, strategy="diloco")
        return ["--resume", str(prev), "--outer-delay", "1", "--out", str(prev)], ("--resume: --outer-delay cannot",
                                                                                 "given 1")
    if case in TOML_TYPES:
        p = tmp / "run.toml"
        p.write_text(TOML_TYPES[case][0])
        return ["--config", str(p), *d], tuple(name.format(file=p) for name in TOML_TYPES[case][1:])
    # a warm-up that leaves no sync late: the run would be synchronous under --outer-delay 1
    if case == "outer_delay_warmup_at_steps":
        return ["--strategy", "diloco", "--outer-delay", "1", "--outer-delay-warmup", "200", "--steps", "200", *d], \
            ("--outer-delay-warmup 200", "--steps 200")
    if case == "outer_delay_warmup_past_the_last_sync":  # syncs at 32, ..., 192 and the final one at 200
        return ["--strategy", "diloco", "--outer-delay", "1", "--outer-delay-warmup", "192", "--steps", "200", *d], \
            ("--outer-delay-warmup 192", "--steps 200", "step 224")
    if case == "max_accum_below_accum":
        return ["--strategy", "acco", "--accum", "4", "--max-accum", "2", *d], ("--max-accum", "--accum 4")
    if case == "inside_fsdp_without_replicas":  # one process a replica: nothing to shard, not ignored silently
        return ["--inside", "fsdp", *d], ("--inside fsdp", "needs replica groups", "--replicas")
    if case == "out_not_writable":
        out = unwritable_dir(tmp)
        return ["--out", str(out), *d], (str(out), "cannot be written")
    if case == "out_under_proc":  # root passes every mode check, yet nothing can be made in /proc
        return ["--out", "/proc/lowcomm-run", *d], ("/proc/lowcomm-run", "cannot be written")
    if case == "tensorboard_not_writable":  # refused before the run dir is made, not at the first step
        board = unwritable_dir(tmp) / "tb"
        return ["--tensorboard", str(board), *d], ("--tensorboard", str(board), "cannot be written")
    if case == "tensorboard_under_proc":
        return ["--tensorboard", "/proc/tb", *d], ("--tensorboard '/proc/tb'", "cannot be written")
    if case == "tensorboard_is_a_file":
        p = tmp / "board"
        p.write_text("not a directory\n")
        return ["--tensorboard", str(p), *d], ("--tensorboard", str(p), "not a directory")
    if case == "out_is_a_file":
        p = tmp / "taken"
        p.write_text("not a directory\n")
        return ["--out", str(p), *d], str(p)
    if case == "overwrite_not_a_run":  # the dir holds someone's files, not a lowcomm run
        return ["--overwrite", *d], ("--overwrite", "not a lowcomm run")
    # -- what cannot be honoured as written: refused, not adjusted or ignored without a word
    if case == "resume_with_another_strategy":  # named for what it is, not for an option it brings along
        prev = _previous_run(tmp)
        return ["--resume", str(prev), "--strategy", "zero1", "--out", str(prev)], ("--strategy zero1", "ddp")
    if case == "resume_with_overwrite":  # --overwrite cannot apply to a run that continues
        prev = _previous_run(tmp)
        return ["--resume", str(prev), "--overwrite", "--out", str(prev)], ("--overwrite", "--resume")
    if case == "toml_table_of_another_strategy":  # refused as its flag (--max-accum) is
        p = tmp / "run.toml"
        p.write_text('strategy = "ddp"\n[acco]\nmax_accum = 8\n')
        return ["--config", str(p), *d], ("[acco]", "acco.max_accum", "'ddp'")
    if case == "empty_flag_value":  # not read as the default
        return ["--slowdown", "", *d], ("--slowdown", "empty")
    if case == "empty_option_value":
        return ["--strategy", "diloco", "--outer-compress", " ", *d], ("--outer-compress", "empty")
    # options the model cannot honour are refused, never clamped silently
    if case == "demo_topk_beyond_chunks":
        return ["--strategy", "demo", "--demo-topk", "5000", *d], ("--demo-topk 5000", "nothing is compressed")
    if case == "powersgd_rank_beyond_matrices":
        return ["--strategy", "powersgd", "--powersgd-rank", "200", *d], ("--powersgd-rank 200", "no tensor")
    if case == "binary_data":
        p = tmp / "model.dat"
        p.write_bytes(TEXT.encode() + b"\x00\x01\x02" * 100)
        return ["--data", str(p)], (str(p), "not text", f"offset {len(TEXT):,}")
    if case == "binary_file_in_data_dir":
        p = tmp / "corpus"
        p.mkdir()
        (p / "a.txt").write_text(TEXT)
        (p / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
        return ["--data", str(p)], (str(p / "b.png"), "not text")
    if case.startswith("token_file") or case == "nanogpt_data_directory":
        return _token_file_case(case, tmp)
    raise AssertionError(case)


# TOML's booleans are not its numbers or strings: the file, and what the refusal names
TOML_TYPES = {
    "toml_bool_from_string": ('strategy = "diloco"\n[diloco]\nouter_delay = 1\neager = "yes"\n',
                              'diloco.eager must be true or false, got "yes"', "{file}"),
    "toml_bool_from_integer": ("trace = 1\n", "trace must be true or false, got 1", "{file}"),
    # a strategy option at the top level, applied once the strategy is known
    "toml_option_bool_from_integer": ('strategy = "diloco"\nouter_delay = 1\neager = 1\n',
                                      "eager must be true or false, got 1"),
    "toml_integer_from_bool": ("steps = true\n", "steps must be an integer, got true", "{file}"),
    "toml_float_from_bool": ("[optim]\nlr = false\n", "optim.lr must be a number, got false", "{file}"),
    "toml_link_from_number": ("link = 5\n", 'link must be text, "BANDWIDTH,LATENCY[,JITTER]"', "[link] table, got 5"),
}


def _token_file_case(case: str, tmp: Path) -> tuple[list[str], tuple[str, ...]]:
    """Pre-tokenized data (nanoGPT's train.bin of uint16 tokens, llm.c's shards) too small to train
    on, or with a vocabulary file that is not one: refused naming the file (tests/data has the rest)."""
    if case == "token_file_with_zero_byte":  # nanoGPT's shakespeare_char: a 65-token vocabulary, high bytes 0
        (tmp / "meta.pkl").write_bytes(b"\x80\x04\x95 pickled vocabulary")
        p = tmp / "train.bin"
        p.write_bytes(struct.pack("<8H", 18, 47, 56, 57, 58, 1, 15, 47))
        return ["--data", str(p)], (str(tmp / "meta.pkl"), "is not nanoGPT's meta.pkl")
    if case == "token_file_without_zero_byte":  # GPT-2 tokens whose bytes hold no 0 and are not UTF-8
        p = tmp / "train.bin"
        p.write_bytes(struct.pack("<6H", 5962, 22307, 1169, 966, 464, 2068))
        assert b"\0" not in p.read_bytes()
        return ["--data", str(p)], (str(p), "is longer than the data")
    if case == "token_file_of_llm_c":  # a shard of llm.c: 256 int32s of header, magic first, any name
        p = tmp / "tinyshakespeare_val.dat"
        p.write_bytes(struct.pack("<256i", 20240520, 1, 3, *[0] * 253) + struct.pack("<3H", 5962, 22307, 25))
        return ["--data", str(p)], (str(p), "is longer than the data")
    if case == "nanogpt_data_directory":  # the folder nanoGPT's prepare.py leaves: its text beside its tokens
        p = tmp / "shakespeare_char"
        p.mkdir()
        (p / "input.txt").write_text(TEXT)
        (p / "meta.pkl").write_bytes(b"\x80\x04\x95\x00 pickled vocabulary")
        (p / "train.bin").write_bytes(struct.pack("<4H", 18, 47, 56, 57))
        return ["--data", str(p)], (str(p / "meta.pkl"), "is not nanoGPT's meta.pkl")
    raise AssertionError(case)


def _previous_run(tmp: Path, strategy: str = "ddp") -> Path:
    """A run's directory as `lowcomm train` leaves it (config.toml; no checkpoint needed:
    what is refused is refused before one is looked for)."""
    prev = tmp / "prev"
    prev.mkdir()
    cfg = C.RunConfig(strategy=strategy)
    cfg.out = str(prev)
    (prev / "config.toml").write_text(C.to_toml(cfg))
    return prev


CASES = ["unknown_strategy", "workers_zero", "workers_negative", "workers_non_numeric",
         "steps_non_numeric", "steps_negative", "steps_float", "lr_non_numeric", "lr_negative", "lr_nan",
         "micro_batch_negative", "micro_batch_non_numeric", "accum_zero", "seq_len_negative",
         "seed_negative", "missing_data", "empty_data_file", "whitespace_data_file", "empty_directory",
         "unreadable_data_chmod", "unreadable_data_eio", "seq_len_longer_than_data", "malformed_toml",
         "unknown_toml_key_top", "unknown_toml_key_in_table", "unknown_toml_table", "toml_non_numeric",
         "missing_config_file", "unknown_flag",
         "abbreviated_flag", "steps_beyond_int64", "toml_seed_beyond_int64", "timeout_negative",
         "model_beyond_memory", "micro_batch_beyond_memory", "workers_beyond_memory", "data_device",
         "data_fifo", "link_negative_bandwidth", "link_negative_latency", "link_negative_jitter",
         "slowdown_negative", "replicas_negative", "max_restarts_negative", "intra_link_negative_latency",
         "intra_link_zero_bandwidth", "nccl_on_cpu", "slowdown_of_other_workers", "resume_with_another_outer_delay",
         "toml_bool_from_string", "toml_bool_from_integer", "toml_option_bool_from_integer", "toml_integer_from_bool",
         "toml_float_from_bool", "toml_link_from_number", "outer_delay_warmup_at_steps", "outer_delay_warmup_past_the_last_sync",
         "max_accum_below_accum", "out_not_writable", "out_is_a_file",
         "inside_fsdp_without_replicas", "out_under_proc", "tensorboard_not_writable", "tensorboard_under_proc", "tensorboard_is_a_file",
         "overwrite_not_a_run",
         "resume_with_another_strategy", "resume_with_overwrite", "toml_table_of_another_strategy",
         "empty_flag_value", "empty_option_value", "binary_data", "binary_file_in_data_dir",
         "demo_topk_beyond_chunks", "powersgd_rank_beyond_matrices", "token_file_with_zero_byte",
         "token_file_without_zero_byte", "token_file_of_llm_c", "nanogpt_data_directory"]

# The cases whose check runs last before anything is written (data, sizes, config):
# run them against an output dir that already holds files, which must stay as they were.
PRE_EXISTING = {"unknown_strategy", "empty_data_file", "unreadable_data_eio", "seq_len_longer_than_data",
                "unknown_toml_key_in_table", "workers_zero", "model_beyond_memory", "max_accum_below_accum",
                "link_negative_latency", "overwrite_not_a_run", "toml_table_of_another_strategy", "binary_data"}


def assert_usage_error(code: int, stdout: str, stderr: str, names: str | tuple[str, ...]) -> None:
    assert code == 2, f"exit {code}\nstdout: {stdout}\nstderr: {stderr}"
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    assert lines[0].startswith("error: "), lines[0]
    for name in (names,) if isinstance(names, str) else names:
        assert name in lines[0], f"the message does not name {name!r}: {lines[0]}"


def _prepare_case(case, tmp_path, data_file):
    work = tmp_path / "cwd"
    work.mkdir()
    args, names = _setup(case, tmp_path, data_file)
    out = tmp_path / "out"
    if "--out" in args:  # the case is about the output path itself
        return work, args, names, Path(args[args.index("--out") + 1])
    if case in PRE_EXISTING:
        out.mkdir()
        (out / "notes.txt").write_text("my notes\n")
        (out / "config.toml").write_text("# an older run's config\n")
        (out / "sub").mkdir()
        (out / "sub" / "x.bin").write_bytes(b"\x00\x01")
    return work, [*args, "--out", str(out)], names, out


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_with_one_line(case, tmp_path, data_file, capfd, monkeypatch):
    """Every case through `lowcomm.cli.main`, the function `python -m lowcomm` runs
    (in this process: a subprocess per case would spend the suite's time importing torch;
    test_bad_input_subprocess runs a representative subset the way a user does)."""
    work, argv, names, out = _prepare_case(case, tmp_path, data_file)
    before = snapshot(out)
    code, stdout, stderr = train_in_process(argv, work, monkeypatch, capfd, case)
    assert_usage_error(code, stdout, stderr, names)
    assert snapshot(out) == before, "the output dir was touched"
    assert list(work.iterdir()) == [], "something was written to the working directory"


SUBPROCESS_CASES = ["unknown_flag", "unreadable_data_eio", "unknown_toml_key_in_table"]  # argparse, data, config


@pytest.mark.procs
@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_bad_input_subprocess(case, tmp_path, data_file):
    """The same contract for `python -m lowcomm train ...` as a process: exit status 2,
    a single stderr line (no warning or traceback around it), nothing written."""
    work, argv, names, out = _prepare_case(case, tmp_path, data_file)
    before = snapshot(out)
    proc = run_cli(argv, cwd=work)
    assert_usage_error(proc.returncode, proc.stdout, proc.stderr, names)
    assert snapshot(out) == before, "the output dir was touched"
    assert list(work.iterdir()) == [], "something was written to the working directory"


def _command_case(case: str, tmp: Path, data_file: Path) -> tuple[list[str], str | tuple[str, ...]]:
    """bench's and plan's own bad inputs: the arguments (subcommand first) and what the message names."""
    plan = ["plan", "--worker-tflops", "1"]
    bench = ["bench", "--data", str(data_file), "--out", str(tmp / "bench")]
    if case == "plan_absurd_params":  # would walk ddp's buckets for hours
        return [*plan, "--params", "1e18"], ("--params 1e18", "at most")
    if case == "plan_absurd_width":
        return [*plan, "--d-model", "10000000", "--n-head", "1"], ("--d-model", "parameters", "at most")
    if case == "plan_absurd_depth":
        return [*plan, "--n-layer", "100000"], ("--n-layer", "100000 layers", "at most")
    if case == "plan_absurd_workers":
        return [*plan, "--params", "1e6", "--workers", "100000000"], ("--workers 100000000", "at most")
    if case == "plan_micro_batch_zero":  # the flag typed, not the key behind it
        return [*plan, "--params", "1e6", "--micro-batch", "0"], "--micro-batch must be at least 1, got 0"
    if case == "plan_slowdown_of_other_workers":
        return [*plan, "--params", "1e6", "--workers", "3", "--slowdown", "1,2"], ("--slowdown has 2 factor(s)",
                                                                                    "(--workers 3)")
    if case == "plan_empty_strategies":  # not read as "all of them"
        return [*plan, "--params", "1e6", "--strategies", ""], "--strategies ''"
    if case == "plan_train_only_flag":
        return [*plan, "--params", "1e6", "--resume", str(tmp)], ("--resume", "lowcomm plan")
    if case == "bench_empty_strategies":  # not read as the default list
        return [*bench, "--strategies", " "], "--strategies ' '"
    if case == "bench_table_of_no_benched_strategy":
        p = tmp / "bench.toml"
        p.write_text("[acco]\nmax_accum = 8\n")
        return [*bench, "--strategies", "ddp,zero1", "--config", str(p)], ("[acco]", "none of the strategies")
    if case == "bench_recipe_of_two_million_runs":  # was minutes of silent checking, then years of runs
        p = tmp / "huge.toml"
        lrs = ", ".join(f"{(i + 1) * 1e-6:g}" for i in range(2000))
        p.write_text(f"seeds = {list(range(1000))}\n[sweep]\nlr = [{lrs}]\n[[run]]\nstrategy = \"ddp\"\n")
        return ["bench", str(p), "--out", str(tmp / "bench")], ("2,000,000 runs", "2,000 lr x 1,000 seeds",
                                                                "at most 1,000")
    if case == "bench_single_strategy_flag":
        return [*bench, "--strategy", "ddp"], ("--strategy", "--strategies")
    raise AssertionError(case)


COMMAND_CASES = ["plan_absurd_params", "plan_absurd_width", "plan_absurd_depth", "plan_absurd_workers",
                 "plan_micro_batch_zero", "plan_slowdown_of_other_workers",
                 "plan_empty_strategies", "plan_train_only_flag", "bench_empty_strategies",
                 "bench_table_of_no_benched_strategy", "bench_single_strategy_flag", "bench_recipe_of_two_million_runs"]


@pytest.mark.parametrize("case", COMMAND_CASES)
def test_bad_input_of_bench_and_plan(case, tmp_path, data_file, capfd, monkeypatch):
    """The same contract for `lowcomm bench` and `lowcomm plan`: exit 2, one line, nothing written."""
    import lowcomm.launch.launcher
    from lowcomm.cli.main import main

    monkeypatch.setattr(lowcomm.launch.launcher, "launch", lambda *a, **k: pytest.fail(f"{case}: training started"))
    work = tmp_path / "cwd"
    work.mkdir()
    argv, names = _command_case(case, tmp_path, data_file)
    before = snapshot(tmp_path)
    monkeypatch.chdir(work)
    capfd.readouterr()
    code = main(argv)
    captured = capfd.readouterr()
    assert_usage_error(code, captured.out, captured.err, names)
    assert snapshot(tmp_path) == before, "something was written"


def test_text_that_is_not_utf8_is_trained_on_with_one_warning(tmp_path, capsys):
    """Latin-1 text is text: its raw bytes are the tokens; the user is told once, and the
    run's description of its data (summary.json's `data`) says so."""
    from lowcomm.data import load_bytes

    p = tmp_path / "latin1.txt"
    p.write_bytes(TEXT.encode() + "déjà vu\n".encode("latin-1"))
    tokens, label = load_bytes(str(p))
    assert len(tokens) == len(TEXT) + len("déjà vu\n") and label.endswith(", not UTF-8)")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: data file '{p}' is not UTF-8 (an invalid byte at offset {len(TEXT) + 1:,}): "
                   f"training on its raw bytes"]
    load_bytes(str(p), quiet=True)  # the launcher's check before the workers start: silent
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("toml, said", [
    ("max_restarts = -1\n", "max_restarts must not be negative, got -1"),
    ("replicas = -1\n", "replicas must be at least 1 (0: one per worker), got -1"),
    ('workers = 3\nslowdown = "1,2"\n', "slowdown '1,2' has 2 factor(s) but there are 3 workers (workers = 3; give "
                                          "one factor per worker)"),
    ('[intra_link]\nlatency = "5ms"\n', "intra_link.latency '5ms' needs a link bandwidth too (e.g. --intra-link "
                                          "inf,5ms for latency only)"),
])
def test_a_refusal_names_a_setting_as_the_config_file_wrote_it(toml, said, tmp_path, data_file, monkeypatch, capfd):
    """The flag typed is named on the command line (the cases above); the TOML key, from a file."""
    p = tmp_path / "run.toml"
    p.write_text(toml)
    code, stdout, stderr = train_in_process(["--config", str(p), "--data", str(data_file)], tmp_path, monkeypatch,
                                            capfd, toml)
    assert (code, stderr) == (2, f"error: {said}\n")


@pytest.mark.parametrize("strategy, warmup, first_late", [("diloco", 150, 160), ("streaming_diloco", 150, 152),
                                                           ("streaming_diloco", 184, 192)])
def test_a_warm_up_is_taken_while_a_sync_after_it_comes_before_the_last_step(strategy, warmup, first_late):
    """--steps 200, H = 32: diloco syncs at 32, ..., 192; streaming_diloco's four fragments every 8 steps."""
    cfg = C.RunConfig(strategy=strategy)
    for key, value in (("outer_delay", 1), ("outer_delay_warmup", warmup)):
        C.set_value(cfg, f"{strategy}.{key}", value)
    C.validate(cfg)
    assert cfg.strategy_options().first_late_sync() == first_late


def test_a_plan_of_the_steady_state_takes_any_warm_up(capsys):
    """`lowcomm plan` without --steps prices the steady state, where no warm-up is left: the run's
    length (--steps' default) does not bound it there as it bounds a run that trains."""
    from lowcomm.cli.main import main
    argv = ["plan", "--strategies", "diloco", "--outer-delay", "1", "--outer-delay-warmup", "300", "--params", "1e6",
            "--worker-tflops", "1"]
    assert main(argv) == 0, capsys.readouterr().err
    assert main([*argv, "--steps", "400"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("steps, said", [(33, True), (32, False), (20, False)])
def test_the_delays_momentum_note_is_said_only_where_a_mean_comes_late(steps, said):
    """H = 32: --steps 33 has a regular sync at 32, a period late; at 32 or fewer steps the only sync is
    the run's final one, which waits for its mean: nothing stale goes through the momentum."""
    cfg = C.RunConfig(strategy="diloco", steps=steps)
    C.set_value(cfg, "diloco.outer_delay", 1)
    C.validate(cfg)
    note = cfg.strategy_options().run_note(cfg)
    assert (note is not None and note.startswith("--outer-delay 1 with outer momentum 0.9")) == said, note


def test_a_token_file_is_refused_from_its_first_bytes_or_else_from_all_of_them(tmp_path, monkeypatch):
    """A token file may be gigabytes (nanoGPT's openwebtext train.bin is 17 GB): refused before it is
    read whole, and so is binary data; one whose first bytes happen to be text is refused once it is read."""
    from lowcomm.data import corpus, load_bytes
    from lowcomm.errors import UsageError

    tokens = struct.pack("<4H", 18, 47, 56, 57)
    head_tokens, text_head = tmp_path / "a" / "train.bin", tmp_path / "b" / "train.bin"
    for p, data in ((head_tokens, tokens * corpus.HEAD_BYTES), (text_head, TEXT.encode() * 20 + tokens)):
        p.parent.mkdir()
        p.write_bytes(data)
    assert len(TEXT.encode() * 20) > corpus.HEAD_BYTES
    with monkeypatch.context() as patched:
        patched.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} was read whole"))
        with pytest.raises(UsageError, match=f"data file '{head_tokens}' looks like pre-tokenized tokens"):
            load_bytes(str(head_tokens))
        weights = tmp_path / "model.safetensors"
        weights.write_bytes(b"\x08\x00\x00\x00" * corpus.HEAD_BYTES)
        with pytest.raises(UsageError, match=f"data file '{weights}' is not text: a NUL byte at offset 1 "):
            load_bytes(str(weights))
    with pytest.raises(UsageError, match=f"data file '{text_head}' looks like pre-tokenized tokens"):
        load_bytes(str(text_head))


def test_bad_input_without_out_writes_nothing(tmp_path, monkeypatch, capfd):
    """With no --out the default is runs/<...> under the working directory: not created either."""
    code, stdout, stderr = train_in_process(["--strategy", "telepathy"], tmp_path, monkeypatch, capfd, "telepathy")
    assert_usage_error(code, stdout, stderr, "telepathy")
    assert list(tmp_path.iterdir()) == []


# -- a valid tiny run -----------------------------------------------------------------------

STEP_FIELDS = {"step", "loss", "tokens", "micro_batches", "wire_bytes", "compute_s", "comm_s",
               "exposed_comm_s", "wall_s", "lr"}
SUMMARY_FIELDS = {"strategy", "workers", "steps", "tokens", "final_train_loss", "final_val_loss", "wall_s",
                  "tokens_per_s", "wire_bytes_total", "wire_bytes_per_step", "exposed_comm_fraction",
                  "peak_mem_bytes"}
TINY = ["--workers", "2", "--steps", "3", "--n-layer", "1", "--n-head", "2", "--d-model", "16",
        "--seq-len", "16", "--micro-batch", "2", "--eval-every", "2", "--eval-batches", "2",
        "--warmup", "1", "--quiet"]


@pytest.mark.procs
def test_valid_tiny_run_writes_the_output_contract(tmp_path, data_file):
    out = tmp_path / "run"
    proc = run_cli([*TINY, "--data", str(data_file), "--out", str(out), "--strategy", "zero1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr

    # config.toml: the resolved config, with the flags applied
    cfg_text = (out / "config.toml").read_text()
    cfg = tomllib.loads(cfg_text)
    assert cfg["strategy"] == "zero1" and cfg["workers"] == 2 and cfg["steps"] == 3
    assert cfg["model"]["d_model"] == 16 and cfg["model"]["seq_len"] == 16
    assert cfg["data"]["source"] == str(data_file)

    # steps.jsonl: one object per optimizer step, every field present and sensible
    lines = (out / "steps.jsonl").read_text().strip().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    tokens_per_step = 2 * 1 * 2 * 16  # workers * accum * micro_batch * seq_len
    for r in records:
        assert STEP_FIELDS <= r.keys(), STEP_FIELDS - r.keys()
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 10
        assert r["tokens"] == tokens_per_step
        assert r["micro_batches"] == 2
        assert r["wire_bytes"] > 0
        assert r["lr"] > 0
        for k in ("compute_s", "comm_s", "exposed_comm_s", "wall_s"):
            assert r[k] >= 0
    assert "val_loss" in records[1] and "val_loss" in records[2]  # every 2 steps and at the end
    assert abs(records[0]["loss"] - math.log(256)) < 0.3  # N(0, 0.02) init: first loss ~ ln(vocab)

    # summary.json
    s = json.loads((out / "summary.json").read_text())
    assert SUMMARY_FIELDS <= s.keys(), SUMMARY_FIELDS - s.keys()
    assert s["strategy"] == "zero1" and s["workers"] == 2 and s["steps"] == 3
    assert s["tokens"] == 3 * tokens_per_step
    assert s["wire_bytes_total"] == sum(r["wire_bytes"] for r in records)
    assert s["wire_bytes_per_step"] == pytest.approx(s["wire_bytes_total"] / 3)
    assert s["final_train_loss"] == pytest.approx(records[-1]["loss"])
    assert s["final_val_loss"] == pytest.approx(records[-1]["val_loss"])
    assert math.isfinite(s["final_val_loss"])
    assert 0 <= s["exposed_comm_fraction"] <= 1
    assert s["peak_mem_bytes"] > 0 and s["wall_s"] > 0 and s["tokens_per_s"] > 0
    assert s["machine"]["threads"] == 2 and s["machine"]["cores"] >= 1  # 2 workers, one thread each

    # config.toml fed back through --config resolves to the same config
    again = C.load_toml(out / "config.toml")
    assert C.to_dict(again) == cfg
    assert C.to_toml(again) == cfg_text
    # ... and through the CLI's own parsing of --config (what a second run would train with)
    from lowcomm.cli.main import build_parser, config_from_args
    via_cli = config_from_args(build_parser().parse_args(["train", "--config", str(out / "config.toml")]))
    assert C.to_dict(via_cli) == cfg


def test_existing_run_is_not_overwritten(tmp_path, data_file, monkeypatch, capfd):
    """An output dir that already holds a run is a usage error unless --overwrite."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "steps.jsonl").write_text('{"step": 1}\n')
    (out / "config.toml").write_text("# old\n")
    before = snapshot(out)
    code, stdout, stderr = train_in_process([*TINY, "--data", str(data_file), "--out", str(out)], tmp_path,
                                            monkeypatch, capfd, "an existing run")
    assert_usage_error(code, stdout, stderr, str(out))
    assert snapshot(out) == before


def test_nccl_takes_a_gpu_per_worker_auto_falls_back_and_asked_for_is_refused(tmp_path, data_file, capfd,
                                                                               monkeypatch):
    """On a machine with one GPU (faked here: this one has none), two workers cannot run NCCL
    (two ranks on one GPU fail with "Duplicate GPU detected"): --backend auto runs them on gloo,
    saying so; --backend nccl is refused in one line before anything is written."""
    import torch
    import torch.distributed as dist
    from lowcomm.train.worker import pick_backend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert [pick_backend(C.RunConfig(workers=w)) for w in (1, 2)] == ["nccl", "gloo"]
    work = tmp_path / "cwd"
    work.mkdir()
    out = tmp_path / "out"
    argv = ["--workers", "2", "--backend", "nccl", "--steps", "2", "--data", str(data_file), "--out", str(out)]
    code, stdout, stderr = train_in_process(argv, work, monkeypatch, capfd, "nccl on one GPU")
    assert_usage_error(code, stdout, stderr, ("--backend nccl", "2 workers on 1 GPU"))
    assert not out.exists()
