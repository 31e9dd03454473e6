"""One offline run (``vllm.LLM``) of the tiny LLaVA model, run by run.py in
the vLLM venv's Python; writes a JSON result file.

    python offline.py MODEL_DIR RESULT_JSON [--passes N] [--tp 2]
        [--ec JSON] [--max-batched-tokens N] [--max-model-len N] [--hold FILE]
        [--no-prefix-caching]

The workload (the same for every configuration): a pass is 20 prompts of
2 images each, from a pool of 12 images, so a pass has 40 items and the
first pass already hits the cache; later passes hit it for every item.
Then single requests of one image, each timed alone. Greedy decoding of 8
tokens, so token ids are comparable across configurations.

For the encoder cache (ec.py): ``--ec`` is an ``ec_transfer_config`` (JSON),
``--max-batched-tokens`` also sizes vLLM's own encoder cache (in image
tokens: 64 holds 4 of the tiny model's images), and ``--hold FILE`` keeps
the engine running after the result is written, for as long as FILE
exists (a second engine then reads what this one saved).
"""

import argparse
import json
import os
import time

import workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("result")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--singles", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ec", default=None, help="ec_transfer_config, as JSON")
    ap.add_argument("--max-batched-tokens", type=int, default=None)
    # Two images of a model built for larger images take more than 256.
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--hold", default=None, help="after the result, wait while this file exists")
    ap.add_argument("--ready-file", default=None, help="written when the engine is built, before the first pass")
    # A prompt seen before is served from the KV cache, its images with it,
    # and never asks for their encoder outputs: off, every prompt does.
    ap.add_argument("--no-prefix-caching", action="store_true")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    res = {"pid": os.getpid(), "events": {}}

    def event(name):
        res["events"][name] = time.time()

    event("start")
    extra = {}
    if args.ec:
        from vllm.config import ECTransferConfig

        extra["ec_transfer_config"] = ECTransferConfig(**json.loads(args.ec))
    if args.max_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_batched_tokens
    t0 = time.monotonic()
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        distributed_executor_backend="mp",
        mm_processor_cache_type="shm",
        max_model_len=args.max_model_len,
        max_num_seqs=8,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        limit_mm_per_prompt={"image": 2},
        gpu_memory_utilization=float(os.environ.get("E2E_MEM_UTIL", "0.1")),
        enable_prefix_caching=not args.no_prefix_caching,
        **extra,
    )
    res["init_s"] = time.monotonic() - t0
    event("ready")
    if args.ready_file:
        with open(args.ready_file, "w") as f:
            f.write(str(time.time()))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens, pass_s, pass_t, finish = [], [], [], []
    for _ in range(args.passes):
        reqs = workload.pass_requests()
        t, wall = time.monotonic(), time.time()
        outs = llm.generate(reqs, params, use_tqdm=False)
        pass_s.append(time.monotonic() - t)
        pass_t.append([wall, time.time()])
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        finish.append([o.outputs[0].finish_reason for o in outs])
    single_s, single_tokens = [], []
    for i in range(args.singles):
        req = workload.single_request(i)
        t = time.monotonic()
        out = llm.generate([req], params, use_tqdm=False)
        single_s.append(time.monotonic() - t)
        single_tokens.append(list(out[0].outputs[0].token_ids))
    event("done")
    res.update(
        pass_s=pass_s, pass_t=pass_t, single_s=single_s, tokens=tokens, single_tokens=single_tokens, finish=finish
    )
    with open(args.result + ".part", "w") as f:
        json.dump(res, f)
    os.replace(args.result + ".part", args.result)  # whole, for a reader polling for it
    while args.hold and os.path.exists(args.hold):
        time.sleep(0.2)  # held for a second engine; the harness removes the file
    # No explicit shutdown: the script ends as a user's does, and run.py
    # times the exit (from "done" until this process and its children are
    # gone) and reads vLLM's shutdown lines.


if __name__ == "__main__":
    main()
