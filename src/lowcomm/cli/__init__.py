"""The command line, one module a concern: the parser and `main` (main.py), the run flags as
argparse reads them (config/flags.py), and bench, report, plan and join (verbs.py).

Imports: bench, launch, plan, elastic, metrics, checkpoint, config, strategies, contract, models, data,
storage, errors and lowcomm (the version). Nothing imports cli but lowcomm.__main__.
"""
