"""`lowcomm bench`, `report`, `plan`, `join`, `data` and `sample`: the table `lowcomm --help` lists them from, and the
dispatch to each verb's module (bench.py, report.py, plan.py, join.py, data.py, sample.py).

bench and plan declare the run flags they use from config/flags.py (bench: all of train's but
--strategy and --resume; plan: those the planner reads), read by cli/flags.config_from_args
as train's are, so a model, link, slowdown or strategy option is written the same way
everywhere, and each subcommand's --help lists only what it accepts. A strategy option
reaches the strategies that declare it.
"""
from __future__ import annotations

import argparse

from ..errors import UsageError
from . import bench, data, join, plan, report, sample
from .flags import TRAIN_ONLY


SUBCOMMANDS = {  # name -> (one line for `lowcomm --help`, description, what declares its arguments)
    "bench": ("run several strategies side by side and report which to pick",
              "Train each strategy on the same model, data order, seed, workers, link and slowdowns (a train flag "
              "applies to every run; a strategy option to the strategies that have it), then write OUT/report.md "
              "(which run reached the target first, with fewest bytes, and which to pick), plots and the runs.",
              bench.add_bench_arguments),
    "report": ("compare existing runs (report.md and plots)",
               "Build the bench report from run dirs (lowcomm train --out) or bench dirs.", report.add_report_arguments),
    "plan": ("predict step time, traffic and memory of every strategy on a cluster",
             "An analytic model of every strategy on a cluster: compute 6*N*tokens/FLOP/s (or measured with "
             "--calibrate), each strategy's communication plan priced by the link emulator's formulas, what it "
             "overlaps as it declares.", plan.add_plan_arguments),
    "join": ("add one more worker to an elastic run that is training",
             "Join the elastic run in RUNDIR (lowcomm train --elastic --out RUNDIR) as one more worker: it takes "
             "the run's config.toml and the addresses its launcher published, receives the live state from a "
             "member at their next commit point and trains with them to the end of the run.", join.add_arguments),
    "data": ("turn text into token files a run trains on (data prepare)",
             "lowcomm data prepare SOURCE --tokenizer T --out DIR: tokenize a text file or directory, JSONL, "
             "Parquet or a Hugging Face datasets directory into train.bin, val.bin, tokenizer.json and meta.json "
             "(lowcomm train --data DIR reads them).", data.add_arguments),
    "sample": ("generate text from a run's final model",
               "Load RUNDIR/model (the weights a run leaves) and its tokenizer, and continue --prompt.",
               sample.add_arguments),
}


def run_subcommand(args: argparse.Namespace) -> int:
    for flag, hint in TRAIN_ONLY.items():
        if getattr(args, flag[2:], None) is not None:
            raise UsageError(f"{flag} does not apply to lowcomm {args.command} ({hint})")
    return {"bench": bench.run, "report": report.run, "plan": plan.run, "join": join.run, "data": data.run,
            "sample": sample.run}[args.command](args)
