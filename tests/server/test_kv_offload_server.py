"""``pagedllm serve --kv-offload-gib --kv-offload-dir`` (docs/kv-offload.md): a prefix evicted from a small device pool
comes back from the tiers with the offline engine's greedy text, and /metrics counts it per tier with nothing held
afterwards."""

from __future__ import annotations

import openai
import pytest
import torch
from server_utils import API_KEY, ServerProcess, tiny_chat_model, wait_idle

from pagedllm import LLM, SamplingParams

BLOCK_BYTES = 2 * 2 * 16 * 1 * 32 * 4  # the tiny chat model: layers x K/V x tokens x kv heads x head size x float32


@pytest.mark.slow
def test_served_prefix_from_the_tiers_matches_the_offline_engine(tmp_path):
    ids = torch.randint(100, 40000, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    prefix, filler, last = ids[:160], ids[160:360], ids[:160] + ids[360:367]
    server = ServerProcess(tiny_chat_model(), "--max-model-len", "256", "--block-size", "16",
                           "--kv-cache-memory", str(16 * BLOCK_BYTES), "--kv-offload-gib", str(3 * BLOCK_BYTES / 2**30),
                           "--kv-offload-dir", str(tmp_path))
    try:
        client = openai.OpenAI(base_url=server.url_v1, api_key=API_KEY, max_retries=0, timeout=60)
        texts = [client.completions.create(model=server.served_name, prompt=p, max_tokens=4,
                                           temperature=0).choices[0].text for p in (prefix + ids[367:370], filler, last)]
        m = wait_idle(server.base_url)
        assert m["pagedllm:kv_cache_used_blocks"] == 0 and m["pagedllm:kv_offload_delayed_frees"] == 0
        # P0..P2 stay on the device, P3..P5 come from host, P6..P9 from disk
        assert m["pagedllm:kv_offload_hits_total"] == 7 and m["pagedllm:kv_offload_load_errors_total"] == 0, m
        assert m["pagedllm:kv_offload_bytes_saved_total"] > 0
    finally:
        server.stop()
    llm = LLM(tiny_chat_model(), device="cpu", max_model_len=256)
    want = llm.generate([{"prompt_token_ids": last}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert texts[2] == want[0].outputs[0].text
