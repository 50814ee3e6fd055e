"""Why a run was slow or failed: the post-mortem of every rank's flight ring (postmortem.py,
ringtail.py), stalled collectives (stalls.py), stragglers, slow links and loss spikes
(stragglers.py, slowlink.py, spikes.py), the Chrome trace (trace.py), and the recorder's own cost (flight_cost.py).

Imports: comm (the flight ring), metrics, storage.
"""
