"""Chat: a conversation becomes one prompt through the model's chat template.

A chat model was trained on text laid out one way, e.g. SmolLM2's
`<|im_start|>user\\nWhat is...?<|im_end|>\\n<|im_start|>assistant\\n`; the template (a Jinja
program shipped with the tokenizer, or in a GGUF's header) writes that layout, special tokens
included, and `add_generation_prompt` opens the assistant's turn for the model to fill. The
engine then sees an ordinary prompt: chat is a front end, not a new kind of request.
`LLM.chat`, `llmopt chat` and the server's /v1/chat/completions all render here.
"""

from __future__ import annotations

CHAT_ROLES = ("system", "developer", "user", "assistant")


class MessageError(ValueError):
    """A bad message; `field` names it as OpenAI's errors do (e.g. "messages[0].role")."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check_messages(messages, where: str = "messages", check_text=None) -> list[dict]:
    """One conversation -> [{"role", "content"}] with text content, or a MessageError naming the
    message at fault. OpenAI's content parts ([{"type": "text", "text": ...}]) are joined;
    the "developer" role is the newer name of "system". `check_text(field, text)` may refuse
    a content string (the server refuses lone surrogates there)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MessageError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} dicts", where)
    plain = []
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise MessageError(f"{at} must be a dict with 'role' and 'content', got {type(m).__name__}", at)
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise MessageError(f"{at}['role'] must be one of {', '.join(CHAT_ROLES)}; got {role!r}", f"{at}.role")
        if isinstance(content, (list, tuple)):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise MessageError(f"{at}['content'] parts must be {{'type': 'text', 'text': ...}}",
                                   f"{at}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise MessageError(f"{at}['content'] must be a string; got {type(content).__name__}", f"{at}.content")
        if check_text is not None:
            check_text(f"{at}.content", content)
        plain.append({"role": "system" if role == "developer" else role, "content": content})
    return plain


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """Checked messages -> (prompt text, its token ids), through the template."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template; pass chat_template=... or "
                         "use generate() with a plain prompt")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be True: "
                         "either a new assistant turn is opened or the last message is continued")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=template,
            **(chat_template_kwargs or {}))
    except Exception as e:  # a template may refuse a conversation (e.g. roles out of order)
        raise ValueError(f"the chat template rejected the messages: {e}") from None
    # the template writes the special tokens (BOS, turn markers) itself: add none here
    return text, tokenizer(text, add_special_tokens=False)["input_ids"]
