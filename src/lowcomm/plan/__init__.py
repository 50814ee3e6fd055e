"""`lowcomm plan`: predicting step time, bytes and memory per strategy (planner.py), per level of
replica groups (levels.py), per replica count (replica_sizes.py, pick.py), tuning a strategy's
options (tune.py), reading --assume (assume.py) and printing the tables (text.py).

Imports: the library, config, metrics, train (the model a run would build). Never launch, bench or cli.
"""
