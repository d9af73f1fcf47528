"""Chat transcripts -> rollout records (runtime/rollouts.py format) through a tokenizer's own chat template.

Used by launch/prepare_rollouts.py; `tokenizer` is any `transformers` tokenizer with a chat template
(this module never imports transformers). Token ranges come from renderings of the whole conversation
and of its prefixes, never from tokenizing pieces on their own:

  tokens        the rendering of all messages (with the tools), tokenized as `apply_chat_template` does.
  message i     starts where the rendering of messages[:i] ends (0 for the first) and ends where that
                of messages[:i+1] ends. Every prefix rendering must be a prefix of the whole one, text
                and tokens (a token may not straddle the cut); templates that render earlier messages
                differently once later ones follow (e.g. dropping old reasoning) are refused, naming the
                message.
  assistant i   only the generated tokens: from the end of messages[:i] rendered with the generation
                prompt (the role header is not generated) to just after the last end-of-turn token in
                the message's rendering (the glue a template writes after it, such as a newline, is
                not generated either); without an end-of-turn token there, to the message's end.
  hint          a message of role `hint_role` rendered just before the target assistant message.
                With T the tokens and T' those of the conversation with the hint message: at = start
                of message i, H = len(T') - len(T), hint = T'[at:at+H], and T' must equal
                T[:at] + hint + T[at:] token for token (else refused, naming the message).

Letters: none (token lists are plain Python lists).
"""

import math
from typing import NamedTuple

ROLES = ("system", "user", "assistant", "tool")
KEYS = ("messages", "tools", "reward", "advantage", "group", "feedback", "logprobs")


class Conversation(NamedTuple):
    messages: list[dict]
    tools: list | None
    reward: float | None
    advantage: float | None
    group: str | None
    feedback: dict[int, str]  # assistant message index -> hint text
    logprobs: dict[int, list[float]]  # assistant message index -> behaviour log-probs of its generated tokens


class Rendered(NamedTuple):
    tokens: list[int]
    ranges: list[tuple[int, int]]  # per message; assistant: the generated tokens only
    starts: list[int]  # per message: where its rendering starts (the hint goes there)


# ---- parsing and validating one record ----------------------------------------------------------

def parse_conversation(record) -> Conversation:
    """A validated conversation from a decoded JSON line; ValueError naming the key and the values."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    unknown = set(record) - set(KEYS)
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} (known: {list(KEYS)})")
    messages = _messages(record.get("messages"))
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools: expected a list of tool schemas, got {type(tools).__name__}")
    group = record.get("group")
    if group is not None and (not isinstance(group, (str, int)) or isinstance(group, bool)):
        raise ValueError(f"group: expected a string or an integer, got {group!r}")
    return Conversation(messages, tools or None, _optional_number(record, "reward"),
                        _optional_number(record, "advantage"), None if group is None else str(group),
                        _feedback(record.get("feedback", []), messages), _logprobs(record.get("logprobs", {}), messages))


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError("messages: expected a non-empty list of {role, content}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: expected an object {{role, content, ...}}, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role={m.get('role')!r} is not one of {list(ROLES)}")
    return value


def _optional_number(record: dict, key: str) -> float | None:
    value = record.get(key)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return float(value)


def _assistant_index(value, key: str, messages: list[dict]) -> int:
    """`value` as the index of an assistant message; ValueError naming `key` otherwise."""
    index = int(value) if isinstance(value, str) and value.lstrip("-").isdigit() else value
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(messages):
        raise ValueError(f"{key}={value!r} is not a message index in [0, {len(messages)})")
    if messages[index]["role"] != "assistant":
        raise ValueError(f"{key}={index} is a {messages[index]['role']} message; only assistant messages qualify")
    return index


def _feedback(value, messages: list[dict]) -> dict[int, str]:
    if not isinstance(value, list):
        raise ValueError("feedback: expected a list of {message, hint}")
    out = {}
    for k, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"message", "hint"}:
            raise ValueError(f"feedback[{k}]: expected {{\"message\": int, \"hint\": str}}, got {item!r}")
        index = _assistant_index(item["message"], f"feedback[{k}].message", messages)
        if index in out:
            raise ValueError(f"feedback[{k}].message={index} already has feedback")
        if not isinstance(item["hint"], str) or not item["hint"]:
            raise ValueError(f"feedback[{k}].hint: expected a non-empty string, got {item['hint']!r}")
        out[index] = item["hint"]
    return out


def _logprobs(value, messages: list[dict]) -> dict[int, list[float]]:
    if not isinstance(value, dict):
        raise ValueError("logprobs: expected an object {message index: [log-prob per generated token]}")
    out = {}
    for key, lp in value.items():
        index = _assistant_index(key, f"logprobs key {key!r}", messages)
        if not isinstance(lp, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                               and math.isfinite(x) for x in lp):
            raise ValueError(f"logprobs[{key!r}]: expected a list of finite numbers")
        out[index] = [float(x) for x in lp]
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    missing = [i for i in assistants if i not in out]
    if out and missing:
        raise ValueError(f"logprobs: given for messages {sorted(out)} but not for assistant messages {missing} "
                         f"(give them for every assistant message or for none)")
    return out


# ---- rendering --------------------------------------------------------------------------------

def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool, what: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja2 errors and the template's own raise_exception
        detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"the chat template failed on {what} ({type(e).__name__}: {detail})") from None


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of rendered texts, as `apply_chat_template(tokenize=True)` makes them (no added specials)."""
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _cut(tokens: list[int], text: str, full_text: str, ids: list[int], what: str) -> int:
    """Token index where rendering `text` (a prefix of the conversation) ends inside `tokens`."""
    if not full_text.startswith(text):
        raise ValueError(f"{what}: the chat template renders the earlier messages differently once later ones "
                         f"follow (not a prefix of the whole rendering), so turns cannot be cut exactly")
    if tokens[:len(ids)] != ids:
        raise ValueError(f"{what}: a token straddles the boundary (the prefix tokenizes to {len(ids)} tokens that "
                         f"are not the first {len(ids)} of the whole conversation)")
    return len(ids)


def render_conversation(tokenizer, conv: Conversation, end_of_turn: set[int]) -> Rendered:
    """The conversation's tokens and every message's token range (module docstring); ValueError naming
    the message where the template does not allow exact ranges."""
    messages, n = conv.messages, len(conv.messages)
    full = _render(tokenizer, messages, conv.tools, False, "the conversation")
    texts = [_render(tokenizer, messages[:i], conv.tools, False, f"messages[:{i}]") for i in range(1, n)]
    assistants = [i for i in range(n) if messages[i]["role"] == "assistant"]
    if assistants and assistants[0] == 0:
        raise ValueError("messages[0] is an assistant message: its role header has nothing to follow "
                         "(start with a system or user message)")
    prompts = [_render(tokenizer, messages[:i], conv.tools, True, f"messages[:{i}] with the generation prompt")
               for i in assistants]
    ids = encode(tokenizer, [full, *texts, *prompts])
    tokens = ids[0]
    starts = [0] + [_cut(tokens, t, full, x, f"message {i}") for i, (t, x) in enumerate(zip(texts, ids[1:]), start=1)]
    bounds = starts + [len(tokens)]
    prompt_ends = {i: _cut(tokens, t, full, x, f"message {i} (generation prompt)")
                   for i, t, x in zip(assistants, prompts, ids[1 + len(texts):])}
    ranges = []
    for i in range(n):
        start, end = bounds[i], bounds[i + 1]
        if i in prompt_ends:
            start, end = _generated(tokens, bounds[i], prompt_ends[i], end, end_of_turn, i)
        if start >= end:
            raise ValueError(f"message {i} ({messages[i]['role']}) renders no tokens of its own")
        ranges.append((start, end))
    return Rendered(tokens, ranges, starts)


def _generated(tokens: list[int], begin: int, prompt_end: int, end: int, end_of_turn: set[int],
               i: int) -> tuple[int, int]:
    """[first generated token, one past the last end-of-turn token) of assistant message i."""
    if not begin <= prompt_end <= end:
        raise ValueError(f"message {i}: the generation prompt ends at token {prompt_end}, outside the message's "
                         f"rendering [{begin}, {end})")
    last = max((j for j in range(prompt_end, end) if tokens[j] in end_of_turn), default=end - 1)
    return prompt_end, last + 1


def insert_hint(tokenizer, conv: Conversation, rendered: Rendered, message: int, role: str) -> tuple[int, list[int]]:
    """(at, hint tokens) of a hint message of `role` before assistant `message`; ValueError naming the
    message unless the rendering with it equals tokens[:at] + hint + tokens[at:] token for token."""
    hinted = conv.messages[:message] + [{"role": role, "content": conv.feedback[message]}] + conv.messages[message:]
    text = _render(tokenizer, hinted, conv.tools, False, f"the conversation with the hint before message {message}")
    tokens, hinted_ids = rendered.tokens, encode(tokenizer, [text])[0]
    at, size = rendered.starts[message], len(hinted_ids) - len(rendered.tokens)
    hint = hinted_ids[at:at + size]
    other = "user" if role == "system" else "system"
    if size <= 0:
        raise ValueError(f"feedback on message {message}: the template does not render a {role} hint message there "
                         f"(with the hint: {len(hinted_ids)} tokens, without: {len(tokens)}); try --hint-role {other}")
    rebuilt = tokens[:at] + hint + tokens[at:]
    if hinted_ids != rebuilt:
        first = next(j for j, (a, b) in enumerate(zip(hinted_ids, rebuilt)) if a != b)
        raise ValueError(f"feedback on message {message}: the template does not render a {role} hint message as an "
                         f"insertion before it (the rendering with it differs from tokens[:{at}] + hint + "
                         f"tokens[{at}:] at token {first} of {len(hinted_ids)}); try --hint-role {other}")
    return at, hint


def check_logprobs(conv: Conversation, rendered: Rendered) -> None:
    """ValueError unless every message's log-probs count its generated tokens."""
    for i, values in conv.logprobs.items():
        start, end = rendered.ranges[i]
        if len(values) != end - start:
            raise ValueError(f"logprobs[{str(i)!r}]: {len(values)} values for the {end - start} generated tokens "
                             f"of message {i} (tokens [{start}, {end}))")


def to_record(conv: Conversation, rendered: Rendered, advantage: float,
              hints: dict[int, tuple[int, list[int]]]) -> dict:
    """The rollout record (runtime/rollouts.py format): one turn per message, turn index = message index."""
    record = {"tokens": rendered.tokens,
              "turns": [{"role": m["role"], "start": s, "end": e} for m, (s, e) in zip(conv.messages, rendered.ranges)],
              "advantage": advantage}
    if conv.logprobs:
        check_logprobs(conv, rendered)
        logprobs = [0.0] * len(rendered.tokens)  # only assistant positions are read
        for i, values in conv.logprobs.items():
            start, end = rendered.ranges[i]
            logprobs[start:end] = values
        record["logprobs"] = logprobs
    if hints:
        record["feedback"] = [{"turn": i, "hint": hint, "at": at} for i, (at, hint) in sorted(hints.items())]
    return record
