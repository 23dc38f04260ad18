"""A small client for `rl-infer generate`: text in, completions out."""

from pathlib import Path
from typing import Iterator

from rlcli.errors import ConfigError, PeerUnreachable
from rlcli.models.tokenizer import load_tokenizer
from rlcli.protocol import ErrorReply, GenerateRequest, GenerateResponse, SamplingParams
from rlcli.transport.registry import list_entries
from rlcli.transport.rundir import RunDir
from rlcli.transport.zmq import RpcClient, check_endpoint, check_timeout, new_request_id


def check_sampling_flags(*, max_tokens: int, temperature: float, n: int, timeout: float,
                         n_flag: str = "--n") -> None:
    """The command line's sampling flags, checked before any prompt is read or server reached:
    a ConfigError naming the first flag out of range (``n_flag``: how the command spells the
    completions per prompt)."""
    if max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {max_tokens}")
    if n < 1:
        raise ConfigError(f"{n_flag} must be >= 1, got {n}")
    if not temperature >= 0 or temperature == float("inf"):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0 is greedy), got {temperature:g}")
    check_timeout(timeout)


def generate_texts(prompts: list[str | dict], *, run_dir: Path | None, connect: str | None, model: Path | None,
                   max_tokens: int, temperature: float, n: int, timeout: float) -> Iterator[tuple[str, dict]]:
    """(prompt, result) per prompt, in order. A prompt is a string or a record with a ``prompt`` field
    (and optionally its own ``max_tokens``), as ``rl-orchestrate tasks`` writes them."""
    check_sampling_flags(max_tokens=max_tokens, temperature=temperature, n=n, timeout=timeout)
    run = RunDir(run_dir) if run_dir else None
    if connect is not None:
        check_endpoint(connect, "--connect")
    else:
        if run is None:
            raise ConfigError("pass --connect tcp://host:port or --run-dir of a run with a live rl-infer")
        entries = list_entries(run.registry_dir(), "infer")
        if not entries:
            raise PeerUnreachable(f"no live rl-infer registered in {run.registry_dir()}")
        connect = entries[0].endpoints["rpc"]
    if model is None:
        step = run.latest_stable("weights") if run else None
        if step is None:
            raise ConfigError("pass --model DIR (for the tokenizer) or --run-dir of a run with weights")
        model = run.resolve_weights(step)
    tokenizer = load_tokenizer(model)
    client = RpcClient(connect)
    try:
        for item in prompts:
            prompt = item["prompt"] if isinstance(item, dict) else item
            limit = int(item.get("max_tokens") or max_tokens) if isinstance(item, dict) else max_tokens
            request = GenerateRequest(request_id=new_request_id(), prompt_ids=tokenizer.encode(prompt),
                                      sampling=SamplingParams(temperature=temperature, max_tokens=limit, n=n))
            reply = client.call(request, timeout, peer="rl-infer")
            if isinstance(reply, ErrorReply):
                raise ConfigError(f"rl-infer rejected the request: {reply.message}")
            assert isinstance(reply, GenerateResponse)
            yield prompt, {
                "completions": [tokenizer.decode(c.token_ids) for c in reply.completions],
                "token_ids": [c.token_ids for c in reply.completions],
                "logprobs": [c.logprobs for c in reply.completions],
                "versions": [c.versions for c in reply.completions],
                "finish_reasons": [c.finish_reason for c in reply.completions],
            }
    finally:
        client.close()
