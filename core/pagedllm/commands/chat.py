"""``pagedllm chat`` and ``pagedllm complete``: interactive terminal sessions, as ``vllm chat`` / ``vllm complete``.

With ``--url`` they talk to a running OpenAI-compatible server through the official ``openai`` client; without it
they load the model in process. ``chat`` keeps the conversation (the chat template sees every earlier turn);
``complete`` continues each line on its own. ``/exit``, Ctrl-D or Ctrl-C leave with exit code 0; ``--quick MSG``
answers one message and exits (scripts).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Iterator

from pagedllm.commands.engine_args import add_engine_args, engine_config
from pagedllm.commands.stream_clients import LocalStreams, RemoteStreams
from pagedllm.errors import ParamError
from pagedllm.sampling_params import SamplingParams

EXIT_COMMANDS = ("/exit", "/quit")


def add_parser(sub) -> None:
    for name, text in (("chat", "interactive chat with a model (a running server with --url, else in process)"),
                       ("complete", "interactive text completion (a running server with --url, else in process)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--url", default=None, help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 "
                                                   "(default: load --model in this process)")
        p.add_argument("--model-name", default=None, help="model name on the server (default: its first)")
        p.add_argument("--api-key", default=None, help="server API key (default: $OPENAI_API_KEY)")
        if name == "chat":
            p.add_argument("--system-prompt", default=None, help="system message opening the conversation")
        p.add_argument("--quick", "-q", default=None, metavar="MSG", help="send one message, print the reply, exit")
        p.add_argument("--max-tokens", type=int, default=None)
        p.add_argument("--temperature", type=float, default=None)
        add_engine_args(p)
        p.set_defaults(func=run)


def _streams(args: argparse.Namespace):
    if args.url:
        if args.model is not None:
            raise ParamError("model", "--model loads a model in process; with --url name the served model with "
                                      "--model-name")
        return RemoteStreams(args.url, args.model_name, args.api_key or os.environ.get("OPENAI_API_KEY"),
                             args.max_tokens, args.temperature)
    from pagedllm.entrypoints.llm import LLM  # heavy: the engine stack, only when the command runs

    sp = SamplingParams(max_tokens=args.max_tokens or 256,
                        temperature=args.temperature if args.temperature is not None else 0.7, seed=args.seed)
    return LocalStreams(LLM(**vars(engine_config(args))), sp)


def _print_stream(pieces: Iterator[str]) -> str:
    out = []
    for piece in pieces:
        out.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    print(flush=True)
    return "".join(out)


def _loop(prompt: str, handle: Callable[[str], None]) -> int:
    try:
        import readline  # noqa: F401 (optional, not on Windows: line editing and history for input())
    except ImportError:
        pass
    while True:
        try:
            line = input(prompt)
        except (EOFError, KeyboardInterrupt):
            print(flush=True)
            return 0
        if line.strip() in EXIT_COMMANDS:
            return 0
        if not line.strip():
            continue
        try:
            handle(line)
        except KeyboardInterrupt:  # stops this answer (the request is aborted) and leaves, as vllm chat does
            print(flush=True)
            return 0


def run(args: argparse.Namespace) -> int:
    streams = _streams(args)
    where = getattr(streams, "url", None) or "this process"
    if args.command == "complete":
        def handle(text: str) -> None:
            _print_stream(streams.complete(text))
    else:
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []

        def handle(text: str) -> None:
            messages.append({"role": "user", "content": text})
            try:
                reply = _print_stream(streams.chat(messages))
            except BaseException:
                messages.pop()  # a failed turn is not history
                raise
            messages.append({"role": "assistant", "content": reply})
    if args.quick is not None:
        handle(args.quick)
        return 0
    print(f"pagedllm {args.command}: {streams.model_name} in {where}. /exit or Ctrl-D to leave.", flush=True)
    return _loop("> ", handle)
