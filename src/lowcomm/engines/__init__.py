"""What the papers are built from, importing no paper: flat sharded state (flat.py), the
background round (overlap.py), the outer sync, its schedule and its wire (outer_sync.py,
outer_schedule.py, outer_options.py, outer_contract.py, outer_wire.py, sync_by_time.py,
token_weights.py, eager.py), the engine inside a replica (inside.py, inside_fsdp.py), inner
optimizers (optim.py), the two-stage compressed all-reduce with its error feedback (compressed.py)
and torch's PowerSGD hook state kept per parameter (powersgd_state.py).

Imports: contract, comm, compress, models, robust, errors. Never strategies/.
"""
