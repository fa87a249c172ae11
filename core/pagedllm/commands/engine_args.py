"""Engine flags shared by ``generate``, ``serve`` and ``bench``, with vLLM's names."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Optional

from pagedllm.config import DEFAULT_MAX_NUM_SEQS, EngineConfig
from pagedllm.lora.request import LoRARequest
from pagedllm.errors import ParamError
from pagedllm.json_args import json_object
from pagedllm.structured_output.limits import StructuredOutputsConfig, flag as limit_flag, limit_fields


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        p.add_argument("model", nargs="?", default=None,
                       help="HF folder, .gguf file or Hugging Face Hub id org/name (default: embedded SmolLM2)")
        p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                       help="the same as the positional MODEL (vLLM accepts both)")
    else:
        p.add_argument("--model", default=None,
                       help="HF folder, .gguf file or Hugging Face Hub id org/name (default: embedded SmolLM2)")
    p.add_argument("--device", default="auto", help="backend name, or auto (see `pagedllm backends`)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: the backend's)")
    # Unset flags stay None so the backend's update_config can tell them from a user's value (config.py).
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"most sequences in one step (default: {DEFAULT_MAX_NUM_SEQS})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one step; longer prefills run in chunks (default: the backend's, else "
                        "max(2048, max-model-len) up to 8192)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV pool")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--swap-space", type=float, default=0.0, help="GiB of host memory for swapped KV blocks")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one block table for every layer: sliding-window layers keep every block (vLLM's flag)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no graph capture (default: the backend's graphs)")
    p.add_argument("--quantization", default=None,
                   help="vLLM method name (gguf), or none for dense weights in --dtype; default: the checkpoint's "
                        "when the backend runs it and no --dtype is given (docs/quantization.md)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                   help="KV cache dtype: auto (the model dtype), or fp8 (= fp8_e4m3) / fp8_e5m2 where the backend "
                        "declares it: half the bytes of bf16 per token (docs/quantization.md)")
    p.add_argument("--structured-outputs-backend", default="auto", choices=["auto", "xgrammar", "guidance"],
                   help="grammar backend for structured outputs (auto: xgrammar, llguidance for what it refuses)")
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help="grammar limits and compile pool as JSON, keys as the flags below without the prefix, e.g. "
                        '\'{"max_choices": 1000}\' (docs/structured_outputs.md)')
    for f in limit_fields():  # one flag per limit; it wins over the same key in the JSON
        p.add_argument(limit_flag(f.name), type=float if f.name == "compile_timeout" else int, default=None,
                       help=f"{_LIMIT_HELP[f.name]} (default {f.default})")
    p.add_argument("--model-impl", default="auto", choices=["auto", "native", "transformers"],
                   help="native decoder, or transformers' module with pagedllm paged attention (auto: native when "
                        "the architecture has one; docs/models.md)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="default sampling parameters for requests that leave them unset: auto (the model's "
                        "generation_config.json), vllm (ignore it), or a folder holding a generation_config.json")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="generate text, or pool (embed, classify, score, reward); auto: pooling for a pooling "
                        "architecture or with --convert (docs/pooling.md)")
    p.add_argument("--convert", default="auto", choices=["auto", "none", "embed", "classify", "reward"],
                   help="turn the model into a pooling model: embed (decoder embeddings), classify "
                        "(*ForSequenceClassification heads), reward (docs/pooling.md)")
    p.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='vLLM\'s PoolerConfig, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
                        "(pooling_type LAST|MEAN|CLS|ALL, normalize, dimensions, use_activation; docs/pooling.md)")
    p.add_argument("--hf-overrides", default=None, metavar="JSON", type=_json_object,
                   help='keys merged into the HF config, e.g. a Qwen3-Reranker\'s \'{"architectures": '
                        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
                        '"is_original_qwen3_reranker": true}\'')
    p.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON", type=_json_object,
                   help='most items per prompt of each modality, e.g. \'{"image": 4}\' (vLLM\'s; default 999 each; '
                        'docs/multimodal.md)')
    p.add_argument("--allowed-local-media-path", default=None, metavar="FOLDER",
                   help="image file: URLs are read only from under this folder (default: file: URLs refused)")
    p.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="image http(s) URLs are fetched only from these hosts, redirects included (default: any)")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (docs/lora.md)")
    p.add_argument("--max-loras", type=int, default=1, help="adapters one batch may use (device slots); default 1")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted; default 16")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in host memory (LRU); default --max-loras")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' (docs/spec_decode.md)')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks that split every layer (docs/distributed.md)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="ranks that each run a slice of the layers (docs/distributed.md)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="how the ranks start: worker processes on this host (mp, default) or Ray actors (ray)")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='a KV connector in vLLM\'s shape, e.g. \'{"kv_connector": "OffloadingConnector", "kv_role": '
                        '"kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 4294967296}}\' '
                        "(entry points pagedllm.kv_connectors; docs/kv-offload.md)")
    p.add_argument("--kv-offload-gib", type=float, default=0.0,
                   help="GiB of host memory that keeps prefix-cache blocks evicted from the device (docs/kv-offload.md)")
    p.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="folder of the disk tier under the host tier: checksummed block files a restarted (or a "
                        "second) engine on the same model finds")
    p.add_argument("--kv-offload-disk-gib", type=float, default=16.0,
                   help="size bound of --kv-offload-dir in GiB (least recently used files go first); default 16")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split the experts across the tensor-parallel ranks, or with serve "
                        "--data-parallel-size N across the N replicas (vLLM's DP+EP; docs/distributed.md)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    option = getattr(args, "model_option", None)
    if option is not None:
        if args.model is not None and args.model != option:
            raise ParamError("model", f"given twice ({args.model!r} and --model {option!r}); give one")
        args.model = option
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=args.swap_space,
        disable_hybrid_kv_cache_manager=getattr(args, "disable_hybrid_kv_cache_manager", False),
        scheduling_policy=args.scheduling_policy, seed=args.seed,
        enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
        structured_outputs_backend=args.structured_outputs_backend,
        structured_outputs_config=structured_outputs_config(args), enable_lora=args.enable_lora,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
        model_impl=args.model_impl, quantization=args.quantization,
        speculative_config=getattr(args, "speculative_config", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        pipeline_parallel_size=getattr(args, "pipeline_parallel_size", 1),
        distributed_executor_backend=getattr(args, "distributed_executor_backend", None),
        enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
        generation_config=getattr(args, "generation_config", "auto"),
        runner=getattr(args, "runner", "auto"), convert=getattr(args, "convert", "auto"),
        pooler_config=getattr(args, "pooler_config", None), hf_overrides=getattr(args, "hf_overrides", None),
        kv_transfer_config=getattr(args, "kv_transfer_config", None),
        kv_offload_gib=getattr(args, "kv_offload_gib", 0.0), kv_offload_dir=getattr(args, "kv_offload_dir", None),
        kv_offload_disk_gib=getattr(args, "kv_offload_disk_gib", 16.0),
        limit_mm_per_prompt=getattr(args, "limit_mm_per_prompt", None),
        allowed_local_media_path=getattr(args, "allowed_local_media_path", None),
        allowed_media_domains=getattr(args, "allowed_media_domains", None))


def _json_object(text: str) -> dict:
    """argparse type of a JSON-object flag (--hf-overrides)."""
    try:
        return json_object(text, "value")
    except ParamError as e:
        raise argparse.ArgumentTypeError(e.message) from None



_LIMIT_HELP = {
    "compile_timeout": "seconds one request's grammar may take to compile (400 beyond)",
    "compile_workers": "grammar compile worker processes of the server",
    "max_choices": "most strings in a request's choice list",
    "max_grammar_chars": "longest regex, grammar, JSON schema (as JSON) or choice list in characters",
    "max_schema_properties": "most properties in a request's JSON schema",
    "max_schema_depth": "deepest nesting of a request's JSON schema document",
    "cache_bytes": "bytes of compiled grammars cached (server and engine each)",
    "worker_memory_bytes": "resident bytes a compile worker may grow by before it is replaced",
}


def structured_outputs_config(args: argparse.Namespace) -> StructuredOutputsConfig:
    """``--structured-outputs-config`` JSON, then each ``--structured-outputs-<limit>`` flag given over it."""
    base = StructuredOutputsConfig.parse(getattr(args, "structured_outputs_config", None))
    given = {f.name: getattr(args, f"structured_outputs_{f.name}", None) for f in limit_fields()}
    return replace(base, **{k: v for k, v in given.items() if v is not None})


def lora_modules(values: Optional[list[str]], enable_lora: bool) -> list[LoRARequest]:
    """``--lora-modules name=path ...`` (or vLLM's JSON form ``{"name": .., "path": ..}``) as LoRARequests with ids
    1, 2, ..."""
    out: list[LoRARequest] = []
    for i, v in enumerate(values or []):
        v = v.strip()
        if v.startswith("{"):
            d = json.loads(v)
            name, path = d.get("name"), d.get("path")
        else:
            name, sep, path = v.partition("=")
            if not sep:
                raise ParamError("lora_modules", f"expected name=path, got {v!r}")
        if not name or not path:
            raise ParamError("lora_modules", f"expected name=path, got {v!r}")
        if any(r.lora_name == name for r in out):
            raise ParamError("lora_modules", f"adapter name {name!r} given twice")
        out.append(LoRARequest(name, i + 1, path))
    if out and not enable_lora:
        raise ParamError("lora_modules", "--lora-modules needs --enable-lora")
    return out
