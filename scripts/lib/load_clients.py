#!/usr/bin/env python3
"""CLIENTS concurrent greedy completions against a running `leanstream serve` at ADDR.

usage: load_clients.py ADDR CLIENTS TOKENS SLOTS

Prints one JSON line: the aggregate tok/s (every client's completion tokens over the wall time
from the first request to the last reply), p50/p99 latency, and each prompt's text (a caller
compares the texts across servers: greedy replies do not depend on what else is served).
"""
import json
import statistics
import sys
import threading
import time
import urllib.request

PROMPTS = [
    "It is a truth universally acknowledged",
    "The history of the Roman empire",
    "Write a long story about a dragon.",
    "Explain how a steam engine works.",
    "The recipe for bread begins",
    "Once upon a time, in a small village",
    "The theory of relativity says",
    "List the planets of the solar system and describe each.",
]


def complete(addr, prompt, tokens):
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://{addr}/v1/completions", body, {"Content-Type": "application/json"}
    )
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as r:
        reply = json.load(r)
    return reply, time.monotonic() - started


def main():
    addr, clients, tokens, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(clients)]
    # Warm up: one short request (the first one's start-up is not the server's throughput).
    complete(addr, "Hello", 2)
    results = [None] * clients

    def run(i):
        results[i] = complete(addr, prompts[i], tokens)

    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - started
    lost = [i for i, r in enumerate(results) if r is None]
    if lost:
        sys.exit(f"clients {lost} got no reply")
    generated = sum(r["usage"]["completion_tokens"] for r, _ in results)
    latencies = sorted(t for _, t in results)
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    print(json.dumps({
        "slots": slots,
        "clients": clients,
        "tokens": generated,
        "wall_s": round(wall, 3),
        "tok_per_s": round(generated / wall, 2),
        "p50_s": round(statistics.median(latencies), 3),
        "p99_s": round(p99, 3),
        "texts": [r["choices"][0]["text"] for r, _ in results],
    }))


if __name__ == "__main__":
    main()
