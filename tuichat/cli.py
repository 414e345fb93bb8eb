"""Command line: `tuichat` (the TUI), `tuichat ask`, `tuichat models`, `tuichat bench`.

Heavy imports (torch, transformers, textual) happen inside the commands so `--help` stays instant.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, replace

import click

from tuichat.backends.protocol import EngineOptions, Message, RemoteStats, TuichatError, chat_sampling


def engine_options(func):
    """The engine options every front end accepts (TUI, ask, bench)."""
    options = [
        click.option("--device", default=None, help="auto | cpu | cuda | cuda:N  [config: engine.device]"),
        click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None),
        click.option("--kv-cache-mb", type=click.IntRange(min=1), default=None, help="KV cache memory budget."),
        click.option("--kv-disk-mb", type=click.IntRange(min=0), default=None,
                     help="KV kept in the cache dir across restarts, read back instead of prefilled (0: off). "
                          "[default: 2048]"),
        click.option("--batching", type=click.Choice(["continuous", "static", "off"]), default=None),
        click.option("--prefix-cache/--no-prefix-cache", default=None, help="Reuse KV of shared prefixes."),
        click.option("--tp", type=click.IntRange(min=1), default=None, help="Tensor-parallel ranks."),
        click.option("--device-map", default=None, help="'auto': accelerate layer split over the GPUs."),
        click.option("--quant", type=click.Choice(["auto", "none", "int8", "int4"]), default=None,
                     help="auto: a .gguf's weights read in its own blocks (Q8_0/Q4_0/Q4_1; Q5 and K-quants re-cut to "
                          "blocks of 32); none: bf16; int8/int4: "
                          "a dense model's quantized to Q8_0/Q4_1 blocks at load (cached)."),
        click.option("--context-policy", type=click.Choice(["drop", "summarise", "refuse"]), default=None,
                     help="A conversation that outgrows the model's context: drop its oldest turns, summarise them "
                          "with the model, or refuse it (serve's default, as OpenAI's API does). [default: drop]"),
        click.option("--speculate", type=click.Choice(["auto", "ngram", "off"]), default=None,
                     help="Speculative decoding from the conversation's own text (the same replies, more tokens per "
                          "step): auto where it pays, ngram always, off."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def remote_options(func):
    """A server to talk to without config (the TUI, ask, bench)."""
    func = click.option("--api-key-env", default="OPENAI_API_KEY", show_default=True,
                        help="The environment variable that holds --base-url's API key (sent as a bearer token).")(func)
    return click.option("--base-url", default=None,
                        help="An OpenAI-compatible server (http://HOST:PORT/v1) to use without config: --model is "
                             "then its model id (default: its first).")(func)


def _backend(ctx: click.Context, config, options: EngineOptions, model: str | None, base_url: str | None,
             api_key_env: str | None):
    """(the Router over the local engine and the endpoints, the model spec to start with); exits on a bad URL."""
    from tuichat.backends.endpoints import url_problem
    from tuichat.backends.router import build

    base_url = base_url or ctx.obj.get("base_url")
    if base_url is not None and (problem := url_problem(base_url)):
        _fail(f"--base-url {problem}.")
    return build(options, model or ctx.obj.get("model"), config.model, config.endpoints, config.models, base_url,
                 api_key_env or ctx.obj.get("api_key_env"), config.model_dirs)


def _engine_options(config, *flag_sets: dict) -> EngineOptions:
    """The config's engine options under each set of flags in turn (the group's, then the command's): a flag
    left out (None) keeps what came before it."""
    return replace(config.engine, **{k: v for flags in flag_sets for k, v in flags.items() if v is not None})


def _load_config():
    from tuichat.config import load_config

    config, warnings = load_config()
    for warning in warnings:
        click.echo(f"tuichat: {warning}", err=True)
    return config, warnings


def _fail(message: str) -> None:
    click.echo(f"tuichat: {message}", err=True)
    sys.exit(2)


def _utf8(text: str | bytes, what: str) -> str:
    """`text` if it is valid UTF-8, else exit with where the first bad byte is. Python hands undecodable
    argv (and, in some locales, stdin) bytes over as lone surrogates, which the tokenizer rejects with a
    traceback; guessing another encoding or replacing them would send a prompt the user never wrote."""
    try:
        if isinstance(text, bytes):
            return text.decode("utf-8")
        text.encode("utf-8")
        return text
    except UnicodeDecodeError as error:
        bad, at = error.object[error.start], error.start
    except UnicodeEncodeError as error:
        bad, at = ord(error.object[error.start]) - 0xDC00, error.start  # surrogateescape: U+DC80..U+DCFF
    _fail(f"{what} is not valid UTF-8 (byte 0x{bad:02x} at {at}); nothing was sent. Convert it first, "
          "e.g. with `iconv -t UTF-8`.")


def _main_help() -> str:
    from tuichat.paths import location

    return f"""tuichat: chat with local models in your terminal; see batching and caching at work.

    \b
    Files (move them with TUICHAT_CONFIG_DIR, TUICHAT_DATA_DIR, TUICHAT_CACHE_DIR):
      config   {location('config')}/config.toml, themes/
      history  {location('data')}/history.sqlite3
      cache    {location('cache')}/models (converted models), quantized/ (--quant int8|int4)
    """


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]},
             help=_main_help())
@click.option("--model", "-m", default=None,
              help="Model for new tabs: smollm2-135m, a folder, a .gguf, a hub id, or NAME:MODEL of a config endpoint.")
@remote_options
@engine_options
@click.pass_context
def main(ctx: click.Context, model, base_url, api_key_env, **engine_flags) -> None:
    ctx.obj = {"model": model, "engine_flags": engine_flags, "base_url": base_url, "api_key_env": api_key_env}
    if ctx.invoked_subcommand is not None:
        return
    from tuichat.store import Store
    from tuichat.ui.app import run_tui

    config, warnings = _load_config()
    options = _engine_options(config, engine_flags)
    backend, config.model = _backend(ctx, config, options, model, base_url, api_key_env)
    run_tui(lambda: backend, config, Store(), warnings)


@main.command()
def paths() -> None:
    """Print where tuichat keeps its files."""
    from tuichat import paths as p
    from tuichat.config import config_path
    from tuichat.themes import bundled_themes_dir

    click.echo(f"config:  {config_path()}\nthemes:  {p.config_dir() / 'themes'}\nbundled: {bundled_themes_dir()}\n"
               f"history: {p.data_dir() / 'history.sqlite3'}\ncache:   {p.cache_dir()}\nkv:      {p.cache_dir() / 'kv'}")


@main.command()
@click.argument("prompt")
@click.option("--model", "-m", default=None, help="Model spec (default: the config's, else smollm2-135m).")
@click.option("--system", default=None, help="System message.")
@click.option("--temperature", type=click.FloatRange(min=0), default=None)
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None)
@click.option("--top-k", type=click.IntRange(min=0), default=None)
@click.option("--max-tokens", type=click.IntRange(min=1), default=None)
@click.option("--seed", type=int, default=None)
@click.option("--presence-penalty", type=click.FloatRange(-2, 2), default=None,
              help="Lower the logit of every token already in the reply (OpenAI's; 0 is off).")
@click.option("--frequency-penalty", type=click.FloatRange(-2, 2), default=None,
              help="Lower a token's logit by this times its count in the reply (OpenAI's; 0 is off).")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end instead of streaming.")
@remote_options
@engine_options
@click.pass_context
def ask(ctx, prompt, model, system, temperature, top_p, top_k, max_tokens, seed, presence_penalty, frequency_penalty,
        stop, as_json, base_url, api_key_env, **engine_flags):
    """Answer PROMPT (`-` reads stdin), streaming the reply to stdout and stats to stderr."""
    # Checked before anything loads: a bad prompt or setting fails in milliseconds, not after the model.
    prompt = _utf8(sys.stdin.buffer.read(), "the prompt on stdin") if prompt == "-" else _utf8(prompt, "the prompt")
    if not prompt.strip():
        _fail("the prompt is empty.")
    if system is not None:
        system = _utf8(system, "--system")
    config, _ = _load_config()
    options = _engine_options(config, ctx.obj["engine_flags"], engine_flags)
    backend, model = _backend(ctx, config, options, model, base_url, api_key_env)
    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)
    system = system if system is not None else config.system_prompt
    messages = ([Message("system", system)] if system else []) + [Message("user", prompt)]
    chosen = {**config.sampling, **{k: v for k, v in given.items() if v is not None}, **({"stop": stop} if stop else {})}
    try:
        chat_sampling({}, chosen)  # a value out of range fails before the model loads
        asyncio.run(_ask(model, options, messages, chosen, as_json, backend))
    except TuichatError as exc:
        _fail(str(exc))


def stderr_progress(what: str, fraction: float | None) -> None:
    """Loading progress for the command line: one line per stage on stderr; on a terminal, a stage's rising
    figure (a download) redraws its line instead of adding one per percent."""
    partial = fraction not in (None, 0.0, 1.0)
    suffix = f" ({fraction:.0%})" if partial else ""
    if sys.stderr.isatty():
        print(f"\r\x1b[K[tuichat] {what}{suffix}", end="" if partial else "\n", file=sys.stderr, flush=True)
    else:
        print(f"[tuichat] {what}{suffix}", file=sys.stderr, flush=True)


async def _ask(model: str, options: EngineOptions, messages, chosen: dict, as_json: bool, backend) -> None:
    try:
        name = await backend.load(model, stderr_progress)
        params = chat_sampling(backend.sampling_defaults(name), chosen)
        text, started, last = [], time.monotonic(), None
        async for event in backend.stream("ask", messages, params):
            if event.text:
                text.append(event.text)
                if not as_json:
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
            last = event
        usage = last.usage
        if last.error:
            if as_json:  # the partial reply, marked
                click.echo(json.dumps({"text": "".join(text), "model": name, "error": last.error}))
            elif text:
                click.echo()
            raise TuichatError(f"the reply above is partial: {last.error}" if text and not as_json else last.error)
        stats = backend.stats(name)
        local = not isinstance(stats, RemoteStats)  # a server's own settings are not known to the client
        result = {
            "text": "".join(text),
            "model": name,
            "device": stats.device,
            "dtype": stats.dtype,
            "quant": options.quant if local else None,
            "weights": stats.weights,  # what --quant gave: "Q8_0", or "bfloat16 (int8 needs the C layers: why)"
            "weight_mb": round(stats.weight_bytes / 2**20, 1),
            "mapped_mb": round(stats.mapped_bytes / 2**20, 1) if local else None,  # of those, read in place from the file
            "huge_page_mb": round(stats.huge_page_bytes / 2**20, 1) if local else None,  # of the file, mapped in 2 MB pages
            "kv_cache_mb": round(stats.kv_bytes / 2**20, 1) if local else None,
            "load_s": round(stats.load_s, 2) if local else None,
            "rss_mb": round(stats.rss_bytes / 2**20, 1) if local else None,  # this process, after the reply
            "peak_rss_mb": round(stats.peak_rss_bytes / 2**20, 1) if local else None,
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_tokens,
            "restored_tokens": usage.restored_tokens,  # of the cached, read back from disk (kv_disk)
            "cache_miss": usage.cache_miss,  # why the cache held less than the conversation had run
            "context_tokens": usage.context_tokens or None,
            "dropped_messages": usage.dropped_messages,  # left out to fit the context (the context policy)
            "dropped_tokens": usage.dropped_tokens,
            "completion_tokens": usage.completion_tokens,
            "ttft_ms": usage.ttft_ms,
            "tokens_per_s": usage.tokens_per_s,
            "e2e_ms": usage.e2e_ms,
            "finish_reason": usage.finish_reason,
            "finish_detail": usage.finish_detail,
            "speculate": stats.speculate if local else None,
            "tokens_per_step": usage.tokens_per_step,
            "draft_tokens": usage.draft_tokens,
            "accepted_tokens": usage.accepted_tokens,
            "acceptance": usage.acceptance,
            "sampling": {k: v for k, v in asdict(params).items() if k not in ("stop", "max_tokens")},
        }
        if usage.finish_detail:  # "length" before max_tokens: say what filled up, and what to do
            click.echo(f"tuichat: the reply was cut short: {usage.finish_detail}.", err=True)
        if as_json:
            click.echo(json.dumps(result))
        else:
            click.echo()
            ttft = f"{usage.ttft_ms:.0f} ms" if usage.ttft_ms is not None else "n/a"
            tps = f"{usage.tokens_per_s:.1f} tok/s" if usage.tokens_per_s else "n/a"
            served, paren, why = stats.weights.partition(" (")  # "bfloat16 (int8 needs the C layers: ...)"
            weights = f" · {served} weights{paren}{why}" if stats.weights not in ("", stats.dtype) else ""
            click.echo(
                f"[{name} · {' '.join(filter(None, (stats.device, stats.dtype)))}{weights}] TTFT {ttft} · {tps} · {usage.prompt_tokens} prompt "
                f"({usage.cached_tokens} cached) + {usage.completion_tokens} completion tokens · "
                f"finish: {usage.finish_reason} · wall {time.monotonic() - started:.2f} s",
                err=True,
            )
    finally:
        await backend.close()


@main.command()
@click.option("--model", "-m", default=None, help="Model served when a request names none (default: the config's).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True)
@click.option("--api-key", envvar="TUICHAT_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on /v1/ [$TUICHAT_API_KEY].")
@click.option("--insecure-no-auth", is_flag=True, help="Listen beyond loopback without an API key.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@engine_options
@click.pass_context
def serve(ctx, model, host, port, api_key, insecure_no_auth, log_level, **engine_flags):
    """Serve the engine behind an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics; its contract at /openapi.json).

    Every client's requests are batched together and share the prefix cache, as tabs do.
    """
    from tuichat.server import is_loopback
    from tuichat.server import serve as run_server

    if not is_loopback(host) and api_key is None and not insecure_no_auth:
        _fail(f"--host {host} listens beyond this machine: set --api-key (or TUICHAT_API_KEY), or pass "
              "--insecure-no-auth to serve anyone who can reach it.")
    config, _ = _load_config()
    model = model or ctx.obj.get("model") or config.model
    options = _engine_options(config, ctx.obj["engine_flags"], engine_flags)
    if ctx.obj["engine_flags"].get("context_policy") is None and engine_flags.get("context_policy") is None:
        # OpenAI's contract: a request too long for the context is refused (context_length_exceeded), never
        # answered from part of it unasked.
        options = replace(options, context_policy="refuse")
    from tuichat.backends.local import LocalBackend

    backend = LocalBackend(options, model, config.models, config.model_dirs)
    run_server(backend, model, host, port, api_key, config.sampling, log_level)


@main.command()
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object a line: spec, source, path, size_bytes, format, family, quant, parameters, "
                   "context, runs, reason.")
def models(as_json: bool) -> None:
    """List the models tuichat can open: the embedded one, Ollama's store, LM Studio's folders, the Hugging Face
    cache, config.toml's models and model_dirs; a model it cannot run says why."""
    import dataclasses
    import json

    from tuichat.backends.local import LocalBackend
    from tuichat.config import load_config

    config, _ = load_config()
    for info in LocalBackend(extra_models=config.models, model_dirs=config.model_dirs).list_models():
        if as_json:
            fields = dataclasses.asdict(info)
            fields["source"] = {"remote": "endpoint"}.get(fields.pop("kind"), info.kind)
            click.echo(json.dumps(fields))
        else:
            why = f"  [cannot run: {info.reason}]" if info.runs is False and info.reason != info.description else ""
            click.echo(f"{info.spec:<48} {info.kind:<9} {info.description}{why}")


@main.command()
@click.option("--model", "-m", default=None, help="Model spec (default: smollm2-135m, the embedded model).")
@click.option("--quick", is_flag=True, help="A short run (a minute or two): fewer turns, shorter replies.")
@click.option("--scenarios", default="all", show_default=True,
              help="Comma-separated: single,prefill,tabs,multiturn,shared_prefix,interference,speculative.")
@click.option("--tabs", type=click.IntRange(min=1), default=8, show_default=True, help="Conversations at once.")
@click.option("--stagger-ms", type=click.FloatRange(min=0), default=None,
              help="Gap between tab arrivals [100], for tuichat and the batching peers alike; 0 sends all at once.")
@click.option("--turns", type=click.IntRange(min=1), default=None, help="Turns per conversation [8; --quick: 4].")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Cap on every reply (default: 64 single, 128 tabs, 96 per turn; --quick: 32/128/48).")
@click.option("--peers", default="all", show_default=True,
              help="Comma-separated: hf_generate,hf_static_batch,hf_generate_batch,llama_cpp,tuichat_serve (or none).")
@click.option("--llama-server", "llama_server", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The llama-server binary for the llama_cpp peer [$TUICHAT_LLAMA_SERVER, else on PATH].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Save charts to this PNG (needs the 'plot' extra: matplotlib).")
@remote_options
@engine_options
@click.pass_context
def bench(ctx, model, quick, scenarios, tabs, stagger_ms, turns, max_tokens, peers, llama_server, as_json, plot_path,
          base_url, api_key_env, **engine_flags):
    """Measure streaming, batching and caching here, next to transformers and llama.cpp's llama-server.

    The table (or --json) goes to stdout, the progress bar to stderr. Each scenario sets --batching and
    --prefix-cache itself (it compares them); the other engine options apply to every engine. With a remote
    model (NAME:MODEL, --base-url), single, tabs and multiturn run over the wire, without the peers."""
    from tuichat import bench as bench_module
    from tuichat.backends.endpoints import split_spec

    config, _ = _load_config()
    wanted = model or ctx.obj.get("model")
    if base_url or ctx.obj.get("base_url") or split_spec(wanted or "", [e.name for e in config.endpoints]):
        _bench_remote(ctx, config, wanted, base_url, api_key_env, quick, scenarios, tabs, stagger_ms, turns,
                      max_tokens, peers, as_json)
        return
    options = _engine_options(config, ctx.obj["engine_flags"], engine_flags)
    try:
        caps = {} if max_tokens is None else dict(single_tokens=max_tokens, tab_tokens=max_tokens, turn_tokens=max_tokens)
        settings = bench_module.BenchSettings.make(
            quick,
            model=model or ctx.obj.get("model") or None,
            options=options,
            scenarios=bench_module.parse_list(scenarios, bench_module.SCENARIOS, "scenario"),
            peers=bench_module.parse_list(peers, bench_module.PEERS, "peer"),
            tabs=tabs,
            stagger_ms=stagger_ms,
            turns=turns,
            llama_server=llama_server,
            **caps,
        )
        bench_module.main(settings, as_json=as_json, plot_path=plot_path)
    except TuichatError as exc:
        _fail(str(exc))


def _bench_remote(ctx, config, model, base_url, api_key_env, quick, scenarios, tabs, stagger_ms, turns, max_tokens,
                  peers, as_json) -> None:
    from tuichat import bench as bench_module
    from tuichat.bench import remote

    backend, spec = _backend(ctx, config, EngineOptions(), model, base_url, api_key_env)
    try:
        caps = {} if max_tokens is None else dict(single_tokens=max_tokens, tab_tokens=max_tokens, turn_tokens=max_tokens)
        settings = bench_module.BenchSettings.make(
            quick, model=spec, scenarios=bench_module.parse_list(scenarios, bench_module.SCENARIOS, "scenario"),
            peers=bench_module.parse_list(peers, bench_module.PEERS, "peer"), tabs=tabs, stagger_ms=stagger_ms,
            turns=turns, **caps)
        endpoint = backend.endpoints[spec.partition(":")[0]].base_url
        remote.main(settings, backend, spec, endpoint, as_json, sys.stdout)
    except TuichatError as exc:
        _fail(str(exc))

