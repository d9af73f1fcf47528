"""Chat transcripts -> rollout records (runtime/posttrain/rollouts.py format) through a tokenizer's own chat template.

Used by launch/prepare_rollouts.py; `tokenizer` is any `transformers` tokenizer with a chat template
(this module never imports transformers). Token ranges come from renderings of the whole conversation
and of its prefixes, never from tokenizing messages on their own:

  tokens        the rendering of all messages (with the tools), tokenized as `apply_chat_template` does.
  message i     starts where the rendering of messages[:i] ends (0 for the first) and ends where that
                of messages[:i+1] ends. Every prefix rendering must be a prefix of the whole one, text
                and tokens (a token may not straddle the cut); templates that render earlier messages
                differently once later ones follow (e.g. dropping old reasoning) are refused, naming the
                message.
  assistant i   only the generated tokens. A template with `{% generation %}` marks says which they are:
                the tokens of transformers' `return_assistant_tokens_mask` inside the message's rendering
                (one contiguous run per message). Without marks: from the end of messages[:i] rendered
                with the generation prompt (the role header is not generated) to just after the first
                end-of-turn token in the message's rendering, where generation stopped (the glue a
                template writes after it, such as a newline or another stop token, is not generated);
                without an end-of-turn token there, to the message's end. A template with neither marks
                nor a generation prompt is refused: its role headers would be trained as generated.
  cost          a cut is found without tokenizing each prefix whole: the text between the tokenizer's
                added (control) tokens is tokenized once, and only the piece around each cut again. This
                relies on tokenizers isolating added tokens before tokenizing the rest; the tokens of the
                pieces, joined, must equal the whole conversation's, else every prefix is tokenized whole.
  hint          a message of role `hint_role` rendered just before the target assistant message.
                With T the tokens and T' those of the conversation with the hint message: at = start
                of message i, H = len(T') - len(T), hint = T'[at:at+H], and T' must equal
                T[:at] + hint + T[at:] token for token (else refused, naming the message).

Letters: none (token lists are plain Python lists).
"""

import bisect
import math
import re
from typing import NamedTuple

ROLES = ("system", "user", "assistant", "tool")
_GENERATION_MARK = re.compile(r"{%-?\s*generation\s*-?%}")
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
    ranges: list[tuple[int, int] | None]  # per message; assistant: the generated tokens only; None: untracked
    starts: list[int | None]  # per message: where its rendering starts (the hint goes there)


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
                        _feedback(record.get("feedback", []), messages),
                        _logprobs(record.get("logprobs", {}), messages))


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError("messages: expected a non-empty list of {role, content}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: expected an object {{role, content, ...}}, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role={m.get('role')!r} is not one of {list(ROLES)}")
    last = value[-1]
    if last["role"] == "assistant" and _empty(last):
        raise ValueError(f"messages[{len(value) - 1}]: the final assistant message is empty (no content, tool_calls "
                         f"or reasoning_content): it would train an end-of-turn-only turn; drop it or the conversation")
    return value


def _empty(message: dict) -> bool:
    """An assistant message with nothing generated but its end of turn."""
    return not any(message.get(k) for k in ("content", "tool_calls", "reasoning_content"))


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
        if not isinstance(item["hint"], str) or not item["hint"].strip():
            raise ValueError(f"feedback[{k}].hint: expected a string with text (not only white space), "
                             f"got {item['hint']!r}")
        if _empty(messages[index]):
            raise ValueError(f"feedback[{k}].message={index} is an empty assistant message (no content, tool_calls or "
                             f"reasoning_content): its only target would be the end-of-turn token; flag a message "
                             f"with text")
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


def user_turns(conv: Conversation) -> list[tuple[Conversation, int]]:
    """One (conversation, tracked_from) per user message: the messages up to the next user message, tracked
    after this one (the first from message 0), with the feedback and log-probs of the tracked messages.
    Each is what the engine rendered while it answered that user message (templates that empty the
    reasoning of turns before the last user message render the earlier turns that way here too)."""
    users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"] or [0]
    out = []
    for k, u in enumerate(users):
        end = users[k + 1] if k + 1 < len(users) else len(conv.messages)
        first = 0 if k == 0 else u + 1
        feedback = {i: v for i, v in conv.feedback.items() if first <= i < end}
        logprobs = {i: v for i, v in conv.logprobs.items() if first <= i < end}
        out.append((conv._replace(messages=conv.messages[:end], feedback=feedback, logprobs=logprobs), first))
    return out


# ---- rendering --------------------------------------------------------------------------------

def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool, what: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja2 errors and the template's own raise_exception
        detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"the chat template failed on {what} ({type(e).__name__}: {detail})") from None


def has_generation_marks(tokenizer) -> bool:
    """Whether the chat template marks the generated part of assistant messages (`{% generation %}`)."""
    return bool(_GENERATION_MARK.search(str(tokenizer.chat_template or "")))


def check_template(tokenizer, name: str) -> None:
    """ValueError naming `name` unless the template can tell generated tokens from role headers:
    `{% generation %}` marks or a generation-prompt branch."""
    if not has_generation_marks(tokenizer) and "add_generation_prompt" not in str(tokenizer.chat_template or ""):
        raise ValueError(f"{name}: the chat template has neither {{% generation %}} marks nor an "
                         f"add_generation_prompt branch, so the generated tokens of an assistant message cannot be "
                         f"told from its role header (which would be trained); add either to the template")


def _assistant_mask(tokenizer, conv: Conversation, tokens: list[int]) -> list[int]:
    """transformers' `return_assistant_tokens_mask` of the conversation (1: inside `{% generation %}`)."""
    try:
        out = tokenizer.apply_chat_template(conv.messages, tools=conv.tools, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except Exception as e:  # jinja2 errors, the template's own raise_exception, a slow tokenizer
        detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"the assistant mask of the conversation failed ({type(e).__name__}: {detail})") from None
    if list(out["input_ids"]) != tokens:
        raise ValueError(f"transformers' assistant mask comes with {len(out['input_ids'])} tokens that are not the "
                         f"conversation's {len(tokens)} tokens")
    return list(out["assistant_masks"])


def _marked(mask: list[int], begin: int, end: int, i: int) -> tuple[int, int]:
    """[first, one past the last) marked token of assistant message i's rendering [begin, end)."""
    marked = [j for j in range(begin, end) if mask[j]]
    if not marked:
        raise ValueError(f"message {i}: no token of its rendering [{begin}, {end}) is inside {{% generation %}}")
    if marked[-1] + 1 - marked[0] != len(marked):
        raise ValueError(f"message {i}: its {len(marked)} tokens inside {{% generation %}} are not one run (tokens "
                         f"{marked[0]} to {marked[-1]}); one contiguous generated range per message is needed")
    return marked[0], marked[-1] + 1


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of rendered texts, as `apply_chat_template(tokenize=True)` makes them (no added specials)."""
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def _check_prefix(text: str, full_text: str, what: str) -> None:
    if not full_text.startswith(text):
        raise ValueError(f"{what}: the chat template renders the earlier messages differently once later ones "
                         f"follow (not a prefix of the whole rendering), so turns cannot be cut exactly")


def _straddles(what: str, n: int) -> ValueError:
    return ValueError(f"{what}: a token straddles the boundary (the rendering up to there tokenizes to {n} tokens "
                      f"that are not the first {n} of the whole conversation)")


def _cuts_exact(tokenizer, tokens: list[int], prefixes: list[str], names: list[str]) -> list[int]:
    """Token index where each prefix rendering ends: each prefix tokenized whole (quadratic in the length)."""
    out = []
    for ids, what in zip(encode(tokenizer, prefixes), names):
        if tokens[:len(ids)] != ids:
            raise _straddles(what, len(ids))
        out.append(len(ids))
    return out


def _pieces(tokenizer, text: str) -> list[tuple[int, str, bool]]:
    """(start char, text, is an added token) of `text` split at the tokenizer's added tokens (chat control
    tokens), which a tokenizer isolates before it tokenizes the text between them."""
    added = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}, key=len, reverse=True)
    if not added:
        return [(0, text, False)]
    out, pos = [], 0
    for m in re.finditer("|".join(re.escape(a) for a in added), text):
        if m.start() > pos:
            out.append((pos, text[pos:m.start()], False))
        out.append((m.start(), m.group(), True))
        pos = m.end()
    return out + ([(pos, text[pos:], False)] if pos < len(text) else [])


def _cuts_by_pieces(tokenizer, tokens: list[int], full: str, cuts: list[int], names: list[str]) -> list[int] | None:
    """The token index of every char cut, tokenizing each piece between control tokens once and the
    piece around each cut up to the cut (linear in the length); None when the tokens of the pieces,
    joined, are not the whole conversation's (then the exact quadratic path decides)."""
    pieces = _pieces(tokenizer, full)
    texts = [p[1] for p in pieces if not p[2]]
    piece_starts = [p[0] for p in pieces]
    heads = [(c, bisect.bisect_right(piece_starts, c) - 1) for c in cuts]
    heads_text = [full[pieces[k][0]:c] for c, k in heads if c > pieces[k][0] and not pieces[k][2]]
    encoded = iter(encode(tokenizer, texts + heads_text))
    piece_ids, offsets = [], [0]
    for _, text, special in pieces:
        piece_ids.append([tokenizer.convert_tokens_to_ids(text)] if special else next(encoded))
        offsets.append(offsets[-1] + len(piece_ids[-1]))
    if [t for ids in piece_ids for t in ids] != tokens:
        return None
    out = []
    for (c, k), what in zip(heads, names):
        start, _, special = pieces[k]
        if c == start:
            out.append(offsets[k])
            continue
        head = next(encoded) if not special else []
        if special or piece_ids[k][:len(head)] != head:
            raise _straddles(what, offsets[k] + len(head))
        out.append(offsets[k] + len(head))
    return out


def render_conversation(tokenizer, conv: Conversation, end_of_turn: set[int], tracked_from: int = 0) -> Rendered:
    """The conversation's tokens and the token range of every message from `tracked_from` on (module
    docstring; None before it: context whose rendering is not cut); ValueError naming the message where
    the template does not allow exact ranges."""
    messages, n = conv.messages, len(conv.messages)
    full = _render(tokenizer, messages, conv.tools, False, "the conversation")
    tracked = range(tracked_from, n)
    assistants = [i for i in tracked if messages[i]["role"] == "assistant"]
    if assistants and assistants[0] == 0:
        raise ValueError("messages[0] is an assistant message: its role header has nothing to follow "
                         "(start with a system or user message)")
    marks = has_generation_marks(tokenizer)
    prompted = [] if marks else assistants  # marked templates: the mask says what is generated
    cut_at = [i for i in tracked if i > 0]  # message i starts where messages[:i] ends
    prefixes = [_render(tokenizer, messages[:i], conv.tools, False, f"messages[:{i}]") for i in cut_at]
    prefixes += [_render(tokenizer, messages[:i], conv.tools, True, f"messages[:{i}] with the generation prompt")
                 for i in prompted]
    names = [f"message {i}" for i in cut_at] + [f"message {i} (generation prompt)" for i in prompted]
    for text, what in zip(prefixes, names):
        _check_prefix(text, full, what)
    tokens = encode(tokenizer, [full])[0]
    cuts = _cuts_by_pieces(tokenizer, tokens, full, [len(t) for t in prefixes], names)
    if cuts is None:
        cuts = _cuts_exact(tokenizer, tokens, prefixes, names)
    starts = [None] * n
    starts[tracked_from:] = ([0] if tracked_from == 0 else []) + cuts[:len(cut_at)]
    prompt_ends = dict(zip(prompted, cuts[len(cut_at):]))
    mask = _assistant_mask(tokenizer, conv, tokens) if marks and assistants else None
    ranges = [None] * n
    for i in tracked:
        start, end = starts[i], starts[i + 1] if i + 1 < n else len(tokens)
        if mask is not None and messages[i]["role"] == "assistant":
            start, end = _marked(mask, start, end, i)
        elif i in prompt_ends:
            start, end = _generated(tokens, start, prompt_ends[i], end, end_of_turn, i)
        if start >= end:
            raise ValueError(f"message {i} ({messages[i]['role']}) renders no tokens of its own")
        ranges[i] = (start, end)
    return Rendered(tokens, ranges, starts)


def _generated(tokens: list[int], begin: int, prompt_end: int, end: int, end_of_turn: set[int],
               i: int) -> tuple[int, int]:
    """[first generated token, one past the first end-of-turn token) of assistant message i."""
    if not begin <= prompt_end <= end:
        raise ValueError(f"message {i}: the generation prompt ends at token {prompt_end}, outside the message's "
                         f"rendering [{begin}, {end})")
    if prompt_end == begin:
        raise ValueError(f"message {i}: the chat template renders no generation prompt before it and has no "
                         f"{{% generation %}} marks, so its role header cannot be told from its generated tokens")
    stop = next((j for j in range(prompt_end, end) if tokens[j] in end_of_turn), end - 1)
    return prompt_end, stop + 1


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
    """The rollout record (runtime/posttrain/rollouts.py format): one turn per tracked message, in order (all
    messages: turn index = message index)."""
    tracked = [i for i, r in enumerate(rendered.ranges) if r is not None]
    turn_of = {i: k for k, i in enumerate(tracked)}
    record = {"tokens": rendered.tokens,
              "turns": [{"role": conv.messages[i]["role"], "start": rendered.ranges[i][0], "end": rendered.ranges[i][1]}
                        for i in tracked],
              "advantage": advantage}
    if conv.logprobs:
        check_logprobs(conv, rendered)
        logprobs = [0.0] * len(rendered.tokens)  # only assistant positions are read
        for i, values in conv.logprobs.items():
            start, end = rendered.ranges[i]
            logprobs[start:end] = values
        record["logprobs"] = logprobs
    if hints:
        record["feedback"] = [{"turn": turn_of[i], "hint": hint, "at": at} for i, (at, hint) in sorted(hints.items())]
    return record
