"""Token ids of an environment's turn, appended to a sequence the model already wrote.

Token in, token out: a multi-turn episode is one growing list of ids, never re-tokenized,
so each turn's prompt is the previous turn's prompt and completion exactly (the server
reuses their KV) and the trainer sees the ids the model sampled. Only the environment's
turn is tokenized, as the chat template would have rendered it after the model's message:

- ``bridge``: what the template writes after an assistant message's content, minus the
  stop token the model already emitted (ChatML: ``"\\n"`` after ``<|im_end|>``; the whole
  ``<|im_end|>\\n`` when the model was cut off by its token budget);
- the environment's message, and the generation prompt for the next assistant turn.

Both come from rendering two short conversations and taking the difference, so any
template that renders a conversation as a concatenation of its messages works. Without
a chat template the environment's text is appended as it is.
"""

from typing import Any

_SENTINEL = "QZXJ7"  # content of a placeholder assistant message, located in the rendered text


def render_text(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    if hasattr(tokenizer, "render_chat"):
        return tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return tokenizer.decode(ids, skip_special_tokens=False)


class TurnEncoder:
    """Encodes environment turns for one tokenizer and chat setting."""

    def __init__(self, tokenizer: Any, use_chat_template: bool):
        self.tokenizer, self.use_chat_template = tokenizer, use_chat_template
        if use_chat_template:
            user = {"role": "user", "content": "u"}
            assistant = {"role": "assistant", "content": _SENTINEL}
            text = render_text(tokenizer, [user, assistant], False)
            self.tail = text[text.rindex(_SENTINEL) + len(_SENTINEL):]
            self._base = [user, assistant]
            self._base_text = text

    def encode(self, message: dict[str, str], last_model_ids: list[int]) -> list[int]:
        """Ids of ``message`` (an environment turn) after a model turn that produced ``last_model_ids``."""
        tok = self.tokenizer
        if not self.use_chat_template:
            return tok.encode(message["content"], add_special_tokens=False)
        full = render_text(tok, [*self._base, message], True)
        if not full.startswith(self._base_text):
            raise ValueError("the chat template does not render a conversation as the concatenation of its "
                             "messages; set env.use_chat_template = false and format environment turns yourself")
        fragment = full[len(self._base_text):]
        bridge = self.tail
        if last_model_ids and last_model_ids[-1] in tok.eos_token_ids:
            stop = tok.decode(last_model_ids[-1:], skip_special_tokens=False)
            if stop and bridge.startswith(stop):
                bridge = bridge[len(stop):]
        return tok.encode(bridge + fragment, add_special_tokens=False)
