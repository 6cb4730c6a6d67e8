"""Prefill/decode disaggregation with vLLM and TensorCast: a small proxy in front of two vLLM servers.

Start a prefill instance and a decode instance, both with the TensorCast connector (any hosts; they share
no memory, only the cluster):

    vllm serve MODEL --port 8100 --kv-transfer-config \\
        '{"kv_connector": "TensorCastConnector", "kv_role": "kv_producer", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"address": "GATEWAY:PORT"}}'
    vllm serve MODEL --port 8200 --kv-transfer-config '{... "kv_role": "kv_consumer" ...}'
    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Then send OpenAI completion requests to :8000. For each one the proxy asks the prefill instance for one
token (it computes the prompt and stores its KV pages in TensorCast; its answer's ``kv_transfer_params``
say how many pages), then sends the request with those params to the decode instance, which waits for the
pages, loads them and computes only the prompt's last token before decoding. ``handoff`` is the whole
protocol; the rest is HTTP plumbing (standard library only). To deploy it, with pools of each, streaming,
chat, sessions and health checks: ``tensorcast router --prefill URL --backend URL`` (``docs/router.md``).
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Call = Callable[[dict[str, Any]], dict[str, Any]]


def handoff(request: dict[str, Any], prefill: Call, decode: Call) -> dict[str, Any]:
    """One request through both instances: the prefill leg (one token), then the decode leg with the
    prefill's ``kv_transfer_params``. Returns the decode instance's answer."""
    first = prefill({**request, "max_tokens": 1, "stream": False, "kv_transfer_params": {}})
    params = first.get("kv_transfer_params") or {}  # {"tensorcast_pages": N}, or empty: decode recomputes
    return decode({**request, "kv_transfer_params": params})


def http_call(base: str, path: str = "/v1/completions", timeout: float = 600.0) -> Call:
    def call(body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(base.rstrip("/") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer: dict[str, Any] = json.loads(r.read())
            return answer

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer vLLM server")
    ap.add_argument("--decode", required=True, help="base URL of the kv_consumer vLLM server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    prefill, decode = http_call(args.prefill), http_call(args.decode)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self.send_error(404, "only /v1/completions is proxied")
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            out = json.dumps(handoff(body, prefill, decode)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    print(f"proxying http://{args.host}:{args.port}/v1/completions: prefill {args.prefill}, decode {args.decode}")
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
