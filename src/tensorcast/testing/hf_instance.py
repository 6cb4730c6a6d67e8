"""A test/demo instance process: a tiny seeded Llama served through the HF adaptor.

``python -m tensorcast.testing.hf_instance --worker ADDR --id NAME --seed N --ready-file PATH``
"""

from __future__ import annotations

import argparse
import os

from tensorcast.instance import serve
from tensorcast.instance.hf import HFCausalLMAdaptor, tiny_llama
from tensorcast.log import setup_logging
from tensorcast.testing.instance_process import run_until_signalled


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--ready-file", required=True)
    ap.add_argument("--kv-store-in-background", action="store_true",
                    help="store a prefill's new KV pages after it replied (HFCausalLMAdaptor)")
    args = ap.parse_args()
    setup_logging(f"instance-{args.id}")
    import torch

    torch.set_num_threads(1)
    adaptor = HFCausalLMAdaptor(tiny_llama(args.seed, layers=args.layers),
                                kv_store_in_background=args.kv_store_in_background)
    runtime = serve(adaptor, worker=args.worker, instance_id=args.id, token=os.environ.get("TENSORCAST_TOKEN"))
    run_until_signalled(runtime, args.id, args.ready_file)


if __name__ == "__main__":
    main()
