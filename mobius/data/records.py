"""Conversation records in the forms people fine-tune with, as one list of messages (``role`` / ``content``):

* ``messages``: ``[{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]`` (other keys,
  such as ``tool_calls``, pass through to the chat template);
* ShareGPT's ``conversations``: ``[{"from": "system" | "human" | "gpt", "value": "..."}, ...]``;
* Alpaca's ``instruction``, optional ``input`` and ``system``, and ``output``: one user turn (the instruction,
  then the input after a blank line) and one assistant turn;
* ``prompt`` / ``completion``: two strings (a user turn and an assistant turn), or two lists of messages.

A record that breaks its form is a :class:`~mobius.errors.DataError` naming where it was read and the field.
"""

from __future__ import annotations

from typing import Literal

from mobius.data.sources import Where
from mobius.errors import DataError

Form = Literal["messages", "sharegpt", "alpaca", "prompt"]
FORM_FIELDS: dict[str, str] = {"messages": "messages", "sharegpt": "conversations", "alpaca": "instruction",
                               "prompt": "prompt"}  # form -> the field that tells it
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}


def record_form(record: object) -> Form | None:
    """The conversation form of a record (None: it is none of them)."""
    if isinstance(record, dict):
        for form, key in FORM_FIELDS.items():
            if key in record:
                return form  # type: ignore[return-value]
    return None


def form_names() -> str:
    return "messages, conversations (ShareGPT), instruction/output (Alpaca) or prompt/completion"


def conversation(record: object, form: Form, where: Where, tools: bool, final_answer: bool) -> list[dict]:
    """A record of ``form`` as a list of messages, checked: known roles (``tool`` only where ``tools``: the
    template takes it), string contents, and (``final_answer``) a last turn from the assistant."""
    key = FORM_FIELDS[form]
    if not isinstance(record, dict) or key not in record:
        raise DataError(f"{where}: record has no {key!r} field (the file's first record is in the {key!r} form; "
                        f"every record of a file has the same form)")
    if form == "messages":
        messages = _messages(record["messages"], where, "messages", tools)
    elif form == "sharegpt":
        messages = _sharegpt(record["conversations"], where)
    elif form == "alpaca":
        messages = _alpaca(record, where)
    else:
        messages = _prompt_completion(record, where, tools)
    if not messages:
        raise DataError(f"{where}: {key}: the conversation is empty")
    if final_answer and messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: {key}: the conversation ends with a {messages[-1]['role']!r} turn; it must end with "
                        f"an assistant turn (its answers are what trains; data.train_on=all trains on every turn)")
    return messages


def _messages(value: object, where: Where, field: str, tools: bool) -> list[dict]:
    if not isinstance(value, list):
        raise DataError(f"{where}: {field}: not a list of messages (a {type(value).__name__})")
    out = []
    for i, m in enumerate(value):
        at = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: {at}: not a message (a {type(m).__name__}; a message is "
                            f'{{"role": ..., "content": ...}})')
        m = {k: v for k, v in m.items() if v is not None}  # (as transformers: a None field is an absent one)
        role = m.get("role")
        if role not in ROLES or (role == "tool" and not tools):
            known = ", ".join(r for r in ROLES if r != "tool" or tools)
            why = " (the chat template never mentions 'tool')" if role == "tool" else ""
            raise DataError(f"{where}: {at}.role: unknown role {role!r}{why}; expected one of {known}")
        if not isinstance(m.get("content"), str) and not (role == "assistant" and "tool_calls" in m
                                                           and "content" not in m):
            got = "missing" if "content" not in m else f"a {type(m['content']).__name__}"
            raise DataError(f"{where}: {at}.content: not a string ({got})")
        out.append(m)
    return out


def _sharegpt(value: object, where: Where) -> list[dict]:
    if not isinstance(value, list):
        raise DataError(f"{where}: conversations: not a list of turns (a {type(value).__name__})")
    out = []
    for i, turn in enumerate(value):
        at = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise DataError(f'{where}: {at}: not a turn (a {type(turn).__name__}; a turn is {{"from": ..., '
                            f'"value": ...}})')
        role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn.get("from"), str) else None
        if role is None:
            raise DataError(f"{where}: {at}.from: unknown role {turn.get('from')!r}; expected one of system, human, "
                            f"gpt")
        if not isinstance(turn.get("value"), str):
            got = "missing" if "value" not in turn else f"a {type(turn['value']).__name__}"
            raise DataError(f"{where}: {at}.value: not a string ({got})")
        out.append({"role": role, "content": turn["value"]})
    return out


def _alpaca(record: dict, where: Where) -> list[dict]:
    fields = {}
    for key, required in (("instruction", True), ("input", False), ("output", True), ("system", False)):
        value = record.get(key)
        if value is None and not required:
            continue
        if not isinstance(value, str):
            got = "missing" if key not in record else f"a {type(value).__name__}"
            raise DataError(f"{where}: {key}: not a string ({got})")
        fields[key] = value
    user = fields["instruction"] + (f"\n\n{fields['input']}" if fields.get("input") else "")
    system = [{"role": "system", "content": fields["system"]}] if fields.get("system") else []
    return system + [{"role": "user", "content": user}, {"role": "assistant", "content": fields["output"]}]


def _prompt_completion(record: dict, where: Where, tools: bool) -> list[dict]:
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) and isinstance(completion, list):  # (TRL's conversational prompt / completion)
        return _messages(prompt, where, "prompt", tools) + _messages(completion, where, "completion", tools)
    for key, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            got = "missing" if key not in record else f"a {type(value).__name__}"
            raise DataError(f"{where}: {key}: not a string ({got})")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
