"""The CLI's training loop (worker.py), what it routes each step to (outputs.py), its optimizer
and schedule from the config (optim.py), its run end (run_end.py), test-only fault hooks
(faults.py), and the elastic worker built on it (elastic.py, rounds.py, replica_run.py).

Imports: run and the library below it, config, checkpoint, metrics, diagnose, elastic.
Never launch, plan, bench or cli.
"""
