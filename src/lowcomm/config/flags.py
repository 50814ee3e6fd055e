"""The run flags (`lowcomm train`'s, shared with bench, plan and recipes): one table of what each
sets in a RunConfig, its metavar and its help (cli/flags.py declares them to argparse and
reads them back).

Values stay strings here: config.set_value converts and checks them, so a CLI value and
a TOML value fail with the same message. Each help line states its unit and its default,
the default read from RunConfig itself, so help and behaviour cannot drift apart.
This module imports nothing heavy at import time; building a parser does (config, and the
strategy registry for the option flags), which is why cli/main.py builds only the parser of
the subcommand being run.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    key: str          # dotted config key
    metavar: str      # what the value is (its unit where it has one)
    help: str
    zero: str = ""    # how a 0/empty default reads (e.g. "off"), when it means something else
    switch: bool = False  # an on/off flag: given = true


RUN_FLAGS = {
    "--strategy": Flag("strategy", "NAME", "the strategy (one of: {strategies})"),
    "--workers": Flag("workers", "N", "worker processes W (under torchrun: the world size)"),
    "--replicas": Flag("replicas", "R", "R replicas of W/R processes each: the strategy runs across replicas, "
                                        "--inside within each",
                     zero="one per node under torchrun across nodes, else W: one process a replica"),
    "--inside": Flag("inside", "ENGINE", "what runs inside a replica: ddp (gradients averaged every step) or "
                                         "fsdp (FSDP2: parameters, gradients and optimizer state sharded; "
                                         "{fsdp_strategies})"),
    "--steps": Flag("steps", "N", "trainer steps, each one optimizer update (the local-SGD strategies: an inner "
                                  "step; with --sync-by time: a time slot)"),
    "--micro-batch": Flag("micro_batch", "N", "sequences per micro-batch per worker"),
    "--accum": Flag("accum", "N", "micro-batches per step per worker (adaptive strategies: at least this many)"),
    "--seq-len": Flag("model.seq_len", "TOKENS", "tokens per sequence"),
    "--model": Flag("model.preset", "NAME", "model size preset ({presets}; gpt2: GPT-2 small's dims and 1024 "
                                            "positions) or hf:<architecture>, a transformers causal LM built from "
                                            "its config (needs lowcomm[hf]); with --init-from: the saved model's"),
    "--init-from": Flag("model.init_from", "DIR", "start from the weights in DIR: a lowcomm run (its model/), or a "
                                                  "save_pretrained directory (safetensors) of a transformers causal "
                                                  "LM; DIR's config sets the model, its dims and context, and its "
                                                  "vocabulary must be the data's",
                        zero="random, from --seed"),
    "--compile": Flag("model.compile", "", "torch.compile the model (the CPU needs a C++ compiler, CUDA triton; "
                                           "the first steps compile: slower)", switch=True),
    "--activation-checkpointing": Flag("model.activation_checkpointing", "", "recompute each block's activations "
                                       "in backward instead of keeping them (less memory, more compute; the "
                                       "same loss and gradients)", switch=True),
    "--n-layer": Flag("model.n_layer", "N", "transformer blocks", zero="the preset's"),
    "--n-head": Flag("model.n_head", "N", "attention heads", zero="the preset's"),
    "--d-model": Flag("model.d_model", "N", "model width (channels per token)", zero="the preset's"),
    "--lr": Flag("optim.lr", "LR", "peak learning rate (AdamW)"),
    "--warmup": Flag("optim.warmup_steps", "STEPS", "linear warmup, in trainer steps"),
    "--schedule": Flag("optim.schedule", "NAME", "lr schedule after warmup: cosine or constant"),
    "--min-lr-ratio": Flag("optim.min_lr_ratio", "FRACTION", "cosine floor as a fraction of --lr (0 to 1)"),
    "--weight-decay": Flag("optim.weight_decay", "COEF", "AdamW weight decay coefficient"),
    "--data": Flag("data.source", "SOURCE", "'shakespeare' (bundled), 'pydoc', a UTF-8 text file or directory "
                                            "(byte tokens), a directory made by lowcomm data prepare, nanoGPT's "
                                            "train.bin (or its directory) or llm.c's shards (a file or their "
                                            "directory); token files are memory-mapped and the model takes their "
                                            "vocabulary"),
    "--vocab-size": Flag("data.vocab_size", "N", "the model's vocabulary: for token files that do not say theirs "
                                                 "(nanoGPT's .bin without meta.pkl; else their largest id + 1), or "
                                                 "larger than theirs (padded); never below the data's ids",
                         zero="from the data"),
    "--val-fraction": Flag("data.val_fraction", "FRACTION", "share of the data held out for validation (0 to 1), "
                                                            "where no validation file comes with it (a prepared "
                                                            "directory's, nanoGPT's and llm.c's val files are used "
                                                            "instead)"),
    "--seed": Flag("seed", "N", "seed for init, data order and sampling"),
    "--out": Flag("out", "DIR", "output directory", zero="runs/<strategy>-w<W>-<time>"),
    "--eval-every": Flag("eval_every", "STEPS", "validate every STEPS trainer steps", zero="only at the end"),
    "--eval-batches": Flag("eval_batches", "N", "validation micro-batches per worker"),
    "--threads": Flag("threads", "N", "torch threads per worker"),
    "--backend": Flag("backend", "NAME", "auto (nccl with CUDA, else gloo), gloo or nccl"),
    "--device": Flag("device", "NAME", "auto (cuda with nccl, else cpu), cpu or cuda"),
    "--precision": Flag("precision", "NAME", "forward and backward under autocast: fp32 (none), bf16 or fp16 "
                                             "(CUDA, with a loss scaler); parameters, optimizer states and what "
                                             "each strategy sends stay as in fp32"),
    "--log-every": Flag("log_every", "STEPS", "gather all ranks' step results every STEPS trainer steps"),
    "--slowdown": Flag("slowdown", "F1,...,FW", "rank r computes F_r times slower, each factor >= 1 (emulated)",
                       zero="none"),
    "--stragglers": Flag("stragglers", "P,F", "each step one random rank is F times slower with probability P "
                                              "(emulated)", zero="none"),
    "--timeout": Flag("timeout", "SECONDS", "seconds a collective waits for a stuck peer before the run fails"),
    "--checkpoint-every": Flag("checkpoint_every", "STEPS", "write a checkpoint every STEPS trainer steps and at the "
                                                            "end", zero="off"),
    "--keep": Flag("keep", "N", "checkpoints kept (the newest N)"),
    "--stop-at": Flag("stop_at", "STEP", "end cleanly after this trainer step with a checkpoint (continue later "
                                         "with --resume)", zero="off"),
    "--max-restarts": Flag("max_restarts", "N", "relaunch all workers from the last good checkpoint up to N times",
                           zero="0: none"),
    "--elastic": Flag("elastic", "", "survivors go on when a worker dies; a restarted worker rejoins with the "
                                     "live state ({elastic_strategies}; needs torchft: pip install "
                                     "'lowcomm[elastic]')",
                      switch=True),
    "--min-workers": Flag("min_workers", "N", "with --elastic: the fewest workers a step may run with; with "
                                              "--replicas (or under torchrun) it counts replicas",
                          zero="all of them"),
    "--member-timeout": Flag("member_timeout", "SECONDS", "with --elastic: a member that a collective waits on "
                                                          "this long (frozen, hung) is dropped", zero="10 s"),
    "--quorum-timeout": Flag("quorum_timeout", "SECONDS", "with --elastic: the run fails when its members have had "
                                                          "no quorum this long (too few live workers for good); "
                                                          "said every minute until then"),
    "--lighthouse": Flag("lighthouse", "HOST:PORT", "with --elastic: use this running torchft lighthouse (its "
                                                    "--min_replicas is the quorum) instead of starting one",
                         zero="the launcher starts one"),
    "--max-bad-steps": Flag("max_bad_steps", "N", "stop after this many consecutive non-finite (skipped) steps"),
    "--trace": Flag("trace", "", "write trace.json (Chrome/Perfetto) with every rank's spans", switch=True),
    "--tensorboard": Flag("tensorboard", "DIR", "log each step's scalars (loss, tokens/s, bytes, exposed share, "
                                                "per-rank compute) to DIR for TensorBoard; needs lowcomm[tensorboard]",
                          zero="off"),
    "--wandb": Flag("wandb", "PROJECT", "log the same scalars as --tensorboard to this Weights & Biases project "
                                        "(W&B's settings apply: wandb login, WANDB_MODE); needs lowcomm[wandb]",
                    zero="off"),
    "--checkpoint-on-signal": Flag("checkpoint_on_signal", "", "on SIGINT/SIGTERM write a checkpoint before "
                                                               "stopping", switch=True),
}
LINK_HELP = ("emulate a link per rank: bandwidth in bit/s (100mbit, 1gbit, inf) or bytes/s (50MB/s), latency "
             "(10ms), optional jitter (1ms); TOML: [link]")
TYPE_METAVARS = {"int": "N", "float": "NUM", "str": "TEXT"}
LINK_FLAGS = {"--link": "link", "--intra-link": "intra_link"}  # flag -> its TOML table (or that table's one line)


def dest(key: str) -> str:
    return key.replace(".", "__")


def option_dest(field: str) -> str:
    return f"option__{field}"


def shown(value, zero: str = "") -> str:
    """A default as help shows it: on/off for switches, `zero` for a 0 or empty that means something else."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if zero and value in (0, "", (), None):
        return zero
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def given(args: argparse.Namespace, name: str) -> bool:
    """Whether the run flag `name` was given (False where the subcommand does not declare it)."""
    return getattr(args, dest(RUN_FLAGS[name].key), None) is not None
