"""rl-infer: an inference server, and a client for quick generations from the shell."""

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcli.cli._errors import handle_errors
from rlcli.cli.common import (
    OVERRIDES, OVERRIDES_HELP, BatchInvariantOpt, ConfigOpt, EngineOpt, JsonConfigOpt, JsonOpt, PrintConfigOpt,
    R3Opt, RunDirOpt, command_app, emit_json, open_run, print_config, resolve_config, run_app,
)


class Role(str, Enum):
    mixed = "mixed"
    prefill = "prefill"
    decode = "decode"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"

app = command_app("rl-infer", "Inference server: generates tokens with logprobs, loads new weights in flight.")


@app.command("serve", context_settings=OVERRIDES, epilog=OVERRIDES_HELP)
@handle_errors("rl-infer")
def serve(
    ctx: typer.Context,
    config: ConfigOpt = None,
    run_dir: RunDirOpt = None,
    instance: Annotated[int, typer.Option("--id", help="Instance id of this server (registry key infer-<id>).")] = 0,
    engine: EngineOpt = None,
    device: Annotated[Optional[str], typer.Option(help="cpu, cuda or cuda:N [default: infer.device].",
                                                  show_default=False)] = None,
    dtype: Annotated[Optional[DType], typer.Option(help="Parameter and compute dtype [default: infer.dtype, "
                                                   "else model.dtype].", show_default=False)] = None,
    host: Annotated[Optional[str], typer.Option(help="Interface to bind [default: infer.host].")] = None,
    port: Annotated[Optional[int], typer.Option(help="TCP port; 0 picks a free one [default: infer.port].")] = None,
    http_port: Annotated[Optional[int], typer.Option(help="Port of the OpenAI-compatible HTTP API; 0 picks a "
                                                     "free one, -1 is off [default: infer.http_port].")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch intra-op threads of the native engine "
                                                   "[default: infer.engine.num_threads].")] = None,
    fp8: Annotated[bool, typer.Option("--fp8", help="FP8 block-scaled GEMMs (infer.fp8.enabled).")] = False,
    batch_invariant: BatchInvariantOpt = False,
    r3: R3Opt = None,
    kv_cache: Annotated[Optional[str], typer.Option(help="Shared KV store: an rl-cache endpoint tcp://host:port, "
                                                    "or 'registry' for the run's rl-cache [default: "
                                                    "infer.kv_cache.endpoint, off].", show_default=False)] = None,
    role: Annotated[Optional[Role], typer.Option(help="prefill: compute and publish prompt KV; decode: pull it "
                                                 "and generate; mixed: both [default: infer.role].",
                                                 show_default=False)] = None,
    print_config_: PrintConfigOpt = False,
    json_: JsonConfigOpt = False,
) -> None:
    """Serve GenerateRequests over ZeroMQ (and the OpenAI API over HTTP) (the default command)."""
    if instance < 0:
        from rlcli.errors import ConfigError

        raise ConfigError(f"--id must be >= 0, got {instance}")
    cfg = resolve_config(ctx, config, {"run_dir": str(run_dir) if run_dir else None, "infer.host": host,
                                       "infer.port": port, "infer.http_port": http_port,
                                       "infer.engine.name": engine.value if engine else None,
                                       "infer.device": device, "infer.dtype": dtype.value if dtype else None,
                                       "infer.engine.num_threads": threads,
                                       "infer.fp8.enabled": True if fp8 else None,
                                       "infer.kv_cache.endpoint": kv_cache, "infer.role": role.value if role else None,
                                       "model.batch_invariant": True if batch_invariant else None, "r3": r3})
    if print_config_:
        return print_config(cfg, json_)
    from rlcli.config.infer import check_engine_installed
    from rlcli.transport.zmq import check_endpoint, name_bind_keys

    check_engine_installed(cfg.infer.engine.name)
    if cfg.infer.kv_cache.endpoint not in ("", "registry"):
        check_endpoint(cfg.infer.kv_cache.endpoint, "--kv-cache (infer.kv_cache.endpoint)")
    name_bind_keys("--host or infer.host", "--port or infer.port")
    run = open_run(cfg, f"infer-{instance}")
    from rlcli.infer.server import run as serve_forever

    raise typer.Exit(serve_forever(cfg, run, instance))


@app.command("generate")
@handle_errors("rl-infer")
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="Prompts; read one per line from stdin if none.",
                                                           show_default=False)] = None,
    run_dir: RunDirOpt = None,
    connect: Annotated[Optional[str], typer.Option(help="Server endpoint (tcp://host:port) instead of the "
                                                   "run directory's registry.")] = None,
    model: Annotated[Optional[Path], typer.Option(help="Model directory for the tokenizer [default: the run's "
                                                  "newest weights].")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens per completion.")] = 64,
    temperature: Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.")] = 0.0,
    n: Annotated[int, typer.Option(help="Completions per prompt.")] = 1,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each answer.")] = 120.0,
    json_: JsonOpt = False,
) -> None:
    """Send prompts to a running server and print the completions (one per line, or JSON lines).

    Lines of stdin that are JSON objects with a "prompt" (as `rl-orchestrate tasks` writes them) keep
    every field in the --json output, so `rl-orchestrate score` can read the answers after them."""
    from rlcli.infer.client import check_sampling_flags, generate_texts

    check_sampling_flags(max_tokens=max_tokens, temperature=temperature, n=n, timeout=timeout)
    items: list = list(prompts or []) or read_prompts(sys.stdin)
    for item, (prompt, result) in zip(items, generate_texts(
            items, run_dir=run_dir, connect=connect, model=model, max_tokens=max_tokens, temperature=temperature,
            n=n, timeout=timeout)):
        if json_:
            emit_json({**(item if isinstance(item, dict) else {}), "prompt": prompt, **result})
        else:
            for text in result["completions"]:
                sys.stdout.write(text.replace("\n", "\\n") + "\n")
    sys.stdout.flush()


def read_prompts(stream) -> list:
    """The prompts of ``stream``, one per non-empty line: a line that starts with ``{`` is a JSON
    object (a record with a "prompt" string, as `rl-orchestrate tasks` writes them, or any object,
    taken as text); any other line is a prompt as it is. A ``{`` line that is not JSON, or a record
    whose "prompt" or "max_tokens" cannot be used, or a line that is not UTF-8 text, is an error
    naming its line number, as `rl-orchestrate score`'s are."""
    import json

    from rlcli.errors import ConfigError
    from rlcli.transport.jsonl import check_text

    items: list = []
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        check_text(line, "stdin", number)
        if not line.lstrip().startswith("{"):
            items.append(line.rstrip("\n"))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"stdin line {number} starts with '{{' but is not JSON ({e.msg}); pipe in a JSON "
                              "object with a \"prompt\" per line, or plain-text prompts") from None
        if not isinstance(record, dict) or "prompt" not in record:
            items.append(line.rstrip("\n"))
            continue
        if not isinstance(record["prompt"], str):
            raise ConfigError(f"stdin line {number}: \"prompt\" must be a string, got "
                              f"{type(record['prompt']).__name__}")
        limit = record.get("max_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ConfigError(f"stdin line {number}: \"max_tokens\" must be an integer >= 1 (0: --max-tokens), "
                              f"got {limit!r}")
        items.append(record)
    return items


def main() -> None:
    run_app(app, "rl-infer", "serve")


if __name__ == "__main__":
    main()
