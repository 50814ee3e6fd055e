"""Elastic membership: a worker that dies is dropped, the survivors go on, a restarted one rejoins.

    lowcomm train --strategy NAME --workers 3 --elastic --min-workers 2 --max-restarts 2

Built from torchft's lighthouse (membership by heartbeat and quorum) and plain c10d groups:

- support.py   what an elastic run can take (one line refusing the rest) and what it reads of its
               strategy's declarations (contract/elastic.py: local state, commit points, re-cut);
- lighthouse.py the launcher's lighthouse (torchft's LighthouseServer) and the workers' client;
               each worker's heartbeats also from a process of their own (beats_serve.py);
- keeper.py    the lighthouse in its own process (lighthouse_serve.py), restarted when it dies;
- membership.py a quorum at a commit point, and the c10d group of its members;
- transfer.py  the live state sent from a peer to a worker that joins or fell behind;
- address.py   `--lighthouse HOST:PORT` (a lighthouse the launcher uses, not starts) and reachability;
- replicas.py  under torchrun, each job one replica of K processes: its rank 0 the member at the
               lighthouse, the quorum handed to its mates, the R*K group, frozen mates stopped;
- checkpoints.py an elastic run's checkpoints and its --resume.

The elastic worker's loop is train/elastic.py, its launcher launch/elastic.py, `lowcomm join`
launch/join.py. Imports: config, checkpoint, comm, strategies (what each declares), data (the loader's
position a checkpoint keeps), errors -- never train or launch.
"""
