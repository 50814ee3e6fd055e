"""`lowcomm bench`: every chosen strategy on the same run (compare.py), checked before it starts
(preflight.py); recipes (recipe/) and the reports of runs and benches (report/).

Imports: launch, plan, diagnose, metrics, config, strategies, contract (option values), data (the corpus a
preflight reads), errors. Never cli.
"""
