"""The CLI's one training loop (loop.py) and its two membership policies: a plain run's fixed
ranks (worker.py) and an elastic run's members (elastic.py: form, heal, roll back, commit;
member_life.py, member_log.py, member_data.py, rounds.py, replica_run.py); where a rank's Trainer
is assembled, one build_trainer for both (assemble.py); what the loop routes each step to
(outputs.py), its optimizer and schedule from the config (optim.py), its run end, one for both
(run_end.py), test-only fault hooks (faults.py: the run's and an elastic member's).

Imports: run, engines, contract, comm, models, data, storage, errors, config, checkpoint, metrics, diagnose,
elastic.
Never launch, plan, bench or cli.
"""
