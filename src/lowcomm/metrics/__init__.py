"""A run's records and where they go: the output directory (runlog.py: config.toml, steps.jsonl,
summary.json), totals (summary.py), levels (levels.py), the live view (progress.py),
dashboards (scalars.py, tensorboard.py, wandb_log.py), and reading runs back (runs.py).

Imports: config, storage, strategies, engines, contract and models (a run's planned bytes beside
its counted ones), comm, errors.
"""
