"""A local JSON-over-HTTP server (a real socket) for contract tests of the server backends: the
fake engines in test_sglang.py / test_vllm.py give it their routes."""

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse


class JSONServer:
    """Answers ``GET``/``POST`` with ``self.route(method, path, body, query) -> (code, obj)``
    and records every POST as ``(path with query, body)`` in ``self.requests``."""

    def __init__(self):
        self.requests: list[tuple[str, dict | None]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                url = urlparse(self.path)
                if method == "POST":
                    fake.requests.append((self.path, body))
                code, obj = fake.route(method, url.path, body, url.query)
                raw = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def route(self, method: str, path: str, body, query: str):
        return 404, {"detail": "Not Found"}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def good_and_corrupt_exports(hf_dir, root):
    """A bf16 export of ``hf_dir`` with its manifest, and a copy whose config.json no longer
    matches that manifest (what a backend must refuse before telling its server)."""
    from convert.export import export_hf
    from convert.hf_checkpoint import HFCheckpoint

    ckpt = HFCheckpoint(hf_dir)
    good = export_hf(ckpt.tensors(), ckpt.config, root / "v1", "bf16")
    bad = root / "corrupt"
    shutil.copytree(good, bad)
    (bad / "config.json").write_text((bad / "config.json").read_text() + " ")
    return good, bad
