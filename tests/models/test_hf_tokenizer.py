"""HFTokenizer produces the ids, text and chat prompts transformers' AutoTokenizer produces.

The tokenizers are trained here (byte-level BPE on a small corpus, in well under a second), so
the test needs no download; each variant is one of the ways real model directories configure
special tokens: ChatML (Qwen, SmolLM), a BOS-adding post-processor (Llama 3), BOS and EOS
added by the file against the config's ``add_bos_token`` / ``add_eos_token``, no
post-processor, tokens only ``tokenizer_config.json`` knows, and a ``chat_template.jinja`` file.
"""

import json

import pytest
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from rlcli.errors import ModelLoadError
from rlcli.models.hf_tokenizer import HFTokenizer
from rlcli.models.tokenizer import ByteTokenizer, load_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12:45, isn't it?",
    "Reverse the string 'hello world' and answer with the result only.",
    "naïve café, déjà vu — 日本語のテキスト and emoji 🙂🚀 mixed in.",
    "def reverse(s):\n    return s[::-1]\n\n\tprint(reverse('abc'))",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 -42 1e-5",
] * 20

# A ChatML template exercising what transformers' renderer provides: trim_blocks/lstrip_blocks,
# raise_exception, strftime_now, namespace, a tojson that keeps non-ASCII, special-token variables.
CHATML = """{%- set ns = namespace(system=false) -%}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are helpful{{ strftime_now('%%') }}<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{% if message.meta is defined %}{{ message.meta | tojson }}
{% endif %}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MESSAGES = [
    {"role": "user", "content": "Reverse 'héllo wörld' — now! 🙂", "meta": {"lang": "日本語", "n": 3}},
    {"role": "assistant", "content": "  dlröw olléh  "},
    {"role": "user", "content": "<|im_end|> is a special token; so is <|endoftext|>."},
]
TEXTS = ["Hello world!", "  leading spaces\n\n\ttabs  ", "naïve café 日本語 🙂", "x = 12345 + 0.5",
         "<|im_start|>user\nhi<|im_end|>\n", "<|begin_of_text|>text<|eot_id|>", "<tool_call>{}</tool_call>", ""]


# Qwen2's split (single digits, contractions), as in its tokenizer.json and transformers' Qwen2Tokenizer.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _train(specials: list[str], qwen: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if qwen:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _write(path, tok: Tokenizer, config: dict, generation: dict | None = None, jinja: str | None = None):
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


def _added(content: str, special: bool = True) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": special}


def chatml(path):
    """Qwen-style: ChatML special tokens, no BOS, transformers' class Qwen2Tokenizer (which rebuilds
    the same normalizer and pre-tokenizer as the file's)."""
    tok = _train(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], qwen=True)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    decoder = {str(tok.token_to_id(t)): _added(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    # <tool_call> is known only to tokenizer_config.json, as a plain (not special) added token.
    decoder[str(tok.get_vocab_size())] = _added("<tool_call>", special=False)
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "bos_token": None, "chat_template": CHATML, "added_tokens_decoder": decoder,
           "clean_up_tokenization_spaces": False}
    return _write(path, tok, cfg, generation={"eos_token_id": [tok.token_to_id("<|im_end|>"),
                                                               tok.token_to_id("<|endoftext|>")]})


def llama3(path):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _train(specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", bos)])
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
           "eos_token": "<|eot_id|>", "chat_template": LLAMA3,
           "added_tokens_decoder": {str(tok.token_to_id(t)): _added(t) for t in specials}}
    return _write(path, tok, cfg, generation={"bos_token_id": bos, "eos_token_id": [
        tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]})


def bos_eos_in_file(path):
    """tokenizer.json adds BOS and EOS; transformers v5 ignores the config's contrary add_*_token."""
    tok = _train(["<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B:1 </s>:1",
        special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "pad_token": "<pad>", "add_bos_token": False, "add_eos_token": False, "chat_template": LLAMA3}
    return _write(path, tok, cfg)


def no_post_processor_and_jinja_file(path):
    """No post-processor in tokenizer.json; the template comes from chat_template.jinja, and the
    named special tokens are missing from tokenizer.json (they get added, as special)."""
    tok = _train([])
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
           "chat_template": "{{ 'overridden by chat_template.jinja' }}"}
    (path / "config.json").parent.mkdir(parents=True, exist_ok=True)
    _write(path, tok, cfg, jinja=CHATML)
    (path / "config.json").write_text(json.dumps({"eos_token_id": 0}))  # a third EOS source
    return path


VARIANTS = {f.__name__: f for f in (chatml, llama3, bos_eos_in_file, no_post_processor_and_jinja_file)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tokenizers_pair(request, tmp_path_factory):
    path = VARIANTS[request.param](tmp_path_factory.mktemp(request.param))
    return HFTokenizer(path), transformers.AutoTokenizer.from_pretrained(path), request.param


def test_special_token_ids(tokenizers_pair):
    ours, ref, _ = tokenizers_pair
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_ids[0] == ref.eos_token_id
    assert ours.pad_token_id == (ref.pad_token_id if ref.pad_token_id is not None else ref.eos_token_id)


def test_eos_ids_join_every_source(tmp_path):
    ours = HFTokenizer(chatml(tmp_path / "a"))
    assert ours.eos_token_ids == [ours.encode("<|im_end|>")[0], ours.encode("<|endoftext|>")[0]]
    ours = HFTokenizer(no_post_processor_and_jinja_file(tmp_path / "b"))
    assert ours.eos_token_ids == [ours.encode("<|im_end|>")[0], 0]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(tokenizers_pair, add_special_tokens):
    ours, ref, _ = tokenizers_pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens) == ref(text, add_special_tokens=add_special_tokens)["input_ids"]


def test_encode_adds_bos_and_eos_as_configured(tokenizers_pair):
    ours, _, name = tokenizers_pair
    ids = ours.encode("Hello", add_special_tokens=True)
    assert (ids[0] == ours.bos_token_id) == (name in ("llama3", "bos_eos_in_file"))
    assert (ids[-1] == ours.eos_token_ids[0]) == (name == "bos_eos_in_file")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tokenizers_pair, skip_special_tokens):
    ours, ref, _ = tokenizers_pair
    for text in TEXTS:
        ids = ref(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens) == ref.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizers_pair, add_generation_prompt):
    ours, ref, _ = tokenizers_pair
    expected_text = ref.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.render_chat(MESSAGES, add_generation_prompt) == expected_text
    expected = ref.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == expected


def test_chat_template_details(tmp_path):
    ours = HFTokenizer(chatml(tmp_path / "m"))
    text = ours.render_chat(MESSAGES)
    assert '{"lang": "日本語", "n": 3}' in text  # tojson keeps non-ASCII
    assert "You are helpful%<|im_end|>" in text  # strftime_now
    assert text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_end|>") == 5
    ids = ours.apply_chat_template(MESSAGES)
    im_end = ours.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1 and ids.count(im_end[0]) == 5  # special tokens stay whole
    with pytest.raises(ValueError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_token_known_only_to_tokenizer_config_is_added(tmp_path):
    path = chatml(tmp_path / "m")
    ours, ref = HFTokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    ids = ours.encode("<tool_call>", add_special_tokens=False)
    assert len(ids) == 1 and ids == ref.encode("<tool_call>", add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == "<tool_call>"  # not special: kept


@pytest.mark.parametrize("eos_kind", ["vocabulary_entry", "plain_added_token"])
def test_named_special_token_becomes_special(eos_kind, tmp_path):
    """transformers makes every named special token a special added token on load, even an ordinary
    vocabulary entry ("the" here): it is then matched whole and dropped by skip_special_tokens."""
    tok = _train([])
    eos = "the"
    if eos_kind == "plain_added_token":
        eos = "<|im_end|>"
        tok.add_tokens([AddedToken(eos, special=False, normalized=False)])
    path = _write(tmp_path / "m", tok, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos})
    ours, ref = HFTokenizer(path), transformers.AutoTokenizer.from_pretrained(path)
    for text in [f"a {eos} b", f"x{eos}y", "other"]:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.eos_token_ids == [ref.eos_token_id]


def test_load_tokenizer_dispatch(tmp_path):
    path = chatml(tmp_path / "hf")
    assert isinstance(load_tokenizer(path), HFTokenizer)
    byte_dir = tmp_path / "byte"
    byte_dir.mkdir()
    (byte_dir / "tokenizer_config.json").write_text(json.dumps(ByteTokenizer.config()))
    assert isinstance(load_tokenizer(byte_dir), ByteTokenizer)


def test_byte_tokenizer_api_is_unchanged():
    tok = ByteTokenizer()
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.encode("hé") == [256, 104, 195, 169]
    assert tok.decode([256, 104, 195, 169, 257]) == "hé"
    assert tok.decode([256, 104, 257], skip_special_tokens=False) == "<bos>h<eos>"
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == tok.encode("<user>a\n<assistant>")


def test_broken_files_are_model_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="has no tokenizer.json"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json: cannot be read"):
        HFTokenizer(tmp_path)
    path = chatml(tmp_path / "m")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m }"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="chat template: syntax error"):
        HFTokenizer(path).apply_chat_template(MESSAGES)
