"""Starting and watching processes: `lowcomm train`'s launcher (launcher.py), worker processes
(supervise.py, forkserver_guard.py), the run directory (rundir.py), whether a run fits
(resources.py), an elastic run's services (elastic.py) and `lowcomm join` (join.py; a replica:
join_replica.py).

Imports: train, elastic, plan, diagnose, metrics, checkpoint, config, strategies, data, comm (the flight ring),
storage, errors. Never bench or cli.
"""
