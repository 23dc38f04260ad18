"""A tiny Hugging Face tokenizer with a ChatML chat template, for tests that need one that
``transformers.AutoTokenizer`` loads (verifiers' renderers do): byte-level, no merges, so
its 256 byte tokens plus three special tokens fit the tiny model's vocabulary."""

import json
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_chat_tokenizer(model_dir: Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json into ``model_dir``; sets config.json's vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet(), key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML, "clean_up_tokenization_spaces": False}))
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["vocab_size"] = tok.get_vocab_size()
    cfg["eos_token_id"] = tok.token_to_id("<|im_end|>")
    cfg["bos_token_id"] = tok.token_to_id("<|endoftext|>")
    (model_dir / "config.json").write_text(json.dumps(cfg))
    return model_dir


def chatml_renderer():
    """A renderers renderer for this template that bridges turns (as renderers' model-specific
    ones do): the next prompt extends the previous prompt and completion, closing a turn that
    ran out of tokens with <|im_end|>. Import path: ``chat_tokenizer.ChatMLRenderer``."""
    return ChatMLRenderer


try:
    from renderers.base import RenderedTokens
    from renderers.configs import DefaultRendererConfig
    from renderers.default import DefaultRenderer
except ImportError:  # renderers comes with verifiers
    pass
else:
    class ChatMLRenderer(DefaultRenderer):
        config_class = DefaultRendererConfig

        def bridge_to_next_turn(self, previous_prompt_ids, previous_completion_ids, new_messages, *, tools=None):
            im_end = self._tokenizer.convert_tokens_to_ids("<|im_end|>")
            if not previous_prompt_ids or not new_messages or any(m.get("role") == "assistant" for m in new_messages):
                return None
            ids = list(previous_prompt_ids) + list(previous_completion_ids)
            if not previous_completion_ids or previous_completion_ids[-1] != im_end:
                ids.append(im_end)
            ext, indices = self._tokenizer.encode("\n", add_special_tokens=False), []
            indices += [-1] * len(ext)
            for i, m in enumerate(new_messages):
                text = self._tokenizer.encode(f"<|im_start|>{m.get('role')}\n{m.get('content') or ''}<|im_end|>\n",
                                              add_special_tokens=False)
                ext += text
                indices += [i] * len(text)
            gen = self._tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
            ext += gen
            indices += [-1] * len(gen)
            return RenderedTokens(token_ids=ids + ext, message_indices=[-1] * len(ids) + indices,
                                  sampled_mask=[False] * (len(ids) + len(ext)),
                                  message_roles=[m.get("role") or "" for m in new_messages])
