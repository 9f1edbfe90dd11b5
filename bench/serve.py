"""`pdserve bench`: a load generator for any OpenAI-compatible completions endpoint."""
from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp

from bench.metrics import RequestResult, parse_slos, summarize
from bench.workloads import BenchRequest, poisson_arrivals, sharegpt, shared_prefix, synthetic


async def sse_events(resp: aiohttp.ClientResponse):
    """The JSON events of an OpenAI server-sent-event stream; None for its closing [DONE]."""
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            yield None if data == b"[DONE]" else json.loads(data)


def carries_tokens(choice: dict) -> bool:
    """A streamed choice that brings tokens: with text, or without while the request goes on (a
    token whose text is held back, such as one byte of a UTF-8 character, streams with empty text,
    as vLLM and pdserve send it). Not a closing chunk that only carries the finish reason."""
    return bool(choice.get("text")) or ("text" in choice and choice.get("finish_reason") is None)


async def send_one(session: aiohttp.ClientSession, url: str, model: str, req: BenchRequest,
                   headers: dict, exact_output: bool) -> RequestResult:
    """One streamed completion; times each chunk that carries tokens (`carries_tokens`: the first
    one is the time to first token, as vLLM's benchmark times it, whether or not it has text yet)."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if exact_output:  # vLLM's extensions: generate exactly output_len tokens
        body.update(ignore_eos=True, min_tokens=req.output_len)
    result = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for chunk in sse_events(resp):
                if chunk is None:
                    break
                if chunk.get("usage"):
                    result.output_len = chunk["usage"].get("completion_tokens", result.output_len)
                    result.prompt_len = chunk["usage"].get("prompt_tokens", result.prompt_len)
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                if any(carries_tokens(c) for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.success = result.ttft > 0
        if not result.success:
            result.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(base_url: str, model: str | None, requests: list[BenchRequest], *,
                        rate: float = float("inf"), max_concurrency: int | None = None,
                        slos: dict[str, float] | None = None, api_key: str | None = None,
                        seed: int = 0, exact_output: bool = True, progress: bool = True,
                        timeout_s: float = 600.0) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if model is None:
            async with session.get(f"{base_url}/v1/models", headers=headers) as r:
                model = (await r.json())["data"][0]["id"]
        url = f"{base_url}/v1/completions"
        offsets = poisson_arrivals(len(requests), rate, seed)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(requests), desc=f"rate={rate:g}", file=sys.stderr, leave=False)

        async def fire(offset: float, req: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            if gate is None:
                res = await send_one(session, url, model, req, headers, exact_output)
            else:
                async with gate:
                    res = await send_one(session, url, model, req, headers, exact_output)
            if bar is not None:
                bar.update(1)
            return res

        t0 = time.perf_counter()
        results = await asyncio.gather(*(fire(o, r) for o, r in zip(offsets, requests)))
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    summary = summarize(results, duration, slos)
    summary.update(model_id=model, request_rate=rate if rate != float("inf") else "inf",
                   max_concurrency=max_concurrency, num_prompts=len(requests), backend="openai",
                   base_url=base_url)
    return summary


def format_table(summary: dict) -> str:
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Duration (s)", f"{summary['duration']:.2f}"),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{summary['output_throughput']:.1f}")]
    if "request_goodput" in summary:
        rows.append(("Request goodput (req/s)", f"{summary['request_goodput']:.2f}"))
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        rows.append((f"{label} mean/median/p90/p99 (ms)",
                     " / ".join(f"{summary[f'{k}_{name}_ms']:.1f}" for k in ("mean", "median", "p90", "p99"))))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def build_requests(args) -> list[BenchRequest]:
    if args.workload == "synthetic":
        return synthetic(args.num_prompts, args.input_len, args.output_len, args.vocab_size, args.seed)
    if args.workload == "shared-prefix":
        groups = max(1, args.num_prompts // args.requests_per_group)
        return shared_prefix(groups, args.requests_per_group, args.prefix_len, args.input_len,
                             args.output_len, args.vocab_size, args.seed)
    if not args.dataset or not args.tokenizer:
        raise SystemExit("error: --workload sharegpt needs --dataset FILE and --tokenizer DIR")
    from transformers import AutoTokenizer
    return sharegpt(args.dataset, args.num_prompts, AutoTokenizer.from_pretrained(args.tokenizer), args.seed)


def run_cli(args) -> int:
    requests = build_requests(args)
    slos = parse_slos(args.goodput)
    rates = [float(r) for r in args.request_rate.split(",")]
    results = []
    for rate in rates:
        summary = asyncio.run(run_benchmark(args.base_url, args.model, requests, rate=rate,
                                            max_concurrency=args.max_concurrency, slos=slos,
                                            api_key=args.api_key, seed=args.seed,
                                            exact_output=not args.no_exact_output))
        summary["label"] = args.label
        print(f"\n== {args.label}: request rate {rate:g}/s ==\n{format_table(summary)}", flush=True)
        results.append(summary)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=1)
        print(f"results written to {args.result_file}")
    return 0 if all(r["failed"] == 0 for r in results) else 1


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (TTFT, TPOT, ITL, goodput)")
    bsub = p.add_subparsers(dest="bench_command")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", default="synthetic", choices=["synthetic", "sharegpt", "shared-prefix"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", default="uniform:32:512", help="fixed:N | uniform:LO:HI | normal:MEAN:STD")
    p.add_argument("--output-len", default="uniform:16:256")
    p.add_argument("--vocab-size", type=int, default=1000, help="synthetic token ids are drawn below this")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: tokens of the shared prompt")
    p.add_argument("--requests-per-group", type=int, default=8, help="shared-prefix: requests per prefix")
    p.add_argument("--dataset", default=None, help="sharegpt: the JSON file")
    p.add_argument("--tokenizer", default=None, help="sharegpt: tokenizer directory for lengths")
    p.add_argument("--request-rate", default="inf", help="requests/s (Poisson); a comma list sweeps")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs in ms, e.g. ttft:500 tpot:50")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-exact-output", action="store_true",
                   help="do not send ignore_eos/min_tokens (servers without vLLM's extensions)")
    p.add_argument("--label", default="pdserve", help="configuration name in results and plots")
    p.add_argument("--result-file", default=None, help="write the results as JSON")
    p.set_defaults(func=run_cli)
    plot = bsub.add_parser("plot", help="PNG figures from result files")
    plot.add_argument("results", nargs="+")
    plot.add_argument("--out-dir", default=".")
    plot.add_argument("--ttft-slo-ms", type=float, default=None)

    def run_plot(a) -> int:
        from bench.plot import plot_results
        for path in plot_results(a.results, a.out_dir):
            print(f"wrote {path}")
        return 0

    plot.set_defaults(func=run_plot)
