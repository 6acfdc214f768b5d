"""deepinfer-bench: TTFT/TPOT offline on the runtime (prompt length x concurrency), or online against a
running server with N concurrent streaming requests (vllm bench serve's definitions).

Definitions (as `vllm bench serve`): TTFT = request start to the first streamed choice chunk;
TPOT = (latency - TTFT) / (output tokens - 1), output tokens from the usage chunk; ITL = gaps between
consecutive choice chunks; output throughput = all output tokens / wall time of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..common.errors import exit_on_error


def random_prompts(n: int, length: int, vocab: int, seed: int, *key: int, prefix_len: int = 0) -> list[list[int]]:
    """Random token prompts of `length` tokens, drawn from (seed, *key): each row of a run gets its own, so the
    prefix cache never serves one row what an earlier row computed. With prefix_len, all n share their first
    prefix_len tokens (a system prompt; vllm bench serve's --random-prefix-len)."""
    rng = np.random.default_rng([seed, *key])
    prefix = rng.integers(2, vocab, size=min(prefix_len, length)).tolist()
    return [prefix + rng.integers(2, vocab, size=length - len(prefix)).tolist() for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


# -- offline -----------------------------------------------------------------------------------------
def offline(artifact: str, prompt_lens: list[int], concurrency: list[int], max_tokens: int, seed: int,
            device: str = "cpu", prefix_len: int = 0, prefix_caching: bool = True,
            sampling: dict | None = None, timing: bool = False) -> list[dict]:
    """sampling: temperature, top_p, top_k and the penalties for every request (default greedy). timing
    (DEEPINFER_REGION_TIMING): each row's region timing table goes to stderr after the row."""
    from .engine import Engine
    from .sequence import SamplingParams
    engine = Engine.from_artifact(artifact, device=device, prefix_caching=prefix_caching, timing=timing)
    timer = engine.runner.timer
    rows = []
    try:
        vocab = engine.manifest.model.vocab_size
        limit = engine.manifest.compile.context_limit
        engine.generate(random_prompts(1, 8, vocab, seed, 1), SamplingParams(max_tokens=4, ignore_eos=True))  # warm
        for plen in prompt_lens:
            for conc in concurrency:
                if plen + max_tokens > limit:
                    continue
                prompts = random_prompts(conc, plen, vocab, seed, 2, plen, conc, prefix_len=prefix_len)
                hits = engine.scheduler.blocks.hits
                params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(sampling or {}))
                if timer is not None:
                    timer.reset()
                t0 = time.monotonic()
                seqs = [engine.add_request(p, params) for p in prompts]
                done_at: dict[int, float] = {}
                while engine.has_work:
                    for out in engine.step():
                        if out.finished:
                            done_at[out.seq.seq_id] = time.monotonic()
                wall = time.monotonic() - t0
                ttft = [s.first_token_time - t0 for s in seqs]
                tpot = [(done_at[s.seq_id] - s.first_token_time) / (len(s.output_ids) - 1) for s in seqs]
                rows.append({"prompt_len": plen, "concurrency": conc, "ttft_ms_median": 1e3 * statistics.median(ttft),
                             "ttft_ms_p99": 1e3 * pct(ttft, 99), "tpot_ms_median": 1e3 * statistics.median(tpot),
                             "tpot_ms_p99": 1e3 * pct(tpot, 99),
                             "output_tok_s": conc * max_tokens / wall, "wall_s": wall,
                             "cached_pct": 100.0 * (engine.scheduler.blocks.hits - hits) / (conc * plen)})
                if timer is not None:
                    print(f"region timing, prompt_len {plen}, concurrency {conc}:\n{timer.table()}",
                          file=sys.stderr, flush=True)
    finally:
        engine.close()
    return rows


# -- online --------------------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def _one(client, url: str, body: dict, headers: dict) -> Result:
    r = Result()
    st = time.perf_counter()
    last = st
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return r
            buf = ""
            async for text in resp.aiter_text():
                buf += text
                while "\n\n" in buf:
                    msg, buf = buf.split("\n\n", 1)
                    msg = msg.strip()
                    if not msg.startswith("data: ") or msg == "data: [DONE]":
                        continue
                    data = json.loads(msg[6:])
                    if data.get("choices"):
                        now = time.perf_counter()
                        if r.ttft == 0.0:
                            r.ttft = now - st
                        else:
                            r.itl.append(now - last)
                        last = now
                    elif data.get("usage"):
                        r.output_tokens = data["usage"]["completion_tokens"]
        r.latency = last - st
        r.ok = r.ttft > 0
    except Exception as e:  # network errors are results, not crashes
        r.error = f"{type(e).__name__}: {e}"
    return r


async def _online(base_url: str, model: str | None, prompt_len: int, max_tokens: int, num_requests: int,
                  concurrency: int, seed: int, api_key: str | None, vocab: int, prefix_len: int = 0,
                  sampling: dict | None = None) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        if model is None:
            model = (await client.get(base_url + "/v1/models", headers=headers)).json()["data"][0]["id"]
        prompts = random_prompts(num_requests, prompt_len, vocab, seed, prefix_len=prefix_len)
        sem = asyncio.Semaphore(concurrency)

        async def run(p):
            async with sem:
                body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                        **(sampling or {})}
                return await _one(client, base_url + "/v1/completions", body, headers)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    return {"requests": num_requests, "concurrency": concurrency, "prompt_len": prompt_len,
            "completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:3],
            "ttft_ms_median": 1e3 * statistics.median(ttft) if ttft else float("nan"),
            "ttft_ms_p99": 1e3 * pct(ttft, 99), "tpot_ms_median": 1e3 * statistics.median(tpot) if tpot else
            float("nan"), "tpot_ms_p99": 1e3 * pct(tpot, 99),
            "itl_ms_median": 1e3 * statistics.median(itl) if itl else float("nan"), "itl_ms_p99": 1e3 * pct(itl, 99),
            "output_tok_s": sum(r.output_tokens for r in ok) / wall, "wall_s": wall}


def table(rows: list[dict], cols: list[str]) -> str:
    out = ["  ".join(f"{c:>14}" for c in cols)]
    for r in rows:
        out.append("  ".join(f"{r[c]:>14.2f}" if isinstance(r[c], float) else f"{r[c]!s:>14}" for c in cols))
    return "\n".join(out)


def _sampling_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--temperature", type=float, default=None,
                    help="every request's (default 0: greedy; 1 where --top-p or --top-k is given)")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None, help="-1 or 0: no top-k")
    ap.add_argument("--presence-penalty", type=float, default=None)
    ap.add_argument("--frequency-penalty", type=float, default=None)
    ap.add_argument("--repetition-penalty", type=float, default=None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="deepinfer-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = ap.add_subparsers(dest="mode", required=True)
    off = sub.add_parser("offline", help="TTFT/TPOT matrix straight on the runtime")
    off.add_argument("artifacts")
    off.add_argument("--prompt-lens", default="32,128")
    off.add_argument("--concurrency", default="1,4,16")
    off.add_argument("--max-tokens", type=int, default=32)
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--device", default="cpu")
    off.add_argument("--prefix-len", type=int, default=0, help="the prompts of a row share this many first tokens")
    off.add_argument("--no-prefix-caching", action="store_true")
    off.add_argument("--json", action="store_true")
    _sampling_flags(off)
    on = sub.add_parser("online", help="drive a running server with concurrent streaming requests")
    on.add_argument("--base-url", default="http://127.0.0.1:8000")
    on.add_argument("--model", default=None)
    on.add_argument("--prompt-len", type=int, default=64)
    on.add_argument("--max-tokens", type=int, default=32)
    on.add_argument("--num-requests", type=int, default=64)
    on.add_argument("--concurrency", type=int, default=8)
    on.add_argument("--vocab", type=int, default=1000, help="random prompt ids are drawn below this")
    on.add_argument("--seed", type=int, default=0, help="the same seed sends the same prompts (a server with "
                    "prefix caching serves a repeated run from its cache)")
    on.add_argument("--prefix-len", type=int, default=0, help="all prompts share this many first tokens")
    on.add_argument("--api-key", default=None)
    on.add_argument("--json", action="store_true")
    _sampling_flags(on)
    a = ap.parse_args(argv)
    with exit_on_error(a.debug):     # as the other commands: one line, exit code 2
        _run(a)


def _run(a: argparse.Namespace) -> None:
    sampling = {k: v for k, v in (("temperature", a.temperature), ("top_p", a.top_p), ("top_k", a.top_k))
                if v is not None}
    if sampling and a.temperature is None:
        sampling["temperature"] = 1.0          # top-p/top-k alone: sampled at OpenAI's default temperature
    sampling |= {k: v for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")
                 if (v := getattr(a, k)) is not None}
    if a.mode == "offline":
        from .model_runner import timing_requested
        if sampling.get("top_k") == -1:
            sampling["top_k"] = 0              # the server's (and vLLM's) "no top-k" is the engine's 0
        rows = offline(a.artifacts, [int(x) for x in a.prompt_lens.split(",")],
                       [int(x) for x in a.concurrency.split(",")], a.max_tokens, a.seed, a.device, a.prefix_len,
                       not a.no_prefix_caching, sampling,
                       timing=timing_requested())
        print(json.dumps(rows) if a.json else table(rows, ["prompt_len", "concurrency", "ttft_ms_median",
                                                            "ttft_ms_p99", "tpot_ms_median", "tpot_ms_p99",
                                                            "output_tok_s", "cached_pct"]))
    else:
        r = asyncio.run(_online(a.base_url, a.model, a.prompt_len, a.max_tokens, a.num_requests, a.concurrency,
                                a.seed, a.api_key, a.vocab, a.prefix_len, sampling))
        print(json.dumps(r) if a.json else table([r], ["requests", "concurrency", "completed", "failed",
                                                       "ttft_ms_median", "ttft_ms_p99", "tpot_ms_median",
                                                       "tpot_ms_p99", "itl_ms_median", "itl_ms_p99",
                                                       "output_tok_s"]))
        if r["errors"]:
            print("errors:", r["errors"])
