"""The contract a strategy is written against: the Strategy base class (base.py), what a step is
given and returns (context.py), its options (options.py, values.py: typed values from the user),
the plan of what it sends (plan.py), its state by named parts (parts.py) and where --elastic keeps
its steps (elastic.py).

Imports: comm, models, errors. Never an engine or a paper: both are built on this.
"""
