"""Conversations the training-data tests share (test_conversations, test_answers): a chat template
in the byte tokenizer's words and ShareGPT-format records."""

from __future__ import annotations

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}w1 {% else %}w2 {% endif %}{{ m['content'] }} w3 "
    "{% endfor %}{% if add_generation_prompt %}w2 {% endif %}"
)


def sharegpt_record(i: int) -> dict:
    """A ShareGPT-format conversation `i`: two user turns and two answers in the byte tokenizer's words."""
    turns = [("human", f"w{10 + i} w11 w12"), ("gpt", f"w{20 + i} w21 w22 w23"), ("human", "w13"), ("gpt", "w24 w25")]
    return {"id": str(i), "conversations": [{"from": f, "value": v} for f, v in turns]}
