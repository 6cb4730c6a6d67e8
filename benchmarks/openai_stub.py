"""An OpenAI-speaking stub engine for ``router_overhead.py``: answers at once (a fixed completion, or a stream
of ``--chunks`` server-sent events), so that what is measured through a router is the router.

Usage: python benchmarks/openai_stub.py --port PORT [--chunks N]
"""

from __future__ import annotations

import argparse
import json
import time

from aiohttp import web

MODEL = "stub"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--chunks", type=int, default=16)
    args = ap.parse_args()

    def completion(text: str, done: bool) -> dict[str, object]:
        return {"id": "cmpl-stub", "object": "text_completion", "created": int(time.time()), "model": MODEL,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": "length" if done else None}],
                "usage": {"prompt_tokens": 8, "completion_tokens": args.chunks, "total_tokens": 8 + args.chunks}}

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response(completion(" tok" * args.chunks, True))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(args.chunks):
            await out.write(f"data: {json.dumps(completion(' tok', i == args.chunks - 1))}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]})

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def info(request: web.Request) -> web.Response:  # what some gateways ask a worker at registration
        return web.json_response({"model_path": MODEL, "tokenizer_path": MODEL, "is_generation": True})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/v1/models", models)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, ok)
    for path in ("/get_model_info", "/get_server_info", "/model_info", "/server_info"):
        app.router.add_get(path, info)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
