"""``pagedllm generate [--model M] [--device D] [--stream] PROMPT...``: offline generation, text to stdout."""

from __future__ import annotations

import argparse
import sys

from pagedllm.commands.engine_args import add_engine_args, engine_config
from pagedllm.commands.stream_clients import LocalStreams
from pagedllm.generation_defaults import cli_sampling_params

#: Without flags or model defaults, ``generate`` is greedy and short.
_FALLBACK = {"max_tokens": 64, "temperature": 0.0}


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline (default model: embedded SmolLM2-135M-Instruct)")
    add_engine_args(p)
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the model's max_new_tokens, else 64")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the model's generation_config.json, else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message with the chat template")
    p.add_argument("--stream", action="store_true",
                   help="print tokens as they are generated (prompts run one after another)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM  # heavy: the engine stack, only when the command runs

    flags = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                 seed=args.seed)
    cli_sampling_params({}, _FALLBACK, **flags)  # bad sampling values fail before the model loads
    llm = LLM(**vars(engine_config(args)))
    sp = cli_sampling_params(llm.default_sampling_params, _FALLBACK, **flags)
    if args.stream:
        return _run_streamed(llm, sp, args)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], sp, use_tqdm=False)
    else:
        outs = llm.generate(args.prompts, sp, use_tqdm=False)
    for prompt, out in zip(args.prompts, outs):
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        print(prompt + out.outputs[0].text if not args.chat else out.outputs[0].text)
    return 0


def _run_streamed(llm, sp, args: argparse.Namespace) -> int:
    streams = LocalStreams(llm, sp)
    for prompt in args.prompts:
        if len(args.prompts) > 1:
            print(f"### {prompt}", flush=True)
        if args.chat:
            pieces = streams.chat([{"role": "user", "content": prompt}])
        else:
            print(prompt, end="", flush=True)
            pieces = streams.complete(prompt)
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
        print(flush=True)
    return 0
