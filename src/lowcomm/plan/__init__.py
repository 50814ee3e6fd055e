"""`lowcomm plan`: predicting step time, bytes and memory per strategy (planner.py), per level of
replica groups (levels.py), per replica count (replica_sizes.py, pick.py), tuning a strategy's
options (tune.py), reading --assume (assume.py) and printing the tables (text.py).

Imports: strategies, engines, contract, comm, models (the model a run would build), config, metrics, errors.
Never train, launch, bench or cli.
"""
