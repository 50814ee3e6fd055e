"""The command line, one module a concern: the parser and `main` (main.py), the run flags as
argparse reads them (config/flags.py), and bench, report, plan and join (verbs.py).

Imports: anything below it. Nothing imports cli but lowcomm.__main__.
"""
