"""The render worker process: chat-template rendering, tokenisation and detokenisation of requests.

Why a process: a Jinja template is pure Python and holds the GIL for as long as it runs, so even in a thread it
starves the HTTP event loop (a nested ``range(99999)`` loop froze ``/health`` for good, issue 18). Here it runs in a
separate process that the server kills when it overruns ``--template-render-timeout``; the address space is capped
(``RLIMIT_AS``), so ``{{ 'x' * 10**10 }}`` is a MemoryError here instead of the server's OOM, and a rendered prompt
longer than ``max_chars`` is refused before it is tokenised.

Protocol (one ``multiprocessing`` pipe): the worker sends ``("ready", None)`` once, then answers each job with
``("ok", value)`` or ``("err", message)``. Jobs: ``("chat", messages, template, add_generation_prompt,
continue_final_message, kwargs, max_chars)`` -> token ids; ``("encode", texts, add_special_tokens)`` -> id lists;
``("decode", id_lists)`` -> texts; ``("pairs", [(text_1, text_2), ...])`` -> one ``{"input_ids",
"token_type_ids"}`` per pair as the tokenizer pairs two texts (a cross-encoder's score prompt); ``("mm", tag, ids,
[(image bytes, field), ...], max_image_pixels)`` -> a ``ProcessedPrompt`` (images decoded and run through the model's
processor, tensors in shared memory: ``multimodal/processing.py``), whose bad image is answered ``("exc",
MediaError)`` so the server names the field. The tokenizer (and a vision model's processor) arrive pickled, so the
worker needs no file access.
"""

from __future__ import annotations

import os
import pickle
import signal
from multiprocessing.connection import Connection
from typing import Any, Optional

from pagedllm.errors import ParamError

try:  # imported by the forkserver once (preload), so each forked worker starts in milliseconds
    import transformers  # noqa: F401
    import transformers.tokenization_utils_base  # noqa: F401
except Exception:  # noqa: BLE001 - serving without transformers fails later with a clear error
    pass


# CFS weight 335 vs 1024: a contended render gets about a quarter of a CPU next to a busy process, so a normal
# render (milliseconds) barely notices, while a hostile one cannot crowd out /health or the engine's steps.
RENDER_NICENESS = 5


class RenderError(Exception):
    """A request's template or text could not be processed; the message goes back to the client (400)."""


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def render_chat_ids(tok: Any, messages: list[dict], template: Optional[str], add_generation_prompt: bool,
                    continue_final_message: bool, kwargs: Optional[dict], max_chars: int,
                    tools: Optional[list] = None, tools_prompt: Optional[str] = None) -> list[int]:
    """``apply_chat_template(..., tokenize=True)`` in two steps (render, then ``encode`` without special tokens,
    which is what transformers does) so an oversized rendering is refused before it is tokenised.

    ``tools`` go to the template; a template that ignores them (renders the same text without them) gets
    ``tools_prompt`` as a system message instead, so the model always sees its tools."""
    def render(msgs: list[dict], with_tools: Optional[list]) -> Any:
        return tok.apply_chat_template(msgs, chat_template=template, tokenize=False, tools=with_tools,
                                       add_generation_prompt=add_generation_prompt and not continue_final_message,
                                       continue_final_message=continue_final_message, **(kwargs or {}))

    text = render(messages, tools)
    if tools and tools_prompt and _ignores_tools(lambda: render(messages, None), text):
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{tools_prompt}".lstrip())
            messages = [first] + list(messages[1:])
        else:
            messages = [{"role": "system", "content": tools_prompt}] + list(messages)
        text = render(messages, None)
    if not isinstance(text, str):
        raise RenderError(f"the chat template produced {type(text).__name__}, not text")
    if len(text) > max_chars:
        raise RenderError(f"the rendered chat prompt has {len(text)} characters, more than the limit of {max_chars}")
    return [int(t) for t in tok.encode(text, add_special_tokens=False)]


def _ignores_tools(render_without: Any, with_tools: str) -> bool:
    try:
        return render_without() == with_tools
    except Exception:  # noqa: BLE001 - a template that fails without tools clearly uses them
        return False


def pair_ids(tok: Any, text_1: str, text_2: str) -> dict[str, Optional[list[int]]]:
    enc = tok(text=text_1, text_pair=text_2)
    types = enc.get("token_type_ids")
    return {"input_ids": [int(t) for t in enc["input_ids"]],
            "token_type_ids": [int(t) for t in types] if types is not None else None}


def handle(tok: Any, job: tuple, mm_processor: Any = None) -> Any:
    kind = job[0]
    if kind == "mm":
        if mm_processor is None:
            raise RenderError("this server's model takes no images")
        from pagedllm.multimodal.processing import process_encoded_images

        return process_encoded_images(mm_processor, *job[1:])
    if kind == "chat":
        return render_chat_ids(tok, *job[1:])
    if kind == "encode":
        return [list(tok.encode(t, add_special_tokens=job[2])) for t in job[1]]
    if kind == "decode":
        return [tok.decode(ids) for ids in job[1]]
    if kind == "pairs":
        return [pair_ids(tok, a, b) for a, b in job[1]]
    raise RenderError(f"unknown job {kind!r}")


def main(conn: Connection, tokenizer_blob: bytes, mem_limit_bytes: Optional[int],
         mm_processor_blob: Optional[bytes] = None) -> None:
    """Process entry point: load the tokenizer, cap the address space, answer jobs until the pipe closes."""
    # The server owns shutdown (it drains, then closes the pipe or kills us): a process-group SIGINT/SIGTERM must not
    # take the workers away from requests still being drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:  # a template burning its whole time budget yields the CPU to the HTTP loop and the engine first
        os.nice(RENDER_NICENESS)
    except OSError:
        pass
    tok = pickle.loads(tokenizer_blob)
    mm_processor = pickle.loads(mm_processor_blob) if mm_processor_blob else None
    try:  # warm up: compile the model's template and touch the tokenizer, so a first request pays neither
        tok.encode("warm up")
        if getattr(tok, "chat_template", None):
            tok.apply_chat_template([{"role": "user", "content": "warm up"}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that needs more than this is fine; requests will say so
        pass
    if mem_limit_bytes and os.path.exists("/proc/self/statm"):
        import resource  # optional: POSIX-only (resource)

        limit = _vm_bytes() + mem_limit_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = ("ok", handle(tok, job, mm_processor))
        except ParamError as e:  # an image the request named (MediaError: its field and code)
            reply = ("exc", e)
        except RenderError as e:
            reply = ("err", str(e))
        except MemoryError:
            reply = ("err", "rendering exceeded the render worker's memory limit")
        except RecursionError:
            reply = ("err", "the chat template recursed too deeply")
        except Exception as e:  # noqa: BLE001 - jinja errors ("roles must alternate", raise_exception), bad kwargs
            reply = ("err", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except MemoryError:  # the reply itself does not fit: say so in a few bytes
            conn.send(("err", "the result exceeded the render worker's memory limit"))
