"""A run's records and where they go: the output directory (runlog.py: config.toml, steps.jsonl,
summary.json), totals (summary.py), levels (levels.py), the live view (progress.py),
dashboards (scalars.py, tensorboard.py, wandb_log.py), and reading runs back (runs.py).

Imports: config, storage, strategies (the registry's names), engines (the outer step's name),
contract (a step's result), comm (its counters), errors.
"""
