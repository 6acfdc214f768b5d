"""deepinfer-bench: TTFT/TPOT offline on the runtime (prompt length x concurrency), or online against a
running server with N concurrent streaming requests (vllm bench serve's definitions).

Definitions (as `vllm bench serve`): TTFT = request start to the first streamed choice chunk;
TPOT = (latency - TTFT) / (output tokens - 1), output tokens from the usage chunk; ITL = gaps between
consecutive choice chunks; output throughput = all output tokens / wall time of the run. With --max-tokens 1
there are no tokens after the first: TPOT is n/a (NaN in --json).

Bad flags are one `error:` line and exit code 2 before anything loads or connects (offline: a prompt length that
does not fit the artifact's context with --max-tokens is one too, not a skipped row). Online, a request that fails
(an HTTP error, an error event mid-stream, a dropped connection) counts in `failed`: when every request fails there
are no numbers, only the first failure as the error; when some fail, the results are printed and then the count
and the first failure as the error, exit code 2 all the same (numbers over fewer requests, at a lower load than
asked for, are not the run's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ..common.errors import DeepinferError, OptionError, exit_on_error, shown


class ServerError(DeepinferError):
    """online: the server cannot be reached, refuses the benchmark, or fails its requests."""


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
    from .artifact import open_artifact
    from .engine import Engine
    from .sequence import SamplingParams
    limit = open_artifact(artifact, verify=False).manifest.compile.context_limit
    # the engine's rule (Engine.validate): a 1-token request may fill the context with its prompt
    room = limit if max_tokens == 1 else limit - max_tokens
    if room < 1:
        raise OptionError(f"--max-tokens {max_tokens} leaves no room for a prompt in the artifact's context limit "
                          f"{limit}")
    if too_long := [p for p in prompt_lens if p > room]:
        raise OptionError(f"--prompt-lens {','.join(map(str, too_long))}: with --max-tokens {max_tokens}, prompts "
                          f"longer than {room} tokens exceed the artifact's context limit {limit}")
    engine = Engine.from_artifact(artifact, device=device, prefix_caching=prefix_caching, timing=timing)
    timer = engine.runner.timer
    rows = []
    try:
        vocab = engine.manifest.model.vocab_size
        engine.generate(random_prompts(1, 8, vocab, seed, 1), SamplingParams(max_tokens=4, ignore_eos=True))  # warm
        for plen in prompt_lens:
            for conc in concurrency:
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
                # TPOT is over the tokens after the first (vllm's): a 1-token request has none
                tpot = [(done_at[s.seq_id] - s.first_token_time) / (len(s.output_ids) - 1) for s in seqs
                        if len(s.output_ids) > 1]
                rows.append({"prompt_len": plen, "concurrency": conc, "ttft_ms_median": 1e3 * statistics.median(ttft),
                             "ttft_ms_p99": 1e3 * pct(ttft, 99),
                             "tpot_ms_median": 1e3 * statistics.median(tpot) if tpot else float("nan"),
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
                r.error = _http_error(resp.status_code, (await resp.aread()).decode(errors="replace"))
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
                    if "error" in data:       # the server's error event: the request failed mid-stream
                        r.error = "error mid-stream: " + _error_message(data, msg[6:])
                        return r
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
        if not r.ok:
            r.error = "the stream ended without a token"
    except Exception as e:  # network errors are results, not crashes
        r.error = f"{type(e).__name__}: {e}"
    return r


def _error_message(body, text: str) -> str:
    """An OpenAI-shaped error body's message, else the reply's start, as one line."""
    try:
        msg = body["error"]["message"]
    except (LookupError, TypeError):
        msg = text
    return " ".join(str(msg).split())[:300]


def _http_error(status: int, text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    return f"HTTP {status}: {_error_message(body, text)}"


def _base_url(text: str) -> str:
    import httpx
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL:
        url = None
    if url is None or url.scheme not in ("http", "https") or not url.host:
        raise OptionError(f"--base-url {shown(text)!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
    return text.rstrip("/")          # the paths are appended


async def _served_model(client, base_url: str, headers: dict, model: str | None) -> str:
    """GET /v1/models before anything is timed: an unreachable server or a refused --api-key is one error naming
    it, not a failure per request; without --model, the server's first model is the one benchmarked."""
    import httpx
    url = base_url + "/v1/models"
    try:
        resp = await client.get(url, headers=headers)
    except httpx.HTTPError as e:
        raise ServerError(f"--base-url {base_url}: cannot reach the server ({type(e).__name__}: "
                          f"{str(e) or 'no reply'})") from None
    if resp.status_code == 404 and model is not None:
        return model                 # a server without the listing: the requests will tell
    if resp.status_code != 200:
        hint = {401: " (check --api-key)", 403: " (check --api-key)",
                404: " (--base-url is the server's root, without /v1)"}.get(resp.status_code, "")
        raise ServerError(f"GET {url} answered {_http_error(resp.status_code, resp.text)}{hint}")
    if model is not None:
        return model
    try:
        return str(resp.json()["data"][0]["id"])
    except (ValueError, LookupError, TypeError):
        raise ServerError(f"GET {url}: the reply lists no model ({shown(resp.text)!r}); pass --model") from None


async def _online(base_url: str, model: str | None, prompt_len: int, max_tokens: int, num_requests: int,
                  concurrency: int, seed: int, api_key: str | None, vocab: int, prefix_len: int = 0,
                  sampling: dict | None = None) -> dict:
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # connecting gives up in 30 s on a host that never answers (the 600 s are for long generations)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        model = await _served_model(client, base_url, headers, model)
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
    errors = list(dict.fromkeys(r.error for r in results if not r.ok))     # distinct, in request order
    if not ok:
        raise ServerError(f"all {num_requests} requests failed; the first: {errors[0]}")
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    return {"requests": num_requests, "concurrency": concurrency, "prompt_len": prompt_len,
            "completed": len(ok), "failed": len(results) - len(ok),
            "errors": errors[:3],
            "ttft_ms_median": 1e3 * statistics.median(ttft) if ttft else float("nan"),
            "ttft_ms_p99": 1e3 * pct(ttft, 99), "tpot_ms_median": 1e3 * statistics.median(tpot) if tpot else
            float("nan"), "tpot_ms_p99": 1e3 * pct(tpot, 99),
            "itl_ms_median": 1e3 * statistics.median(itl) if itl else float("nan"), "itl_ms_p99": 1e3 * pct(itl, 99),
            "output_tok_s": sum(r.output_tokens for r in ok) / wall, "wall_s": wall}


def table(rows: list[dict], cols: list[str]) -> str:
    out = ["  ".join(f"{c:>14}" for c in cols)]
    for r in rows:
        out.append("  ".join(f"{'n/a':>14}" if isinstance(r[c], float) and math.isnan(r[c]) else
                             f"{r[c]:>14.2f}" if isinstance(r[c], float) else f"{r[c]!s:>14}" for c in cols))
    return "\n".join(out)


def _sampling_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--temperature", type=float, default=None,
                    help="every request's (default 0: greedy; 1 where --top-p or --top-k is given)")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--top-k", type=int, default=None, help="-1 or 0: no top-k")
    ap.add_argument("--presence-penalty", type=float, default=None)
    ap.add_argument("--frequency-penalty", type=float, default=None)
    ap.add_argument("--repetition-penalty", type=float, default=None)


class _Parser(argparse.ArgumentParser):
    """Flag errors as the other commands': one line and exit code 2 (argparse prints the usage first)."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def _counts(flag: str, text: str) -> list[int]:
    """A comma-separated list of positive integers (--prompt-lens 32,128)."""
    try:
        xs = [int(x) for x in text.split(",")]
    except ValueError:
        xs = []
    if not xs or min(xs) < 1:
        raise OptionError(f"{flag} {shown(text)!r} is not a comma-separated list of positive integers (e.g. 1,4,16)")
    return xs


def _at_least(a: argparse.Namespace, name: str, low: int, why: str = "") -> None:
    if (v := getattr(a, name)) < low:
        raise OptionError(f"--{name.replace('_', '-')} {shown(v)} must be at least {low}{why}")


def _check(a: argparse.Namespace) -> None:
    """The flags' rules, before anything loads or connects."""
    _at_least(a, "max_tokens", 1)
    _at_least(a, "prefix_len", 0)
    _at_least(a, "seed", 0, " (numpy's seeds are non-negative)")
    if a.mode == "online":
        a.base_url = _base_url(a.base_url)
        _at_least(a, "prompt_len", 1)
        _at_least(a, "num_requests", 1)
        _at_least(a, "concurrency", 1)
        _at_least(a, "vocab", 3, " (prompt ids are drawn from 2 up to it)")


def main(argv: list[str] | None = None) -> None:
    ap = _Parser(prog="deepinfer-bench", description=__doc__,
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
    _check(a)
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
        rows = offline(a.artifacts, _counts("--prompt-lens", a.prompt_lens),
                       _counts("--concurrency", a.concurrency), a.max_tokens, a.seed, a.device, a.prefix_len,
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
        if r["failed"]:
            raise ServerError(f"{r['failed']} of {r['requests']} requests failed (the numbers above are over the "
                              f"{r['completed']} that completed); the first: {r['errors'][0]}")
