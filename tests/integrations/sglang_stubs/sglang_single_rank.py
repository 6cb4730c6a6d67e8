"""A pytest plugin (``-p sglang_single_rank``) for running SGLang's own test modules outside its launcher.

SGLang reads its parallel topology from a process-wide context that its server launcher publishes; a bare
pytest process has none, so ``HiCacheController.attach_storage_backend`` fails on reading the decode
context-parallel width. This states what a single-rank server publishes (no decode context parallelism)
before any test runs; it changes no SGLang code or test.
"""

from __future__ import annotations


def pytest_configure() -> None:
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0)
