"""``pagedllm bench mm-throughput`` at its smallest size: the seeded mixed workload runs through pagedllm and HF
transformers, and the report's fields agree with the workload (counts, tokens, alternated repeats, a ratio)."""

from __future__ import annotations

import json

import pytest
from pagedllm.bench.mm_throughput import main, make_workload, parse_sizes
from pagedllm.cli import build_parser


def test_the_workload_is_seeded_and_mixed():
    sizes = parse_sizes("32x24,24x32")
    a, b = make_workload(6, 5, sizes, seed=3), make_workload(6, 5, sizes, seed=3)
    assert [p for p, _ in a] == [p for p, _ in b]
    assert [[im.tobytes() for im in ims] for _, ims in a] == [[im.tobytes() for im in ims] for _, ims in b]
    for i, (prompt, images) in enumerate(a):
        assert (1 <= len(images) <= 2) if i % 2 == 0 else not images
        assert prompt.count("<image>") == len(images) and len(prompt.split()) == 5 + len(images)
        assert all(im.size in sizes and im.mode == "RGB" for im in images)
    with pytest.raises(SystemExit):
        parse_sizes("32by24")


def test_smallest_run_against_hf(tmp_path, capsys):
    out = tmp_path / "result.json"
    args = build_parser().parse_args(["bench", "mm-throughput", "--num-prompts", "4", "--input-words", "6",
                                      "--output-len", "3", "--repeats", "2", "--image-sizes", "40x30,30x40",
                                      "--compare-hf", "--cache-dir", str(tmp_path / "models"), "--json",
                                      str(out)])
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert res["preset"] == "tiny-llava" and res["cpu"] and res["threads"] >= 1
    assert (res["num_prompts"], res["num_with_images"]) == (4, 2) and 2 <= res["num_images"] <= 4
    assert res["generated_tokens"] == 4 * 3  # EOS ignored: exactly output_len each
    assert len(res["elapsed_s"]) == len(res["hf_elapsed_s"]) == 2
    assert res["output_tok_s"] > 0 and res["hf_output_tok_s"] > 0 and res["speedup_vs_hf"] > 0
    # each image is 36 placeholder tokens in both runs: the same processor output
    assert res["prompt_tokens"] == res["hf_prompt_tokens"] > 36 * res["num_images"]
    assert res["same_tokens_as_hf"] == 1.0  # fp32 greedy on the same inputs
    text = capsys.readouterr().out
    assert "speedup vs HF" in text and res["cpu"] in text
