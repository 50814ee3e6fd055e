"""A stand-in for a torchft lighthouse's dashboard, in the test's process: `/status` answers as
torchft 0.2.0's does ("Next quorum status: ..."), which is all lowcomm reads of it over HTTP
(elastic/address.py). What a worker asks over gRPC is faked in the tests themselves."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def status_page(status: str):
    """Serve a lighthouse's status page saying `status` of its next quorum; yields its URL."""
    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"\nCurrent quorum_id: 0 <br>\nNext quorum status: {status}\n\n<h3>Previous Quorum</h3>".encode()
            self.send_response(200)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
