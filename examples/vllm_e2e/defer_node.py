"""A consumer engine (``vllm.LLM``, the tiny LLaVA, TP=2) driven step by
step, for ec_defer.py: a text request decodes while image requests arrive
whose encoder outputs a peer may give; writes a JSON result file.

    python defer_node.py MODEL_DIR RESULT_JSON [--ec JSON] [--images N]
        [--text-tokens N]

Recorded: every ``LLMEngine.step()``'s wall time and whether an image
request was unfinished then; the time of each of the text request's new
tokens, and its longest gap between two from the images' arrival on (the
engine's first steps are its warm-up); the image requests' token ids
(against stock's: a miss or a hit must give the same tokens).
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
    ap.add_argument("--ec", default=None, help="ec_transfer_config, as JSON")
    ap.add_argument("--images", type=int, default=6)
    ap.add_argument("--text-tokens", type=int, default=96)
    ap.add_argument("--ready-file", default=None)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    extra = {}
    if args.ec:
        from vllm.config import ECTransferConfig

        extra["ec_transfer_config"] = ECTransferConfig(**json.loads(args.ec))
    llm = LLM(
        model=args.model,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enforce_eager=True,
        dtype="float32",
        seed=0,
        limit_mm_per_prompt={"image": 2},
        gpu_memory_utilization=float(os.environ.get("E2E_MEM_UTIL", "0.1")),
        enable_prefix_caching=False,
        **extra,
    )
    if args.ready_file:
        with open(args.ready_file, "w") as f:
            f.write(str(time.time()))
    eng = llm.llm_engine
    text = SamplingParams(temperature=0.0, max_tokens=args.text_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    eng.add_request("text", {"prompt": "user: tell a story\nassistant:"}, text)
    steps, token_times, seen, images_tokens = [], [], 0, {}
    added, added_at = False, 0.0
    n = 0
    wall0 = time.time()
    while eng.has_unfinished_requests():
        if n == 4 and not added:
            # The images node A saw (workload.image(i), i < 12).
            for i in range(args.images):
                req = {"prompt": workload.SINGLE_PROMPT, "multi_modal_data": {"image": workload.image(i)}}
                eng.add_request(f"img-{i}", req, short)
            added, added_at = True, time.monotonic()
        images_pending = added and len(images_tokens) < args.images
        t0 = time.monotonic()
        outs = eng.step()
        t1 = time.monotonic()
        steps.append([t1 - t0, images_pending])
        for o in outs:
            got = len(o.outputs[0].token_ids)
            if o.request_id == "text" and got > seen:
                token_times.extend([t1] * (got - seen))
                seen = got
            elif o.request_id.startswith("img-") and o.finished:
                images_tokens[o.request_id] = list(o.outputs[0].token_ids)
        n += 1
    # From the images' arrival on (the first steps are the engine's warm-up).
    after = [t for t in token_times if t >= added_at]
    gaps = [b - a for a, b in zip(after, after[1:])]
    res = {
        "steps": steps,
        "token_times": token_times,
        "images_at": added_at,
        "longest_gap_s": max(gaps) if gaps else None,
        "images_tokens": images_tokens,
        "pass_t": [[wall0, time.time()]],
    }
    with open(args.result + ".part", "w") as f:
        json.dump(res, f)
    os.replace(args.result + ".part", args.result)


if __name__ == "__main__":
    main()
