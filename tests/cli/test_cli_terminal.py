"""Terminal use of the CLI as a person sees it: ``generate --stream`` prints tokens while generating, and
``pagedllm chat`` / ``complete`` driven in a real terminal (tmux send-keys / capture-pane) against a real server and
an in-process engine."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server_utils import API_KEY, ServerProcess, metrics, tiny_chat_model, wait_idle



def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.cli", *args]


def test_generate_stream_shows_first_token_before_the_last_is_generated():
    model = tiny_chat_model()
    common = ["generate", "--model", model, "--max-tokens", "400", "Once upon a time"]
    p = subprocess.Popen(_cli(*common, "--stream"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    prefix = b"Once upon a time"
    seen = b""
    while len(seen) <= len(prefix):  # the prompt is echoed at once; wait for the first generated text
        chunk = os.read(p.stdout.fileno(), 4096)
        assert chunk, p.stderr.read().decode()[-2000:]
        seen += chunk
    assert p.poll() is None, "the process had already finished when its first token arrived"
    first_len = len(seen)
    rest = p.stdout.read()
    assert p.wait(timeout=120) == 0
    streamed = (seen + rest).decode()
    assert len(streamed) > first_len + 200, "most of the text should arrive after the first token"
    # the streamed text is exactly what the non-streamed command prints (greedy)
    plain = subprocess.run(_cli(*common), capture_output=True, text=True, timeout=180)
    assert plain.returncode == 0 and streamed == plain.stdout


class Tmux:
    """One detached tmux session running a command; its exit code lands in a file when it ends."""

    def __init__(self, name: str, argv: list[str], tmp: Path):
        self.name = name
        self.code_file = tmp / f"{name}.code"
        shell = f"{shlex.join(argv)}; echo $? > {shlex.quote(str(self.code_file))}; sleep 600"
        subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "220", "-y", "60", shell], check=True)

    def send(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name, "-S", "-200"], capture_output=True,
                              text=True, check=True).stdout

    def wait_for(self, predicate, what: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen()
            if predicate(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{self.screen()}")

    def exit_code(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.code_file.exists() and self.code_file.read_text().strip():
                return int(self.code_file.read_text())
            time.sleep(0.2)
        raise AssertionError(f"{self.name} did not exit; screen:\n{self.screen()}")

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def _prompts(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.startswith(">"))


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(tiny_chat_model())
    yield s
    s.stop()


def test_chat_two_turns_with_history_then_exit(server, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model())
    sampling = ["--max-tokens", "8", "--temperature", "0"]
    t = Tmux(f"chat{os.getpid()}", _cli("chat", "--url", server.url_v1, "--api-key", API_KEY, *sampling), tmp_path)
    try:
        t.wait_for(lambda s: "/exit" in s and _prompts(s) == 1, "the chat banner and prompt")
        before = metrics(server.base_url)["pagedllm:prompt_tokens_total"]
        t.send("My name is Ada", "Enter")
        t.wait_for(lambda s: _prompts(s) == 2, "the first answer")
        turn1 = metrics(server.base_url)["pagedllm:prompt_tokens_total"] - before
        t.send("What is my name?", "Enter")
        t.wait_for(lambda s: _prompts(s) == 3, "the second answer")
        turn2 = metrics(server.base_url)["pagedllm:prompt_tokens_total"] - before - turn1
        t.send("/exit", "Enter")
        assert t.exit_code() == 0
    finally:
        t.kill()
    # the oracle: the same greedy first answer, then the token counts of both rendered conversations
    import openai

    client = openai.OpenAI(base_url=server.url_v1, api_key=API_KEY)
    u1, u2 = {"role": "user", "content": "My name is Ada"}, {"role": "user", "content": "What is my name?"}
    a1 = client.chat.completions.create(model=server.served_name, messages=[u1], max_tokens=8,
                                        temperature=0).choices[0].message.content
    n1 = len(tok.apply_chat_template([u1], add_generation_prompt=True, tokenize=True, return_dict=False))
    n2 = len(tok.apply_chat_template([u1, {"role": "assistant", "content": a1}, u2], add_generation_prompt=True,
                                     tokenize=True, return_dict=False))
    assert turn1 == n1, "the first turn sends one user message"
    assert turn2 == n2, "the second turn sends the whole history: first question, first answer, second question"


def test_ctrl_c_stops_the_answer_then_leaves(tmp_path):
    """In process: the first Ctrl-C stops the answer between two engine steps and the prompt comes back (the engine
    is still usable: the next line is answered); Ctrl-C at the prompt leaves with 0."""
    t = Tmux(f"complete{os.getpid()}", _cli("complete", "--model", tiny_chat_model(), "--max-tokens", "400",
                                            "--temperature", "0"), tmp_path)
    try:
        t.wait_for(lambda s: "/exit" in s and _prompts(s) == 1, "the complete banner and prompt")
        t.send("Hello", "Enter")
        t.wait_for(lambda s: "> Hello" in s and len(s.split("> Hello", 1)[1].strip()) > 20,
                   "the completion to start")
        t.send("C-c")
        t.wait_for(lambda s: "answer stopped" in s and _prompts(s) == 2, "the stopped completion", timeout=30)
        t.send("/help", "Enter")
        t.wait_for(lambda s: "/exit" in s.split("> /help", 1)[-1] and "/clear" not in s, "complete's commands")
        t.send("Hi", "Enter")
        t.wait_for(lambda s: _prompts(s) == 4, "the next completion, to its end", timeout=180)
        t.send("C-c")
        assert t.exit_code() == 0
        assert "Traceback" not in t.screen()
    finally:
        t.kill()


def test_chat_commands_and_ctrl_c_stops_the_answer_not_the_session(server, tmp_path):
    """`/help`, `/system ...`, `/clear` and unknown `/...` are answered by the CLI and never reach the server; Ctrl-C
    while an answer streams stops it (the server aborts the request) and the prompt comes back; Ctrl-D leaves."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model())
    t = Tmux(f"chatkeys{os.getpid()}", _cli("chat", "--url", server.url_v1, "--api-key", API_KEY, "--max-tokens",
                                            "440", "--temperature", "0"), tmp_path)
    try:
        t.wait_for(lambda s: "/help" in s and _prompts(s) == 1, "the chat banner and prompt")
        before = metrics(server.base_url)
        t.send("/help", "Enter")
        t.wait_for(lambda s: "/clear" in s and "/system TEXT" in s and _prompts(s) == 2, "the command list")
        t.send("/system You answer in one word.", "Enter")
        t.wait_for(lambda s: "system prompt set: You answer in one word." in s, "the system prompt")
        t.send("/nonsense", "Enter")
        t.wait_for(lambda s: "unknown command /nonsense; /help lists the commands" in s, "the unknown command")
        t.send("/clear", "Enter")
        t.wait_for(lambda s: "conversation cleared" in s and _prompts(s) == 5, "the cleared conversation")
        after = metrics(server.base_url)
        assert after["pagedllm:prompt_tokens_total"] == before["pagedllm:prompt_tokens_total"], "a command was sent"

        t.send("Tell me a long story", "Enter")
        asked = "> Tell me a long story"
        t.wait_for(lambda s: asked in s and len(s.split(asked, 1)[1].strip()) > 20, "the answer to start")
        t.send("C-c")
        screen = t.wait_for(lambda s: "answer stopped" in s and _prompts(s) == 6, "the stopped answer", timeout=30)
        assert "Traceback" not in screen and not t.code_file.exists(), "the session must go on after one Ctrl-C"
        stopped = wait_idle(server.base_url)
        generated = stopped["pagedllm:generation_tokens_total"] - after["pagedllm:generation_tokens_total"]
        assert 0 < generated < 440, f"the server should have aborted the request, it generated {generated} tokens"

        # the stopped turn is not history: the next request holds the system prompt and the new message only
        t.send("Hi", "Enter")
        t.wait_for(lambda s: _prompts(s) == 7, "the next answer", timeout=120)
        sent = metrics(server.base_url)["pagedllm:prompt_tokens_total"] - stopped["pagedllm:prompt_tokens_total"]
        expected = tok.apply_chat_template([{"role": "system", "content": "You answer in one word."},
                                            {"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
        assert sent == len(expected)
        t.send("C-d")
        assert t.exit_code() == 0
    finally:
        t.kill()
