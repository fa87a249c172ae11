"""``pagedllm chat`` and ``pagedllm complete``: interactive terminal sessions, as ``vllm chat`` / ``vllm complete``.

With ``--url`` they talk to a running OpenAI-compatible server through the official ``openai`` client; without it
they load the model in process. ``chat`` keeps the conversation (the chat template sees every earlier turn);
``complete`` continues each line on its own. Ctrl-C while an answer streams stops it (the request is aborted) and
keeps the session; Ctrl-C at the prompt, Ctrl-D or ``/exit`` leave with exit code 0. Lines starting with ``/`` are
commands (``/help`` lists them), never sent to the model. ``--quick MSG`` answers one message and exits (scripts).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Iterator, Optional

from pagedllm.commands.engine_args import add_engine_args, engine_config
from pagedllm.commands.stream_clients import LocalStreams, RemoteStreams
from pagedllm.errors import ParamError
from pagedllm.generation_defaults import cli_sampling_params

EXIT_COMMANDS = ("/exit", "/quit")
COMMANDS = {"chat": (("/help", "this list"),
                     ("/clear", "forget the conversation (the system prompt stays)"),
                     ("/system TEXT", "set the system prompt (/system alone removes it)"),
                     ("/exit", "leave (also Ctrl-D, or Ctrl-C at the prompt)")),
            "complete": (("/help", "this list"),
                         ("/exit", "leave (also Ctrl-D, or Ctrl-C at the prompt)"))}


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


#: Without flags or model defaults, a chat answer samples at 0.7, up to 256 tokens.
_FALLBACK = {"max_tokens": 256, "temperature": 0.7}


def _streams(args: argparse.Namespace):
    if args.url:
        if args.model is not None:
            raise ParamError("model", "--model loads a model in process; with --url name the served model with "
                                      "--model-name")
        return RemoteStreams(args.url, args.model_name, args.api_key or os.environ.get("OPENAI_API_KEY"),
                             args.max_tokens, args.temperature)
    from pagedllm.entrypoints.llm import LLM  # heavy: the engine stack, only when the command runs

    flags = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    cli_sampling_params({}, _FALLBACK, **flags)  # bad sampling values fail before the model loads
    llm = LLM(**vars(engine_config(args)))
    return LocalStreams(llm, cli_sampling_params(llm.default_sampling_params, _FALLBACK, **flags))


class StopKey:
    """Ctrl-C while an answer streams: the first press asks the stream to stop, a second one leaves (KeyboardInterrupt).

    Only a flag is set in the signal handler, so the stream stops between two pieces: an in-process engine is never
    interrupted inside a step, and closing the stream aborts the request (stream_clients)."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous = None

    def _handler(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __enter__(self) -> "StopKey":
        self.pressed = False
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def _print_stream(pieces: Iterator[str], stop: Optional[StopKey] = None) -> tuple[str, bool]:
    """Print pieces as they come; returns the text and whether Ctrl-C stopped it."""
    out, stopped = [], False
    try:
        for piece in pieces:
            out.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
            if stop is not None and stop.pressed:
                stopped = True
                break
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()  # aborts the request when it is unfinished
    print(flush=True)
    return "".join(out), stopped


class Session:
    """One terminal session of ``chat`` (history, system prompt) or ``complete`` (each line on its own)."""

    def __init__(self, streams, mode: str, system_prompt: Optional[str] = None):
        self.streams, self.mode = streams, mode
        self.system = system_prompt
        self.history: list[dict[str, str]] = []

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def answer(self, text: str, stop: Optional[StopKey] = None) -> bool:
        """Stream the answer to one line; False when Ctrl-C stopped it (that turn is then not kept)."""
        if self.mode == "complete":
            return not _print_stream(self.streams.complete(text), stop)[1]
        turn = {"role": "user", "content": text}
        reply, stopped = _print_stream(self.streams.chat(self.messages() + [turn]), stop)
        if not stopped:
            self.history += [turn, {"role": "assistant", "content": reply}]
        return not stopped

    def command(self, line: str) -> bool:
        """Run a ``/command``; False when it asks to leave."""
        name, _, rest = line.strip().partition(" ")
        known = dict(COMMANDS[self.mode])
        if name in EXIT_COMMANDS:
            return False
        if name == "/help":
            width = max(len(k) for k in known)
            for k, v in COMMANDS[self.mode]:
                print(f"  {k:<{width}}  {v}")
            print("  Ctrl-C while an answer streams stops it; lines not starting with / go to the model.")
        elif name == "/clear" and self.mode == "chat":
            self.history.clear()
            print("conversation cleared" + (" (the system prompt stays)" if self.system else ""))
        elif name == "/system" and self.mode == "chat":
            self.system = rest.strip() or None
            print(f"system prompt set: {self.system}" if self.system else "system prompt removed")
        else:
            print(f"unknown command {name}; /help lists the commands (a line starting with / is never sent to the "
                  "model)")
        return True

    def loop(self, prompt: str = "> ") -> int:
        try:
            import readline  # noqa: F401 (optional, not on Windows: line editing and history for input())
        except ImportError:
            pass
        stop = StopKey()
        while True:
            try:
                line = input(prompt)
            except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt
                print(flush=True)
                return 0
            if not line.strip():
                continue
            if line.lstrip().startswith("/"):
                if not self.command(line):
                    return 0
                continue
            try:
                with stop:
                    finished = self.answer(line, stop)
            except KeyboardInterrupt:  # a second Ctrl-C while stopping: leave
                print(flush=True)
                return 0
            if not finished:
                print("(answer stopped and left out of the conversation; type the next message, or Ctrl-C / "
                      "Ctrl-D to leave)", flush=True)


def run(args: argparse.Namespace) -> int:
    streams = _streams(args)
    where = getattr(streams, "url", None) or "this process"
    session = Session(streams, args.command, getattr(args, "system_prompt", None))
    if args.quick is not None:
        session.answer(args.quick)
        return 0
    print(f"pagedllm {args.command}: {streams.model_name} in {where}. /help lists the commands; Ctrl-C stops an "
          "answer; /exit or Ctrl-D leaves.", flush=True)
    return session.loop()
