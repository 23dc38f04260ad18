"""Hugging Face tokenizers without ``transformers``: ``tokenizer.json`` through the ``tokenizers``
library, special tokens and the chat template from ``tokenizer_config.json``.

The point is to produce exactly the token ids ``transformers`` produces for the same directory:
the trainer scores the very ids the engine sampled, so a drift is no off-policy error, but a
prompt rendered one token differently from the chat format the model was trained on (and that
other tools, evaluation included, produce) silently shifts what the policy is trained on. So
this module copies the few places where
``transformers`` (v5, ``TokenizersBackend``) adds behaviour on top of ``tokenizer.json``:

* tokens listed in ``added_tokens_decoder`` or named as special tokens but missing from
  ``tokenizer.json`` are added (named ones as special);
* BOS/EOS are added by ``tokenizer.json``'s post-processor alone: when ``tokenizer.json``
  exists, transformers v5 drops ``add_bos_token`` / ``add_eos_token`` from
  ``tokenizer_config.json``, and so do we;
* chat templates render in jinja2's immutable sandbox with ``trim_blocks`` and
  ``lstrip_blocks``, the ``raise_exception`` / ``strftime_now`` globals, a ``tojson`` that keeps
  non-ASCII characters, the named special tokens as variables, and the rendered text is
  encoded with ``add_special_tokens=False`` (the template writes BOS itself).

Class-specific quirks of ``transformers`` tokenizer classes (e.g. ``GPT2Tokenizer`` rebuilding
its own pre-tokenizer instead of the file's) are not copied: ``tokenizer.json`` is the truth.
"""

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from rlcli.errors import ModelLoadError

# Named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON: {e}") from None


def _content(token: Any) -> str | None:
    """A special token's text: config files hold either a string or an AddedToken dict."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class HFTokenizer:
    """The tokenizer of an HF-layout model directory (``tokenizer.json`` + ``tokenizer_config.json``).

    ``eos_token_ids`` joins the EOS of ``tokenizer_config.json``, ``generation_config.json`` and
    ``config.json`` (deduplicated, in that order): generation stops at any of them.
    ``bos_token_id`` is the tokenizer's own BOS (None when ``tokenizer_config.json`` names none,
    as for Qwen). ``pad_token_id`` falls back to the first EOS when no pad token is named.
    """

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir} has no tokenizer.json; add the tokenizer files to the model directory")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise ModelLoadError(f"{path}: cannot be read by the tokenizers library ({e})") from None
        cfg = {**_read_json(model_dir / "special_tokens_map.json"), **_read_json(model_dir / "tokenizer_config.json")}
        self.special_tokens = self._special_tokens(cfg)
        self._add_missing_tokens(cfg)
        self._cleanup = bool(cfg.get("clean_up_tokenization_spaces", False)) and \
            type(self._tok.model).__name__ != "BPE"  # transformers v5 never cleans up BPE output
        self.chat_template = self._chat_template(model_dir, cfg)

        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._token_id(self.special_tokens.get("bos_token"))
        gen, hf = _read_json(model_dir / "generation_config.json"), _read_json(model_dir / "config.json")
        eos = [self._token_id(self.special_tokens.get("eos_token"))]
        eos += _ids(gen.get("eos_token_id")) + _ids(hf.get("eos_token_id"))
        self.eos_token_ids = list(dict.fromkeys(i for i in eos if i is not None))
        if not self.eos_token_ids:
            raise ModelLoadError(f"{model_dir}: no EOS token; set eos_token in tokenizer_config.json or "
                                 "eos_token_id in generation_config.json")
        self.eos_token_id = self.eos_token_ids[0]
        pad = self._token_id(self.special_tokens.get("pad_token"))
        self.pad_token_id = pad if pad is not None else self.eos_token_ids[0]

    # ---------------------------------------------------------------------------- setup

    @staticmethod
    def _special_tokens(cfg: dict[str, Any]) -> dict[str, str]:
        names = list(SPECIAL_TOKEN_NAMES)
        extra = cfg.get("extra_special_tokens")
        if isinstance(extra, dict):  # named extra tokens become template variables too
            names += [k for k in extra if k not in names]
            cfg = {**extra, **cfg}
        return {n: c for n in names if (c := _content(cfg.get(n))) is not None}

    def _add_missing_tokens(self, cfg: dict[str, Any]) -> None:
        """Add what transformers adds on load: ``added_tokens_decoder`` entries the file lacks, and
        every named special token as a special added token (even one that is an ordinary vocabulary
        entry in the file: it is then matched whole and skipped by ``skip_special_tokens``)."""
        from tokenizers import AddedToken

        def added_token(tok: dict[str, Any], special: bool) -> AddedToken:
            return AddedToken(tok["content"], single_word=tok.get("single_word", False),
                              lstrip=tok.get("lstrip", False), rstrip=tok.get("rstrip", False),
                              normalized=tok.get("normalized", not special), special=special)

        decoder = cfg.get("added_tokens_decoder") or {}
        for _, tok in sorted(((int(i), t) for i, t in decoder.items()), key=lambda x: x[0]):
            if self._tok.token_to_id(tok["content"]) is None:
                self._tok.add_tokens([added_token(tok, tok.get("special", False))])
        extras = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []
        extras = list(extras.values()) if isinstance(extras, dict) else list(extras)
        named = [cfg.get(n) for n in self.special_tokens] + extras
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        tokens = {}
        for t in named:
            tok = t if isinstance(t, dict) else {"content": t, "normalized": False}
            if tok.get("content") and tok["content"] not in special:
                tokens.setdefault(tok["content"], added_token(tok, special=True))
        if tokens:
            self._tok.add_special_tokens(list(tokens.values()))

    @staticmethod
    def _chat_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():  # transformers lets the file win over the config entry
            return jinja_file.read_text(encoding="utf-8")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: use the default one
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        return template

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # ---------------------------------------------------------------------------- protocol

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._cleanup else text

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The chat template's text for ``messages`` (extra ``kwargs`` become template variables)."""
        if self.chat_template is None:
            raise ModelLoadError("the tokenizer has no chat template; set env.use_chat_template = false or add "
                                 "chat_template to tokenizer_config.json")
        import jinja2

        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return _compile(self.chat_template).render(messages=messages, tools=None, documents=None,
                                                       add_generation_prompt=add_generation_prompt,
                                                       **{**self.special_tokens, **kwargs})
        except jinja2.TemplateError as e:  # raise_exception() in the template: these messages do not fit it
            raise ValueError(f"chat template: {e}") from None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def _clean_up_tokenization(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


@lru_cache(maxsize=16)
def _compile(template: str):
    """Compile a chat template the way transformers does (see the module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text; rendering keeps the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"chat template: syntax error at line {e.lineno}: {e.message}") from None
