"""Every transformers ``*ForCausalLM`` through the transformers fallback, on a tiny random config, against HF.

``tiny_config`` shrinks an architecture's default config generically (hidden 64, 2-4 layers, vocab 128, windows 8);
``verdict`` decides what the fallback does with it: ``native`` (pagedllm's own decoder serves it under ``auto``),
``refused: <reason>`` (``UnsupportedModelError`` at start-up), ``matches`` (teacher-forced greedy through the paged
cache equals HF's greedy continuation), or ``WRONG: <where>`` (what issue 28 forbids). ``python fallback_sweep.py``
prints the whole table (docs/models.md's fallback section records it).
"""

from __future__ import annotations

import random
import sys
from typing import Any, Optional

import torch

from logit_parity import BLOCK_SIZE, run_schedule  # noqa: F401 - BLOCK_SIZE: the paged cache's, 4


# Config fields shrunk wherever an architecture's default config has them (value kept when the default is None).
_SMALL = {
    "vocab_size": 128, "hidden_size": 64, "d_model": 64, "n_embd": 64, "n_embed": 64,
    "intermediate_size": 96, "ffn_dim": 96, "n_inner": 96, "ffn_hidden_size": 96, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32, "dense_intermediate_size": 96,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "num_key_value_heads": 2, "num_kv_heads": 2,
    "multi_query_group_num": 2, "head_dim": 16, "kv_channels": 16, "attention_head_dim": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "moe_topk": 2, "moe_k": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "rotary_dim": 8, "qk_head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16,
    "sliding_window": 8, "attention_chunk_size": 8, "max_position_embeddings": 512, "n_positions": 512,
    "initializer_range": 0.15,
}
MAX_LAYERS = 6
MAX_PARAMS = 20_000_000
# Where an architecture's default config hides the feature its checkpoints have (LFM2's default is all attention;
# LFM2-350M interleaves short-convolution layers).
REPRESENTATIVE: dict[str, dict[str, Any]] = {
    "lfm2": dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3, full_attn_idxs=None),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3, full_attn_idxs=None),
    # Granite 3: logits divided by 8 after lm_head (the default config's 1.0 would hide it)
    "granite": dict(logits_scaling=8.0),
    "granitemoe": dict(logits_scaling=8.0),
    "granitemoeshared": dict(logits_scaling=8.0),
    # Gemma 3n: its last layers reuse earlier layers' KV (num_kv_shared_layers)
    "xmod": dict(default_language="en_XX"),
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512, vocab_size=128,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2)),
}
PROMPT_LENS = (5, 11, 19)  # block 4: every prompt crosses blocks; 19 + new tokens crosses window 8
NEW_TOKENS = 6


def causal_lm_architectures() -> dict[str, str]:
    """model_type -> class name of transformers' causal-LM auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: v for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if isinstance(v, str)}


def _shrink(d: dict[str, Any]) -> dict[str, Any]:
    """The overrides that shrink the config dict ``d``."""
    kw: dict[str, Any] = {}
    for key, small in _SMALL.items():
        if key in d and (isinstance(d[key], int) and not isinstance(d[key], bool)
                         or d[key] is None and key in ("head_dim", "num_key_value_heads", "n_routed_experts",
                                                          "n_shared_experts")):
            kw[key] = small
        elif key in d and isinstance(d[key], float) and key == "initializer_range":
            kw[key] = small
    for key in ("num_experts_per_tok",):  # None in some defaults, required once experts are set
        if key in d and any(k in d for k in ("n_routed_experts", "num_experts", "num_local_experts")):
            kw[key] = 2
    if "qk_rope_head_dim" in d:  # MLA: head_dim is the rotary part, K/V heads = heads
        if "head_dim" in d:
            kw["head_dim"] = kw.get("qk_rope_head_dim", 8)
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    for key, token in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if isinstance(d.get(key), int):
            kw[key] = token
    n_default = next((d[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if isinstance(d.get(k), int)), None)
    types = d.get("layer_types")
    if isinstance(types, list) and types:
        # enough layers to hold every distinct type once (their first occurrences, in order)
        last = max(types.index(t) for t in dict.fromkeys(types))
        n = min(max(2, last + 1), max(MAX_LAYERS, last + 1))
        kw["layer_types"] = types[:n]
        for k in ("num_hidden_layers", "n_layer", "num_layers"):
            if k in kw:
                kw[k] = n
    if n_default:
        n = kw.get("num_hidden_layers", kw.get("n_layer", kw.get("num_layers", 2)))
        for key, value in d.items():  # per-layer lists follow the depth
            if key != "layer_types" and isinstance(value, list) and len(value) == n_default and n_default > n:
                kw[key] = value[:n]
    if "rope_parameters" in d and isinstance(d["rope_parameters"], dict):
        rp = dict(d["rope_parameters"])
        if "original_max_position_embeddings" in rp:
            rp["original_max_position_embeddings"] = 256
        kw["rope_parameters"] = rp
    return kw


def tiny_config(model_type: str, arch: str, **overrides: Any) -> Any:
    """A small config of ``model_type`` with ``architectures=[arch]``: the default's sizes shrunk generically."""
    from transformers import AutoConfig

    d = AutoConfig.for_model(model_type).to_dict()
    kw = _shrink(d)
    for sub in ("text_config",):  # composite configs: their text model too
        if isinstance(d.get(sub), dict):
            kw[sub] = {**d[sub], **_shrink(d[sub])}
    kw["is_decoder"] = True  # BERT-style classes run causally only as decoders (the default refuses: tested apart)
    kw.update(REPRESENTATIVE.get(model_type, {}))
    kw.update(overrides)
    kw.pop("model_type", None)
    return AutoConfig.for_model(model_type, architectures=[arch], **kw)


def randomize(model: torch.nn.Module, seed: int = 1) -> None:
    """Norm weights and biases away from ones/zeros (HF's init), so a missed tensor shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.numel() > 1 and bool((p == p.flatten()[0]).all()):  # constant init: sinks, gates, scales
                p.add_(0.5 * torch.randn(p.shape, generator=gen))


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation by full recomputation (no cache: the oracle for stateful layers too), and the logits
    of the whole sequence."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
            ids.append(int(logits[-1].argmax()))
        logits = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return ids, logits


def chunked_schedule(lens: list[int], prompt_lens: list[int], chunk: int = 7) -> list[list[tuple[int, int]]]:
    """Prefill each prompt in chunks of ``chunk`` (all prompts batched), then decode one token per step."""
    done = [0] * len(lens)
    steps = []
    while any(d < n for d, n in zip(done, lens)):
        step = []
        for s, (d, n, p) in enumerate(zip(done, lens, prompt_lens)):
            if d < n:
                take = min(chunk, p - d) if d < p else 1
                step.append((s, take))
                done[s] += take
        steps.append(step)
    return steps


def paged_logits(model: Any, backend: Any, seqs: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """Teacher-forced logits of ``seqs`` through the paged cache (chunked prefill, then batched decodes)."""
    with torch.inference_mode():
        return run_schedule(model, backend, seqs, chunked_schedule([len(s) for s in seqs], prompt_lens))


def build_pair(config: Any, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(HF eager model, the same weights with ``attn_implementation="pagedllm"``)."""
    import copy

    from transformers import AutoModelForCausalLM

    from pagedllm.models.transformers_impl import ATTN_IMPLEMENTATION, register_attention

    register_attention()
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32, attn_implementation="eager")
    randomize(hf, seed + 1)
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32,
                                             attn_implementation=ATTN_IMPLEMENTATION)
    paged.load_state_dict(hf.state_dict(), strict=True)
    return hf.eval(), paged.eval()


def greedy_mismatch(hf: torch.nn.Module, fallback: Any, backend: Any, atol: float = 1e-3) -> Optional[str]:
    """None when the fallback's greedy tokens equal HF's on every prompt and its fp32 logits are within ``atol``
    of HF's everywhere; else where they first differ."""
    vocab = hf.config.get_text_config().vocab_size
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    runs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    got = paged_logits(fallback, backend, [s for s, _ in runs], [len(p) for p in prompts])
    bad, err = [], 0.0
    for p, (s, expected), g in zip(prompts, runs, got):
        err = max(err, (g - expected).abs().max().item())
        ours = g[len(p) - 1:len(s) - 1].argmax(-1).tolist()
        if ours != s[len(p):]:
            first = next(i for i, (a, b) in enumerate(zip(ours, s[len(p):])) if a != b)
            bad.append(f"prompt {len(p)}: token {first}")
    if bad:
        return f"{len(bad)}/{len(prompts)} prompts differ ({'; '.join(bad)}), max logit diff {err:.1e}"
    return None if err <= atol else f"greedy tokens equal but max logit diff {err:.1e}"


def verdict(model_type: str, arch: str, backend: Any, check_greedy: bool = True) -> str:
    """What the fallback does with ``arch``'s tiny config (see the module docstring)."""
    from pagedllm.errors import UnsupportedModelError
    from pagedllm.models.arch import ARCHITECTURES
    from pagedllm.models.transformers_impl import TransformersCausalLM, transformers_architecture

    native = "native; " if arch in ARCHITECTURES else ""
    try:
        config = tiny_config(model_type, arch)
    except Exception as e:  # noqa: BLE001 - the sweep reports it
        try:  # refused for what the class is, whatever its sizes
            from transformers import AutoConfig

            transformers_architecture(AutoConfig.for_model(model_type, architectures=[arch]))
        except UnsupportedModelError as refused:
            return native + f"refused: {refused}"
        except Exception:  # noqa: BLE001
            pass
        return f"no tiny config: {type(e).__name__}: {str(e)[:120]}"
    try:
        transformers_architecture(config)
    except UnsupportedModelError as e:
        return native + f"refused: {e}"
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMS:
            return f"no tiny config: {size / 1e6:.0f}M parameters after shrinking"
        hf, paged = build_pair(config)
        with torch.inference_mode():
            hf(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)
    except Exception as e:  # noqa: BLE001 - the tiny config does not run in HF itself
        return f"no tiny config: HF fails: {type(e).__name__}: {str(e)[:120]}"
    try:
        fallback = TransformersCausalLM(paged, backend)
    except UnsupportedModelError as e:
        return native + f"refused: {e}"
    if not check_greedy:
        return native + "accepted"
    try:
        wrong = greedy_mismatch(hf, fallback, backend)
    except Exception as e:  # noqa: BLE001 - a crash at run time is a failure the sweep reports
        return native + f"CRASH: {type(e).__name__}: {str(e)[:160]}"
    return native + ("matches" if wrong is None else f"WRONG: {wrong}")


def _run(names: list[str]) -> None:
    import signal

    sys.path.insert(0, __file__.rsplit("/", 1)[0] + "/..")
    from conftest import RefOnlyPlugin
    from pagedllm.backend.registry import Backend

    import resource

    resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))  # a bad shrink fails, not the machine
    backend = Backend(RefOnlyPlugin(), "ref-sweep")
    archs = causal_lm_architectures()

    def _timeout(*_):
        raise TimeoutError("over 120 s")

    signal.signal(signal.SIGALRM, _timeout)
    for model_type in names:
        print(f"START\t{model_type}", flush=True)
        signal.alarm(120)
        try:
            v = verdict(model_type, archs[model_type], backend)
        except Exception as e:  # noqa: BLE001
            v = f"ERROR: {type(e).__name__}: {str(e)[:160]}"
        finally:
            signal.alarm(0)
        print(f"{model_type}\t{archs[model_type]}\t{' '.join(v.split())}", flush=True)


def main(argv: list[str]) -> None:
    """Each architecture (or those named) in a child process that is restarted past any that kills it."""
    import subprocess

    if argv[:1] == ["--child"]:
        return _run(argv[1:])
    archs = causal_lm_architectures()
    todo = [m for m in sorted(archs) if not argv or m in argv or archs[m] in argv]
    while todo:
        child = subprocess.Popen([sys.executable, __file__, "--child", *todo], stdout=subprocess.PIPE, text=True)
        current = None
        for line in child.stdout:
            if line.startswith("START\t"):
                current = line.split("\t")[1].strip()
                continue
            print(line, end="", flush=True)
            todo.remove(line.split("\t")[0])
            current = None
        child.wait()
        if current is not None:
            print(f"{current}\t{archs[current]}\tDIED: exit code {child.returncode}", flush=True)
            todo.remove(current)
        elif child.returncode:
            break


if __name__ == "__main__":
    main(sys.argv[1:])
