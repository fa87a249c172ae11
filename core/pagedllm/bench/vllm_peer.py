"""A vLLM peer process for side-by-side benchmarks: run by the *peer's* Python (its own venv), driven over stdin.

It imports only vLLM and the standard library, so ``pagedllm bench ... --compare-vllm PYTHON`` can start it as
``PYTHON vllm_peer.py '<json engine args>'`` and keep it alive between repeats: the engines then run alternately on
the same prompts without paying vLLM's start-up per repeat. Replies are single lines prefixed with ``@@peer `` on
stdout (vLLM logs to stdout too); every command is one JSON line:

- ``{"op": "generate", "prompts": [[ids...]...], "max_tokens": N}`` -> elapsed seconds and every output's token ids
  (greedy, ``ignore_eos``: exactly N tokens each), the same measurement as ``pagedllm bench throughput``;
- ``{"op": "stream", "prompt": [ids...], "max_tokens": N}`` -> one request stepped through ``llm_engine.step()``
  with a timestamp per new token: time to first token and inter-token latencies;
- ``{"op": "quit"}``.
"""

import json
import sys
import time

TAG = "@@peer "


def reply(obj) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    from vllm import LLM, SamplingParams  # optional: vllm (the peer's own venv)

    args = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    llm = LLM(**args)
    init_s = time.perf_counter() - t0

    def params(n: int) -> "SamplingParams":
        return SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, detokenize=False)

    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params(2), use_tqdm=False)  # warm-up
    reply({"ready": True, "init_s": init_s})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "generate":
            batch = [{"prompt_token_ids": p} for p in cmd["prompts"]]
            t = time.perf_counter()
            outs = llm.generate(batch, params(cmd["max_tokens"]), use_tqdm=False)
            elapsed = time.perf_counter() - t
            reply({"elapsed": elapsed, "token_ids": [list(o.outputs[0].token_ids) for o in outs]})
        elif cmd["op"] == "stream":
            engine = llm.llm_engine
            stamps, seen = [], 0
            t = time.perf_counter()
            engine.add_request("peer-stream", {"prompt_token_ids": cmd["prompt"]}, params(cmd["max_tokens"]))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    n = len(out.outputs[0].token_ids)
                    now = time.perf_counter() - t
                    stamps.extend([now] * (n - seen))
                    seen = n
            reply({"stamps": stamps})
        else:
            reply({"error": f"unknown op {cmd['op']!r}"})


if __name__ == "__main__":
    main()
