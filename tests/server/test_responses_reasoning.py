"""``/v1/responses`` with ``--reasoning-parser``: reasoning items, whole and streamed, on a scripted model.

The model (``reasoning_models.scripted_reasoning_model``) greedily writes ``<think>I should greet</think>Hello
there``: the script is the oracle of the split, whole and streamed.
"""

from __future__ import annotations

import openai
import pytest

from reasoning_models import ANSWER, REASONING, scripted_reasoning_model
from server_utils import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = scripted_reasoning_model(tmp_path_factory.mktemp("responses-reasoning") / "model")
    # the structured-outputs config's reasoning_parser is what serve's --reasoning-parser sets (vLLM's key)
    srv = ServerProcess(model, "--max-model-len", "256", "--structured-outputs-config",
                        '{"reasoning_parser": "deepseek_r1"}')
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url_v1, api_key=server.api_key, max_retries=0)


def test_reasoning_item_then_message(client):
    r = client.responses.create(model="test-model", input="Hi", max_output_tokens=40, temperature=0)
    assert [it.type for it in r.output] == ["reasoning", "message"] and r.status == "completed"
    assert r.output[0].content[0].text == REASONING and r.output_text == ANSWER
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens


def test_streamed_reasoning_events(client):
    events = list(client.responses.create(model="test-model", input="Hi", max_output_tokens=40, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    n_r = kinds.count("response.reasoning_text.delta")
    n_t = kinds.count("response.output_text.delta")
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added"]
                     + ["response.reasoning_text.delta"] * n_r
                     + ["response.reasoning_text.done", "response.output_item.done", "response.output_item.added",
                        "response.content_part.added"] + ["response.output_text.delta"] * n_t
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    final = events[-1].response
    assert [it.type for it in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_reasoning_effort_reaches_the_template(client):
    """``reasoning.effort`` is the template's ``reasoning_effort`` (the scripted template renders it)."""
    plain = client.responses.create(model="test-model", input="Hi", max_output_tokens=40, temperature=0)
    high = client.responses.create(model="test-model", input="Hi", max_output_tokens=40, temperature=0,
                                   reasoning={"effort": "high"})
    chat = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=40, temperature=0,
                                          extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}})
    assert high.usage.input_tokens == chat.usage.prompt_tokens > plain.usage.input_tokens
    assert high.reasoning.effort == "high" and high.output_text == ANSWER


def test_chained_reasoning_is_not_replayed_as_content(client):
    """The stored reasoning item goes back as the assistant turn's ``reasoning_content``, for the template to render
    or not (this scripted one renders it, as Qwen3's does): the continued prompt is the chat prompt of that
    conversation, never the reasoning replayed as the answer's content."""
    r1 = client.responses.create(model="test-model", input="Hi", max_output_tokens=40, temperature=0)
    r2 = client.responses.create(model="test-model", input="Again", previous_response_id=r1.id,
                                 max_output_tokens=40, temperature=0)
    chat = client.chat.completions.create(model="test-model", max_tokens=1, temperature=0, messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
        {"role": "user", "content": "Again"}])
    assert r2.usage.input_tokens == chat.usage.prompt_tokens
    assert [it.type for it in r2.output] == ["reasoning", "message"] and r2.output_text == ANSWER
