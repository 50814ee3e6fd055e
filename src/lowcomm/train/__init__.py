"""The CLI's one training loop (loop.py) and its two membership policies: a plain run's fixed
ranks (worker.py) and an elastic run's members (elastic.py, member_data.py, rounds.py, replica_run.py); where a
rank's run is assembled, for both (assemble.py); what the loop routes each step to (outputs.py),
its optimizer and schedule from the config (optim.py), its run end (run_end.py), test-only fault
hooks (faults.py).

Imports: run and the library below it, config, checkpoint, metrics, diagnose, elastic.
Never launch, plan, bench or cli.
"""
