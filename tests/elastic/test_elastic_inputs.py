"""What an elastic run is given, checked before anything is written, in the test's process: a
value it would override is refused or recorded as it runs; a --min-workers no membership can
reach, a --stop-at between commit points, and a --lighthouse where another service answers,
are refused in one line; `lowcomm join` says why a run cannot be joined (a store address
answered by another service, a directory it may not read), and a joiner that arrives at the
last commit point is not taken in.
"""
from __future__ import annotations

import json
import os
import socket
import threading

import pytest

pytest.importorskip("torchft", reason="--elastic needs torchft (pip install 'lowcomm[elastic]')")

from lowcomm import config as C  # noqa: E402
from lowcomm.cli.flags import config_from_args  # noqa: E402
from lowcomm.cli.main import build_parser, main  # noqa: E402
from lowcomm.launch import join  # noqa: E402
from lowcomm.launch.launcher import prepare  # noqa: E402
from elastic_runs import TINY  # noqa: E402
from fake_lighthouse import status_page  # noqa: E402

DILOCO = [*TINY, "--strategy", "diloco", "--sync-every", "2", "--steps", "4"]


def refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def test_an_elastic_outer_merge_by_equal_weights_is_refused_and_config_records_tokens(tmp_path, capsys):
    out = tmp_path / "r"
    line = refused(["train", *DILOCO, "--outer-weights", "equal", "--out", str(out)], capsys)
    assert line.startswith("error: --outer-weights equal does not run with --elastic: an elastic diloco run uses "
                           "--outer-weights tokens"), line
    assert not out.exists()
    parse = build_parser("train").parse_args
    config_from_args(parse(["train", *DILOCO, "--outer-weights", "tokens", "--sync-every", "4"]))  # what it runs: taken
    # Not given, the merge the run uses is what config.toml records (it recorded 'equal' and ran 'tokens').
    cfg = config_from_args(parse(["train", *DILOCO, "--out", str(out)]))
    prepare(cfg)
    assert C.load_toml(out / "config.toml").strategy_options().outer_weights == "tokens"


def test_min_workers_above_the_replicas_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "r"
    argv = ["train", *TINY, "--workers", "4", "--replicas", "2", "--min-workers", "3", "--steps", "2", "--out", str(out)]
    assert ("--min-workers must be between 1 and --replicas (2): it counts replicas, got 3"
            in refused(argv, capsys))
    assert not out.exists()


def test_a_stop_between_commit_points_is_refused_naming_them_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "r"
    line = refused(["train", *DILOCO, "--steps", "8", "--stop-at", "3", "--out", str(out)], capsys)
    assert line == ("error: --stop-at 3 with --elastic stops at a step that is not a commit point of strategy "
                    "'diloco' (where its workers' state agrees: steps 2, 4, 6, ...)"), line
    assert not out.exists()


def test_a_lighthouse_address_answered_by_another_service_is_refused_up_front(tmp_path, capsys):
    with serving(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n") as port:
        out = tmp_path / "r"
        line = refused(["train", *TINY, "--steps", "2", "--lighthouse", f"127.0.0.1:{port}", "--out", str(out)],
                       capsys)
    assert f"--lighthouse 127.0.0.1:{port}: what answers at 127.0.0.1:{port} is not a torchft lighthouse" in line
    assert not out.exists()


def test_a_lighthouse_waiting_for_more_replicas_than_the_run_has_is_refused_up_front(tmp_path, capsys):
    with status_page("New quorum not ready, only have 0 participants, need min_replicas 4") as url:
        address = url.replace("http://", "")
        line = refused(["train", *TINY, "--steps", "2", "--lighthouse", address, "--out", str(tmp_path / "r")], capsys)
    assert "waits for 4 members (its --min_replicas) before any quorum, and this run has 3" in line


class serving:
    """A TCP service on a free port that answers each connection with `reply` (None: says nothing,
    holding the connection open), as a service on a port a stale address names would."""

    def __init__(self, reply: bytes | None):
        self.reply, self.conns = reply, []
        self.sock = socket.create_server(("127.0.0.1", 0))

    def __enter__(self) -> int:
        threading.Thread(target=self._serve, daemon=True).start()
        return self.sock.getsockname()[1]

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.reply is not None:
                conn.recv(1024)
                conn.sendall(self.reply)

    def __exit__(self, *exc) -> None:
        for conn in self.conns:
            conn.close()
        self.sock.close()


def elastic_run(tmp_path, store: str) -> str:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(C.to_toml(C.RunConfig(elastic=True)))
    (run / "elastic.json").write_text(json.dumps({"lighthouse": "http://127.0.0.1:9", "store": store}))
    return str(run)


@pytest.mark.parametrize("reply", [None, b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n"],
                         ids=["silent", "http"])
def test_a_join_whose_store_address_another_service_answers_is_refused_in_one_line(reply, tmp_path, capsys,
                                                                                    monkeypatch):
    monkeypatch.setattr(join, "STORE_ANSWER_S", 1.0)  # c10d's client, on a silent service: for ever
    with serving(reply) as port:
        run = elastic_run(tmp_path, f"127.0.0.1:{port}")
        line = refused(["join", run], capsys)
    assert line.startswith(f"error: the run in '{run}' is not reachable: what answers at 127.0.0.1:{port} (the "
                           f"store named in {run}/elastic.json) is not its launcher's store ("), line


def test_a_join_of_a_directory_it_may_not_read_says_so(tmp_path, capsys, monkeypatch):
    run = elastic_run(tmp_path, "127.0.0.1:9")
    listdir = os.listdir

    def denied(path):  # as a directory of another user's mode 700 is (the tests run as root)
        if os.fspath(path) == run:
            raise PermissionError(13, "Permission denied", run)
        return listdir(path)
    monkeypatch.setattr(os, "listdir", denied)
    assert refused(["join", run], capsys) == f"error: cannot read '{run}': Permission denied"


@pytest.mark.parametrize("at, taken", [(2, True), (3, False)])
def test_a_joiner_waiting_at_the_last_commit_point_is_not_taken_in(at, taken, monkeypatch):
    """A joiner announced at a commit point re-forms the members with it, except at the last one:
    it would have trained nothing, yet been counted a worker of the run (ddp: a commit each step)."""
    from types import SimpleNamespace
    from lowcomm.train import elastic as E

    w = E.ElasticWorker.__new__(E.ElasticWorker)  # its membership policy alone
    w.cfg, w.joins_seen, w.since = C.RunConfig(steps=4, elastic=True), 0, at
    w.m = SimpleNamespace(progress=lambda: None, joins=lambda: 1)
    # the members trained step `at + 1` and, gathering it, saw one joiner's announcement
    assert w.leaves(at + 1, joins=1) is taken
    assert w.leaves(at + 1, joins=0) is False  # no announcement: the members train on
