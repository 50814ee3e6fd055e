"""What membership.jsonl records of a fault: the members of the quorum a member was in when a
collective failed -- or was forming, when it failed forming it: a joiner lost while the quorum
that took it in built its group or sent it the state (DDP's broadcast of the parameters,
transfer.heal) was recorded as `lost: []` when the record named the quorum before. The failure
is forced in the test's process (a fake membership and a build that fails as gloo does)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from lowcomm.comm.flight import FlightRecorder
from lowcomm.elastic.membership import View
from lowcomm.train import elastic as E

BEFORE = View("q1", 0, 3, (0, 1, 2), (4, 4, 4))        # the quorum the survivors trained in
WITH_JOINER = View("q2", 0, 4, (0, 1, 2, 3), (4, 4, 4, -1))  # the one that took the joiner in


class FakeMembership:
    """Agrees on WITH_JOINER, as Membership.agree does before it forms the quorum's group."""
    latest = None

    def agree(self, step, joining=False):
        self.latest = WITH_JOINER
        return WITH_JOINER


def test_a_joiner_lost_while_its_quorum_forms_is_among_the_faults_members():
    w = object.__new__(E.ElasticWorker)  # a member of BEFORE at its commit point, a joiner announced
    w.m, w.view, w.t, w.snapshot, w.fault = FakeMembership(), BEFORE, None, {"step": 4}, None
    w.flight, w.progress = FlightRecorder(0), SimpleNamespace(pending=[])

    def lost_in_the_transfer(view):  # the joiner died in the parameters' broadcast
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    w._build = lost_in_the_transfer
    with pytest.raises(RuntimeError) as e:
        w.form(joining=False)
    assert E.lost_peer(e.value)  # what run_elastic takes for a lost peer: it rolls back
    w.rollback()
    # the members the next quorum's record compares with its own: the joiner among them, so it is named lost
    assert w.fault["members"] == [0, 1, 2, 3]
    assert w.step == 4
