#!/usr/bin/env python3
"""`leanstream serve` through the official Python clients: the `openai` package (chat, a tools
round trip, a json_schema reply that parses and validates, logprobs) and the `ollama` package
(/api/chat, /api/generate). Installs both into a virtual environment (VENV, default
.venv-clients at the root of the checkout) from PyPI, starts `serve --parallel 2` and checks each
reply. Exits non-zero naming the check that failed.

The embedded model has no chat template: completions (logprobs, json_schema, Ollama's generate)
run on it; chat, tools and Ollama's chat run on the chat model LEANSTREAM_SMOLLM2 names (a GGUF or
converted SmolLM2-135M-Instruct), and are reported as skipped without one.

usage: scripts/test-clients.py [LEANSTREAM_BINARY]   (default: target/release/leanstream)
"""
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("VENV", ROOT / ".venv-clients"))


def in_venv():
    """Re-runs this script under the virtual environment, made and filled first if need be."""
    python = VENV / "bin" / "python"
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    if not python.exists():
        venv.create(VENV, with_pip=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "openai", "ollama"], check=True)
    os.execv(python, [python, __file__, *sys.argv[1:]])


def start(binary, model):
    server = subprocess.Popen(
        [binary, "serve", "--model", model, "--port", "0", "--temp", "0", "--parallel", "2"],
        stderr=subprocess.PIPE, text=True,
    )
    for line in server.stderr:
        if "http://" in line:
            return server, line.split("http://")[1].split("/")[0]
    sys.exit(f"the server did not start (exit {server.wait()})")


def check(what, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' + str(detail)[:200] if detail else ''}")
    if not ok:
        sys.exit(f"failed: {what}")


def completions(addr):
    import ollama
    import openai

    client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="none", timeout=120)
    model = client.models.list().data[0].id
    check("models.list", model == "austen-relu", model)
    prompt = "It is a truth universally acknowledged"
    done = client.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, logprobs=2)
    choice = done.choices[0]
    check("completion", done.usage.completion_tokens == 16, choice.text)
    lp = choice.logprobs
    check("logprobs: one per token", len(lp.token_logprobs) == 16, len(lp.token_logprobs))
    check("logprobs: <= 0, top 2", all(v <= 0 for v in lp.token_logprobs)
          and all(len(t) == 2 for t in lp.top_logprobs))
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True) if c.choices)
    check("streamed equals whole", streamed == choice.text, streamed)
    schema = {"type": "object", "properties": {
        "married": {"type": "boolean"}, "sisters": {"type": "integer"},
        "mood": {"enum": ["happy", "proud", "prejudiced"]}},
        "required": ["married", "sisters", "mood"], "additionalProperties": False}
    record = client.completions.create(
        model=model, prompt="Elizabeth Bennet, as a record:", max_tokens=100, temperature=0,
        extra_body={"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "record", "schema": schema}}})
    text = record.choices[0].text
    value = json.loads(text)
    check("json_schema reply parses and validates",
          set(value) == {"married", "sisters", "mood"}
          and isinstance(value["married"], bool)
          and isinstance(value["sisters"], int) and not isinstance(value["sisters"], bool)
          and value["mood"] in schema["properties"]["mood"]["enum"], text)
    o = ollama.Client(host=f"http://{addr}", timeout=120)
    generated = o.generate(model=model, prompt=prompt, options={"num_predict": 16, "temperature": 0})
    check("ollama generate", generated.response == choice.text, generated.response)


def chat(addr):
    import ollama
    import openai

    client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="none", timeout=120)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me of Mr. Darcy."}],
        max_tokens=16, temperature=0, logprobs=True, top_logprobs=2,
    )
    choice = chat.choices[0]
    check("chat reply", bool(choice.message.content), choice.message.content)
    entries = choice.logprobs.content
    check("chat logprobs: one per token", len(entries) == chat.usage.completion_tokens,
          len(entries))
    check("chat logprobs: top 2, ordered, <= 0",
          all(len(e.top_logprobs) == 2 and e.logprob <= 0
              and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in entries))
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Tell me of Mr. Darcy."}],
            max_tokens=16, temperature=0, stream=True)
        if c.choices
    )
    check("chat streamed equals whole", streamed == choice.message.content, streamed)

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=tools, max_tokens=16, temperature=0)
    r = reply.choices[0]
    check("tools round trip", r.finish_reason in ("stop", "length", "tool_calls")
          and (r.message.content is not None or bool(r.message.tool_calls)), r.finish_reason)

    o = ollama.Client(host=f"http://{addr}", timeout=120)
    answer = o.chat(model=model, messages=[{"role": "user", "content": "Tell me of Mr. Darcy."}],
                    options={"num_predict": 16, "temperature": 0})
    check("ollama chat", answer.message.role == "assistant"
          and answer.message.content == choice.message.content, answer.message.content)
    parts = "".join(p.message.content for p in o.chat(
        model=model, messages=[{"role": "user", "content": "Tell me of Mr. Darcy."}],
        options={"num_predict": 16, "temperature": 0}, stream=True))
    check("ollama chat streamed", parts == answer.message.content, parts)


def main():
    in_venv()
    binary = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "target/release/leanstream")
    server, addr = start(binary, str(ROOT / "models/austen-relu"))
    try:
        completions(addr)
    finally:
        server.kill()
        server.wait()
    chat_model = os.environ.get("LEANSTREAM_SMOLLM2")
    if not chat_model:
        print("skipped: chat, tools and ollama chat (set LEANSTREAM_SMOLLM2 to a chat model)")
        return
    server, addr = start(binary, chat_model)
    try:
        chat(addr)
    finally:
        server.kill()
        server.wait()
    print("every client check passed")


if __name__ == "__main__":
    main()
