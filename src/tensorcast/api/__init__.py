"""Engine-facing APIs under the module names engines' own TensorCast clients import.

``tensorcast.api.store`` is the byte-artifact session that SGLang's bundled ``tensorcast`` HiCache backend
(``sglang/srt/mem_cache/storage/tensorcast_store``) is written against. This package owns those names and
their behaviour on top of the caller SDK's KV pages (``client.kv``); it does not own page storage, shard
homes or the wire protocol, and it imports nothing of an engine.
"""
